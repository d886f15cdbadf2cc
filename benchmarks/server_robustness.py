"""Robustness figures for `treadle serve` (issue 18), on loopback only, every wait bounded.

1. Stall under the issue's repros, each on a fresh server: while one greedy stream runs,
   send (a) 1,000 prompts x n=128 and leave after 3 s, (b) a 900 KB, a 5 MB and a 50 MB
   prompt (and a baseline and a request at the cap), each from a child process;
   report each answer, its time (including the child's start, ~0.2 s), and the longest gap
   between the watched stream's chunks from sending until 2 s after the answer.
2. Disconnect storms: 200 concurrent streams, every other one leaves after its first chunk;
   per storm: completions lost (a staying stream without finish_reason and [DONE]), seconds
   until the engine is idle again, KV blocks not back, and the server's RSS.

    PYTHONPATH=$PWD python benchmarks/server_robustness.py [--storms 3] [--streams 200]

Run it with another checkout on PYTHONPATH to compare before and after.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

CMPL = "/v1/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("treadle:") and "{" in line and "finished_reason" not in line:
            name, value = line.split("{", 1)[0], line.rsplit(" ", 1)[1]
            out[name] = float(value)
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Watcher:
    """Greedy streams back to back in a thread; chunk arrival times. Gaps count only
    between chunks of one stream (a new stream may rightly wait its turn in the queue)."""

    def __init__(self, url: str) -> None:
        self.url, self.times, self.stop = url, [time.monotonic()], threading.Event()
        self.stream_of: list[int] = [0]
        self.streams = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
        while not self.stop.is_set():
            self.streams += 1
            try:
                with httpx.stream("POST", self.url + CMPL, json=body, timeout=120) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: "):
                            self.stream_of.append(self.streams)
                            self.times.append(time.monotonic())
                        if self.stop.is_set():
                            return
            except httpx.HTTPError:
                time.sleep(0.05)

    def max_gap(self, start: float, end: float) -> float:
        marks = list(zip(self.times, self.stream_of))
        first = max((i for i, (t, _) in enumerate(marks) if t <= start), default=0)
        last = next((i for i, (t, _) in enumerate(marks) if t > end), len(marks) - 1)
        window = marks[first:last + 1]
        return max((b - a for (a, sa), (b, sb) in zip(window, window[1:]) if sa == sb), default=end - start)


_SEND = """
import sys, time, httpx
body = open(sys.argv[2], "rb").read()
leave_after = float(sys.argv[3])
sys.stdin.readline()  # loaded and ready: wait for the go
start = time.monotonic()
try:
    with httpx.stream("POST", sys.argv[1], content=body, timeout=120,
                      headers={"content-type": "application/json"}) as r:
        text = b""
        for part in r.iter_bytes():
            text += part
            if time.monotonic() - start > leave_after:
                print(r.status_code, "left early", flush=True)
                sys.exit(0)
    code = httpx.Response(r.status_code, content=text, headers=r.headers)
    error = code.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
    print(r.status_code, error.get("code", ""), flush=True)
except httpx.HTTPError as e:
    print(type(e).__name__, flush=True)
