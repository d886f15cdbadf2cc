"""llama.cpp's own server (``llama-server``) as a peer: a process on 127.0.0.1 serving a GGUF.

The binary is built from source by ``tools/build_llamacpp.sh`` (llama.cpp as vendored in
llama-cpp-python's source distribution, GGML_NATIVE on) and found in its cache, or in
``$TREADLE_LLAMACPP_BIN``. Three users:

- ``LlamaServerBackend``: the ``llamacpp-server`` backend of ``treadle bench throughput`` /
  ``latency``: llama-server with ``-np N`` slots (N = the concurrency) and continuous batching,
  driven by the same client (serve_client.py) as Treadle's own server.
- ``treadle bench serve --base-url llamacpp-server``: the same server started for each
  concurrency level (see bench/cli.py).
- ``greedy_logprobs``: greedy tokens and top logprobs of llama.cpp for given prompt token ids,
  a correctness reference for a GGUF model::

      from treadle.bench.llamacpp_server import greedy_logprobs
      runs = greedy_logprobs("model.gguf", [[1, 450, 4996]], max_tokens=48, top_n=5)
      runs[0].tokens          # [int] * 48, llama.cpp's greedy continuation
      runs[0].logprobs        # log p(token) at each step (log-softmax of the raw logits)
      runs[0].top             # [[(token id, logprob), ...top_n]] at each step

Every process started here is killed when its ``LlamaServer`` closes (a ``with`` block, or
``close()``), when it is garbage-collected or the interpreter exits, and by the kernel if this
process dies first (PR_SET_PDEATHSIG on Linux).
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from treadle import envs
from treadle.bench.metrics import RunResult
from treadle.bench.workloads import BenchRequest

BUILD_SCRIPT = "tools/build_llamacpp.sh"
LLAMACPP_PY_VERSION = "0.3.36"  # the sdist whose vendor/llama.cpp the build script compiles
START_TIMEOUT_S = 120.0


def _cpu_hash() -> str:
    """The build script's cache key: the CPU's flags line and the compiler's version line."""
    flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    try:
        cxx = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True,
                             timeout=10).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        cxx = ""
    return hashlib.sha256(f"{flags}\n{cxx}\n".encode()).hexdigest()[:12]


def llamacpp_bin_dir() -> Path:
    """The directory holding llama-server and llama-quantize, or a RuntimeError naming the build."""
    given = envs.get("TREADLE_LLAMACPP_BIN")
    if given:
        folder = Path(given)
    else:
        cache = Path(envs.cache_dir())
        version = os.environ.get("LLAMACPP_PY_VERSION", LLAMACPP_PY_VERSION)
        folder = cache / "llamacpp" / f"{version}-{_cpu_hash()}" / "bin"
    if not (folder / "llama-server").is_file():
        raise RuntimeError(f"llama-server is not built for this CPU (looked in {folder}); run {BUILD_SCRIPT}")
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


