"""The KV connector contract below the HTTP layer: the scheduler side with hand-built worker
reports (torch-free, no model), the wire checks, kv_transfer_config parsing, and two real
engines in this process handing KV over 127.0.0.1 (tcp and shm): the consumer's KV is
bitwise what it computes itself, and its greedy output is the colocated one, with layer-wise
start on and off; a load that breaks after some layers, while the model waits for the next,
still gives the colocated output (recomputed) and leaks no block."""
from __future__ import annotations

import dataclasses
import socket
import threading
import time
import zlib

import msgspec
import pytest
import torch
import zmq

from treadle.config import KVTransferConfig, SchedulerConfig, TreadleError
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.kv_connector_data import KVConnectorMetadata, KVConnectorOutput, LoadSpec, RemoteRelease
from treadle.core.request import Request, RequestStatus
from treadle.core.step_data import ModelRunnerOutput, SchedulerOutput
from treadle.engine.llm_engine import LLMEngine
from treadle.kv_transfer import create_connector
from treadle.kv_transfer.options import resolve_kv_transfer
from treadle.kv_transfer.release import send_release
from treadle.kv_transfer.scheduler import KVTransferScheduler
from treadle.kv_transfer.wire import LayerHeader, PullHeader, PullRequest, TransferError, check_frame
from treadle.sampling_params import SamplingParams

PROMPT = "Once upon a time there was a little girl named Lily. She loved to play outside in the park"
ENGINE_KW = dict(num_kv_blocks=64, block_size=16, max_model_len=256)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kv_scheduler(role: str, clock: Clock, num_blocks: int = 32, layerwise: bool = False) -> KVTransferScheduler:
    cfg = KVTransferConfig("tcp", role, "127.0.0.1", 5555, "e1", transfer_timeout_s=1.0, producer_block_timeout_s=5.0,
                           layerwise_start=layerwise)
    sched_cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                                enable_chunked_prefill=True)
    return KVTransferScheduler(sched_cfg, KVCacheManager(num_blocks, 4), None, cfg, clock)


def request(rid: str, n_prompt: int, kv_params: dict | None, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, kv_transfer_params=kv_params)
    return Request(rid, list(range(100, 100 + n_prompt)), params, max_tokens, eos_token_ids=(2,))


def remote(n_tokens: int, rid: str = "p1") -> dict:
    return {"do_remote_prefill": True, "remote_engine_id": "e0", "remote_host": "127.0.0.1", "remote_port": 1,
            "remote_request_id": rid, "num_tokens": n_tokens}


def report(**kw) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled={}, kv_connector_output=KVConnectorOutput(**kw))


# -- scheduler side ------------------------------------------------------------------------
def test_consumer_loads_prompt_less_last_token_then_decodes() -> None:
    s = kv_scheduler("kv_consumer", Clock())
    s.add_request(request("c", 10, remote(10)))
    out = s.schedule()
    assert out.scheduled == [] and len(out.kv_connector_metadata.loads) == 1
    load = out.kv_connector_metadata.loads[0]
    assert (load.remote_request_id, load.num_tokens, len(load.local_block_ids)) == ("p1", 9, 3)
    assert s.requests["c"].status is RequestStatus.WAITING_FOR_REMOTE_KV and s.has_pending_transfers()
    s.update_from_output(out, report(finished_loading=["c"], num_bytes_received=10))
    out = s.schedule()
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(9, 1)]
    assert s.kv_stats.num_loads == 1 and s.kv_stats.num_recomputes == 0


def test_consumer_failed_load_recomputes_the_prompt() -> None:
    s = kv_scheduler("kv_consumer", Clock())
    s.add_request(request("c", 10, remote(10)))
    out = s.schedule()
    s.update_from_output(out, report(failed_loading={"c": "timed out"}))
    out = s.schedule()
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(0, 10)]
    assert s.kv_stats.num_recomputes == 1


def started(s: KVTransferScheduler, rid: str, **kw) -> None:
    """One empty step whose workers report ``rid``'s load started (the producer is sending)."""
    s.update_from_output(s.schedule(), report(started_loading=[rid], **kw))


