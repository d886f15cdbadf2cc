"""The router's choices on hand-built instance states (no servers)."""
from __future__ import annotations

import pytest

from treadle.entrypoints.cli import main
from treadle.router.config import Role, RouterConfig
from treadle.router.forward import prefill_body
from treadle.router.instances import Instance, InstanceLoad
from treadle.router.policy import PREFIX_BLOCK_CHARS, PrefixIndex, choose, estimate_prompt_tokens, prompt_text


def _inst(url: str, role: Role = Role.DECODE, **load: float) -> Instance:
    inst = Instance(url, role)
    inst.load = InstanceLoad(**load)  # type: ignore[arg-type]
    return inst


def test_decode_choice_weighs_running_requests_and_kv_usage():
    busy, full, idle = _inst("a", running=3), _inst("b", kv_usage=0.9), _inst("c", running=1, kv_usage=0.1)
    assert choose([busy, full, idle], turn=0).instance is idle
    idle.in_flight = 5  # sent by this router, not yet in the polled load
    assert choose([busy, full, idle], turn=0).instance is busy


def test_prefill_choice_by_queued_prompt_tokens():
    a = _inst("a", Role.PREFILL, waiting_prompt_tokens=4000)
    b = _inst("b", Role.PREFILL, running=9, kv_usage=0.9)
    assert choose([a, b], turn=0).instance is b
    b.in_flight_prompt_tokens = 5000
    assert choose([a, b], turn=0).instance is a


def test_unhealthy_instances_are_skipped_and_ties_rotate():
    a, b, c = _inst("a"), _inst("b"), _inst("c")
    assert {choose([a, b, c], turn=t).instance.url for t in range(3)} == {"a", "b", "c"}
    b.mark_down("test")
    assert {choose([a, b, c], turn=t).instance.url for t in range(6)} == {"a", "c"}
    a.mark_down("test")
    c.mark_down("test")
    assert choose([a, b, c], turn=0) is None


def test_affinity_wins_unless_the_holder_is_much_busier():
    a, b = _inst("a", Role.BACKEND, running=2), _inst("b", Role.BACKEND)
    assert choose([a, b], 0, affinity=a).reason == "affinity"
    a.load = InstanceLoad(running=10)
    picked = choose([a, b], 0, affinity=a)
    assert picked.instance is b and picked.reason == "load"


def test_prefix_index_finds_the_longest_remembered_prefix():
    index = PrefixIndex(max_blocks=8)
    system = "s" * (3 * PREFIX_BLOCK_CHARS)
    index.record(system + "first question", "a")
    index.record("t" * PREFIX_BLOCK_CHARS * 2, "b")
    assert index.owner(system + "another question") == "a"
    assert index.owner("t" * PREFIX_BLOCK_CHARS * 3) == "b"
    assert index.owner("u" * PREFIX_BLOCK_CHARS * 3) is None
    assert index.owner("short") is None
    index.record("v" * PREFIX_BLOCK_CHARS * 8, "c")  # evicts the oldest blocks
    assert index.owner(system) is None and len(index.owners) == 8


def test_prompt_text_and_size():
    assert prompt_text({"prompt": "hello"}) == "hello"
    assert prompt_text({"messages": [{"role": "user", "content": "hi"}]}).startswith('[{"role":"user"')
    assert estimate_prompt_tokens({"prompt": [5, 6, 7]}) == 3
    assert estimate_prompt_tokens({"prompt": "x" * 400}) == 101


def test_load_from_metrics_text():
    text = ('treadle:num_requests_running{model_name="m"} 3.0\ntreadle:num_requests_waiting{model_name="m"} 2.0\n'
            'treadle:kv_cache_usage_perc{model_name="m"} 0.25\n')
    assert InstanceLoad.from_metrics(text) == InstanceLoad(0, 3, 2, 0.25)
    assert InstanceLoad.from_json({"waiting_prompt_tokens": 7, "running": 1, "waiting": 0, "kv_usage": 0.5,
                                   "role": "kv_producer"}) == InstanceLoad(7, 1, 0, 0.5)


def test_prefill_body_asks_for_one_token_and_remote_decode():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 5, "max_completion_tokens": 50, "temperature": 0}
    out = prefill_body(body)
    assert out == {"prompt": "x", "max_tokens": 1, "stream": False, "max_completion_tokens": 1, "temperature": 0,
                   "kv_transfer_params": {"do_remote_decode": True}}
    assert body["max_tokens"] == 50  # the client's request is left as it was


def test_config_needs_one_mode():
    with pytest.raises(ValueError):
        RouterConfig()
    with pytest.raises(ValueError):
        RouterConfig(prefill=("http://p",))
    with pytest.raises(ValueError):
        RouterConfig(prefill=("http://p",), decode=("http://d",), backend=("http://b",))
    with pytest.raises(ValueError):
        RouterConfig(backend=("http://b", "http://b"))
    pd = RouterConfig(prefill=("http://p",), decode=("http://d",))
    assert pd.disaggregated and pd.generating_role == Role.DECODE and pd.prompt_role == Role.PREFILL


@pytest.mark.parametrize("argv", [["router"], ["router", "--prefill", "http://p"], ["router", "--backend", "localhost:1"],
                                  ["router", "--backend", "http://b", "--port", "70000"]])
def test_cli_mistakes_are_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
