"""Pieces of the quantized-checkpoint loader: the W8A8 kernel against its torch reference (bit
for bit) and against compressed-tensors' activation rule, the Q4_1 repacking against the gguf
package's dequantizer, each format's decoding against the values that were packed, and bad
input as one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_checkpoints import ct_float_dir, write_compressed_tensors, write_int4_checkpoint
from safetensors.torch import load_file, save_file

from treadle.config import TreadleError
from treadle.kernels import native
from treadle.layers.attention.cpu import CPUBackend
from treadle.loaders import load_model, open_model_source
from treadle.quantization import resolve_quantization
from treadle.quantization.formats.int4 import Int4Format, q4_1_blocks
from treadle.quantization.formats.published import parse_quantization_config
from treadle.quantization.methods.gguf_native import GGUFBlocks, dequantize_blocks
from treadle.quantization.methods.w8a8 import quantize_per_token, w8a8_reference

needs_native = pytest.mark.skipif(not native.available(), reason="Treadle's C kernels are not built here")


@needs_native
@pytest.mark.parametrize("m,k", [(1, 64), (3, 100), (4, 256), (9, 48), (17, 130)])
def test_w8a8_kernel_equals_reference_bit_for_bit(m: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, 0] = -x[0].abs().max()  # a token whose minimum is its largest magnitude: quantizes to -128
    w = torch.randint(-128, 128, (40, k), generator=gen, dtype=torch.int8)
    w[:, 0] = -128
    scale = torch.rand(40, generator=gen) * 0.01
    bias = torch.randn(40, generator=gen)
    want = w8a8_reference(x, w, scale, bias)
    assert torch.equal(native.w8a8_matmul(x, w, scale, bias), want)  # AVX2 where the CPU has it
    assert torch.equal(native.w8a8_matmul(x, w, scale, bias, plain=True), want)  # the plain-C loops
    assert torch.equal(native.w8a8_matmul(x, w, scale), w8a8_reference(x, w, scale))


def test_reference_is_exact_integer_arithmetic() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen)
    w = torch.randint(-128, 128, (8, 96), generator=gen, dtype=torch.int8)
    xq, xs = quantize_per_token(x)
    exact = (xq.double() @ w.double().t()).float()  # sums < 2^24 here: exact in float64 and float32
    assert torch.equal(w8a8_reference(x, w, torch.ones(8)), exact * xs[:, None])
    assert int(xq.min()) == -128 or int(xq.max()) == 127


def test_activation_quantization_is_compressed_tensors_rule() -> None:
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = preset_name_to_scheme("W8A8", ["Linear"]).input_activations
    x = torch.randn(1, 7, 64) * torch.rand(1, 7, 1) * 3
    scale, zero = compute_dynamic_scales_and_zp(x, args, torch.nn.Linear(64, 8))
    fake = fake_quantize(x, scale, zero, args)[0]  # the library's dynamic quantize-dequantize
    xq, xs = quantize_per_token(x[0])
    assert torch.equal(xq.float() * xs[:, None], fake)


def test_q4_1_blocks_follow_the_gguf_layout() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (6, 64), generator=gen, dtype=torch.uint8)
    scale = torch.rand(6, 2, generator=gen).half().float()
    zero = torch.randint(0, 16, (6, 2), generator=gen).float()
    got = dequantize_blocks(GGUFBlocks("Q4_1", q4_1_blocks(q, scale, zero), (6, 64)))
    m = (-zero * scale).half().float()
    want = q.float() * scale.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    assert torch.equal(got, want)


def _decoded(path: Path, module: str) -> torch.Tensor:
    """One module's weight as the loader decodes it, before any repacking."""
    source = open_model_source(str(path), skip_tokenizer_init=True)
    assert source.checkpoint_quantization is not None
    fmt = source.checkpoint_quantization.format_for(module)
    assert isinstance(fmt, Int4Format)
    state = load_file(str(path / "model.safetensors"))
    tensors = {k.removeprefix(module + "."): v for k, v in state.items() if k.startswith(module + ".")}
    rows, k = load_file(str(path.parent / "float" / "model.safetensors"))[f"{module}.weight"].shape
    return fmt.decode(tensors, rows, k).dequantize()