def test_layerwise_start_runs_once_the_load_started_while_layers_land() -> None:
    s = kv_scheduler("kv_consumer", Clock(), layerwise=True)
    s.add_request(request("c", 10, remote(10)))
    out = s.schedule()
    assert [x.request_id for x in out.kv_connector_metadata.loads] == ["c"] and out.scheduled == []
    s.update_from_output(out, report(started_loading=["c"]))
    out = s.schedule()
    assert out.kv_connector_metadata.streaming == ["c"] and not out.kv_connector_metadata.loads
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(9, 1)]  # last prompt token
    s.update_from_output(out, ModelRunnerOutput(sampled={"c": [5]}, kv_connector_output=KVConnectorOutput(
        finished_loading=["c"])))
    assert s.requests["c"].output_token_ids == [5] and s.kv_stats.num_loads == 1 and not s.has_pending_transfers()
    out = s.schedule()
    assert [(x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [(10, 1)]
    assert out.kv_connector_metadata is None


def test_layerwise_load_over_before_its_request_runs_is_not_streamed() -> None:
    s = kv_scheduler("kv_consumer", Clock(), layerwise=True)
    for rid in ("a", "b"):
        s.add_request(request(rid, 10, remote(10, "p" + rid)))
    s.update_from_output(s.schedule(), report(started_loading=["a", "b"]))  # both queue to run ...
    # ... but their loads end before a step takes them (a step without them comes back first)
    s.update_from_output(SchedulerOutput([], [], []), report(finished_loading=["a"], failed_loading={"b": "crc"}))
    out = s.schedule()
    assert out.kv_connector_metadata is None or not out.kv_connector_metadata.streaming
    assert [(x.request_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == \
        [("a", 9, 1), ("b", 0, 10)]
    assert (s.kv_stats.num_loads, s.kv_stats.num_recomputes) == (1, 1)


def test_layerwise_load_failing_during_the_step_discards_its_output_and_recomputes() -> None:
    s = kv_scheduler("kv_consumer", Clock(), layerwise=True)
    s.add_request(request("c", 10, remote(10)))
    d = request("d", 6, None)  # a local request in the same step (another prompt) is not affected
    d.prompt_token_ids[:] = range(200, 206)
    s.add_request(d)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled={"d": [6]}, kv_connector_output=KVConnectorOutput(
        started_loading=["c"])))
    out = s.schedule()
    assert {x.request_id for x in out.scheduled} == {"c", "d"} and out.kv_connector_metadata.streaming == ["c"]
    s.update_from_output(out, ModelRunnerOutput(sampled={"c": [5], "d": [7]}, kv_connector_output=KVConnectorOutput(
        failed_loading={"c": "layer 2 keys: checksum mismatch"})))
    c = s.requests["c"]
    assert c.output_token_ids == [] and c.num_computed_tokens == 0 and s.requests["d"].output_token_ids == [6, 7]
    assert s.kv_stats.num_recomputes == 1 and s.kv.num_free_blocks == 32 - 2  # only d's blocks
    out = s.schedule()
    assert "c" in out.finished_request_ids  # the runner drops its copy (with the discarded token) ...
    assert [n.request_id for n in out.new_requests] == ["c"]  # ... and gets it anew, to recompute
    assert [(x.request_id, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == \
        [("d", 7, 1), ("c", 0, 10)]
    assert [r.remote_request_id for r in out.kv_connector_metadata.remote_releases] == ["p1"]


def test_layerwise_request_finished_before_its_load_is_reported_keeps_its_blocks() -> None:
    s = kv_scheduler("kv_consumer", Clock(), layerwise=True)
    s.add_request(request("c", 10, remote(10), max_tokens=1))
    s.schedule()
    started(s, "c")
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled={"c": [5]}))  # finished; "loaded" not yet here
    assert "c" not in s.requests and s.kv.num_free_blocks == 32 - 3 and s.has_pending_transfers()
    s.update_from_output(s.schedule(), report(finished_loading=["c"]))
    assert s.kv.num_free_blocks == 32 and not s.has_pending_transfers() and s.kv_stats.num_loads == 1


def test_layerwise_request_aborted_while_queued_to_stream_waits_for_its_pull() -> None:
    s = kv_scheduler("kv_consumer", Clock(), layerwise=True)
    s.add_request(request("c", 10, remote(10)))
    s.schedule()
    s.update_from_output(s.schedule(), report(started_loading=["c"]))
    s.abort(["c"])  # in the queue, its pull still writing
    out = s.schedule()
    assert out.scheduled == [] and [r.request_id for r in out.kv_connector_metadata.remote_releases] == ["c"]
    assert s.kv.num_free_blocks == 32 - 3
    s.update_from_output(out, report(failed_loading={"c": "cancelled"}))
    assert s.kv.num_free_blocks == 32 and not s.has_pending_transfers()


def test_consumer_length_mismatch_recomputes_without_pulling() -> None:
    s = kv_scheduler("kv_consumer", Clock())
    s.add_request(request("c", 10, remote(12)))
    out = s.schedule()
    meta = out.kv_connector_metadata
    assert not meta.loads and out.scheduled[0].num_scheduled_tokens == 10
    assert [(r.request_id, r.remote_request_id) for r in meta.remote_releases] == [("c", "p1")]  # not pulled: free it
    assert s.kv_stats.num_recomputes == 1


def test_consumer_abort_while_loading_frees_blocks_only_after_the_workers_report() -> None:
    s = kv_scheduler("kv_consumer", Clock())
    s.add_request(request("c", 10, remote(10)))
    assert len(s.schedule().kv_connector_metadata.loads) == 1
    s.abort(["c"])
    assert s.kv.num_free_blocks == 32 - 3  # the workers may still write them
    out = s.schedule()  # the workers cancel the pull, and the producer is told to free its blocks
    assert [(r.request_id, r.remote_request_id, r.remote_port) for r in out.kv_connector_metadata.remote_releases] \
        == [("c", "p1", 1)]
    s.update_from_output(out, report(failed_loading={"c": "cancelled"}))
    assert s.kv.num_free_blocks == 32 and not s.has_pending_transfers() and not s.running


def test_consumer_releases_the_producer_when_aborted_before_or_after_a_failed_load() -> None:
    s = kv_scheduler("kv_consumer", Clock())
    s.add_request(request("w", 10, remote(10, "pw")))
    s.abort(["w"])  # still waiting: its load never started
    assert [r.remote_request_id for r in s.schedule().kv_connector_metadata.remote_releases] == ["pw"]
    s.add_request(request("f", 10, remote(10, "pf")))
    out = s.schedule()
    s.update_from_output(out, report(failed_loading={"f": "layout mismatch"}))  # the producer may still hold it
    assert [r.remote_request_id for r in s.schedule().kv_connector_metadata.remote_releases] == ["pf"]
    s.abort(["f"])  # running now (recomputing): nothing more to release
    meta = s.schedule().kv_connector_metadata
    assert meta is None or not meta.remote_releases


def test_producer_holds_until_pulled_or_timeout() -> None:
    clock = Clock()
    s = kv_scheduler("kv_producer", clock)
    for rid in ("a", "b"):
        s.add_request(request(rid, 10, {"do_remote_decode": True}, max_tokens=1))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(sampled={"a": [7], "b": [8]}))
    a = s.kv.block_ids("a")
    assert len(a) == 3 and s.kv.num_free_blocks == 32 - 6
    out = s.schedule()
    assert out.kv_connector_metadata.saves == {"a": a, "b": s.kv.block_ids("b")}
    s.update_from_output(out, report(finished_sending=["a"]))
    assert s.kv.num_free_blocks == 32 - 3 and s.kv_stats.num_pulled == 1
    clock.now = 6.0
    out = s.schedule()
    assert out.kv_connector_metadata.releases == ["b"] and s.kv.num_free_blocks == 32
    assert s.kv_stats.num_expired == 1 and not s.has_pending_transfers()


def test_producer_frees_held_blocks_a_consumer_released() -> None:
    s = kv_scheduler("kv_producer", Clock())
    s.add_request(request("a", 10, {"do_remote_decode": True}, max_tokens=1))
    s.update_from_output(s.schedule(), ModelRunnerOutput(sampled={"a": [7]}))
    assert s.kv.num_free_blocks == 32 - 3
    s.update_from_output(s.schedule(), report(released_unpulled=["a"]))
    assert s.kv.num_free_blocks == 32 and s.kv_stats.num_released == 1 and s.kv_stats.num_pulled == 0
    assert not s.has_pending_transfers()


def test_producer_frees_aborted_and_plain_requests_at_once() -> None:
    s = kv_scheduler("kv_producer", Clock())
    s.add_request(request("a", 10, {"do_remote_decode": True}, max_tokens=1))
    s.add_request(request("p", 10, None, max_tokens=1))
    out = s.schedule()
    s.abort(["a"])  # while its step is in flight
    s.update_from_output(out, ModelRunnerOutput(sampled={"a": [7], "p": [7]}))
    assert s.kv.num_free_blocks == 32 and not s.has_pending_transfers()


# -- wire and config ----------------------------------------------------------------------------
def test_corrupt_or_short_frames_are_refused() -> None:
    data = bytes(range(256)) * 4
    check_frame(data, zlib.crc32(data), len(data), "ok")
    bad = bytearray(data)
    bad[17] ^= 1
    with pytest.raises(TransferError, match="checksum"):
        check_frame(bytes(bad), zlib.crc32(data), len(data), "layer 0 keys")
    with pytest.raises(TransferError, match="expected"):
        check_frame(data[:-4], zlib.crc32(data[:-4]), len(data), "layer 0 keys")


def test_kv_transfer_config_parsing() -> None:
    cfg = resolve_kv_transfer('{"kv_connector": "shm", "kv_role": "kv_consumer", "transfer_timeout_s": 2}')
    assert (cfg.connector, cfg.role, cfg.transfer_timeout_s, cfg.is_consumer, cfg.is_producer) == \
        ("shm", "kv_consumer", 2.0, True, False)
    assert resolve_kv_transfer(None) is None
    for bad, msg in [('{"kv_role": "x"}', "kv_role"), ('{"kv_role": "kv_both", "kv_connector": "rdma"}', "kv_connector"),
                     ('{"kv_role": "kv_both", "bogus": 1}', "unknown"), ("{", "JSON"),
                     ('{"kv_role": "kv_both", "kv_port": -1}', "kv_port"),
                     ('{"kv_role": "kv_both", "layerwise_start": 1}', "layerwise_start")]:
        with pytest.raises(TreadleError, match=msg):
            resolve_kv_transfer(bad)


# -- two real engines in this process -------------------------------------------------------------
def run(engine: LLMEngine, rid: str, params: SamplingParams):
    engine.add_request(rid, PROMPT, params)
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no final output")


def pump(engine: LLMEngine, stop: threading.Event) -> None:
    """The producer's step loop (as its engine-core process runs it): serves held blocks."""
    deadline = time.monotonic() + 60
    while not stop.is_set() and time.monotonic() < deadline:
        engine.step() if engine.scheduler.has_pending_transfers() else time.sleep(0.005)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("connector", "layerwise"), [("tcp", True), ("tcp", False), ("shm", True)])
