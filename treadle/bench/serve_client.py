"""Load generator for any OpenAI-compatible server (``/v1/completions``, streamed).

Arrivals: with ``request_rate`` finite, the gaps between sends are drawn from
a gamma distribution with shape ``burstiness`` and mean ``1 / request_rate``
(``burstiness`` 1 is a Poisson process), seeded; with ``inf`` everything is
sent at once. ``max_concurrency`` caps the requests in flight: a request that
arrives while the cap is reached waits on the client (its clock starts when
it is sent, as in vLLM). Every streamed chunk with a choice counts as a chunk
of output (as vLLM counts them); the token count comes from the server's
``usage`` when it sends one.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np

from treadle.bench import BenchError
from treadle.bench.metrics import RequestRecord
from treadle.bench.workloads import BenchRequest


@dataclass(frozen=True)
class Traffic:
    request_rate: float = math.inf  # requests/s
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def arrival_gaps(self, n: int) -> list[float]:
        if math.isinf(self.request_rate):
            return [0.0] * n
        if self.request_rate <= 0 or self.burstiness <= 0:
            raise BenchError("request rate and burstiness must be positive")
        rng = np.random.default_rng(self.seed)
        scale = 1.0 / (self.request_rate * self.burstiness)
        return rng.gamma(self.burstiness, scale, size=n).tolist()


async def first_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    r = await client.get(f"{base_url}/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --served-model-name")
    return str(data[0]["id"])


def _request_body(model: str, req: BenchRequest, prompt: str | list[int]) -> dict[str, Any]:
    body = {
        "model": model, "prompt": prompt, "max_tokens": req.output_len, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }
    if req.priority:
        body["priority"] = req.priority
    return body


async def send_one(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, prompt: str | list[int]
) -> RequestRecord:
    rec = RequestRecord(req.prompt_len, time.perf_counter())
    try:
        async with client.stream("POST", url, json=_request_body(model, req, prompt)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.success, rec.error = False, f"HTTP {resp.status_code}: {body[:200]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                _read_chunk(rec, json.loads(payload), time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        rec.success, rec.error = False, f"{type(e).__name__}: {e}"
    if rec.success and not rec.chunk_times:
        rec.success, rec.error = False, "the stream carried no output"
    return rec


def _read_chunk(rec: RequestRecord, data: dict[str, Any], now: float) -> None:
    choices = data.get("choices") or []
    if choices:  # as vLLM: every chunk with a choice is a chunk of output, even with empty text
        rec.chunk_times.append(now)
    usage = data.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])


async def run_serve(
    base_url: str,
    reqs: list[BenchRequest],
    prompts: Sequence[str | list[int]],
    traffic: Traffic,
    model: str | None = None,
    progress: Callable[[int], Any] | None = None,
    timeout_s: float = 3600.0,
) -> tuple[list[RequestRecord], float, str]:
    """Send every request once after one warm-up request; returns the records,
    the wall time from the first send to the last byte, and the model id."""
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=traffic.max_concurrency or len(reqs) + 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False) as client:
        model = model or await first_model_id(client, base_url)
        url = f"{base_url}/v1/completions"
        # a short warm-up prompt: less than one KV block, so it seeds no prefix cache
        warm_prompt = prompts[0][:8]
        warm = await send_one(client, url, model, BenchRequest(reqs[0].prompt_token_ids[:8], 2), warm_prompt)
        if not warm.success:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(traffic.max_concurrency) if traffic.max_concurrency else contextlib.nullcontext()

        async def limited(req: BenchRequest, prompt: str | list[int]) -> RequestRecord:
            async with gate:
                rec = await send_one(client, url, model, req, prompt)
            if progress:
                progress(1)
            return rec

        tasks = []
        t0 = time.perf_counter()
        gaps = traffic.arrival_gaps(len(reqs))
        for i, (req, prompt) in enumerate(zip(reqs, prompts)):
            if i and gaps[i - 1] > 0:  # the first request goes at once
                await asyncio.sleep(gaps[i - 1])
            tasks.append(asyncio.create_task(limited(req, prompt)))
        records = list(await asyncio.gather(*tasks))
        return records, time.perf_counter() - t0, model
