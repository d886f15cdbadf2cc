"""P/D disaggregation composed with tensor parallelism: the head plan (which consumer rank pulls
which heads from which producer rank), the merge of the ranks' transfer reports, the data path
between connectors of different TP sizes (bitwise, exactly the bytes each rank needs; tcp and
shm, over 127.0.0.1), and real engines (stories260k: 4 KV heads, so TP 2 really slices them;
the TP 2 one with worker processes over gloo, one thread each): producer TP 1 -> consumer TP 2,
TP 2 -> TP 1 and TP 2 -> TP 2 give the greedy output of one colocated TP 1 instance, and a
corrupt transfer on one consumer rank is recomputed by every rank."""
from __future__ import annotations

import functools
import itertools
import math
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import msgspec
import openai
import pytest
import torch
import zmq
from server_harness import MODEL_NAME, ServerThread, engine_idle, metric_values, stories_with_chat_template, wait_until

from treadle.config import KVTransferConfig, TreadleError
from treadle.core.kv_connector_data import KVConnectorMetadata, KVConnectorOutput, LoadSpec, RemotePrefill
from treadle.engine.client.multi_process import EngineCoreClient
from treadle.engine.llm_engine import LLMEngine
from treadle.kv_transfer import create_connector
from treadle.kv_transfer.aggregate import KVOutputAggregator
from treadle.kv_transfer.heads import HeadSlice, RankPlacement, num_pullers, pull_plan
from treadle.kv_transfer.options import free_ports
from treadle.kv_transfer.wire import PullRequest, TransferError
from treadle.kv_transfer.worker import KVConnectorWorker
from treadle.sampling_params import SamplingParams
from treadle.server.app import build_app

pytestmark = pytest.mark.server  # starts processes (servers, workers)

PROMPT = "Once upon a time there was a little girl named Lily. She loved to play outside in the park"
PROMPT_LEN = 30  # tokens of PROMPT
# a colocated run computes prompt[:-1] in one chunk, then the last prompt token: what a consumer
# does after its load, so where the KV is the same its logprobs are bitwise the same too
ENGINE_KW = dict(num_kv_blocks=48, block_size=8, max_model_len=256, enable_prefix_caching=False,
                 max_num_batched_tokens=PROMPT_LEN - 1, max_num_seqs=4)
TIMEOUT_S = 60


# -- the head plan ------------------------------------------------------------------------------
def test_pull_plan_slices_heads_across_tp_sizes() -> None:
    h = HeadSlice
    assert pull_plan(4, 2, 1) == [[h(0, 0, 0, 2), h(1, 0, 2, 2)]]
    assert pull_plan(4, 1, 2) == [[h(0, 0, 0, 2)], [h(0, 2, 0, 2)]]
    assert pull_plan(4, 2, 2) == [[h(0, 0, 0, 2)], [h(1, 0, 0, 2)]]
    assert pull_plan(4, 2, 4) == [[h(0, 0, 0, 1)], [h(0, 1, 0, 1)], [h(1, 0, 0, 1)], [h(1, 1, 0, 1)]]
    # one replicated head: the second producer rank only hears that the request is done
    assert pull_plan(1, 2, 1) == [[h(0, 0, 0, 1), h(1, 0, 0, 0)]]
    assert pull_plan(1, 1, 2) == [[h(0, 0, 0, 1)], [h(0, 0, 0, 1)]]
    assert [num_pullers(4, 1, 2, 0), num_pullers(1, 2, 1, 1), num_pullers(2, 4, 2, 3)] == [2, 1, 1]
    with pytest.raises(TransferError, match="cannot hold"):
        pull_plan(4, 3, 1)


