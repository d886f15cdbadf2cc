"""GPU check of the whole engine on CUDA (``device="cuda"``), printed as one short table.

    python benchmarks/gpu_engine_check.py            # on a CUDA machine
    python benchmarks/gpu_engine_check.py --device cpu --quick   # the same checks' logic on the CPU

``benchmarks/gpu_check.py`` checks the Triton attention kernels and CUDA graphs on a bare model;
this one runs what a user runs, ``LLM(path, device="cuda")``, and holds it to transformers on
the same GPU:

1. kernels: the suite's W8A8 / W4A16 and per-token operator checks (tests/gpu/test_quant_gpu_kernels.py,
   test_triton_ops.py) on the device, the MoE grouped matmul against float64 per expert;
2. random-weight Llama (GQA), Qwen3, Phi-3, Gemma 3 (sliding layers), Mixtral, Qwen3-MoE in float32:
   greedy tokens identical to transformers, logprobs close, CUDA graphs == eager;
3. the engine's paths (prompts alone, small chunks, preemption, prefix hits, n-gram speculation, a
   window) give the plain run's tokens; ``treadle serve`` answers the openai client (stream = whole,
   a 400, still serving); W8A8 and act-order GPTQ checkpoints match transformers' decoded weights;
4. decode throughput of a 1.1B (TinyLlama-shaped) random bfloat16 model at batch 1 / 16 / 64 with
   CUDA graphs, eager and transformers' generate, side by side (what this run measured).
Exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS / d) for d in ("", "models", "quantization", "gpu")]  # the tests' model makers, checks

ROWS: list[tuple[str, bool, str]] = []
PROMPTS = [[5, 9, 200, 17], list(range(30, 53)), [77] * 19, list(range(100, 160))]


def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
    """Run one check; an exception is a failure with its last line, the traceback on stderr."""
    start = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as exc:  # noqa: BLE001 - a broken check is a failed row, the run goes on
        traceback.print_exc()
        ok, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    ROWS.append((name, ok, f"{detail} [{time.perf_counter() - start:.0f}s]"))
    print(f"{name}: {'ok' if ok else 'FAIL'} {detail}", flush=True)


# 1. kernels -----------------------------------------------------------------------------------

def quant_kernels(device: torch.device) -> tuple[bool, str]:
    """tests/gpu/test_quant_gpu_kernels.py's checks on this device: W8A8 bit for bit (and a larger
    shape here), W4A16 for every group layout and in 16-bit activations (bfloat16 only on a GPU:
    the interpreter's tl.dot on bfloat16 is broken)."""
    from test_quant_gpu_kernels import (
        LAYOUTS,
        W8A8_SHAPES,
        check_activation_quantization,
        check_w4a16_16_bit,
        check_w4a16_layer,
        check_w8a8_matmul,
    )

    d = str(device)
    for dtype in (torch.float32, torch.bfloat16):
        check_activation_quantization(dtype, d)
    for shape in W8A8_SHAPES + ([(300, 2048, 512)] if device.type == "cuda" else []):
        check_w8a8_matmul(*shape, d)
    for layout in LAYOUTS:
        for m in (1, 5, 40):
            check_w4a16_layer(layout, m, d)
    dtypes = (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.float16,)
    for dtype in dtypes:
        check_w4a16_16_bit(dtype, d)
    return True, f"W8A8 bit-equal, W4A16 within float32 / {' / '.join(str(t)[6:] for t in dtypes)} rounding"


def moe_kernel(device: torch.device) -> tuple[bool, str]:
    from treadle.layers import moe_triton

    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 210, 1, 16, 0, 77, 64]
    n, k = (1408, 2048) if device.type == "cuda" else (40, 48)
    w = torch.randn(8, n, k, generator=g)
    x = torch.randn(sum(counts), k, generator=g)
    tiles = moe_triton.expert_tiles(counts, range(8), device)
    got = moe_triton.grouped_matmul(x.to(device), w.to(device), tiles).cpu().double()
    want, start = [], 0
    for e, c in enumerate(counts):
        want.append(x[start : start + c].double() @ w[e].double().t())
        start += c
    err = (got - torch.cat(want)).abs().max().item()
    return err < 1e-3, f"{sum(counts)} rows over 8 experts (2 empty), max|err| vs float64 {err:.1e}"


