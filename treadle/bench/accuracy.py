"""The accuracy table: every quantization mode of a model, evaluated on one text against
the float model (``treadle eval table``)."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from treadle.bench.perplexity import PerplexityResult, evaluate
from treadle.config import TreadleError

TABLE_SAMPLES = 32  # calibration windows of 256 tokens per quantized checkpoint
CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "assets" / "text" / "calibration.txt"


class Row(NamedTuple):
    label: str
    method: str | None  # `treadle quantize --method` (then evaluated from its checkpoint), or None
    bits: int | None
    group_size: int | None
    quantization: str | None  # the load-time mode (`--quantization`) of the float model


ROWS = (
    Row("float32", None, None, None, "none"),
    Row("RTN W8A8 (int8 channel, dynamic int8 tokens)", "rtn", 8, None, None),
    Row("SmoothQuant W8A8 (alpha 0.8)", "smoothquant", 8, None, None),
    Row("RTN int4-g32 (W4A16)", "rtn", 4, 32, None),
    Row("GPTQ int4-g32 (W4A16)", "gptq", 4, 32, None),
    Row("AWQ int4-g32 (W4A16)", "awq", 4, 32, None),
    Row("load-time int8 (weight-only RTN)", None, None, None, "int8"),
    Row("load-time int4-g32 (weight-only RTN)", None, None, None, "int4-g32"),
    Row("GGUF native blocks", None, None, None, "gguf"),
)


def evaluate_text(model: str, text: Path, quantization: str | None, reference: str | None, window: int = 512,
                  stride: int = 256) -> PerplexityResult:
    from treadle.layers.attention.selector import select_backend
    from treadle.loaders import load_model

    try:
        raw = text.read_text(encoding="utf-8")
    except OSError as e:
        raise TreadleError(f"{text}: cannot read the evaluation text ({e.strerror})") from None
    if window < 2 or not 0 < stride <= window:
        raise TreadleError("--window must be >= 2 and 0 < --stride <= --window")
    lm = load_model(model, select_backend("auto", "cpu"), quantization=quantization)
    ref = load_model(reference, select_backend("auto", "cpu"), quantization="none") if reference else None
    if lm.tokenizer is None:
        raise TreadleError(f"{model}: no tokenizer")
    ids = lm.tokenizer.encode(raw)
    if len(ids) < 2:
        raise TreadleError(f"{text}: too short to score")
    return evaluate(lm, ids, window, stride, ref)


def _checkpoint(model: str, row: Row, workdir: Path) -> str:
    from treadle.quantize.pipeline import quantize_checkpoint
    from treadle.quantize.spec import QuantizeSpec

    assert row.method is not None
    out = workdir / (f"{Path(model).name}-{row.method}-w{row.bits}" + (f"-g{row.group_size}" if row.group_size else ""))
    if not (out / "config.json").is_file():
        spec = QuantizeSpec.build(row.method, row.bits, row.group_size, 0.8, TABLE_SAMPLES, 256)
        quantize_checkpoint(model, out, CALIBRATION_TEXT, spec)
    return str(out)


def accuracy_table(models: list[str], workdir: Path, text: Path) -> str:
    """Markdown: one line per (model, row); a row that cannot run says why."""
    lines = ["| model | mode | perplexity | vs float | top-1 agree | mean abs dlogit | weights MB | decode ms |",
             "|---|---|---|---|---|---|---|---|"]
    for model in models:
        base: float | None = None
        for row in ROWS:
            try:
                path = _checkpoint(model, row, workdir) if row.method else model
                r = evaluate_text(path, text, row.quantization, None if row.label == "float32" else model)
            except TreadleError as e:
                lines.append(f"| {model} | {row.label} | n/a: {e} | | | | | |")
                continue
            base = r.perplexity if base is None else base
            agree = "" if r.top1_agreement is None else f"{100 * r.top1_agreement:.1f} %"
            dl = "" if r.mean_abs_dlogit is None else f"{r.mean_abs_dlogit:.3f}"
            lines.append(f"| {model} | {row.label} | {r.perplexity:.3f} | {100 * (r.perplexity / base - 1):+.2f} % | "
                         f"{agree} | {dl} | {r.weight_mb:.1f} | {r.decode_ms:.1f} |")
    return "\n".join(lines)
