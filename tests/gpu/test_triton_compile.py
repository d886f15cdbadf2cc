"""The Triton kernels compile for a real GPU (sm_90: H100/H200) on a machine without one.

The interpreter (test_triton_attention.py, test_quant_gpu_kernels.py) checks the numerics but
accepts code the GPU compiler rejects (tl.dot shapes and types, shared memory per block,
non-constexpr globals). Here every kernel is compiled ahead of time to a CUDA binary with the
ptxas shipped in the triton wheel, in a subprocess without TRITON_INTERPRET (other test
modules set it for this process): the attention kernels, and the quantized-linear kernels
(W8A8 int8 GEMM, W4A16 dequantize-in-the-loop GEMM) at each tile size and dtype gpu.py
launches them with, and the per-token operators (triton_ops.py) in each activation dtype.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treadle.layers.attention.triton_backend import TritonTiles

pytestmark = pytest.mark.server  # starts processes (servers, workers)

KERNELS = ("store_kv_kernel", "prefill_kernel", "decode_split_kernel", "decode_reduce_kernel")
_W8A8_ARGS = {"xq_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*i8", "ws_ptr": "*fp32", "bias_ptr": "*fp32",
              "y_ptr": "*fp32"}
SHARED_LIMIT = 99 * 1024  # bytes per block on the smallest sm_80+ parts (sm_86/sm_89)
HEAD_DIM, GROUP, KV_HEADS = 128, 4, 8  # a Llama-3-8B-like layer


def _constexprs(tiles: TritonTiles) -> dict[str, dict[str, object]]:
    """Compile-time arguments as TritonBackend passes them for fp16 and HEAD_DIM/GROUP."""
    return {
        "store_kv_kernel": {"BLOCK_H": KV_HEADS, "BLOCK_D": HEAD_DIM},
        "prefill_kernel": {"BLOCK_M": tiles.prefill_block_m, "BLOCK_N": tiles.prefill_block_n,
                           "BLOCK_D": HEAD_DIM, "IEEE": False},
        "decode_split_kernel": {"NUM_SPLITS": tiles.num_kv_splits or 32, "BLOCK_G": max(16, GROUP),
                                "BLOCK_N": tiles.decode_block_n, "BLOCK_D": HEAD_DIM, "IEEE": False},
        "decode_reduce_kernel": {"NUM_SPLITS": tiles.num_kv_splits or 32, "BLOCK_S": tiles.num_kv_splits or 32,
                                 "BLOCK_D": HEAD_DIM},
    }


def _arg_type(name: str) -> str:
    if name in ("slot_ptr",):
        return "*i64"
    if name in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr"):
        return "*i32"
    if name.startswith("part_"):
        return "*fp32"
    if name.endswith("_ptr"):
        return "*fp16"
    return "fp32" if name == "scale" else "i32"


def _quant_cases() -> dict[str, tuple[str, dict[str, str], dict[str, object]]]:
    """label -> (kernel, pointer argument types, constexprs) as treadle.quantization.methods.gpu
    launches them: decode-sized (16) and large row tiles, each activation dtype."""
    from treadle.quantization.methods import gpu

    cases: dict[str, tuple[str, dict[str, str], dict[str, object]]] = {}
    for dt in ("fp16", "bf16", "fp32"):
        cases[f"w8a8_quantize_kernel/{dt}"] = (
            "w8a8_quantize_kernel", {"x_ptr": f"*{dt}", "xq_ptr": "*i8", "xs_ptr": "*fp32"}, {"BLOCK_K": 1024})
    bm, bn, bk = gpu._W8A8_TILES
    for rows, bias in ((16, True), (bm, False)):
        cases[f"w8a8_matmul_kernel/{rows}"] = (
            "w8a8_matmul_kernel", _W8A8_ARGS, {"HAS_BIAS": bias, "BLOCK_M": rows, "BLOCK_N": bn, "BLOCK_K": bk})
    bm, bn, bk = gpu._W4A16_TILES
    for dt in ("fp16", "bf16", "fp32"):
        args = {"x_ptr": f"*{dt}", "packed_ptr": "*u8", "group_ptr": "*i32", "shard_ptr": "*i32", "scale_ptr": "*fp32",
                "mins_ptr": "*fp32", "bias_ptr": f"*{dt}", "y_ptr": f"*{dt}"}
        for rows, uniform in ((16, True), (bm, True), (16, False)):
            cases[f"w4a16_matmul_kernel/{dt}/{rows}/{'uniform' if uniform else 'gather'}"] = (
                "w4a16_matmul_kernel", args, {"HAS_BIAS": True, "IEEE": dt == "fp32", "UNIFORM": uniform,
                                              "BLOCK_M": rows, "BLOCK_N": bn, "BLOCK_K": bk})
    return cases


def _op_cases() -> dict[str, tuple[str, dict[str, str], dict[str, object]]]:
    """label -> (kernel, argument types, constexprs) of treadle/layers/triton_ops.py as the layers
    launch them for each activation dtype (a 2048-wide row, 5632-wide gates, head_dim 128)."""
    cases: dict[str, tuple[str, dict[str, str], dict[str, object]]] = {}
    for dt in ("fp16", "bf16", "fp32"):
        for res in (False, True):
            cases[f"_rms_norm_kernel/{dt}/{'residual' if res else 'alone'}"] = (
                "_rms_norm_kernel", {"x_ptr": f"*{dt}", "res_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}",
                                     "eps": "fp32"}, {"HAS_RES": res, "ROUND": dt != "fp32", "BLOCK": 2048})
        for gelu in (False, True):
            cases[f"_gated_kernel/{dt}/{'gelu' if gelu else 'silu'}"] = (
                "_gated_kernel", {"gu_ptr": f"*{dt}", "out_ptr": f"*{dt}"}, {"GELU": gelu, "BLOCK": 1024})
        cases[f"_rope_kernel/{dt}"] = (
            "_rope_kernel", {"x_ptr": f"*{dt}", "cs_ptr": "*fp32", "pos_ptr": "*i64"}, {"HALF": 64})
    return cases


def compile_all(capability: int) -> dict[str, int]:
    """Compile each kernel for ``sm_<capability>``; returns its shared memory in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treadle.layers import triton_ops
    from treadle.layers.attention import triton_kernels
    from treadle.quantization.methods import triton_kernels as quant_kernels

    target = GPUTarget("cuda", capability, 32)
    shared = {}
    for name, consts in _constexprs(TritonTiles.default_for(torch.float16)).items():
        fn = getattr(triton_kernels, name)
        signature = {a: "constexpr" if a in consts else _arg_type(a) for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts)
        binary = triton.compile(src, target=target, options={"num_warps": 4})
        assert binary.asm["cubin"], name
        shared[name] = int(binary.metadata.shared)
    for label, (name, pointers, consts) in _quant_cases().items():
        fn = getattr(quant_kernels, name)
        signature = {a: "constexpr" if a in consts else pointers.get(a, "i32") for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts)
        exact = name.startswith("w8a8")  # launched without fused multiply-adds (bit-exact epilogue)
        binary = triton.compile(src, target=target, options={"num_warps": 4, "enable_fp_fusion": not exact})
        assert binary.asm["cubin"], label
        shared[label] = int(binary.metadata.shared)
    for label, (name, types, consts) in _op_cases().items():  # launched without fused multiply-adds
        fn = getattr(triton_ops, name)
        signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
        binary = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=target,
                                options={"num_warps": 4, "enable_fp_fusion": False})
        assert binary.asm["cubin"], label
        shared[label] = int(binary.metadata.shared)
    return shared


def test_kernels_compile_for_sm90_within_shared_memory(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))  # a real, cold compile
    proc = subprocess.run([sys.executable, __file__, "90"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shared = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(shared) == sorted([*KERNELS, *_quant_cases(), *_op_cases()])
    assert all(0 <= size <= SHARED_LIMIT for size in shared.values()), shared
    assert shared["prefill_kernel"] > 0  # the tiles really are staged through shared memory
    assert shared["w8a8_matmul_kernel/64"] > 0 and shared["w4a16_matmul_kernel/fp16/32/uniform"] > 0


if __name__ == "__main__":
    print(json.dumps(compile_all(int(sys.argv[1]))))
