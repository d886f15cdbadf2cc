"""EAGLE and Medusa draft heads: the training and the paged EAGLE layer compute the same thing;
greedy (and seeded sampled) output is identical with speculation on and off, with the heads
shipped for stories260k and with random heads on a random model (the worst case), under
chunking and preemption; `treadle train-draft-head` runs end to end; bad heads are one line."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_run import assert_no_leaks, run

from treadle import LLM, SamplingParams
from treadle.config import TreadleError
from treadle.entrypoints.cli import main
from treadle.layers.attention import StepInputBuilder
from treadle.layers.attention.selector import select_backend
from treadle.loaders import load_model
from treadle.loaders.resolve import resolve_model
from treadle.spec_decode.head_format import (
    DRAFT_VOCAB,
    EagleLayerShape,
    HeadConfig,
    TargetFingerprint,
    load_head,
    save_head,
)
from treadle.spec_decode.head_proposers import DraftVocab
from treadle.spec_decode.heads import EagleLayer, EagleTrainLayer, MedusaHeads
from treadle.worker.model_runner import allocate_kv_cache

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
STORIES = ["Once upon a time, there was a little girl named Lily.", "Tom had a big red ball. He",
           "One day, a cat went to the park with", "The sun was hot. Sam and Mia"]


def random_head(target: Path, out: Path, method: str, k: int = 4, seed: int = 0) -> Path:
    """A randomly initialized head for ``target`` (random weights, not the near-identity start)."""
    lm = load_model(str(target), select_backend("reference", torch.device("cpu")))
    torch.manual_seed(seed)
    shape = EagleLayerShape.like(lm.config) if method == "eagle" else None
    module = EagleTrainLayer(lm.config, shape) if shape is not None else MedusaHeads(lm.config.hidden_size, k)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    save_head(out, HeadConfig(method, k, TargetFingerprint.of(lm.config, target.name), shape), module.state_dict())
    return out


def spec(method: str, model: Path | None = None, k: int = 4) -> dict[str, object]:
    cfg: dict[str, object] = {"method": method, "num_speculative_tokens": k, "fallback": False}
    return cfg if model is None else {**cfg, "model": str(model)}


def token_prompts(model: Path | str, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    vocab = 500 if str(model) == "stories260k" else 250
    return [torch.randint(3, vocab, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_training_layer_and_paged_layer_agree() -> None:
    """The same tensors in EagleTrainLayer (plain torch, causal SDPA) and EagleLayer (Treadle's
    decoder layer over scattered paged blocks, two chunks) give the same features."""
    lm = load_model("stories260k", select_backend("cpu", torch.device("cpu")))
    shape = EagleLayerShape.like(lm.config)
    torch.manual_seed(0)
    train = EagleTrainLayer(lm.config, shape)
    with torch.no_grad():
        for p in train.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        ids, hid = torch.randint(3, 500, (11,)), torch.randn(11, lm.config.hidden_size)
        stream = train(lm.model.embed_tokens.weight[ids][None], hid[None])[0]
        want = torch.nn.functional.rms_norm(stream, (lm.config.hidden_size,), lm.model.norm.weight,
                                            lm.config.rms_norm_eps)
    layer = EagleLayer(lm.model, shape, train.state_dict())
    kv = allocate_kv_cache(layer.config, 8, 4, torch.float32, "cpu")[0]
    builder, table, got = StepInputBuilder(4), [[5, 2, 7]], []
    with torch.inference_mode():
        for lo, hi in ((0, 7), (7, 11)):
            positions, meta = builder.build([hi - lo], [hi], table)
            meta.plan = lm.model.backend.plan(meta)
            got.append(layer(ids[lo:hi], hid[lo:hi], positions, kv, meta))
    torch.testing.assert_close(torch.cat(got), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_shipped_stories_heads_greedy_identical(method: str) -> None:
    """"model" omitted: the head shipped with stories260k; it is accepted often."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    plain = LLM("stories260k").generate(STORIES, params, use_tqdm=False)
    llm = LLM("stories260k", speculative_config=spec(method))
    out = llm.generate(STORIES, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    stats = llm.get_stats()["spec_decode"]
    assert stats["mean_acceptance_length"] > 1.5
    assert_no_leaks(llm)


VARIANTS = {
    "k4": {},
    "k1": {"k": 1},
    "chunked": {"max_num_batched_tokens": 8},  # drafts cut by the budget, prompt chunks beside verifies
    "preemption": {"num_kv_blocks": 7, "max_num_batched_tokens": 32},
    "fallback-on": {"fallback": True},  # the default: the controller may drop drafts (the head catches up later)
}


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_random_head_on_random_model_greedy_identical(tiny_llama: Path, tmp_path: Path, method: str,
                                                       variant: str) -> None:
    kw = dict(VARIANTS[variant])
    k = int(kw.pop("k", 4))  # type: ignore[call-overload]
    fallback = bool(kw.pop("fallback", False))
    head = random_head(tiny_llama, tmp_path / method, method)
    prompts = token_prompts(tiny_llama, 5)
    plain, _ = run(tiny_llama, prompts, GREEDY, **kw)
    out, llm = run(tiny_llama, prompts, GREEDY, speculative_config={**spec(method, head, k), "fallback": fallback},
                   **kw)
    assert out == plain
    stats = llm.get_stats()["spec_decode"]
    assert stats["drafts"] > 0 and stats["emitted_tokens"] == stats["accepted_tokens"] + stats["drafts"]
    if variant == "preemption":
        assert llm.get_stats()["preemptions"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_seeded_sampling_equals_plain(method: str) -> None:
    """Head drafts are argmax tokens (a point mass): the plain draws decide, so a seeded
    request gives the same tokens with and without them (the distribution, exactly)."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True)
    prompts = token_prompts("stories260k", 3)
    plain, _ = run("stories260k", prompts, params)
    out, llm = run("stories260k", prompts, params, speculative_config=spec(method), max_num_batched_tokens=16)
    assert out == plain
    assert llm.get_stats()["spec_decode"]["accepted_tokens"] > 0


def test_prefix_hit_after_eagle_equals_a_cold_run() -> None:
    """A prefix hit: the head's first catch-up recomputes its KV over the hit, from the target's
    hidden states the proposer kept per slot (the cached blocks' slots)."""
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm = LLM("stories260k", num_kv_blocks=64, block_size=4, speculative_config=spec("eagle"))
    first = llm.generate(STORIES[0], params, use_tqdm=False)[0]
    follow = first.prompt_token_ids + first.outputs[0].token_ids[:20]
    hit = llm.generate({"prompt_token_ids": follow}, params, use_tqdm=False)[0]
    assert hit.metrics.num_cached_tokens >= len(first.prompt_token_ids)
    cold = LLM("stories260k", enable_prefix_caching=False).generate({"prompt_token_ids": follow}, params,
                                                                     use_tqdm=False)[0]
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_no_leaks(llm)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_train_draft_head_end_to_end(tmp_path: Path, method: str, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\nTom had a ball.\nThe cat\n")
    out = tmp_path / "head"
    argv = ["train-draft-head", "stories260k", str(out), "--method", method, "--prompts", str(prompts),
            "--max-new-tokens", "12", "--steps", "3", "--batch-tokens", "64", "--num-speculative-tokens", "2"]
    assert main(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    prompt_ids = token_prompts("stories260k", 2)
    plain, _ = run("stories260k", prompt_ids, GREEDY)
    got, llm = run("stories260k", prompt_ids, GREEDY, speculative_config=spec(method, out, 2))
    assert got == plain and llm.get_stats()["spec_decode"]["drafts"] > 0


def _one_line_error(**kw: object) -> str:
    with pytest.raises(TreadleError) as e:
        LLM(**kw)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_heads_are_one_line_errors(tiny_llama: Path, tmp_path: Path) -> None:
    stories_eagle = resolve_model("stories260k") / "draft-heads" / "eagle"
    assert "does not fit" in _one_line_error(model=str(tiny_llama), speculative_config=spec("eagle", stories_eagle))
    assert "no config.json" in _one_line_error(model="stories260k", speculative_config=spec("eagle", tmp_path))
    assert "not medusa" in _one_line_error(model="stories260k", speculative_config=spec("medusa", stories_eagle))
    assert "ships no eagle head" in _one_line_error(model=str(tiny_llama), speculative_config=spec("eagle"))
    medusa = random_head(tiny_llama, tmp_path / "m2", "medusa", k=2)
    assert "2 Medusa heads" in _one_line_error(model=str(tiny_llama), speculative_config=spec("medusa", medusa, 3))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text("{\"format\": \"treadle-draft-head\", \"version\": 1}")
    assert "method" in _one_line_error(model="stories260k", speculative_config=spec("eagle", tmp_path / "junk"))
    assert main(["train-draft-head", "stories260k", str(tmp_path / "x"), "--method", "eagle",
                 "--prompts", str(tmp_path / "missing.txt")]) == 2


def test_draft_vocab_restricts_drafts_and_is_checked(tmp_path: Path) -> None:
    """A head's ``draft_vocab``: drafts are the argmax over those lm_head rows only (greedy output
    unchanged); ids outside the vocabulary are a one-line error."""
    lm = load_model("stories260k", select_backend("reference", torch.device("cpu")))
    feats = torch.randn(6, lm.config.hidden_size)
    full = DraftVocab(lm.model).argmax(feats)
    ids = torch.tensor(sorted(set(full) | {7, 9, 100}), dtype=torch.int32)
    assert DraftVocab(lm.model, ids).argmax(feats) == full  # the subset holds every argmax
    few = torch.tensor([7, 9], dtype=torch.int32)
    assert set(DraftVocab(lm.model, few).argmax(feats)) <= {7, 9}
    stories_eagle = resolve_model("stories260k") / "draft-heads" / "eagle"
    cfg, tensors = load_head(stories_eagle, lm.config, "eagle")
    head = tmp_path / "eagle"
    save_head(head, cfg, {**tensors, DRAFT_VOCAB: torch.arange(3, 300, dtype=torch.int32)})
    prompts = token_prompts("stories260k", 2)
    plain, _ = run("stories260k", prompts, GREEDY)
    out, llm = run("stories260k", prompts, GREEDY, speculative_config=spec("eagle", head))
    assert out == plain and llm.get_stats()["spec_decode"]["drafts"] > 0
    save_head(head, cfg, {**tensors, DRAFT_VOCAB: torch.tensor([1, 512], dtype=torch.int32)})
    assert "draft_vocab" in _one_line_error(model="stories260k", speculative_config=spec("eagle", head))