"""


def stall(url: str, label: str, body: bytes, client_timeout: float, settle: float = 2.0) -> None:
    watcher = Watcher(url)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:  # sent by another process: no shared GIL
        f.write(body)
        f.flush()
        child = subprocess.Popen([sys.executable, "-c", _SEND, url + CMPL, f.name, str(client_timeout)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        time.sleep(3)  # the child's imports and read, before the watch starts
        watcher.thread.start()
        deadline = time.monotonic() + 30
        while len(watcher.times) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        try:
            out, _ = child.communicate("go\n", timeout=client_timeout + 30)
        except subprocess.TimeoutExpired:
            child.kill()
            out, _ = child.communicate()
        answered = time.monotonic()
    answer = out.strip() or "no answer"
    time.sleep(settle)
    # a frozen server shows as no chunk at all: measure until the watched stream moves (max 60 s)
    wait_until = time.monotonic() + 60
    while watcher.times[-1] < answered + settle and time.monotonic() < wait_until:
        time.sleep(0.05)
    gap = watcher.max_gap(start, max(watcher.times[-1], answered + settle))
    watcher.stop.set()
    watcher.thread.join(5)
    print(f"{label:<36} answer {answer:<34} in {answered - start:6.2f} s   longest chunk gap {gap * 1000:8.1f} ms")


async def storm(url: str, n: int) -> tuple[int, int]:
    """n streams; odd ones leave after their first chunk. Returns (staying, lost)."""
    body = {"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "temperature": 0.8, "stream": True}

    async def one(client: httpx.AsyncClient, i: int) -> bool:
        async with client.stream("POST", url + CMPL, json=body) as resp:
            finish, done = None, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if i % 2:
                    return True  # leaves: dropping the connection aborts the request
                if line == "data: [DONE]":
                    done = True
                else:
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    finish = choices[0].get("finish_reason") or finish
            return finish == "length" and done

    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        ok = await asyncio.gather(*[one(client, i) for i in range(n)], return_exceptions=True)
    staying = [r for i, r in enumerate(ok) if i % 2 == 0]
    return len(staying), sum(1 for r in staying if r is not True)


def storms(url: str, pid: int, count: int, n: int) -> None:
    print(f"RSS before storms: {rss_mib(pid):.0f} MiB")
    for k in range(count):
        start = time.monotonic()
        staying, lost = asyncio.run(storm(url, n))
        ended = time.monotonic()
        idle_by = ended + 30
        while time.monotonic() < idle_by:
            m = metrics(url)
            if m["treadle:num_requests_running"] == m["treadle:num_requests_waiting"] == 0 \
                    and m["treadle:num_requests_open"] == 0 \
                    and m["treadle:kv_cache_free_blocks"] == m["treadle:kv_cache_total_blocks"]:
                break
            time.sleep(0.02)
        m = metrics(url)
        leaked = m["treadle:kv_cache_total_blocks"] - m["treadle:kv_cache_free_blocks"]
        print(f"storm {k + 1}: {n} streams in {ended - start:5.2f} s, {staying} stayed, {lost} lost; "
              f"idle {time.monotonic() - ended:4.2f} s after; {leaked:.0f} of "
              f"{m['treadle:kv_cache_total_blocks']:.0f} blocks not back; RSS {rss_mib(pid):.0f} MiB")


@contextlib.contextmanager
def running_server(model: str) -> Iterator[tuple[str, int]]:
    """`treadle serve MODEL` on a free loopback port: (url, pid); always stopped after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "treadle.entrypoints.cli", "serve", model, "--port", str(port),
           "--log-level", "error", "--heartbeat-timeout", "5", "--shutdown-timeout", "1"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def repros() -> list[tuple[str, bytes, float]]:
    """(label, body, seconds until the client leaves)"""
    def body(**kw: object) -> bytes:
        return json.dumps(kw).encode()

    return [
        ("baseline: one small request", body(prompt="Once", max_tokens=2), 60.0),
        ("4 prompts x n=128 (the cap), leaves at 1 s",
         body(prompt=["Once", "Lily", "Tom", "The"], n=128, max_tokens=64, ignore_eos=True, stream=True), 1.0),
        ("900 KB prompt (under the body limit)", body(prompt="Once upon a time there was a girl. " * 25_000), 120.0),
        ("1,000 prompts x n=128, leaves at 3 s", body(prompt=["Once"] * 1000, n=128, max_tokens=16, stream=True), 3.0),
        ("5 MB prompt", body(prompt="Once upon a time " * (5 * 1024 * 1024 // 17)), 120.0),
        ("50 MB prompt", body(prompt="Once upon a time " * (50 * 1024 * 1024 // 17)), 120.0),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k")
    ap.add_argument("--storms", type=int, default=3)
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--skip-stalls", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the server is stopped on a kill too
    if not args.skip_stalls:
        for label, body, leave_after in repros():  # a fresh server each: one repro cannot spoil the next
            with running_server(args.model) as (url, _):
                stall(url, label, body, leave_after)
    if args.storms:
        with running_server(args.model) as (url, pid):
            storms(url, pid, args.storms, args.streams)


if __name__ == "__main__":
    main()
