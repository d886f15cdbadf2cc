"""The Triton kernels compile for a real GPU (sm_90: H100/H200) on a machine without one.

The interpreter (test_triton_attention.py) checks the numerics but accepts code the GPU
compiler rejects (tl.dot shapes and types, shared memory per block). Here every kernel is
compiled ahead of time to a CUDA binary with the ptxas shipped in the triton wheel, in a
subprocess without TRITON_INTERPRET (other test modules set it for this process).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from treadle.layers.attention.triton_backend import TritonTiles

KERNELS = ("store_kv_kernel", "prefill_kernel", "decode_split_kernel", "decode_reduce_kernel")
SHARED_LIMIT = 99 * 1024  # bytes per block on the smallest sm_80+ parts (sm_86/sm_89)
HEAD_DIM, GROUP, KV_HEADS = 128, 4, 8  # a Llama-3-8B-like layer


def _constexprs(tiles: TritonTiles) -> dict[str, dict[str, object]]:
    """Compile-time arguments as TritonBackend passes them for fp16 and HEAD_DIM/GROUP."""
    return {
        "store_kv_kernel": {"BLOCK_H": KV_HEADS, "BLOCK_D": HEAD_DIM},
        "prefill_kernel": {"BLOCK_M": tiles.prefill_block_m, "BLOCK_N": tiles.prefill_block_n,
                           "BLOCK_D": HEAD_DIM, "IEEE": False},
        "decode_split_kernel": {"NUM_SPLITS": tiles.num_kv_splits, "BLOCK_G": max(16, GROUP),
                                "BLOCK_N": tiles.decode_block_n, "BLOCK_D": HEAD_DIM, "IEEE": False},
        "decode_reduce_kernel": {"NUM_SPLITS": tiles.num_kv_splits, "BLOCK_S": tiles.num_kv_splits,
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


def compile_all(capability: int) -> dict[str, int]:
    """Compile each kernel for ``sm_<capability>``; returns its shared memory in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treadle.layers.attention import triton_kernels

    shared = {}
    for name, consts in _constexprs(TritonTiles.default_for(torch.float16)).items():
        fn = getattr(triton_kernels, name)
        signature = {a: "constexpr" if a in consts else _arg_type(a) for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=consts)
        binary = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
        assert binary.asm["cubin"], name
        shared[name] = int(binary.metadata.shared)
    return shared


def test_kernels_compile_for_sm90_within_shared_memory(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))  # a real, cold compile
    proc = subprocess.run([sys.executable, __file__, "90"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shared = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(shared) == sorted(KERNELS)
    assert all(0 <= size <= SHARED_LIMIT for size in shared.values()), shared
    assert shared["prefill_kernel"] > 0  # the tiles really are staged through shared memory


if __name__ == "__main__":
    print(json.dumps(compile_all(int(sys.argv[1]))))