def token_ops(device: torch.device) -> tuple[bool, str]:
    """treadle/layers/triton_ops.py against the torch paths: tests/gpu/test_triton_ops.py's checks on
    this device, in bfloat16 too where it is a GPU (the interpreter truncates bfloat16)."""
    from test_triton_ops import DTYPES, check_gated, check_rms_norm, check_rope

    dtypes = [*DTYPES, torch.bfloat16] if device.type == "cuda" else DTYPES
    for dtype in dtypes:
        for flag in (False, True):
            check_rms_norm(dtype, flag, str(device))
            check_gated(dtype, flag, str(device))
        check_rope(dtype, str(device))
    return True, f"residual sum and RoPE bit-equal, norm and gates within a rounding step: {len(dtypes)} dtypes"


# 2. model families through LLM(device=...) ------------------------------------------------------

def make_model(arch: str, path: Path) -> Path:
    """The suite's own random-weight models of ``arch``, saved at ``path``."""
    from test_gemma3_model import make_tiny_gemma3
    from test_models_moe import make_moe_model
    from tiny_models import make_tiny_model

    if arch == "gemma3":
        return make_tiny_gemma3(path)
    if arch in ("mixtral", "qwen3-moe"):
        make_moe_model(path, arch)
        return path
    return make_tiny_model(path, arch)


def hf_greedy(path: Path, device: torch.device, new: int) -> tuple[list[list[int]], list[list[float]]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf = hf.to(device).eval()
    toks, lps = [], []
    with torch.no_grad():
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p], device=device), max_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            ids = out.sequences[0, len(p):].tolist()
            lp = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, ids)]
            toks.append(ids)
            lps.append(lp)
    return toks, lps


class Run(NamedTuple):
    tokens: list[list[int]]
    logprobs: list[list[float]]  # each chosen token's
    preemptions: int


def treadle_greedy(path: Path, device: torch.device, new: int, repeat: bool = False, **kw: object) -> Run:
    from treadle import LLM, SamplingParams

    args: dict[str, object] = dict(max_num_batched_tokens=32, block_size=16, num_kv_blocks=64)
    args.update(kw)  # default: chunked prefill (the 60-token prompt takes two steps), mixed batches
    llm = LLM(str(path), device=str(device), dtype="float32", **args)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    if repeat:  # again on the same engine: every full prompt block now a prefix-cache hit
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return Run(toks, lps, llm.engine.scheduler.num_preemptions)


