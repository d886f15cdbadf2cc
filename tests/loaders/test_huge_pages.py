"""loaders/huge_pages.py: a loaded CPU model's weights gathered into one mapping advised for
transparent huge pages -- the same values, tied weights still one storage, the engine's greedy
tokens unchanged, and TREADLE_HUGE_PAGES=0 leaving torch's allocations alone."""
from __future__ import annotations

import pytest
import torch

from treadle import LLM, SamplingParams
from treadle.loaders import huge_pages
from treadle.loaders.resolve import resolve_model

needs_huge_pages = pytest.mark.skipif(not huge_pages.supported(),
                                      reason="no transparent huge pages here (not Linux, or set to never)")


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(300, 128, generator=g), requires_grad=False)
        self.head = torch.nn.Linear(128, 300, bias=False)
        self.head.weight = self.embed  # tied: one storage
        self.small = torch.nn.Parameter(torch.randn(4, generator=g), requires_grad=False)
        self.register_buffer("table", torch.randn(200, 96, generator=g).to(torch.bfloat16))
        self.view = torch.nn.Parameter(self.table.view(torch.uint8)[10:], requires_grad=False)  # a view of a buffer


@needs_huge_pages
def test_gather_moves_large_storages_into_one_aligned_mapping_with_the_same_values() -> None:
    m = Tied()
    before = {n: t.clone() for n, t in [*m.named_parameters(), *m.named_buffers()]}
    small_at = m.small.data_ptr()
    moved = huge_pages.gather(m, min_bytes=1024)
    assert moved >= 300 * 128 * 4 + 200 * 96 * 2
    for n, t in [*m.named_parameters(), *m.named_buffers()]:
        assert torch.equal(t, before[n]), n
    assert m.head.weight is m.embed and m.head.weight.data_ptr() == m.embed.data_ptr()
    assert m.view.untyped_storage().data_ptr() == m.table.untyped_storage().data_ptr()  # still a view of it
    assert m.view.data_ptr() == m.table.data_ptr() + 10 * 192  # rows 10.. of the bytes
    assert m.embed.untyped_storage().data_ptr() == m.table.untyped_storage().data_ptr()  # one mapping
    assert m.embed.data_ptr() % huge_pages.HUGE_PAGE == 0  # the first storage moved starts the mapping's aligned part
    assert m.small.data_ptr() == small_at  # under min_bytes: left where it was
    m.embed.data.mul_(2)  # the moved tensors are writable and still tied
    assert torch.equal(m.head.weight, before["embed"] * 2)


def test_disabled_by_the_environment_moves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert huge_pages.describe().startswith("yes (" if huge_pages.supported() else "no (")
    monkeypatch.setenv("TREADLE_HUGE_PAGES", "0")
    assert huge_pages.describe() == "no (TREADLE_HUGE_PAGES=0)"
    m = Tied()
    at = m.embed.data_ptr()
    assert huge_pages.gather(m, min_bytes=1024) == 0
    assert m.embed.data_ptr() == at


@needs_huge_pages
def test_engine_output_is_the_same_with_and_without_huge_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("TREADLE_HUGE_PAGES", flag)
        llm = LLM(str(resolve_model("stories260k")), kv_cache_memory="8MiB")
        try:
            outs[flag] = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
        finally:
            llm.engine.shutdown()
    assert outs["1"].token_ids == outs["0"].token_ids
    assert outs["1"].cumulative_logprob == outs["0"].cumulative_logprob
