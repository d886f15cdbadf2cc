"""The fused Gemma 3 decoder stack (one C call for all layers, treadle/kernels/csrc/gemma_layer.c)
on all-decode CPU steps gives exactly what the module path gives (the same kernels one by one):
on a tiny random Gemma 3 in GGUF blocks through the paged cache (logits equal), through the
engine with hybrid KV on prompts past the sliding window, batched (tokens and logprobs equal,
``fused_layers=False`` the module path), and on the real ``gemma-3-270m`` file (slow)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_gemma3_model import make_tiny_gemma3
from test_layer_kernel import decode_logits, gguf_block_model

from treadle import LLM, SamplingParams
from treadle.kernels import native
from treadle.kernels.gemma_layer import GemmaDecoderKernel
from treadle.layers.fused_gemma import FusedGemmaStack
from treadle.worker.fused_layers import fuse_decoder_layers

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)"),
]


def count_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per step the C stack runs (its batch size)."""
    calls: list[int] = []
    run = GemmaDecoderKernel.__call__

    def counted(self: GemmaDecoderKernel, x: torch.Tensor, *a: object) -> None:
        calls.append(x.shape[0])
        run(self, x, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(GemmaDecoderKernel, "__call__", counted)
    return calls


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-fused"), seed=2)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_fused_gemma_stack_equals_module_path(gemma_dir: Path, monkeypatch: pytest.MonkeyPatch, qtype: str) -> None:
    fused, modules = gguf_block_model(gemma_dir, qtype), gguf_block_model(gemma_dir, qtype)
    assert fuse_decoder_layers(fused.model) == fused.config.num_layers
    assert isinstance(fused.model.decoder, FusedGemmaStack)
    calls = count_steps(monkeypatch)
    prompts = [[5, 9, 13, 2, 7], [3] * 19, [8, 4]]  # 19 + 14 steps: past the window (16)
    got = decode_logits(fused, prompts, 14)
    assert calls == [26] + [3] * 14  # the prompt step too (its 26 tokens are decode rows)
    for a, b in zip(got, decode_logits(modules, prompts, 14)):
        assert torch.equal(a, b)


def _engine_run(path: Path, fused: bool, monkeypatch: pytest.MonkeyPatch, **kw: object) -> tuple[list, list[int]]:
    prompts = [list(range(2, 82)), [7, 3, 9] * 9, [40, 41]]  # 80 tokens: five windows
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    llm = LLM(str(path), fused_layers=fused, **kw)
    calls = count_steps(monkeypatch)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    monkeypatch.undo()
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], calls


@pytest.mark.parametrize("hybrid,weights", [(True, {"quantization": "int8"}), (False, {"quantization": "int8"}),
                                            (True, {"quantization": "int4", "kv_cache_dtype": "int8"}),
                                            (True, {"dtype": "bfloat16"})])
def test_engine_fused_gemma_with_hybrid_kv(gemma_dir: Path, monkeypatch: pytest.MonkeyPatch, hybrid: bool,
                                           weights: dict) -> None:
    """Sliding groups give blocks back (hybrid) or not: each layer reads its group's tables; GGUF
    blocks or bfloat16 rows, a float32 or an int8 KV cache."""
    kw = dict(num_kv_blocks=128, block_size=8, max_num_batched_tokens=24, disable_hybrid_kv_cache_manager=not hybrid,
              **weights)
    got, calls = _engine_run(gemma_dir, True, monkeypatch, **kw)
    want, none = _engine_run(gemma_dir, False, monkeypatch, **kw)
    assert len(calls) >= 11 and 3 in calls and not none  # the batched decode steps ran the C stack
    assert got == want


@pytest.mark.slow
def test_real_gemma_fused_equals_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """gemma-3-270m (Q4_K_M) through the engine with hybrid KV: a batch of a short prompt and one
    past the 512-token window (its sliding groups give blocks back), 6 greedy tokens each. Token
    ids in and out: no tokenizer (building the file's 262k-piece one took ~3 s per engine)."""
    long = [2] + [(i * 37) % 5000 + 100 for i in range(14)] * 38  # 533 tokens
    prompts = [long, [2, 818, 5279, 529, 7001, 563]]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    outs, calls = {}, []
    for fused in (True, False):
        llm = LLM("gemma-3-270m", fused_layers=fused, max_model_len=1024, block_size=16, skip_tokenizer_init=True)
        calls = count_steps(monkeypatch)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
        monkeypatch.undo()
        assert bool(calls) == fused and (not fused or calls.count(2) >= 5)  # batched decode steps in C
    assert outs[True] == outs[False]