def test_handover_is_bitwise_and_output_matches_colocated(connector: str, layerwise: bool) -> None:
    engines = []
    stop = threading.Event()
    try:
        prod, cons, ref = (LLMEngine.from_args("stories260k", kv_transfer_config=kv, **ENGINE_KW) for kv in (
            {"kv_connector": connector, "kv_role": "kv_producer"},
            {"kv_connector": connector, "kv_role": "kv_consumer", "layerwise_start": layerwise}, None))
        engines = [prod, cons, ref]
        first = run(prod, "p", SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
        params = first.kv_transfer_params
        assert params["do_remote_prefill"] and params["num_tokens"] == len(first.prompt_token_ids)
        pumping = threading.Thread(target=pump, args=(prod, stop))
        pumping.start()
        got = run(cons, "c", SamplingParams(temperature=0, max_tokens=24, kv_transfer_params=params))
        want = run(ref, "r", SamplingParams(temperature=0, max_tokens=24))
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].token_ids[0] == first.outputs[0].token_ids[0] == params["first_token_id"]
        assert cons.scheduler.stats()["num_loads"] == 1 and cons.scheduler.stats()["num_recomputes"] == 0
        # the consumer's blocks hold the producer's KV of prompt[:-1]; the colocated engine computed the
        # same prompt into the same block ids (both started empty): bitwise equal
        n = params["num_tokens"] - 1
        for (ck, cv), (rk, rv) in zip(cons.model_runner().kv_caches, ref.model_runner().kv_caches):
            for c, r in ((ck, rk), (cv, rv)):
                assert torch.equal(c.flatten(0, 1)[:n], r.flatten(0, 1)[:n])
        stop.set()
        pumping.join(10)
        assert prod.scheduler.stats()["num_pulled"] == 1
        assert prod.kv_manager.num_free_blocks == prod.kv_manager.pool.num_blocks
    finally:
        stop.set()
        for e in engines:
            e.shutdown()



