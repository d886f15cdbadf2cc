"""Mixtures of experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) agree with
transformers on the same random weights: logits through the paged cache within float32
tolerance and greedy continuations token for token, including a prompt that routes every
token of a layer to the same two experts (the others get none); the engine gives the same
tokens whatever the batch and the chunking; the fused layer equals a per-token loop, and its
expert-parallel and column-parallel parts add up to the whole."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from engine_run import assert_no_leaks, run
from paged_session import PagedSession, greedy
from tiny_models import write_byte_tokenizer

from treadle import SamplingParams
from treadle.layers.attention import ReferenceBackend
from treadle.layers.moe import FusedMoE, Routing, route
from treadle.loaders import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

_COMMON = dict(vocab_size=258, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
VARIANTS = {
    # top-2 of 8, renormalized
    "mixtral": lambda: transformers.MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=2),
    # a shared expert beside the routed ones; layer 1 keeps a dense MLP; no renormalization
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False),
    # q/k head norms; top-2 of 4 renormalized; every other layer sparse (layer 0 dense)
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **_COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
        norm_topk_prob=True, decoder_sparse_step=2),
    "qwen3-moe-top1": lambda: transformers.Qwen3MoeConfig(
        **_COMMON, num_experts=6, num_experts_per_tok=1, moe_intermediate_size=32, head_dim=16,
        norm_topk_prob=False),
}
PROMPTS = [[5, 9, 200, 17], list(range(30, 53)), [77] * 19]  # the last: one token repeated


def make_moe_model(path: Path, variant: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A random-weight transformers model of ``variant``, saved with a byte tokenizer at ``path``."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(VARIANTS[variant](), attn_implementation="eager",
                                                       dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init, so tokens and routes vary
        for p in hf.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
    hf.save_pretrained(path)
    write_byte_tokenizer(path)
    return hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_moe_model(path, request.param)
    return hf, load_model(str(path), ReferenceBackend()), path


def test_logits_match_transformers_prefill_and_decode(pair) -> None:
    hf, lm, _ = pair
    session = PagedSession(lm, len(PROMPTS), 40)
    got = session.feed(PROMPTS)  # the three prompts in one batch
    extra = [[3], [250], [77]]
    got_next = session.feed(extra)
    for prompt, logits, tok, nxt in zip(PROMPTS, got, extra, got_next):
        with torch.no_grad():
            want = hf(torch.tensor([prompt + tok])).logits[0]
        torch.testing.assert_close(logits, want[:-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(nxt, want[-1:], atol=1e-4, rtol=1e-4)


def test_greedy_tokens_identical_to_transformers(pair) -> None:
    hf, lm, _ = pair
    got = greedy(lm, PROMPTS, 24)
    for prompt, tokens in zip(PROMPTS, got):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == want


def test_uneven_routing_leaves_experts_without_tokens(pair) -> None:
    """The repeated-token prompt sends every token of the first sparse layer to the same top-k
    experts: the others get no tokens, and the logits still match (checked above too)."""
    hf, lm, _ = pair
    sparse = next(layer for layer in lm.model.layers if hasattr(layer.mlp, "experts"))
    seen: list[torch.Tensor] = []
    handle = sparse.mlp.experts.register_forward_hook(lambda mod, args, out: seen.append(args[1].ids))
    try:
        logits = PagedSession(lm, 1, 24).feed([PROMPTS[2]])[0]
    finally:
        handle.remove()
    used = seen[0].unique().numel()
    assert used == seen[0].shape[1] < sparse.mlp.experts.num_experts
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(torch.tensor([PROMPTS[2]])).logits[0], atol=1e-4, rtol=1e-4)


def test_engine_tokens_do_not_depend_on_batch_or_chunking(pair) -> None:
    hf, _, path = pair
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batched, llm = run(path, PROMPTS, params, max_num_batched_tokens=8, block_size=8)  # prompts chunked by 8
    assert_no_leaks(llm)
    llm.shutdown()
    for prompt, tokens in zip(PROMPTS, batched):
        alone, llm = run(path, [prompt], params, enable_chunked_prefill=False)
        llm.shutdown()
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == alone[0] == want


# -- the fused layer on its own --------------------------------------------------------------
def _per_token(x: torch.Tensor, routing: Routing, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The plain reference: every token through each of its experts, one at a time."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for w, e in zip(routing.weights[t].tolist(), routing.ids[t].tolist()):
            h = w13[e] @ x[t]
            out[t] += w * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def _fused(num_experts: int, w13: torch.Tensor, w2: torch.Tensor, experts: range | None = None,
           columns: range | None = None) -> FusedMoE:
    inter, hidden = w2.shape[2], w2.shape[1]
    layer = FusedMoE(num_experts, hidden, inter, torch.float32, experts, columns)
    for e in range(num_experts):
        layer.w13.weight_loader(layer.w13, w13[e, :inter], 2 * e)
        layer.w13.weight_loader(layer.w13, w13[e, inter:], 2 * e + 1)
        layer.w2.weight_loader(layer.w2, w2[e], e)
    return layer


def test_fused_layer_equals_per_token_loop_and_its_parts_add_up() -> None:
    g = torch.Generator().manual_seed(0)
    num_experts, hidden, inter, tokens, k = 6, 16, 12, 9, 2
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g)
    w2 = torch.randn(num_experts, hidden, inter, generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, 5] = -30  # expert 5 gets no token
    routing = route(logits, k, renormalize=True)
    assert torch.allclose(routing.weights.sum(-1), torch.ones(tokens))
    want = _per_token(x, routing, w13, w2)
    torch.testing.assert_close(_fused(num_experts, w13, w2)(x, routing), want, atol=1e-4, rtol=1e-4)
    by_experts = sum(_fused(num_experts, w13, w2, experts=range(a, b))(x, routing) for a, b in ((0, 3), (3, 6)))
    torch.testing.assert_close(by_experts, want, atol=1e-4, rtol=1e-4)
    by_columns = sum(_fused(num_experts, w13, w2, columns=range(a, b))(x, routing) for a, b in ((0, 4), (4, 12)))
    torch.testing.assert_close(by_columns, want, atol=1e-4, rtol=1e-4)


def test_router_normalisation() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain, norm = route(logits, 2, renormalize=False), route(logits, 2, renormalize=True)
    assert plain.ids.tolist() == norm.ids.tolist() == [[0, 1]]
    torch.testing.assert_close(plain.weights, torch.softmax(logits, -1)[:, :2])
    torch.testing.assert_close(norm.weights, torch.softmax(logits[:, :2], -1))  # Mixtral: softmax of the top-k
