"""Helpers for the router tests: `treadle serve` instances and `treadle router` as real
subprocesses on 127.0.0.1 (each in its own session, so a test can kill it with everything
it started, and with its own TMPDIR, removed when it is killed), waits with timeouts, and the
router's Prometheus counters."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from server_harness import metric_values, wait_until

TESTS_DIR = Path(__file__).parent
START_TIMEOUT = 240  # seconds for an instance to load (2 shared cores, several helpers' tests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=2).status_code
    except httpx.TransportError:
        return None


@dataclass
class Proc:
    """A server subprocess and its URL."""
    url: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    port: int = field(init=False)
    # the process's TMPDIR, where an instance's engine client makes its ipc socket folder: a
    # SIGKILLed server cannot remove that folder, so kill() removes this one with it
    tmpdir: str | None = None

    def __post_init__(self) -> None:
        self.port = int(self.url.rsplit(":", 1)[1])

    def start(self) -> Proc:
        path = os.pathsep.join([str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.tmpdir = tempfile.mkdtemp(prefix="treadle-test-")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "TMPDIR": self.tmpdir}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> Proc:
        wait_until(lambda: self.exited() or health(self.url) == 200, timeout, f"{self.url} to start")
        assert not self.exited(), f"{self.url} exited at start-up:\n{self.log.read_text()[-3000:]}"
        return self

    def exited(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def kill(self) -> None:
        """SIGKILL the process and everything it started (the engine process), reap it, and
        remove its TMPDIR."""
        if self.proc is None:
            return
        try:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        finally:
            if self.tmpdir is not None:
                shutil.rmtree(self.tmpdir, ignore_errors=True)


def instance(tmp: Path, name: str, step_delay: float = 0.0, model: str = "stories260k", *flags: str,
             port: int | None = None) -> Proc:
    """`treadle serve MODEL` (one engine thread) whose engine sleeps ``step_delay`` s before each step."""
    url = f"http://127.0.0.1:{port or free_port()}"
    argv = [sys.executable, "-c", "import engine_hooks as h; h.serve_main()", str(step_delay), "serve", model,
            "--port", url.rsplit(":", 1)[1], "--threads", "1", "--kv-cache-memory", "8MiB", "--max-model-len", "512",
            "--log-level", "warning", *flags]
    return Proc(url, argv, tmp / f"{name}.log")


def router(tmp: Path, name: str, *flags: str) -> Proc:
    url = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "treadle.entrypoints.cli", "router", "--port", url.rsplit(":", 1)[1],
            "--log-level", "warning", *flags]
    return Proc(url, argv, tmp / f"{name}.log")


@contextlib.contextmanager
def running(*procs: Proc) -> Iterator[tuple[Proc, ...]]:
    """Start ``procs`` together, wait until each is healthy, kill them all at the end."""
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_healthy()
        yield procs
    finally:
        for p in procs:
            p.kill()


def wait_in_rotation(router_url: str, *instances: Proc, timeout: float = 30) -> None:
    """Wait until the router's health checks have found each of ``instances`` healthy (a
    router started together with its instances counted their start-up as failures)."""
    def ready() -> bool:
        resp = httpx.get(router_url + "/health", timeout=5)
        return resp.status_code == 200 and all(resp.json()["instances"][i.url]["healthy"] for i in instances)

    wait_until(ready, timeout, f"{router_url} to take {[i.url for i in instances]} into rotation")


def upstream_count(router_url: str, instance_url: str, outcome: str = "ok") -> float:
    """Requests the router sent to ``instance_url`` with this outcome."""
    m = metric_values(router_url)
    return sum(v for k, v in m.items() if k.startswith("treadle:router_upstream_requests_total{")
               and f"instance={instance_url}," in k and f"outcome={outcome}," in k)


def router_metric(router_url: str, name: str, **labels: str) -> float:
    """The sum of a router metric's samples with these label values (over all others)."""
    want = [f"{k}={v}" for k, v in labels.items()]
    return sum(v for k, v in metric_values(router_url).items()
               if (k == name or k.startswith(name + "{")) and all(w in k[len(name):].strip("{}").split(",") for w in want))
