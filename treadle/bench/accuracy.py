"""The accuracy table: every quantization mode of a model, evaluated on one text against
the float model (``treadle eval table``)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import torch

from treadle.bench.perplexity import PerplexityResult, evaluate
from treadle.config import TreadleError
from treadle.engine.args import KV_CACHE_DTYPES

TABLE_SAMPLES = 32  # calibration windows of 256 tokens per quantized checkpoint
CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "assets" / "text" / "calibration.txt"


class Row(NamedTuple):
    label: str
    method: str | None  # `treadle quantize --method` (then evaluated from its checkpoint), or None
    bits: int | None
    group_size: int | None
    quantization: str | None  # the load-time mode (`--quantization`) of the float model
    kv_cache_dtype: str = "auto"  # `--kv-cache-dtype`


ROWS = (
    Row("float32", None, None, None, "none"),
    Row("RTN W8A8 (int8 channel, dynamic int8 tokens)", "rtn", 8, None, None),
    Row("SmoothQuant W8A8 (alpha 0.8)", "smoothquant", 8, None, None),
    Row("RTN int4-g32 (W4A16)", "rtn", 4, 32, None),
    Row("GPTQ int4-g32 (W4A16)", "gptq", 4, 32, None),
    Row("AWQ int4-g32 (W4A16)", "awq", 4, 32, None),
    Row("--quantization int8 (load time: Q8_0 blocks, weight-only)", None, None, None, "int8"),
    Row("--quantization int4-g32 (load time: Q4_1 blocks, asymmetric)", None, None, None, "int4-g32"),
    Row("--quantization gguf (the file's own blocks)", None, None, None, "gguf"),
    Row("float32 weights, --kv-cache-dtype int8", None, None, None, "none", "int8"),
    Row("float32 weights, --kv-cache-dtype fp8", None, None, None, "none", "fp8"),
)


def _read_ids(model: str, text: Path) -> list[int]:
    from treadle.loaders import open_model_source

    try:
        raw = text.read_text(encoding="utf-8")
    except OSError as e:
        raise TreadleError(f"{text}: cannot read the evaluation text ({e.strerror})") from None
    tokenizer = open_model_source(model).tokenizer
    if tokenizer is None:
        raise TreadleError(f"{model}: no tokenizer")
    ids = tokenizer.encode(raw)
    if len(ids) < 2:
        raise TreadleError(f"{text}: too short to score")
    return ids


def _logits_and_result(model: str, ids: list[int], quantization: str | None, window: int, stride: int,
                       reference: list[torch.Tensor] | None,
                       kv_cache_dtype: str = "auto") -> tuple[PerplexityResult, list[torch.Tensor]]:
    from treadle.layers.attention.selector import select_backend
    from treadle.loaders import load_model

    if window < 2 or not 0 < stride <= window:
        raise TreadleError("--window must be >= 2 and 0 < --stride <= --window")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise TreadleError(f"--kv-cache-dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return evaluate(load_model(model, select_backend("auto", "cpu"), quantization=quantization), ids, window, stride,
                    reference, kv_cache_dtype)


def evaluate_text(model: str, text: Path, quantization: str | None, reference: str | None, window: int = 512,
                  stride: int = 512, kv_cache_dtype: str = "auto") -> PerplexityResult:
    """``model`` (loaded with ``quantization``, its KV cache in ``kv_cache_dtype``) on ``text``;
    ``reference`` is loaded in float with a float cache."""
    ids = _read_ids(model, text)
    ref = _logits_and_result(reference, ids, "none", window, stride, None)[1] if reference else None
    return _logits_and_result(model, ids, quantization, window, stride, ref, kv_cache_dtype)[0]


def _checkpoint(model: str, row: Row, workdir: Path, quantize: bool) -> str:
    from treadle.calibrate.pipeline import quantize_checkpoint
    from treadle.calibrate.spec import QuantizeSpec

    assert row.method is not None
    out = workdir / (f"{Path(model).name}-{row.method}-w{row.bits}" + (f"-g{row.group_size}" if row.group_size else ""))
    if not (out / "config.json").is_file():
        if not quantize:
            raise TreadleError(f"{out} not made (--no-quantize)")
        spec = QuantizeSpec.build(row.method, row.bits, row.group_size, 0.8, TABLE_SAMPLES, 256)
        quantize_checkpoint(model, out, CALIBRATION_TEXT, spec)
    return str(out)


def accuracy_table(models: list[str], workdir: Path, text: Path, window: int = 512, stride: int = 512,
                   quantize: bool = True) -> str:
    """Markdown: one line per (model, row); a row that cannot run says why. The float row's
    logits are the reference of the others."""
    lines = ["| model | mode | perplexity | vs float | top-1 agree | mean abs dlogit | weights MB | decode ms |",
             "|---|---|---|---|---|---|---|---|"]
    for model in models:
        ids = _read_ids(model, text)
        base: tuple[float, list[torch.Tensor]] | None = None
        for row in ROWS:
            try:
                path = _checkpoint(model, row, workdir, quantize) if row.method else model
                r, logits = _logits_and_result(path, ids, row.quantization, window, stride, base and base[1],
                                               row.kv_cache_dtype)
            except TreadleError as e:
                lines.append(f"| {model} | {row.label} | n/a: {e} | | | | | |")
                print(lines[-1], file=sys.stderr, flush=True)
                continue
            base = base or (r.perplexity, logits)
            agree = "" if r.top1_agreement is None else f"{100 * r.top1_agreement:.1f} %"
            dl = "" if r.mean_abs_dlogit is None else f"{r.mean_abs_dlogit:.3f}"
            lines.append(f"| {model} | {row.label} | {r.perplexity:.3f} | {100 * (r.perplexity / base[0] - 1):+.2f} % | "
                         f"{agree} | {dl} | {r.weight_mb:.1f} | {r.decode_ms:.1f} |")
            print(lines[-1], file=sys.stderr, flush=True)  # progress: the table grows row by row
    return "\n".join(lines)