class LlamaServer:
    """One llama-server process: ``slots`` parallel sequences of ``ctx_per_slot`` tokens each,
    continuous batching on, ``threads`` threads for decode and prompt, no host prompt cache."""

    def __init__(self, gguf: str | Path, slots: int = 1, ctx_per_slot: int = 2048, threads: int | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.gguf, self.slots = Path(gguf), slots
        self.threads = threads or len(os.sched_getaffinity(0))
        port = _free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self.command = [str(llamacpp_bin_dir() / "llama-server"), "-m", str(self.gguf), "--host", "127.0.0.1",
                        "--port", str(port), "-np", str(slots), "-c", str(ctx_per_slot * slots), "-cb",
                        "-t", str(self.threads), "-tb", str(self.threads), "--cache-ram", "0", "--no-webui",
                        *extra_args]
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self._finalizer = weakref.finalize(self, _stop, self.proc)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server did not become ready in {START_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def log_tail(self, n: int = 600) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-n:].strip()

    def close(self) -> None:
        self._finalizer()
        self._log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GreedyRun(NamedTuple):
    tokens: list[int]
    logprobs: list[float]  # log p of each chosen token
    top: list[list[tuple[int, float]]]  # each step's top_n (token id, logprob), best first


def greedy_logprobs(gguf: str | Path, prompts: list[list[int]], max_tokens: int, top_n: int = 5,
                    ignore_eos: bool = False, threads: int | None = None,
                    extra_args: tuple[str, ...] = ()) -> list[GreedyRun]:
    """llama.cpp's greedy continuation of each prompt (token ids, BOS included if wanted) with
    the log-softmax of its raw logits at each step: one llama-server, one slot, no prompt reuse.
    ``extra_args`` go to llama-server (``("--no-repack",)`` avoids ggml's AMX path, which dies
    with SIGILL on the project's VM; see docs/kernels.md)."""
    ctx = max(len(p) for p in prompts) + max_tokens + 8
    out = []
    with LlamaServer(gguf, slots=1, ctx_per_slot=ctx, threads=threads, extra_args=extra_args) as server:
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "n_probs": top_n,
                    "return_tokens": True, "cache_prompt": False, "ignore_eos": ignore_eos}
            r = httpx.post(f"{server.base_url}/completion", json=body, timeout=600.0, trust_env=False)
            r.raise_for_status()
            steps = r.json()["completion_probabilities"]
            out.append(GreedyRun([int(s["id"]) for s in steps], [float(s["logprob"]) for s in steps],
                                 [[(int(t["id"]), float(t["logprob"])) for t in s["top_logprobs"]] for s in steps]))
    return out


@dataclass
class LlamaServerBackend:
    """The ``llamacpp-server`` bench backend: each run goes through the OpenAI-compatible
    ``/v1/completions`` stream of a llama-server with ``concurrency`` slots (started afresh when
    the concurrency changes, killed by ``close()`` or at exit)."""

    gguf: Path
    n_ctx: int  # per slot
    threads: int | None = None
    extra_args: tuple[str, ...] = ()  # passed to llama-server
    name: str = "llamacpp-server"
    server: LlamaServer | None = None

    @property
    def weight_bytes(self) -> int:
        return self.gguf.stat().st_size

    def _server_for(self, concurrency: int) -> LlamaServer:
        if self.server is None or self.server.slots != concurrency:
            self.close()
            self.server = LlamaServer(self.gguf, slots=concurrency, ctx_per_slot=self.n_ctx, threads=self.threads,
                                      extra_args=self.extra_args)
        return self.server

    def run(self, reqs: list[BenchRequest], concurrency: int, progress: Any = None) -> RunResult:
        from treadle.bench.serve_client import Traffic, run_serve

        server = self._server_for(concurrency)
        prompts: list[str | list[int]] = [r.prompt_token_ids for r in reqs]
        records, duration, _ = asyncio.run(run_serve(server.base_url, reqs, prompts,
                                                     Traffic(max_concurrency=concurrency), progress=progress))
        failed = [r.error for r in records if not r.success]
        if failed:
            raise RuntimeError(f"llama-server failed {len(failed)} of {len(records)} requests: {failed[0]}")
        return RunResult(records, duration)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def make_server_backend(model: str, n_ctx: int, threads: int | None = None) -> LlamaServerBackend:
    """The backend for ``model`` (a GGUF path or short name), or a RuntimeError saying what is missing."""
    from treadle.loaders.resolve import resolve_model

    path = resolve_model(model)
    if path.suffix != ".gguf":
        raise RuntimeError(f"llamacpp-server needs a GGUF file; {path} is not one")
    llamacpp_bin_dir()  # fail now, with the build command, rather than at the first run
    if threads is None:
        import torch  # the threads Treadle's backends use (--threads)

        threads = torch.get_num_threads()
    return LlamaServerBackend(path, n_ctx, threads, tuple(shlex.split(envs.get("TREADLE_LLAMACPP_ARGS") or "")))


@contextlib.contextmanager
def launched_server(model: str, slots: int, ctx_per_slot: int, threads: int | None = None) -> Iterator[str]:
    """The base URL of a llama-server on ``model``'s GGUF, alive for the ``with`` block."""
    backend = make_server_backend(model, ctx_per_slot, threads)
    with LlamaServer(backend.gguf, slots=slots, ctx_per_slot=ctx_per_slot, threads=threads) as server:
        yield server.base_url