def test_every_consumer_rank_gets_exactly_its_heads_once() -> None:
    for k, tp_p, tp_c in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)):
        if not (k % tp_p == 0 or tp_p % k == 0) or not (k % tp_c == 0 or tp_c % k == 0):
            continue
        plans = pull_plan(k, tp_p, tp_c)
        for c, plan in enumerate(plans):
            got = [tp_p_rank_head(k, tp_p, s.producer_rank, s.src_head + i) for s in plan for i in range(s.num_heads)]
            start = c * k // tp_c
            assert got == list(range(start, start + max(1, k // tp_c))), (k, tp_p, tp_c, c)
        assert all(num_pullers(k, tp_p, tp_c, p) >= 1 for p in range(tp_p))  # every producer rank hears


def tp_p_rank_head(k: int, tp: int, rank: int, local: int) -> int:
    return rank * k // tp + local


def test_remote_tp_size_is_read_from_the_params_and_bounded() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_host": "127.0.0.1", "remote_port": 5000,
              "remote_request_id": "p", "num_tokens": 9}
    assert RemotePrefill.parse(params).tp_size == 1  # type: ignore[union-attr]
    assert RemotePrefill.parse({**params, "remote_tp_size": 2}).tp_size == 2  # type: ignore[union-attr]
    for bad in (0, -1, 10_000, "x"):  # a malformed body: the consumer computes the prompt itself
        assert RemotePrefill.parse({**params, "remote_tp_size": bad}) is None


# -- the ranks' reports merged ---------------------------------------------------------------------
def test_a_load_fails_everywhere_once_every_rank_ended_it() -> None:
    agg = KVOutputAggregator(2)
    out = KVConnectorOutput
    assert agg.merge([out(finished_loading=["a", "b"], num_bytes_received=10), None]) == out(num_bytes_received=10)
    merged = agg.merge([out(finished_sending=["p"]), out(failed_loading={"a": "checksum"}, finished_loading=["b"])])
    assert merged == out(finished_loading=["b"], failed_loading={"a": "checksum"})
    assert agg.merge([None, out(finished_sending=["p"])]) == out(finished_sending=["p"])
    assert agg.merge([out(failed_loading={"c": "timeout"}), out(failed_loading={"c": "refused"})]) == \
        out(failed_loading={"c": "timeout"})
    assert agg.merge([None, None]) is None and agg.num_pending == 0
    # a step that failed on one rank: what the other ranks sent with it comes out with the next step
    agg.add([out(finished_loading=["d"], finished_sending=["q"]), None])
    agg.add([None, out(finished_loading=["d"])])
    assert agg.merge([None, None]) == out(finished_loading=["d"])
    assert agg.merge([None, out(finished_sending=["q"])]) == out(finished_sending=["q"]) and agg.num_pending == 0


# -- the data path between connectors of different TP sizes -----------------------------------------
def connectors(role: str, connector: str, port: int, k: int, tp: int, caches: list) -> list[KVConnectorWorker]:
    cfg = KVTransferConfig(connector, role, "127.0.0.1", port, "e", transfer_timeout_s=10.0,
                           producer_block_timeout_s=30.0, layerwise_start=False)
    return [create_connector(cfg, caches[r], RankPlacement(k, tp, r)) for r in range(tp)]


def shard(full: list, k: int, tp: int, rank: int) -> list:
    """Rank ``rank``'s copy of a per-layer [(k, v)] cache with ``k`` heads."""
    start, n = rank * k // tp, max(1, k // tp)
    return [tuple(t[:, :, start:start + n].clone() for t in layer) for layer in full]


def reports(conn: KVConnectorWorker, deadline: float) -> KVConnectorOutput:
    while time.monotonic() < deadline:
        out = conn.get_finished(0.05)
        if out is not None and (out.finished_loading or out.failed_loading or out.finished_sending):
            return out  # (a load's "started" report comes first)
    raise AssertionError("no transfer report in time")


@pytest.mark.parametrize(("connector", "k", "tp_p", "tp_c"), [
    ("tcp", 4, 2, 1), ("tcp", 4, 1, 2), ("tcp", 4, 2, 2), ("shm", 4, 2, 1), ("shm", 4, 1, 2), ("tcp", 1, 2, 1),
])
def test_each_consumer_rank_receives_its_heads_bitwise(connector: str, k: int, tp_p: int, tp_c: int) -> None:
    torch.manual_seed(0)
    layers, blocks, bs, hd = 3, 12, 4, 8
    full = [(torch.randn(blocks, bs, k, hd), torch.randn(blocks, bs, k, hd)) for _ in range(layers)]
    port = free_ports("127.0.0.1", tp_p)
    producers = connectors("kv_producer", connector, port, k, tp_p, [shard(full, k, tp_p, r) for r in range(tp_p)])
    empty = [(torch.zeros(blocks, bs, k, hd), torch.zeros(blocks, bs, k, hd)) for _ in range(layers)]
    consumers = connectors("kv_consumer", connector, 0, k, tp_c, [shard(empty, k, tp_c, r) for r in range(tp_c)])
    try:
        held, local = [7, 2, 9], [1, 5, 3]  # 3 blocks = 12 tokens
        for p in producers:
            p.start_step(KVConnectorMetadata(saves={"p1": held}))
        for c in consumers:
            c.start_step(KVConnectorMetadata(loads=[LoadSpec("c1", "p1", "127.0.0.1", port, 12, local, tp_p)]))
        deadline = time.monotonic() + TIMEOUT_S
        for r, c in enumerate(consumers):
            out = reports(c, deadline)
            assert out.finished_loading == ["c1"] and not out.failed_loading
            heads = max(1, k // tp_c)
            assert out.num_bytes_received == 2 * layers * len(local) * bs * heads * hd * 4  # exactly its heads
            want, got = shard(full, k, tp_c, r), c.kv  # type: ignore[attr-defined]
            for (wk, wv), (gk, gv) in zip(want, got):
                assert torch.equal(gk[local], wk[held]) and torch.equal(gv[local], wv[held])
                rest = [b for b in range(blocks) if b not in local]
                assert not gk[rest].any() and not gv[rest].any()
        for p in producers:  # every producer rank reports the request sent, once
            assert reports(p, deadline).finished_sending == ["p1"]
            assert p.get_finished(0.1) is None
    finally:
        for conn in producers + consumers:
            conn.shutdown()


# -- real engines: TP 1 in this process, TP 2 in worker processes ----------------------------------------
@pytest.fixture(scope="module")
def engines(one_thread: None) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    """(TP 1, TP 2) stories260k engines, each both producer and consumer."""
    made: list[LLMEngine] = []
    try:
        for tp in (1, 2):
            made.append(LLMEngine.from_args("stories260k", tensor_parallel_size=tp, **ENGINE_KW,
                                            kv_transfer_config={"kv_connector": "tcp", "kv_role": "kv_both",
                                                                "transfer_timeout_s": 10}))
        assert made[1].config.parallel.distributed_executor_backend == "mp"
        yield made[0], made[1]
    finally:
        for e in made:
            e.shutdown()


_ids = itertools.count()


def run(engine: LLMEngine, params: SamplingParams):
    engine.add_request(f"r{next(_ids)}", PROMPT, params)
    deadline = time.monotonic() + TIMEOUT_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "request did not finish in time"
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no final output")


class Pump:
    """The producer's step loop on a thread (as its engine-core process runs it): it serves
    held blocks until they are pulled and freed."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine, self.stop = engine, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            self.engine.step() if self.engine.scheduler.has_pending_transfers() else time.sleep(0.005)

    def __enter__(self) -> Pump:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 20
        while exc[0] is None and self.engine.scheduler.has_pending_transfers() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()


GREEDY = SamplingParams(temperature=0, max_tokens=20, logprobs=1)


def prefill(producer: LLMEngine) -> dict:
    first = run(producer, SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert len(first.prompt_token_ids) == PROMPT_LEN
    return first.kv_transfer_params


def stats(engine: LLMEngine) -> dict:
    return engine.scheduler.stats()  # type: ignore[attr-defined]


def assert_same(got, want, exact: bool) -> None:
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for lp, want_lp in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        for t in want_lp:
            assert lp[t].logprob == want_lp[t].logprob if exact else math.isclose(lp[t].logprob, want_lp[t].logprob,
                                                                                  abs_tol=2e-3)


@pytest.mark.parametrize(("tp_p", "tp_c"), [(1, 2), (2, 1), (2, 2)])
def test_disaggregated_across_tp_sizes_equals_colocated(engines: tuple[LLMEngine, LLMEngine], tp_p: int,
                                                        tp_c: int) -> None:
    producer, consumer = engines[tp_p - 1], engines[tp_c - 1]
    params = prefill(producer)
    assert params["remote_tp_size"] == tp_p
    before = stats(consumer)
    with Pump(producer) if producer is not consumer else _nothing():
        got = run(consumer, replace(GREEDY, kv_transfer_params=params))
    after = stats(consumer)
    assert (after["num_loads"] - before["num_loads"], after["num_recomputes"] - before["num_recomputes"]) == (1, 0)
    # the same TP size on both sides: the KV received is bitwise what the consumer computes, and so are its
    # logprobs; across TP sizes the reductions add up in another order, so they are close
    assert_same(got, run(consumer, GREEDY), exact=tp_p == tp_c)
    assert_same(got, run(engines[0], GREEDY), exact=tp_p == tp_c == 1)
    assert_idle(producer)
    assert_idle(consumer)


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.scheduler.has_pending_transfers()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def corrupting_relay(front_port: int, back: str, stop: threading.Event, corrupt_rank: int, seen: list[int]) -> None:
    """A man in the middle on 127.0.0.1: relays pulls to the producer at ``back`` and flips one
    byte in the keys of every layer it sends to consumer rank ``corrupt_rank``; ``seen`` gets
    the consumer rank of each pull."""
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    front.bind(f"tcp://127.0.0.1:{front_port}")
    pulls: dict[zmq.Socket, tuple[bytes, int]] = {}
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    try:
        while not stop.is_set():
            for sock, _ in poller.poll(20):
                if sock is front:
                    msg = front.recv_multipart()
                    if len(msg) != 2:  # the consumer's release after the failed pull: not relayed
                        continue
                    identity, frame = msg
                    dealer = ctx.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.connect(back)
                    dealer.send(frame)
                    pulls[dealer] = (identity, msgspec.msgpack.decode(frame, type=PullRequest).consumer_rank)
                    seen.append(pulls[dealer][1])
                    poller.register(dealer, zmq.POLLIN)
                else:
                    identity, rank = pulls[sock]
                    parts = sock.recv_multipart()
                    if rank == corrupt_rank and len(parts) == 3:
                        keys = bytearray(parts[1])
                        keys[len(keys) // 2] ^= 0x40
                        parts[1] = bytes(keys)
                    front.send_multipart([identity, *parts])
    finally:
        for sock in [front, *pulls]:
            sock.close(0)
        ctx.term()


def test_a_corrupt_transfer_on_one_rank_is_recomputed_by_every_rank(engines: tuple[LLMEngine, LLMEngine],
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    producer, consumer = engines  # TP 1 -> TP 2: both consumer ranks pull from producer rank 0
    params = prefill(producer)
    relay_port, seen = free_ports("127.0.0.1", 1), []
    stop = threading.Event()
    relay = threading.Thread(target=corrupting_relay, daemon=True,
                             args=(relay_port, f"tcp://127.0.0.1:{params['remote_port']}", stop, 1, seen))
    relay.start()
    try:
        before = stats(consumer)
        with Pump(producer):
            got = run(consumer, replace(GREEDY, kv_transfer_params={**params, "remote_port": relay_port}))
        after = stats(consumer)
    finally:
        stop.set()
        relay.join(10)
    assert (after["num_loads"] - before["num_loads"], after["num_recomputes"] - before["num_recomputes"]) == (0, 1)
    assert sorted(seen) == [0, 1]  # rank 0's pull went through untouched; rank 1's keys were corrupt
    assert "keys: checksum mismatch" in caplog.text
    assert_same(got, run(consumer, GREEDY), exact=True)  # computed here, from the prompt, on both ranks
    assert_idle(producer)  # both ranks' pulls were served: the producer's blocks are free
    assert_idle(consumer)


def test_pipeline_parallelism_is_refused_precisely() -> None:
    with pytest.raises(TreadleError, match=r"not available with pipeline parallelism \(pipeline_parallel_size 2\)"):
        LLMEngine.from_args("stories260k", pipeline_parallel_size=2, **ENGINE_KW,
                            kv_transfer_config={"kv_connector": "tcp", "kv_role": "kv_producer"})


# -- over HTTP: engine-core processes, the TP 2 producer's with its worker processes ---------------------
def test_http_producer_tp2_consumer_tp1_equals_colocated(tmp_path: Path) -> None:
    model = stories_with_chat_template(tmp_path / "stories")
    kw = {**ENGINE_KW, "max_num_batched_tokens": 256, "max_num_seqs": 8}

    def start(tp: int, role: str) -> EngineCoreClient:
        make = functools.partial(LLMEngine.from_args, str(model), tensor_parallel_size=tp, **kw,
                                 kv_transfer_config={"kv_connector": "tcp", "kv_role": role})
        return EngineCoreClient(make, threads=1)

    with ThreadPoolExecutor(2) as pool:  # started side by side
        futures = [pool.submit(start, 2, "kv_producer"), pool.submit(start, 1, "kv_consumer")]
    llms = [f.result() for f in futures if f.exception() is None]
    try:
        for f in futures:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        with ServerThread(build_app(llms[0], MODEL_NAME)) as producer, \
                ServerThread(build_app(llms[1], MODEL_NAME)) as consumer:
            client = {url: openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
                      for url in (producer.url, consumer.url)}

            def complete(url: str, stream: bool, kv: dict | None, max_tokens: int = 16) -> str:
                resp = client[url].completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=max_tokens,
                                                      temperature=0, stream=stream,
                                                      extra_body={} if kv is None else {"kv_transfer_params": kv})
                if stream:
                    return "".join(ch.choices[0].text for ch in resp if ch.choices)  # type: ignore[union-attr]
                return resp.choices[0].text  # type: ignore[union-attr]

            want = complete(consumer.url, False, None)  # the consumer computing the prompt itself: colocated
            for stream in (False, True):
                resp = client[producer.url].completions.create(
                    model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0,
                    extra_body={"kv_transfer_params": {"do_remote_decode": True}})
                params = resp.model_extra["kv_transfer_params"]  # type: ignore[index]
                assert params["remote_tp_size"] == 2
                assert complete(consumer.url, stream, params) == want
            values = metric_values(consumer.url)
            assert (values["treadle:kv_transfer_loads_total"], values["treadle:kv_transfer_recomputes_total"]) == (2, 0)
            wait_until(lambda: engine_idle(producer.url) and engine_idle(consumer.url), 20,
                       "both sides idle, every block free (both producer ranks reported the pulls)")
    finally:
        for llm in llms:
            llm.shutdown()
