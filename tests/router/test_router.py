"""`treadle router --backend A B`: two real `treadle serve` instances (stories260k, one
thread each) and the router, each its own process on 127.0.0.1, driven by the official
openai client and raw HTTP."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from router_harness import instance, router, router_metric, running, upstream_count, wait_in_rotation
from server_harness import engine_idle, metric_values, stories_with_chat_template, wait_until

pytestmark = [pytest.mark.server, pytest.mark.slow]  # three servers to start: about a minute on a quiet 2-core machine

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park", "One day, a bird"]
STEP_DELAY = 0.01  # each engine step sleeps this long, so long requests stay in flight


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Two instances and a router polling them every 0.2 s (started with them), and a second
    router that polls them once, when they are up, and then not for an hour (for the test
    of a router that has not noticed a dead instance yet)."""
    tmp = tmp_path_factory.mktemp("router")
    model = str(stories_with_chat_template(tmp / "model"))
    a, b = instance(tmp, "a", STEP_DELAY, model), instance(tmp, "b", STEP_DELAY, model)
    r = router(tmp, "router", "--backend", a.url, b.url, "--poll-interval", "0.2")
    slow_poll = router(tmp, "slow-poll", "--backend", a.url, b.url, "--poll-interval", "3600")
    with running(a, b, r):
        wait_in_rotation(r.url, a, b)
        with running(slow_poll):
            yield a, b, r, slow_poll, model


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _complete(url: str, model: str, prompt: str, stream: bool) -> str:
    kw = dict(model=model, prompt=prompt, max_tokens=24, temperature=0)
    if not stream:
        return _client(url).completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in _client(url).completions.create(**kw, stream=True))


