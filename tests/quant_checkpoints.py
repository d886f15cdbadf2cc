"""Tiny quantized checkpoints written as the publishing tools write them, for the loader tests.

compressed-tensors: by the compressed-tensors library itself, the path llm-compressor takes
(``apply_quantization_config`` on a transformers model, scales from the library's
``calculate_qparams`` over each weight's min/max -- llm-compressor's min-max observer --,
then ``ModelCompressor.compress_model`` + ``update_config``).

GPTQ and AWQ: a reference packer written here from the formats' published descriptions
(AutoGPTQ: qweight packed along input rows, qzeros along output columns storing zero - 1;
AutoAWQ GEMM: both packed along output columns in nibble order [0, 2, 4, 6, 1, 3, 5, 7]).
Each writer also saves the dequantized float weights it packed (``float_dir``) so
transformers can run the same values as the oracle.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

TINY = dict(hidden_size=128, intermediate_size=256)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_compressed_tensors(path: Path, kind: str, seed: int = 0) -> Path:
    """kind: "w8a8", or "int4-<g32|g64|g128|channel>-<sym|asym>"."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    make_tiny_model(path, seed=seed, **TINY)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if kind == "w8a8":
        scheme = preset_name_to_scheme("W8A8", ["Linear"])
    else:
        _, group, sym = kind.split("-")
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=sym == "sym",
                                   strategy="channel" if group == "channel" else "group",
                                   group_size=None if group == "channel" else int(group[1:]))
        scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            args, w = module.quantization_scheme.weights, module.weight.data
            g = w.view(w.shape[0], -1, args.group_size) if args.strategy == "group" else w.unsqueeze(1)
            scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def ct_float_dir(path: Path, out: Path) -> Path:
    """The checkpoint decompressed to float by the library's own compressor (the oracle for
    formats this transformers cannot load compressed: asymmetric pack-quantized)."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((path / "config.json").read_text())
    scheme = QuantizationConfig.model_validate(config["quantization_config"]).config_groups["group_0"]
    state = load_file(str(path / "model.safetensors"))
    for m in {k.rpartition(".")[0] for k in state if k.endswith("weight_packed")}:
        local = {k.removeprefix(m + "."): v for k, v in state.items() if k.startswith(m + ".")}
        state = {k: v for k, v in state.items() if not k.startswith(m + ".")}
        state[f"{m}.weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    return _float_dir(path, out, state)


def _float_dir(src: Path, out: Path, state: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def _quantize_groups(w: torch.Tensor, group: torch.Tensor, groups: int, sym: bool):
    """w [N, K] -> q [N, K] 0..15, scale [N, groups] float16-exact, zero [N, groups] 1..15."""
    n = w.shape[0]
    scale, zero = torch.empty(n, groups), torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, group == g]
        if sym:
            s = (cols.abs().amax(1) * 2 / 15).half().float()
            z = torch.full((n,), 8.0)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).half().float()
            z = torch.round(-lo / s).clamp(1, 15)  # >= 1: AutoGPTQ's v1 "zero - 1" must not wrap
        scale[:, g], zero[:, g] = s, z
    q = torch.round(w / scale[:, group] + zero[:, group]).clamp(0, 15)
    return q.to(torch.int64), scale, zero


def _pack_rows(v: np.ndarray) -> np.ndarray:
    """[R, C] 0..15 -> int32 [R / 8, C]: value r at bits 4 * (r % 8) of word r // 8."""
    r, c = v.shape
    words = np.zeros((r // 8, c), dtype=np.uint32)
    for i in range(8):
        words |= v[i::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def _pack_cols(v: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """[R, C] 0..15 -> int32 [R, C / 8]: nibble i of word j holds column 8j + order[i]."""
    r, c = v.shape
    words = np.zeros((r, c // 8), dtype=np.uint32)
    for i in range(8):
        words |= v[:, order[i]::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def write_int4_checkpoint(path: Path, float_out: Path, method: str, group_size: int, sym: bool = False,
                          desc_act: bool = False, seed: int = 0) -> Path:
    """method "gptq" (v1 zeros) or "awq" (gemm); the float oracle goes to ``float_out``."""
    make_tiny_model(path, seed=seed, **TINY)
    state = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 1)
    for name in [k for k in state if k.endswith("_proj.weight")]:
        w = state.pop(name)
        n, k = w.shape
        g = k if group_size == -1 else group_size
        group = torch.arange(k) // g
        if desc_act:  # act-order: groups follow a permutation of the inputs
            order = torch.randperm(k, generator=gen)
            group = torch.empty(k, dtype=torch.int64)
            group[order] = torch.arange(k) // g
        q, scale, zero = _quantize_groups(w, group, k // g, sym)
        stem = name.removesuffix(".weight")
        state[name] = (q - zero[:, group]) * scale[:, group]  # the float oracle
        if method == "gptq":
            tensors = {"qweight": _pack_rows(q.t().numpy()), "qzeros": _pack_cols((zero - 1).t().to(torch.int64).numpy()),
                       "scales": scale.t().half(), "g_idx": group.to(torch.int32)}
        else:
            awq_order = (0, 2, 4, 6, 1, 3, 5, 7)
            tensors = {"qweight": _pack_cols(q.t().numpy(), awq_order),
                       "qzeros": _pack_cols(zero.t().to(torch.int64).numpy(), awq_order), "scales": scale.t().half()}
        for suffix, t in tensors.items():
            state[f"{stem}.{suffix}.q"] = torch.as_tensor(t).contiguous()
    _float_dir(path, float_out, {k: v for k, v in state.items() if not k.endswith(".q")})
    packed = {k.removesuffix(".q") if k.endswith(".q") else k: v for k, v in state.items()
              if k.endswith(".q") or not k.endswith("_proj.weight")}
    save_file(packed, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
         "checkpoint_format": "gptq"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm", "zero_point": True})
    (path / "config.json").write_text(json.dumps(config))
    return path