def serve_broken_after(sock: zmq.Socket, good_layers: int, stop: threading.Event) -> None:
    """A producer that answers one pull, sends ``good_layers`` layers, waits, then a corrupt one."""
    if not sock.poll(10_000):
        return
    identity, frame = sock.recv_multipart()[:2]
    pull = msgspec.msgpack.decode(frame, type=PullRequest)
    sock.send_multipart([identity, msgspec.msgpack.encode(PullHeader(True, "", pull.layout, pull.num_blocks))])
    data = bytes(pull.num_blocks * pull.layout.block_bytes())
    for layer in range(good_layers + 1):
        if layer == good_layers:
            stop.wait(0.3)  # the model is waiting for this layer by now
        bad = layer == good_layers
        head = LayerHeader(layer, zlib.crc32(data) ^ bad, zlib.crc32(data))
        sock.send_multipart([identity, msgspec.msgpack.encode(head), data, data])


@pytest.mark.usefixtures("one_thread")
def test_layerwise_load_broken_after_some_layers_is_recomputed() -> None:
    engines: list[LLMEngine] = []
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    stop = threading.Event()
    server = None
    try:
        cons, ref = (LLMEngine.from_args("stories260k", kv_transfer_config=kv, **ENGINE_KW) for kv in (
            {"kv_connector": "tcp", "kv_role": "kv_consumer", "layerwise_start": True}, None))
        engines = [cons, ref]
        want = run(ref, "r", SamplingParams(temperature=0, max_tokens=24))
        port = fake.bind_to_random_port("tcp://127.0.0.1")
        server = threading.Thread(target=serve_broken_after, args=(fake, 2, stop))
        server.start()
        params = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "127.0.0.1",
                  "remote_port": port, "remote_request_id": "r", "num_tokens": len(want.prompt_token_ids)}
        got = run(cons, "c", SamplingParams(temperature=0, max_tokens=24, kv_transfer_params=params))
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        stats = cons.scheduler.stats()
        assert (stats["num_recomputes"], stats["num_loads"]) == (1, 0)
        deadline = time.monotonic() + 10
        while cons.scheduler.has_pending_transfers() and time.monotonic() < deadline:
            cons.step()
        assert cons.kv_manager.num_free_blocks == cons.kv_manager.pool.num_blocks
    finally:
        stop.set()
        if server is not None:
            server.join(10)
        fake.close(0)
        ctx.term()
        for e in engines:
            e.shutdown()