def max_dlogprob(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def family(arch: str, device: torch.device, work: Path, new: int) -> tuple[bool, str]:
    path = make_model(arch, work / arch)
    want, want_lp = hf_greedy(path, device, new)
    got, got_lp, _ = treadle_greedy(path, device, new)
    eager = treadle_greedy(path, device, new, enforce_eager=True).tokens
    same = sum(g == w for g, w in zip(got, want))
    dlp = max_dlogprob(got_lp, want_lp)
    ok = same == len(PROMPTS) and eager == got and dlp < 1e-3
    return ok, (f"{same}/{len(PROMPTS)} greedy equal to transformers ({new} tokens), graphs == eager: {eager == got}, "
                f"max|dlogprob| {dlp:.1e}")


def engine_paths(device: torch.device, work: Path, new: int) -> tuple[bool, str]:
    """The engine's paths on the GPU give the plain run's greedy tokens: prompts one at a time,
    small prefill chunks, preemption (too few KV blocks for the batch), prefix-cache hits, n-gram
    speculative decoding (the graph-less verify steps), and Gemma 3's sliding window past it."""
    from treadle import LLM, SamplingParams

    out = []
    blocks = {"llama": 8, "gemma3": 30}  # room for the longest request, not for all four at once
    for arch in ("llama", "gemma3"):
        path = work / arch if (work / arch).exists() else make_model(arch, work / arch)
        want = treadle_greedy(path, device, new).tokens
        alone = []
        llm = LLM(str(path), device=str(device), dtype="float32", num_kv_blocks=64)
        for p in PROMPTS:
            o = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                             use_tqdm=False)
            alone.append(o[0].outputs[0].token_ids)
        del llm
        preempted = treadle_greedy(path, device, new, num_kv_blocks=blocks[arch], max_num_batched_tokens=64)
        if preempted.preemptions == 0:
            return False, f"{arch}: {blocks[arch]} KV blocks preempted nothing"
        cases = {
            "alone": alone,
            "chunks of 8": treadle_greedy(path, device, new, max_num_batched_tokens=8).tokens,
            "preemption": preempted.tokens,
            "prefix hits": treadle_greedy(path, device, new, repeat=True).tokens,
            "ngram spec": treadle_greedy(path, device, new, speculative_config={
                "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}).tokens,
        }
        bad = [name for name, got in cases.items() if got != want]
        if bad:
            return False, f"{arch}: tokens differ from the plain run under {', '.join(bad)}"
        out.append(arch)
    return True, f"{' and '.join(out)}: plain = alone = chunks of 8 = preemption = prefix hits = ngram spec"


def server(device: torch.device, work: Path) -> tuple[bool, str]:
    """`treadle serve` on the device (started, waited for and killed by the router tests' harness),
    driven by the official openai client: a greedy chat answer streamed equals the same answer
    whole, a bad request is a 400 with an OpenAI error body, and the server keeps serving after it."""
    import openai
    from router_harness import Proc, free_port, running

    path = work / "llama" if (work / "llama").exists() else make_model("llama", work / "llama")
    url = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "treadle.entrypoints.cli", "serve", str(path), "--device", str(device),
            "--port", url.rsplit(":", 1)[1]]
    with running(Proc(url, argv, work / "serve.log")):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Tell me about the sea."}]
        whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
        chunks = client.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        try:
            client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=-1)
            return False, "temperature=-1 was accepted"
        except openai.BadRequestError as exc:
            bad = exc.status_code == 400 and isinstance(exc.body, dict) and "message" in exc.body
        after = client.completions.create(model=model, prompt=[5, 9, 200, 17], max_tokens=8, temperature=0)
    ok = streamed == whole.choices[0].message.content and bad and after.usage.completion_tokens == 8
    return ok, (f"stream == whole: {streamed == whole.choices[0].message.content} "
                f"({whole.usage.completion_tokens} tokens), bad request -> 400 with an error body: {bad}, "
                f"served after it: {after.usage.completion_tokens == 8}")


# 3. quantized checkpoints ----------------------------------------------------------------------------

def quantized(kind: str, device: torch.device, work: Path, new: int) -> tuple[bool, str]:
    from quant_checkpoints import write_compressed_tensors, write_int4_checkpoint

    # tol: per-step activation rounding (W8A8) and float16 group scales (GPTQ) move generated-token
    # logprobs; the suite holds the prompt logprobs tighter (test_quant_checkpoints)
    tol = 0.1
    if kind == "w8a8":  # transformers runs it through compressed-tensors (dynamic 8-bit activations too)
        path = oracle = write_compressed_tensors(work / "ct", "w8a8")
    else:
        path = write_int4_checkpoint(work / "gptq", work / "gptq-float", "gptq", 32, False, True)
        oracle = work / "gptq-float"
    want, want_lp = hf_greedy(oracle, device, new)
    got, got_lp, _ = treadle_greedy(path, device, new)
    same = sum(g == w for g, w in zip(got, want))
    dlp = max_dlogprob(got_lp, want_lp)
    return same == len(PROMPTS) and dlp < tol, (f"{same}/{len(PROMPTS)} greedy equal to transformers on the decoded "
                                                 f"weights, max|dlogprob| {dlp:.1e} (tol {tol})")


# 4. throughput --------------------------------------------------------------------------------------

