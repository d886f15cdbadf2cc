"""``treadle quantize`` end to end: open, calibrate layer by layer, write."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from treadle.calibrate.calibration import calibration_batch
from treadle.calibrate.grid import Grid
from treadle.calibrate.layers import LayerInput, decoder_layers, first_layer_inputs, run_layer
from treadle.calibrate.spec import QuantizeSpec
from treadle.config import TreadleError

log = logging.getLogger(__name__)


def quantize_layer(layer: nn.Module, inputs: list[LayerInput], spec: QuantizeSpec) -> dict[str, torch.Tensor]:
    """Quantize one decoder layer in place (weights become their fake-quantized floats);
    returns the scales [out, groups] of each linear by its name inside the layer. A linear
    whose input width is not a multiple of the group size stays float (the writer lists it
    in ``ignore``)."""
    from treadle.calibrate.awq import awq_layer
    from treadle.calibrate.gptq import gptq_layer
    from treadle.calibrate.smoothquant import rtn_layer, smoothquant_layer

    grid = Grid(spec.bits, spec.group_size)
    skip = {name for name, m in layer.named_modules()
            if isinstance(m, nn.Linear) and grid.group_size and m.in_features % grid.group_size}
    if spec.method == "rtn":
        return rtn_layer(layer, grid, skip)
    if spec.method == "smoothquant":
        return smoothquant_layer(layer, inputs, grid, spec.alpha)
    if spec.method == "gptq":
        return gptq_layer(layer, inputs, grid, spec.damp, spec.act_order, skip)
    return awq_layer(layer, inputs, grid, skip)


@torch.no_grad()
def quantize_model(model: nn.Module, batch: torch.Tensor, spec: QuantizeSpec) -> dict[str, torch.Tensor]:
    """Every decoder layer in turn, each calibrated on the outputs of the layers already
    quantized; returns the scales of every quantized linear by its full module name."""
    from tqdm import tqdm

    inputs = first_layer_inputs(model, batch) if spec.method != "rtn" else []
    scales: dict[str, torch.Tensor] = {}
    layers = decoder_layers(model)
    for i, layer in enumerate(tqdm(layers, desc=f"{spec.method} layers", unit="layer")):
        for name, s in quantize_layer(layer, inputs, spec).items():
            scales[f"model.layers.{i}.{name}"] = s
        if inputs and i + 1 < len(layers):
            inputs = run_layer(layer, inputs)
    return scales


def quantize_checkpoint(model_name: str, out: Path, calibration: Path | None, spec: QuantizeSpec) -> None:
    from treadle.calibrate.hf_model import build_hf_model, copy_tokenizer_files, hf_config_dict, require_transformers
    from treadle.calibrate.writer import write_checkpoint
    from treadle.loaders import open_model_source

    require_transformers()
    if spec.method != "rtn" and calibration is None:
        raise TreadleError(f"--method {spec.method} needs --calibration FILE (a text file)")
    source = open_model_source(model_name)
    config = hf_config_dict(source)
    batch = calibration_batch(calibration, source.tokenizer, spec.num_samples, spec.seq_len) if calibration else None
    model = build_hf_model(source, config)
    log.info("calibrating %s on %s", source.path, "no data" if batch is None else f"{tuple(batch.shape)} tokens")
    scales = quantize_model(model, batch if batch is not None else torch.zeros(0, 1, dtype=torch.long), spec)
    skipped = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in scales and n != "lm_head"]
    if skipped:
        log.warning("kept in float (input width not a multiple of the group size): %s", ", ".join(skipped))
    write_checkpoint(model, scales, spec, out, skipped)
    copy_tokenizer_files(source, out)
