"""bfloat16 weights on the CPU (``--dtype bfloat16``): csrc/bf16matmul.c against its plain-C build
(bit for bit: the same float operations in the same order), against torch's float32 matmul of the
widened weights, batch invariance, and a tiny random Llama in bfloat16 against transformers in
float32 on the same bfloat16-rounded weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_variants import VARIANTS, force, rand, runnable
from paged_session import PagedSession
from tiny_models import make_tiny_model

from treadle import LLM, SamplingParams
from treadle.kernels import native
from treadle.layers.attention.cpu import CPUBackend
from treadle.layers.fused_decoder import FusedDecoderLayer
from treadle.layers.linear import Linear
from treadle.loaders import load_model
from treadle.quantization.methods.bfloat16_cpu import BFloat16CPUMethod

pytestmark = [pytest.mark.skipif(not native.available(), reason="needs a C compiler (Treadle's CPU kernels)"),
              pytest.mark.usefixtures("one_thread")]
SHAPES = [(1, 37, 64), (5, 64, 72), (16, 130, 576)]  # N not a multiple of the 4-row tile; K = 72: no 32s


def operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rand(m, k, seed=1), rand(n, k, seed=2).to(torch.bfloat16), rand(n, seed=3)


@VARIANTS
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_variant_matches_plain_c_and_torch(variant: str, m: int, n: int, k: int) -> None:
    runnable(variant)
    x, w, b = operands(m, n, k)
    got = native.bf16_matmul(x, w, b, variant=variant)
    ref = native.bf16_matmul(x, w, b, plain=True)
    oracle = F.linear(x.double(), w.double(), b.double()).float()
    if native.rounds_activations_to_bf16(variant) and k % 32 == 0:  # vdpbf16ps: x rounded to bfloat16, another order
        oracle = F.linear(x.bfloat16().double(), w.double(), b.double()).float()
        torch.testing.assert_close(got, oracle, rtol=0, atol=1e-5 * float(oracle.abs().max()))
        return
    assert torch.equal(got, ref)  # the same fused multiply-adds in the same order
    torch.testing.assert_close(got, F.linear(x, w.float(), b), rtol=0, atol=1e-5 * float(oracle.abs().max()))
    torch.testing.assert_close(got, oracle, rtol=0, atol=1e-5 * float(oracle.abs().max()))


@pytest.mark.parametrize("plain", [False, True], ids=["simd", "plain"])
def test_rows_do_not_depend_on_the_batch(plain: bool) -> None:
    """M = 1 widens weights in registers, M = 16 widens each tile once: the same sums either way."""
    x, w, b = operands(16, 130, 576)
    batch = native.bf16_matmul(x, w, b, plain=plain)
    for i in range(16):
        assert torch.equal(native.bf16_matmul(x[i : i + 1], w, b, plain=plain), batch[i : i + 1])
    assert torch.equal(native.bf16_matmul(x[3:6], w, b, plain=plain), batch[3:6])


@VARIANTS
def test_bf16_rows_in_a_layout_are_the_kernel_bit_for_bit(variant: str) -> None:
    """tq_matmul's "BF16" segments (the C decoder layer's path) call the same kernel, rows
    written at the layout's row stride: a [q | k | v]-like weight in two segments too."""
    runnable(variant)
    x, w, b = operands(7, 130, 576)
    want = native.bf16_matmul(x, w, b, out_dtype=torch.float32, variant=variant)
    for segments in ((("BF16", 130),), (("BF16", 64), ("BF16", 66))):
        assert torch.equal(native.qmatmul(segments, w, x, b, variant=variant), want)
    assert torch.equal(native.qmatmul((("BF16", 130),), w, x, b, plain=True),
                       native.bf16_matmul(x, w, b, out_dtype=torch.float32, plain=True))


def test_bfloat16_in_and_out_round_like_torch() -> None:
    x, w, b = operands(5, 64, 128)
    xb = x.bfloat16()
    y = native.bf16_matmul(xb, w, b)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, native.bf16_matmul(xb.float(), w, b, out_dtype=torch.float32).bfloat16())
    assert native.bf16_matmul(xb, w, b, out_dtype=torch.float32).dtype == torch.float32


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-bf16"), seed=5)