def rate(tokens: int, device: torch.device, fn: Callable[..., object], *args: object, **kw: object) -> float:
    """Tokens per second of ``fn(*args, **kw)``, the device's queue drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn(*args, **kw)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t)


def transformers_rates(path: Path, device: torch.device, batches: tuple[int, ...], new: int) -> dict[int, float]:
    """The baseline: transformers' own generate on the same device and weights (its default cache)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    out = {}
    with torch.no_grad():
        for b in batches:
            ids = torch.tensor([[5 + i, 9, 200, 17] * 8 for i in range(b)], device=device)
            hf.generate(ids[:1], max_new_tokens=4, **kw)  # warm
            out[b] = rate(b * new, device, hf.generate, ids, max_new_tokens=new, min_new_tokens=new, **kw)
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def profile(llm, prompts: list[dict], params, device: torch.device) -> None:  # noqa: ANN001
    """Where a batch-1 step's time goes: cProfile of the host, and the GPU's own time per kernel."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(llm.generate, prompts, params, use_tqdm=False)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            llm.generate(prompts, params, use_tqdm=False)
        print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


def throughput(device: torch.device, work: Path, quick: bool, with_profile: bool = False) -> tuple[bool, str]:
    import transformers
    from tiny_models import write_byte_tokenizer

    from treadle import LLM, SamplingParams

    path = work / "tinyllama"
    path.mkdir()
    assert write_byte_tokenizer(path) <= 32000
    shape = (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2) if quick else
             dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4))
    cfg = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
                                   **shape)
    with torch.device(device):
        transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    batches, new = ((1, 4), 8) if quick else ((1, 16, 64), 128)
    baseline = transformers_rates(path, device, batches, new)
    rates: dict[bool, dict[int, float]] = {}  # enforce_eager -> batch -> tok/s
    for eager in (False, True):
        llm = LLM(str(path), device=str(device), dtype="bfloat16", enforce_eager=eager, max_num_seqs=max(batches))
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        rates[eager] = {}
        for b in batches:
            prompts = [{"prompt_token_ids": [5 + i, 9, 200, 17] * 8} for i in range(b)]
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm
            rates[eager][b] = rate(b * new, device, llm.generate, prompts, params, use_tqdm=False)
            if with_profile and b == 1 and not eager:
                profile(llm, prompts, params, device)
        del llm
    return True, "tok/s graphs / eager / transformers: " + ", ".join(
        f"b{b} {rates[False][b]:.0f} / {rates[True][b]:.0f} / {baseline[b]:.0f} ({rates[False][b] / baseline[b]:.2f}x "
        "transformers)" for b in batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="fewer tokens, a tiny throughput model")
    parser.add_argument("--profile", action="store_true", help="cProfile the batch-1 graph-replayed decode")
    parser.add_argument("--only", nargs="*", default=None, help="sections: kernels families paths server quantized throughput")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    new = 6 if args.quick else 32
    want = set(args.only or ["kernels", "families", "paths", "server", "quantized", "throughput"])
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "kernels" in want:
            check("kernel: W8A8 / W4A16", lambda: quant_kernels(device))
            check("kernel: MoE grouped matmul", lambda: moe_kernel(device))
            check("kernel: norm / gated / rope", lambda: token_ops(device))
        if "families" in want:
            for arch in ("llama", "qwen3", "phi3", "gemma3", "mixtral", "qwen3-moe"):
                check(f"engine: {arch}", lambda arch=arch: family(arch, device, work, new))
        if "paths" in want:
            check("engine: paths", lambda: engine_paths(device, work, new))
        if "server" in want:
            check("server: openai client", lambda: server(device, work))
        if "quantized" in want:
            for kind in ("w8a8", "gptq-act-order"):
                check(f"engine: {kind} checkpoint", lambda kind=kind: quantized(kind, device, work, new))
        if "throughput" in want:
            check("engine: 1.1B bf16 decode", lambda: throughput(device, work, args.quick, args.profile))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\ntreadle gpu_engine_check on {name}, torch {torch.__version__}")
    width = max(len(r[0]) for r in ROWS)
    for check_name, ok, detail in ROWS:
        print(f"{check_name:<{width}}  {'ok  ' if ok else 'FAIL'}  {detail}")
    print(f"{sum(r[1] for r in ROWS)}/{len(ROWS)} checks ok in {time.perf_counter() - start:.0f}s")
    return 0 if all(r[1] for r in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
