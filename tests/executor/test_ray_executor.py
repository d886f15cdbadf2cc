"""The Ray executor on a local Ray cluster of two simulated nodes (``ray.cluster_utils.Cluster``,
one CPU each, so the two tensor-parallel ranks land on different nodes): token-identical to
one rank; a killed rank is a clear error and an unhealthy engine within seconds."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from test_parallel import KW, assert_same, run

from treadle import LLM, SamplingParams
from treadle.config import EngineDeadError

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def test_ray_tp2_on_two_nodes_is_token_identical(cluster: object) -> None:
    want = run(LLM("stories260k", **KW))
    llm = LLM("stories260k", tensor_parallel_size=2, distributed_executor_backend="ray", **KW)
    try:
        assert_same(run(llm), want)
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) == 2
        engine = llm.engine
        engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True))
        engine.step()
        os.kill(engine.executor.worker_pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="Ray actor") as info:
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - t0 < 10.0 and "\n" not in str(info.value)
        assert engine.health() is not None
    finally:
        llm.shutdown()