# -- the release message between two real connectors (no model) ---------------------------------
def _finished(conn, timeout: float = 10.0) -> KVConnectorOutput:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = conn.get_finished(0.02)
        if out is not None:
            return out
    raise AssertionError("no transfer ended")


def test_release_message_frees_held_blocks_and_refuses_later_pulls() -> None:
    def caches(fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.full((4, 4, 1, 8), fill), torch.full((4, 4, 1, 8), fill)) for _ in range(2)]

    port = _free_port()
    cfg = KVTransferConfig("tcp", "kv_producer", "127.0.0.1", port, "e", 5.0, 600.0, False)
    producer = create_connector(cfg, caches(1.0))
    consumer = create_connector(dataclasses.replace(cfg, role="kv_consumer"), caches(0.0))
    ctx = zmq.Context()
    try:
        send_release(ctx, "127.0.0.1", port, ["early"])  # before its save: the save is dropped
        producer.start_step(KVConnectorMetadata(saves={"held": [0, 1]}))
        time.sleep(0.2)
        producer.start_step(KVConnectorMetadata(saves={"early": [2]}))
        assert _finished(producer).released_unpulled == ["early"]
        consumer.start_step(KVConnectorMetadata(remote_releases=[RemoteRelease("c", "held", "127.0.0.1", port)]))
        assert _finished(producer).released_unpulled == ["held"]
        consumer.start_step(KVConnectorMetadata(loads=[LoadSpec("c", "held", "127.0.0.1", port, 8, [0, 1])]))
        assert "not held" in _finished(consumer).failed_loading["c"]
    finally:
        ctx.destroy(linger=0)
        producer.shutdown()
        consumer.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
