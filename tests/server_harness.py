"""Helpers for the server tests: a real uvicorn server on a free loopback port in a
background thread, serving a real engine (in its own engine-core process, as
`treadle serve` does, or in a thread); slow or failing steps on demand (engine_hooks.py);
Prometheus parsing; polling."""
from __future__ import annotations

import contextlib
import functools
import json
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from engine_hooks import HookedEngineFactory, StepControl  # (re-exported: the tests import them from here)
from prometheus_client.parser import text_string_to_metric_families

from treadle.engine.client.engine_client import EngineClient
from treadle.engine.client.in_process import AsyncLLM
from treadle.engine.client.multi_process import EngineCoreClient
from treadle.engine.llm_engine import LLMEngine
from treadle.loaders.resolve import resolve_model
from treadle.server.app import build_app

MODEL_NAME = "tiny"
# the same engine settings for the server and the offline reference
ENGINE_KW: dict[str, Any] = dict(num_kv_blocks=512, block_size=16, max_num_batched_tokens=256, max_num_seqs=64,
                                 max_model_len=512)


# stories260k ships without a chat template; the tests give it a plain one
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def stories_with_chat_template(dest: Path) -> Path:
    """A copy of the bundled stories260k model (real tiny TinyStories weights) whose
    tokenizer config also declares a chat template."""
    shutil.copytree(resolve_model("stories260k"), dest, dirs_exist_ok=True)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return dest


class ServerThread:
    """uvicorn serving ``app`` on 127.0.0.1 (a port picked by the OS) in a thread."""

    def __init__(self, app: Any) -> None:
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP;
        # with 0, Nagle held each keep-alive response's body for the client's delayed ACK (~40 ms)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "server start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def start_engine(model_dir: Path, heartbeat_timeout: float = 60.0, control: StepControl | None = None,
                 in_process: bool = False, **engine_kw: Any) -> EngineClient:
    """An engine client for ``model_dir`` with ENGINE_KW (``engine_kw`` overrides): in an
    engine-core process (the server's default) with one torch thread, or, with ``in_process``,
    AsyncLLM's thread. One thread, as `treadle serve` gives its engine process on 2 cores (one
    fewer than the cores): two OpenMP threads spun against this process's server and clients
    (55 server tests: 62.6 -> 53.8 s and 62.8 -> 48.5 s in two interleaved A/B runs)."""
    factory = HookedEngineFactory(control) if control is not None else LLMEngine.from_args
    kw = {**ENGINE_KW, **engine_kw}
    if in_process:
        return AsyncLLM(factory(str(model_dir), **kw), heartbeat_timeout)
    return EngineCoreClient(functools.partial(factory, str(model_dir), **kw), heartbeat_timeout, threads=1)


@contextlib.contextmanager
def engine(model_dir: Path, heartbeat_timeout: float = 60.0, control: StepControl | None = None,
           in_process: bool = False, **engine_kw: Any) -> Iterator[EngineClient]:
    llm = start_engine(model_dir, heartbeat_timeout, control, in_process, **engine_kw)
    try:
        yield llm
    finally:
        llm.shutdown()


@contextlib.contextmanager
def serve(model_dir: Path, heartbeat_timeout: float = 60.0, control: StepControl | None = None,
          in_process: bool = False, engine_kw: dict[str, Any] | None = None,
          **app_kw: Any) -> Iterator[tuple[ServerThread, EngineClient]]:
    """``engine_kw``: EngineArgs over ENGINE_KW; ``app_kw``: build_app's options."""
    with engine(model_dir, heartbeat_timeout, control, in_process, **(engine_kw or {})) as llm:
        with ServerThread(build_app(llm, MODEL_NAME, **app_kw)) as srv:
            yield srv, llm


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def metric_values(url: str) -> dict[str, float]:
    """/metrics -> {sample name (with labels other than model_name): value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return values


def engine_idle(url: str) -> bool:
    """No request running, waiting or open, and every KV block free."""
    m = metric_values(url)
    return (m["treadle:num_requests_running"] == 0 and m["treadle:num_requests_waiting"] == 0
            and m["treadle:num_requests_open"] == 0
            and m["treadle:kv_cache_free_blocks"] == m["treadle:kv_cache_total_blocks"])
