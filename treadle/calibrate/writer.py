"""The quantized model as a compressed-tensors checkpoint, written by the
compressed-tensors library the way llm-compressor does: attach the scheme to every
decoder linear, set the scales we computed, let the library compress (int8 values or
int4 packed into int32) and write ``quantization_config`` into config.json."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from treadle.calibrate.spec import QuantizeSpec


def scheme_config(spec: QuantizeSpec, ignore: list[str]) -> object:
    """W8A8 (int8 channel weights, dynamic int8 token activations) or weight-only int
    (group or channel), symmetric; the lm_head and embeddings stay float."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(num_bits=spec.bits, type="int", symmetric=True, dynamic=False,
                               strategy="group" if spec.group_size else "channel", group_size=spec.group_size)
    acts = (QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
            if spec.activations else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head", *ignore], quantization_status="frozen")


@torch.no_grad()
def write_checkpoint(model: nn.Module, scales: dict[str, torch.Tensor], spec: QuantizeSpec, out: Path,
                     ignore: list[str]) -> None:
    """``model``'s decoder linears hold fake-quantized weights (q * scale exactly) and
    ``scales`` their scales by module name; linears named in ``ignore`` stay float."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    apply_quantization_config(model, scheme_config(spec, ignore))
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            s = scales[name]
            module.weight_scale.data = s.reshape(module.weight_scale.shape).to(module.weight_scale.dtype)
            module.weight_zero_point.data.zero_()
    fmt = "int-quantized" if spec.activations else "pack-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # type: ignore[operator]  # a transformers PreTrainedModel
    compressor.update_config(str(out))
