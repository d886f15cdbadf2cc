"""GPU check of the whole engine on CUDA (``device="cuda"``), printed as one short table.

    python benchmarks/gpu_engine_check.py            # on a CUDA machine
    python benchmarks/gpu_engine_check.py --device cpu --quick   # the same checks' logic on the CPU

``benchmarks/gpu_check.py`` checks the Triton attention kernels and CUDA graphs on a bare model;
this one runs what a user runs, ``LLM(path, device="cuda")``, and holds it to transformers on
the same GPU:

1. kernels on CUDA tensors: W8A8 activation quantization and matmul bit-equal to the torch
   reference, W4A16 (float32 / float16 / bfloat16) close to the decoded weight, the MoE grouped
   matmul equal to a matmul per expert (float32 sums, IEEE products), the per-token operators
   (layers/triton_ops.py) against the torch paths;
2. random-weight models of each family (Llama GQA, Qwen3, Phi-3, Gemma 3 with sliding layers,
   Mixtral, Qwen3-MoE) in float32: greedy tokens identical to transformers on CUDA, and the
   chosen tokens' logprobs close; CUDA graphs (the default on CUDA) and eager give the same tokens;
3. the engine's paths (prompts alone, small chunks, preemption, prefix-cache hits, n-gram
   speculation, a sliding window) give the plain run's tokens; ``treadle serve`` on the device
   answers the openai client (streamed = whole, a bad request a 400, still serving after it);
   quantized checkpoints (compressed-tensors W8A8, act-order GPTQ) on the Triton kernels match
   transformers on the decoded weights;
4. decode throughput of a TinyLlama-shaped (1.1B) random model in bfloat16 at batch 1 / 16 / 64:
   CUDA graphs, eager, and transformers' own generate on the same device and weights, side by side
   (timings: what this run measured, not a claim).
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' model makers

ROWS: list[tuple[str, bool, str]] = []
PREEMPTIONS: list[int] = []  # each treadle_greedy run's count
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

def w8a8_kernels(device: torch.device) -> tuple[bool, str]:
    from treadle.quantization.methods import gpu
    from treadle.quantization.methods.w8a8 import quantize_per_token, w8a8_reference

    worst = []
    shapes = [(1, 64, 40), (3, 100, 70), (17, 130, 129), (70, 64, 65)]
    for m, k, n in shapes + ([(300, 2048, 512)] if device.type == "cuda" else []):
        g = torch.Generator().manual_seed(m * 1000 + k)
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale, bias = torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g)
        xq, xs = gpu.w8a8_quantize(x.to(device))
        want_q, want_s = quantize_per_token(x)
        got = gpu.w8a8_matmul(x.to(device), w.to(device), scale.to(device), bias.to(device)).cpu()
        want = w8a8_reference(x, w, scale, bias)
        same = torch.equal(xq.cpu(), want_q) and torch.equal(xs.cpu(), want_s) and torch.equal(got, want)
        worst.append((same, (got - want).abs().max().item()))
    return all(s for s, _ in worst), f"{sum(s for s, _ in worst)}/{len(worst)} shapes bit-equal (max|d| {max(d for _, d in worst):.1e})"


def w4a16_kernels(device: torch.device) -> tuple[bool, str]:
    import torch.nn.functional as F

    from treadle.layers.linear import Linear
    from treadle.quantization.formats.int4 import Int4Weight, install
    from treadle.quantization.methods.w8a8 import W8A8Method

    errs = {}
    dtypes = [(torch.float32, 1e-4), (torch.float16, 2e-2)]
    if device.type == "cuda":  # Triton's interpreter returns garbage for tl.dot on bfloat16 tiles
        dtypes.append((torch.bfloat16, 1e-1))
    for dtype, tol in dtypes:
        for m, group in ((1, 32), (5, 128), (40, 0)):
            k, g = 256, torch.Generator().manual_seed(m)
            gidx = torch.randperm(k, generator=g) // 32 if group == 0 else torch.arange(k) // group
            groups = int(gidx.max()) + 1
            part = Int4Weight(torch.randint(0, 16, (64, k), generator=g, dtype=torch.uint8),
                              torch.rand(64, groups, generator=g) * 0.1,
                              torch.randint(0, 16, (64, groups), generator=g).float(), gidx)
            layer = Linear(k, [64], bias=False, dtype=dtype, method=W8A8Method())
            install(layer, [part], "triton", dtype)
            layer.to(device)
            x = torch.randn(m, k, generator=g).to(dtype)
            y = layer(x.to(device)).float().cpu()
            want = F.linear(x.float(), part.dequantize().to(dtype).float())
            err = ((y - want).abs().max() / want.abs().max()).item()
            errs[dtype] = max(errs.get(dtype, 0.0), err)
            if err > tol:
                return False, f"{dtype} m={m} group={group}: relative error {err:.1e} > {tol:.0e}"
    return True, "relative max|err| " + ", ".join(f"{str(d)[6:]} {e:.1e}" for d, e in errs.items())


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
    """treadle/layers/triton_ops.py against the torch paths, on the GPU in every dtype: the residual
    sum and RoPE bit for bit, RMSNorm and the gated activations within one rounding step (bfloat16
    cannot be checked in the interpreter: it truncates)."""
    import torch.nn.functional as F

    from treadle.layers import triton_ops
    from treadle.layers.norm import rms_norm_plain
    from treadle.layers.rotary import RotaryEmbedding, rotate_in_place

    step = {torch.float32: 1e-5, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}  # rtol: a rounding step
    worst: dict[str, float] = {}
    for dtype in (torch.float32, torch.float16) + ((torch.bfloat16,) if device.type == "cuda" else ()):
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(37, 2048, generator=g) * 2).to(dtype).to(device)
        res = (torch.randn(37, 2048, generator=g) * 2).to(dtype).to(device)
        w = (1 + 0.1 * torch.randn(2048, generator=g)).to(dtype).to(device)
        want, want_sum = rms_norm_plain(x, res, w, 1e-6)
        got, got_sum = triton_ops.rms_norm(x, res.clone(), w, 1e-6)
        if not torch.equal(got_sum, want_sum):
            return False, f"{dtype}: residual sum differs"
        torch.testing.assert_close(got, want, rtol=step[dtype], atol=1e-5)
        gu = (torch.randn(37, 2 * 5632, generator=g) * 2).to(dtype).to(device)
        for gelu in (False, True):
            act = F.gelu(gu[:, :5632], approximate="tanh") if gelu else F.silu(gu[:, :5632])
            torch.testing.assert_close(triton_ops.gated(gu, gelu), act * gu[:, 5632:], rtol=step[dtype], atol=1e-5)
        rope = RotaryEmbedding(128, 4096, 10000.0, None).to(device)
        q = (torch.randn(37, 40, 128, generator=g) * 2).to(dtype).to(device)
        pos = torch.randint(0, 4096, (37,), generator=g).to(device)
        ref = q.clone()
        cs = rope.cos_sin.index_select(0, pos).to(dtype).unsqueeze(1)
        rotate_in_place(ref, cs[..., :64], cs[..., 64:])
        triton_ops.rope_(q, rope.cos_sin, pos)
        if not torch.equal(q, ref):
            return False, f"{dtype}: rope differs, max|d| {(q.float() - ref.float()).abs().max().item():.1e}"
        worst[str(dtype)[6:]] = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    return True, "residual and rope bit-equal; norm rel max|d| " + ", ".join(f"{k} {v:.0e}" for k, v in worst.items())


# 2. model families through LLM(device=...) ------------------------------------------------------

def make_model(arch: str, path: Path) -> Path:
    import transformers
    from tiny_models import make_tiny_model, write_byte_tokenizer

    if arch in ("llama", "qwen3", "phi3"):
        return make_tiny_model(path, arch)
    path.mkdir(parents=True)
    if arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            vocab_size=write_byte_tokenizer(path), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    else:
        common = dict(vocab_size=write_byte_tokenizer(path), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0,
                      eos_token_id=1)
        cfg = (transformers.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2) if arch == "mixtral"
               else transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                head_dim=16, norm_topk_prob=True, decoder_sparse_step=2))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():  # larger than the default init, so tokens and routes vary
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif arch == "gemma3":  # its norms hold (1 + weight): not all zero
                p.normal_(0, 0.3)
    hf.save_pretrained(path)
    return path


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


def treadle_greedy(path: Path, device: torch.device, new: int, repeat: bool = False, **kw: object) -> tuple[list[list[int]], list[list[float]]]:
    from treadle import LLM, SamplingParams

    args: dict[str, object] = dict(max_num_batched_tokens=32, block_size=16, num_kv_blocks=64)
    args.update(kw)  # default: chunked prefill (the 60-token prompt takes two steps), mixed batches
    llm = LLM(str(path), device=str(device), dtype="float32", **args)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    if repeat:  # again on the same engine: every full prompt block now a prefix-cache hit
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    PREEMPTIONS.append(llm.engine.scheduler.num_preemptions)
    toks = [o.outputs[0].token_ids for o in outs]
    lps = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    del llm
    return toks, lps


def family(arch: str, device: torch.device, work: Path, new: int) -> tuple[bool, str]:
    path = make_model(arch, work / arch)
    want, want_lp = hf_greedy(path, device, new)
    got, got_lp = treadle_greedy(path, device, new)
    eager, _ = treadle_greedy(path, device, new, enforce_eager=True)
    same = sum(g == w for g, w in zip(got, want))
    dlp = max(abs(a - b) for g, w in zip(got_lp, want_lp) for a, b in zip(g, w))
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
        want, _ = treadle_greedy(path, device, new)
        alone = []
        llm = LLM(str(path), device=str(device), dtype="float32", num_kv_blocks=64)
        for p in PROMPTS:
            o = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                             use_tqdm=False)
            alone.append(o[0].outputs[0].token_ids)
        del llm
        cases = {
            "alone": alone,
            "chunks of 8": treadle_greedy(path, device, new, max_num_batched_tokens=8)[0],
            "preemption": treadle_greedy(path, device, new, num_kv_blocks=blocks[arch], max_num_batched_tokens=64)[0],
            "prefix hits": treadle_greedy(path, device, new, repeat=True)[0],
            "ngram spec": treadle_greedy(path, device, new, speculative_config={
                "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})[0],
        }
        if PREEMPTIONS[-3] == 0:
            return False, f"{arch}: {blocks[arch]} KV blocks preempted nothing"
        bad = [name for name, got in cases.items() if got != want]
        if bad:
            return False, f"{arch}: tokens differ from the plain run under {', '.join(bad)}"
        out.append(arch)
    return True, f"{' and '.join(out)}: plain = alone = chunks of 8 = preemption = prefix hits = ngram spec"


def server(device: torch.device, work: Path) -> tuple[bool, str]:
    """`treadle serve` on the device, driven by the official openai client: a greedy chat answer
    streamed equals the same answer whole, a bad request is a 400 with an OpenAI error body, and
    the server keeps serving after it."""
    import signal
    import socket
    import subprocess

    import httpx
    import openai

    path = work / "llama" if (work / "llama").exists() else make_model("llama", work / "llama")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = open(work / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "treadle.entrypoints.cli", "serve", str(path), "--device", str(device),
                             "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                return False, f"the server exited ({proc.returncode}): {(work / 'serve.log').read_text()[-300:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                return False, "the server did not come up in 180 s"
            time.sleep(0.5)
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
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


# 3. quantized checkpoints ----------------------------------------------------------------------------

def quantized(kind: str, device: torch.device, work: Path, new: int) -> tuple[bool, str]:
    from quant_checkpoints import write_compressed_tensors, write_int4_checkpoint

    if kind == "w8a8":  # transformers runs it through compressed-tensors (dynamic 8-bit activations too)
        path = write_compressed_tensors(work / "ct", "w8a8")
        oracle, tol = path, 0.1  # per-step activation rounding moves generated-token logprobs (the suite holds
        # the prompt logprobs to 1e-3: test_quant_checkpoints)
    else:
        path = write_int4_checkpoint(work / "gptq", work / "gptq-float", "gptq", 32, False, True)
        oracle, tol = work / "gptq-float", 0.1
    want, want_lp = hf_greedy(oracle, device, new)
    got, got_lp = treadle_greedy(path, device, new)
    same = sum(g == w for g, w in zip(got, want))
    dlp = max(abs(a - b) for g, w in zip(got_lp, want_lp) for a, b in zip(g, w) if g is not None)
    return same == len(PROMPTS) and dlp < tol, (f"{same}/{len(PROMPTS)} greedy equal to transformers on the decoded "
                                                 f"weights, max|dlogprob| {dlp:.1e} (tol {tol})")


# 4. throughput --------------------------------------------------------------------------------------

def throughput(device: torch.device, work: Path, quick: bool, profile: bool = False) -> tuple[bool, str]:
    import transformers
    from tiny_models import write_byte_tokenizer

    from treadle import LLM, SamplingParams

    path = work / "tinyllama"
    path.mkdir()
    vocab = write_byte_tokenizer(path)
    shape = (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2) if quick else
             dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4))
    cfg = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
                                   **shape)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    hf.save_pretrained(path)
    del hf
    assert vocab <= 32000
    out = []
    batches = (1, 4) if quick else (1, 16, 64)
    new = 8 if quick else 128
    baseline = {}  # transformers' own generate on the same device and weights (its default cache)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    for b in batches:
        ids = torch.tensor([[5 + i, 9, 200, 17] * 8 for i in range(b)], device=device)
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            hf.generate(ids[:1], max_new_tokens=4, **kw)  # warm
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize()
        baseline[b] = b * new / (time.perf_counter() - t)
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for eager in (False, True):
        llm = LLM(str(path), device=str(device), dtype="bfloat16", enforce_eager=eager, max_num_seqs=max(batches))
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        for b in batches:
            prompts = [{"prompt_token_ids": [5 + i, 9, 200, 17] * 8} for i in range(b)]
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append((eager, b, b * new / (time.perf_counter() - t)))
            if profile and b == 1 and not eager:  # where a graph-replayed batch-1 step's host time goes
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.runcall(llm.generate, prompts, params, use_tqdm=False)
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
                if device.type == "cuda":  # the GPU's own time per kernel over the same run
                    from torch.profiler import ProfilerActivity
                    from torch.profiler import profile as torch_profile

                    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                        llm.generate(prompts, params, use_tqdm=False)
                    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
        del llm
    graphs = {b: tps for e, b, tps in out if not e}
    eagers = {b: tps for e, b, tps in out if e}
    return True, "tok/s graphs / eager / transformers: " + ", ".join(
        f"b{b} {graphs[b]:.0f} / {eagers[b]:.0f} / {baseline[b]:.0f} ({graphs[b] / baseline[b]:.2f}x transformers)"
        for b in batches)


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
            check("kernel: W8A8 quantize + matmul", lambda: w8a8_kernels(device))
            check("kernel: W4A16 f32/f16/bf16", lambda: w4a16_kernels(device))
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