@pytest.mark.parametrize("kind", ["gptq-act-order", "awq", "ct-asym"])
def test_decoded_weights_equal_the_oracle(tmp_path: Path, kind: str) -> None:
    """The layouts, exactly: GPTQ/AWQ against the values the reference packer packed,
    compressed-tensors against the library's own decompressor."""
    if kind == "ct-asym":
        path = write_compressed_tensors(tmp_path / "q", "int4-g32-asym")
        ct_float_dir(path, tmp_path / "float")
    else:
        method = kind.partition("-")[0]
        path = write_int4_checkpoint(tmp_path / "q", tmp_path / "float", method, 32, desc_act=kind != "awq")
    oracle = load_file(str(tmp_path / "float" / "model.safetensors"))
    for module in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        assert torch.equal(_decoded(path, module), oracle[f"{module}.weight"])


# -- bad input: one line each ---------------------------------------------------------------
def _one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("raw,needle", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq bits=3"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version=gemv"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}},
     "format 'float-quantized', weights float8"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "strategy": "tensor", "dynamic": False}}}},
     "dynamic=False"),
])
def test_unsupported_schemes_are_named(raw: dict, needle: str) -> None:
    with pytest.raises(TreadleError) as excinfo:
        parse_quantization_config(raw, Path("m/config.json"))
    message = _one_line(excinfo)
    assert needle in message and "m/config.json" in message


def test_conflicting_quantization_is_an_error() -> None:
    assert resolve_quantization("auto", False, True, "gptq") == "gptq"
    assert resolve_quantization(None, False, True, "awq") == "awq"
    for bad in ("int8", "none", "awq"):
        with pytest.raises(TreadleError, match="conflicts with the checkpoint's quantization_config"):
            resolve_quantization(bad, False, True, "gptq")
    with pytest.raises(TreadleError, match="needs a checkpoint"):
        resolve_quantization("gptq", False, True, None)


def _rewrite(path: Path, edit) -> None:  # noqa: ANN001
    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"))


def test_corrupt_or_mismatched_checkpoints_name_file_and_tensor(tmp_path: Path) -> None:
    path = write_int4_checkpoint(tmp_path / "q", tmp_path / "float", "gptq", 32)
    name = "model.layers.0.self_attn.q_proj.qweight"
    good = load_file(str(path / "model.safetensors"))

    _rewrite(path, lambda s: s.__setitem__(name, s[name].float()))  # wrong dtype
    with pytest.raises(TreadleError) as excinfo:
        load_model(str(path), CPUBackend())
    message = _one_line(excinfo)
    assert "model.safetensors" in message and name in message and "I32" in message

    _rewrite(path, lambda s: s.__setitem__(name, good[name][:-1].contiguous()))  # wrong shape
    with pytest.raises(TreadleError) as excinfo:
        load_model(str(path), CPUBackend())
    assert name in _one_line(excinfo)

    _rewrite(path, lambda s: s.update(good))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # the tensors hold groups of 32
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TreadleError) as excinfo:
        load_model(str(path), CPUBackend())
    message = _one_line(excinfo)
    assert "qzeros" in message or "scales" in message


def test_int4_tensor_parallelism_is_refused_in_one_line(tmp_path: Path) -> None:
    """int4 packed tensors are not split across ranks yet (W8A8 is: test_quant_checkpoints.py)."""
    from treadle.distributed import shard_config
    from treadle.engine.args import engine_args
    from treadle.engine.resolver import resolve_config
    from treadle.loaders import quantization_plan

    source = open_model_source(str(write_compressed_tensors(tmp_path / "q", "int4-g32-sym")), skip_tokenizer_init=True)
    with pytest.raises(TreadleError) as excinfo:  # at start-up, before any worker process
        resolve_config(engine_args(model=str(source.path), tensor_parallel_size=2), source, 1 << 34)
    assert "compressed-tensors int4 checkpoints are not supported with tensor parallelism" in _one_line(excinfo)
    with pytest.raises(TreadleError) as excinfo:  # and in the loader, for load_model callers
        quantization_plan(source, "auto", "cpu", shard_config(source.config, 2, 0))
    assert "not supported with tensor parallelism" in _one_line(excinfo)