def _chat(url: str, model: str, prompt: str, stream: bool) -> str:
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
    if not stream:
        return _client(url).chat.completions.create(**kw).choices[0].message.content or ""
    chunks = _client(url).chat.completions.create(**kw, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("call", [_complete, _chat], ids=["completions", "chat"])
def test_outputs_match_one_instance_and_both_instances_serve(pool, call):
    a, b, r, _, model = pool
    before = {i.url: upstream_count(r.url, i.url) for i in (a, b)}
    expected = [call(a.url, model, p, False) for p in PROMPTS]
    jobs = [(p, stream) for p in PROMPTS for stream in (False, True)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        got = list(ex.map(lambda job: call(r.url, model, *job), jobs))
    assert got == [e for e in expected for _ in (False, True)]
    assert all(upstream_count(r.url, i.url) > before[i.url] for i in (a, b)), "both instances serve"
    models = _client(r.url).models.list()
    assert [m.id for m in models.data] == [model]


def test_less_loaded_instance_is_preferred(pool):
    """Two long requests sent straight to A keep it busy; the router's next requests go to B."""
    a, b, r, _, model = pool
    # A's two requests must outlast the router's four below (seen once in a full suite on a fast CPU:
    # one of the four reached A): ~480 steps of STEP_DELAY against four requests of 4 tokens. They
    # ignore EOS, so A reports their exact remaining tokens (480 - generated each); before, the
    # length predictor's guess at their EOS could make A look lighter than B by the router's cost
    # (the likely cause of a second such failure, a full suite on Zen 4, 2026-12-04)
    long = {"model": model, "prompt": "Once", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", a.url + "/v1/completions", json=long, timeout=60) as s1, \
            httpx.stream("POST", a.url + "/v1/completions", json=long, timeout=60) as s2:
        held = [s.iter_lines() for s in (s1, s2)]  # (a dropped iterator would close its stream)
        assert all(next(lines).startswith("data: {") for lines in held)  # each is running on A
        wait_until(lambda: metric_values(a.url)["treadle:num_requests_running"] == 2, 10, "A to run both")
        wait_until(lambda: httpx.get(r.url + "/health").status_code == 200, 5, "router")
        wait_until(lambda: router_metric(r.url, "treadle:router_instance_running", instance=a.url) == 2, 10,
                   "the router to read A's load")
        before_a, before_b = upstream_count(r.url, a.url), upstream_count(r.url, b.url)
        for p in PROMPTS:  # one at a time: the router's own in-flight counts are 0 for both
            _client(r.url).completions.create(model=model, prompt=p + " and", max_tokens=4, temperature=0)
        assert metric_values(a.url)["treadle:num_requests_running"] == 2, "A's requests ended before the check did"
        assert upstream_count(r.url, a.url) == before_a
        assert upstream_count(r.url, b.url) == before_b + len(PROMPTS)


def test_prompts_sharing_a_prefix_go_to_the_instance_that_has_it(pool):
    a, b, r, _, model = pool
    system = "Lily and Ben were best friends who lived next to a big green park with tall trees. " * 2
    counts = [upstream_count(r.url, i.url) for i in (a, b)]
    affinity = router_metric(r.url, "treadle:router_routing_decisions_total", reason="affinity")
    for question in ("What did they find?", "Where did they go?", "Who came to play?", "Why was Ben sad?"):
        _complete(r.url, model, system + question, False)
    gained = [upstream_count(r.url, i.url) - c for i, c in zip((a, b), counts)]
    assert sorted(gained) == [0, 4]  # all on the instance that computed the prefix first
    # (ties rotate, so without affinity the three follow-ups could not all land on one instance)
    assert router_metric(r.url, "treadle:router_routing_decisions_total", reason="affinity") >= affinity + 1


def test_bad_input_gets_an_openai_400(pool):
    _, _, r, _, model = pool
    url = r.url + "/v1/completions"
    for raw in (b'{"prompt": ', b"[1, 2]", b"\xff\xfe"):
        resp = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=10)
        assert resp.status_code == 400, raw
        assert resp.json()["error"]["type"] == "invalid_request_error" and resp.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:  # the instance's own 400 comes back as it is
        _client(r.url).completions.create(model=model, prompt="Once", max_tokens=-1)
    assert err.value.body["param"] == "max_tokens"


def test_client_disconnect_aborts_on_the_instance(pool):
    a, b, r, _, model = pool
    body = {"model": model, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        busy = [i for i in (a, b) if metric_values(i.url)["treadle:num_requests_open"] == 1]
        assert len(busy) == 1
    wait_until(lambda: engine_idle(busy[0].url), 10, "the instance to abort the request")
    wait_until(lambda: router_metric(r.url, "treadle:router_instance_in_flight") == 0, 10, "router in-flight 0")


def test_dead_instance_leaves_rotation_requests_retry_and_it_comes_back(pool):
    """A killed instance: its stream ends with an error event; requests still succeed (a
    router that has not noticed yet retries them); it is back in rotation once restarted."""
    a, b, r, slow_poll, model = pool
    body = {"model": model, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = (ln for ln in resp.iter_lines() if ln)
        assert next(lines).startswith("data: {")
        victim = next(i for i in (a, b) if metric_values(i.url)["treadle:num_requests_open"] == 1)
        victim.kill()
        rest = list(lines)  # the stream ends: no hang
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == "upstream_error"
    survivor = b if victim is a else a
    expected = [_complete(survivor.url, model, p, False) for p in PROMPTS]
    for url in (r.url, slow_poll.url):
        assert [_complete(url, model, p, False) for p in PROMPTS] == expected
    assert router_metric(slow_poll.url, "treadle:router_retries_total") >= 1
    healthy = metric_values(r.url)
    assert healthy[f"treadle:router_instance_healthy{{instance={victim.url},role=backend}}"] == 0
    assert httpx.get(r.url + "/health").status_code == 200  # one instance is enough
    victim.start().wait_healthy()
    wait_until(lambda: metric_values(r.url)[f"treadle:router_instance_healthy{{instance={victim.url},role=backend}}"]
               == 1, 10, "the instance back in rotation")
    before = upstream_count(r.url, victim.url)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda p: _complete(r.url, model, p, True), PROMPTS))
    assert upstream_count(r.url, victim.url) > before
