"""The KV connector contract below the HTTP layer: the scheduler side with hand-built worker
reports (torch-free, no model), the wire checks, kv_transfer_config parsing, and two real
engines in this process handing KV over 127.0.0.1 (tcp and shm): the consumer's KV is
bitwise what it computes itself, and its greedy output is the colocated one."""
from __future__ import annotations

import threading
import time
import zlib

import pytest
import torch

from treadle.config import KVTransferConfig, SchedulerConfig, TreadleError
from treadle.core.kv_cache_manager import KVCacheManager
from treadle.core.request import Request, RequestStatus
from treadle.core.step_data import ModelRunnerOutput
from treadle.engine.llm_engine import LLMEngine
from treadle.engine.resolver import resolve_kv_transfer
from treadle.kv_transfer.metadata import KVConnectorOutput
from treadle.kv_transfer.scheduler import KVTransferScheduler
from treadle.kv_transfer.wire import TransferError, check_frame
from treadle.sampling_params import SamplingParams

PROMPT = "Once upon a time there was a little girl named Lily. She loved to play outside in the park"
ENGINE_KW = dict(num_kv_blocks=64, block_size=16, max_model_len=256)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kv_scheduler(role: str, clock: Clock, num_blocks: int = 32) -> KVTransferScheduler:
    cfg = KVTransferConfig("tcp", role, "127.0.0.1", 5555, "e1", transfer_timeout_s=1.0, producer_block_timeout_s=5.0)
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


def test_consumer_length_mismatch_recomputes_without_pulling() -> None:
    s = kv_scheduler("kv_consumer", Clock())
    s.add_request(request("c", 10, remote(12)))
    out = s.schedule()
    assert out.kv_connector_metadata is None and out.scheduled[0].num_scheduled_tokens == 10
    assert s.kv_stats.num_recomputes == 1


def test_consumer_abort_while_loading_frees_blocks_only_after_the_workers_report() -> None:
    s = kv_scheduler("kv_consumer", Clock())
    s.add_request(request("c", 10, remote(10)))
    assert len(s.schedule().kv_connector_metadata.loads) == 1
    s.abort(["c"])
    assert s.kv.num_free_blocks == 32 - 3  # the workers may still write them
    s.update_from_output(s.schedule(), report(failed_loading={"c": "cancelled"}))
    assert s.kv.num_free_blocks == 32 and not s.has_pending_transfers() and not s.running


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
                     ('{"kv_role": "kv_both", "kv_port": -1}', "kv_port")]:
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
@pytest.mark.parametrize("connector", ["tcp", "shm"])
def test_handover_is_bitwise_and_output_matches_colocated(connector: str) -> None:
    engines = []
    stop = threading.Event()
    try:
        prod, cons, ref = (LLMEngine.from_args("stories260k", kv_transfer_config=kv, **ENGINE_KW) for kv in (
            {"kv_connector": connector, "kv_role": "kv_producer"},
            {"kv_connector": connector, "kv_role": "kv_consumer"}, None))
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
        for (ck, cv), (rk, rv) in zip(cons.executor.worker.runner.kv_caches, ref.executor.worker.runner.kv_caches):
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