def test_float_layers_of_a_bfloat16_model_use_the_kernel(tiny_bf16: Path) -> None:
    """bfloat16 weights, float32 activations (and the small float32 tensors: norms, biases)."""
    lm = load_model(str(tiny_bf16), CPUBackend(), dtype="bfloat16")
    linears = {name: m for name, m in lm.model.named_modules() if isinstance(m, Linear)}
    assert linears and all(isinstance(m.method, BFloat16CPUMethod) for m in linears.values())
    assert all(m.weight.dtype is torch.bfloat16 for m in linears.values())
    assert lm.model.dtype is torch.float32 and lm.model.norm.weight.dtype is torch.float32
    f32 = load_model(str(tiny_bf16), CPUBackend(), dtype="float32")
    assert not any(isinstance(m.method, BFloat16CPUMethod) for m in f32.model.modules() if isinstance(m, Linear))


def bf16_rounded_inputs(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (args[0].bfloat16().float(), *args[1:])


@VARIANTS
def test_greedy_matches_transformers_float32_on_the_rounded_weights(tiny_bf16: Path, variant: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Oracle: transformers in float32 with every weight rounded to bfloat16 (what the model
    holds). Treadle's bfloat16 model computes in float32 too: through the engine (fused C decoder
    layers, a bfloat16 KV cache, which rounds K and V) greedy tokens are identical; over a float32
    cache the logits differ only by summation order. The contract follows the variant the engine
    runs (forced here, each in turn): one whose bfloat16 matmul rounds activations to bfloat16
    (avx512-bf16: vdpbf16ps, where K % 32 == 0) is held to transformers with each such linear
    layer's input rounded the same way -- then too only the summation order differs."""
    import transformers

    force(monkeypatch, variant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_bf16, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    if native.rounds_activations_to_bf16(variant):
        for m in hf.modules():
            if isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0:
                m.register_forward_pre_hook(bf16_rounded_inputs)
    prompts = [[5, 17, 33, 2, 90, 41, 7], [60, 3, 3, 28, 71, 19, 44, 12, 8, 50, 23]]
    llm = LLM(str(tiny_bf16), dtype="bfloat16", num_kv_blocks=64, block_size=4)
    assert all(isinstance(layer, FusedDecoderLayer) for layer in llm.engine.model_runner().model.layers)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert list(got.outputs[0].token_ids) == out[0, len(prompt):].tolist()
    logits = PagedSession(load_model(str(tiny_bf16), CPUBackend(), dtype="bfloat16"), 1, 16).feed([prompts[1]])[0]
    with torch.no_grad():
        expect = hf(torch.tensor([prompts[1]])).logits[0]
    torch.testing.assert_close(logits, expect, rtol=0, atol=1e-4 * float(expect.abs().max()))


@pytest.fixture(scope="module")
def odd_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """hidden 90: no input width is a multiple of 8, so every linear layer takes torch's path."""
    return make_tiny_model(tmp_path_factory.mktemp("odd-bf16"), seed=5, hidden_size=90, num_attention_heads=3,
                           num_key_value_heads=1, intermediate_size=100)


@pytest.mark.parametrize("model", ["tiny_bf16", "odd_bf16"])
def test_a_sequence_gets_the_same_logits_alone_and_in_a_batch(model: str, request: pytest.FixtureRequest) -> None:
    lm = load_model(str(request.getfixturevalue(model)), CPUBackend(), dtype="bfloat16")
    prompts = [[5, 17, 33, 2], [60, 3, 3, 28, 71, 19], [9, 9, 40]]
    batch = PagedSession(lm, 3, 12)
    together = [batch.feed(prompts), batch.feed([[7], [8], [9]])]
    for i, p in enumerate(prompts):
        alone = PagedSession(lm, 1, 12)
        assert torch.equal(alone.feed([p])[0], together[0][i])  # prefill
        assert torch.equal(alone.feed([[7 + i]])[0], together[1][i])  # a decode step
