"""Sending a request on: instance choice, timeouts, retries, and the P/D prefill step (one
call's pieces, the job and its errors and streams: ``upstream.py``).

With ``--queue`` the generating step first waits in the router's dispatch queue for a free
batch slot among the generating instances (``queue.py``), and holds the slot until its answer
or stream ends; the instance is then chosen among those with a free slot.

A step (prefill, or the generating call) tries up to ``max_attempts`` instances: one that
cannot be reached, times out, answers 5xx, or ends its stream before the first event is
left for the next one (connection failures also count against it: ``instances.py``). When
the generating role has no healthy instance left, a request waits for a backing-off one to
be due and tries it again, so the last decode instance frozen for a few seconds costs no
503; only instances out of rotation (``max_failures`` failures) fail a request at once. An
instance's 4xx is the client's mistake and goes back to the client as it is. A stream is
only handed to the client once its first event arrived, so everything before that can be
retried; a failure after it ends the stream with an error event and ``data: [DONE]``.

```
 P/D:  prefill step ──ok──> kv_transfer_params ──> generating step (decode instances)
            │ every prefill instance failed
            └──> generating step without KV (the decode instance computes the prompt)
```

When the generating step of a request that carries a producer's ``kv_transfer_params`` ends
without an answer (the client left, every decode instance failed, a 4xx), the producer is sent
the connector's release message (``treadle.kv_transfer.release``, ZeroMQ to the ``remote_host``
and ``remote_port`` of those params), so it frees the prompt's blocks now rather than at its
``producer_block_timeout_s``. That is the router's only non-HTTP word; releasing a request a
decode instance already pulled does nothing. A client that leaves during the prefill call
does not cut it: the call ends in the background and what it returns is released the same way
(a one-token call; cutting it would lose the producer's answer, the only name of its KV).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
import zmq
from starlette.responses import Response

from treadle.core.cost_policy import PREFILL_TOKEN_COST, UNKNOWN_OUTPUT_TOKENS, runs_to_max_tokens
from treadle.core.kv_connector_data import RemotePrefill
from treadle.kv_transfer.release import send_release
from treadle.router.config import Role, RouterConfig
from treadle.router.instances import Instance, InstancePool, describe
from treadle.router.metrics import RouterMetrics
from treadle.router.policy import PrefixIndex, choose
from treadle.router.queue import DispatchQueue
from treadle.router.upstream import Job, OpenStream, Relay, UpstreamFailure, error_body, first_event, upstream_errors

logger = logging.getLogger("treadle.router")
T = TypeVar("T")
PASSES_PER_INSTANCE = 20  # the engine's default count bound (scheduling_max_passed_over)

SSE_DONE = "data: [DONE]\n\n"


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a producer gets: the prompt only (one token), not streamed, KV kept for a consumer."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


class Forwarder:
    def __init__(self, config: RouterConfig, pool: InstancePool, metrics: RouterMetrics,
                 client: httpx.AsyncClient, zmq_ctx: zmq.Context) -> None:
        self.config, self.pool, self.metrics, self.client = config, pool, metrics, client
        self.zmq_ctx = zmq_ctx  # for release messages to producers
        self.prefix = PrefixIndex()
        self._detached: set[asyncio.Future[dict[str, Any] | None]] = set()  # prefill calls of clients who left
        self.turn = 0
        self.timeout = httpx.Timeout(config.upstream_timeout_s, connect=config.connect_timeout_s)
        self.queue: DispatchQueue | None = None
        if config.queue != "off":
            passes = config.queue_max_passed_over
            if passes is None:  # each instance admits about as often as a lone engine does
                passes = PASSES_PER_INSTANCE * len(pool.by_role(config.generating_role))
            self.queue = DispatchQueue(pool, config.generating_role.value, config.queue, config.queue_aging_s, passes)
            pool.after_poll.append(self.queue.dispatch)
            metrics.watch_queue(self.queue)

    # --- choosing and retrying -------------------------------------------------------------
    def _pick(self, role: Role, job: Job, tried: set[str]) -> Instance | None:
        candidates = [i for i in self.pool.by_role(role) if i.url not in tried]
        if self.queue is not None and role == self.config.generating_role:
            room = [i for i in candidates if not i.load.max_num_seqs or i.in_flight < i.load.max_num_seqs]
            candidates = room or candidates
        owner_url = self.prefix.owner(job.text) if self.config.prefix_affinity and role == self.config.prompt_role \
            else None
        owner = next((i for i in candidates if i.url == owner_url), None)
        self.turn += 1
        choice = choose(candidates, self.turn, owner, self.config.balance_by_cost)
        if choice is None:
            return None
        self.metrics.decisions.labels(role.value, choice.reason).inc()
        return choice.instance

    async def _retry_after_backoff(self, role: Role, waited: set[str]) -> Instance | None:
        """The generating role has no healthy instance left to try: wait for one that is backing
        off (or was, when this request began waiting: ``waited``) to be due for a retry, or to
        pass a health check. None when none is (every one is out of rotation, or failed otherwise)."""
        while True:
            now = time.monotonic()
            waited.update(i.url for i in self.pool.by_role(role) if i.backing_off)
            candidates = [i for i in self.pool.by_role(role) if i.url in waited and not i.out]
            if not candidates:
                return None
            due = [i for i in candidates if i.retry_due(now)]
            if due:
                return min(due, key=lambda i: i.failures)
            await asyncio.sleep(min(0.1, min(i.retry_at for i in candidates) - now))

    async def _attempts(self, role: Role, job: Job, attempt: Callable[[Instance], Awaitable[T]],
                        keep: bool = False) -> tuple[Instance, T]:
        """``attempt`` on one instance after another until one does not raise UpstreamFailure.
        The instance's in-flight count stays raised when ``keep`` (the caller lowers it). With no
        healthy instance left, the generating role's backing-off instances are retried as their
        back-off allows (at most ``max_failures`` times); prompts go to the decode side instead."""
        tried: set[str] = set()
        waited: set[str] = set()
        last = "no instance is healthy"
        retries = self.config.max_attempts + self.config.max_failures
        for n in range(retries):
            inst = self._pick(role, job, tried) if len(tried) < self.config.max_attempts else None
            if inst is None and role == self.config.generating_role:
                inst = await self._retry_after_backoff(role, waited)
            if inst is None:
                break
            tried.add(inst.url)
            if n:
                self.metrics.retries.labels(role.value).inc()
            inst.begin(job.prompt_tokens)
            try:
                result = await attempt(inst)
            except UpstreamFailure as e:
                inst.end(job.prompt_tokens)
                self.metrics.upstream.labels(inst.url, role.value, "failed").inc()
                if e.down:
                    inst.mark_down(str(e))
                logger.warning("%s instance %s failed a request (%s)%s", role.value, inst.url, e,
                               "; trying again" if n + 1 < retries else "")
                last = f"{inst.url}: {e}"
                continue
            except BaseException:
                inst.end(job.prompt_tokens)
                raise
            inst.mark_up()  # it answered
            if not keep:
                inst.end(job.prompt_tokens)
            if role == self.config.prompt_role:
                self.prefix.record(job.text, inst.url)
            return inst, result
        out = [f"{i.url} is out of rotation after {i.failures} consecutive failures ({i.problem})"
               for i in self.pool.by_role(role) if i.out]
        last = "; ".join(out) or last
        raise Relay.error(503, f"no {role.value} instance could take the request ({last})",
                          "service_unavailable_error", "no_instance")

    # --- one upstream call -----------------------------------------------------------------
    async def _post(self, inst: Instance, job: Job, body: dict[str, Any]) -> httpx.Response:
        with upstream_errors():
            resp = await self.client.post(inst.url + job.path, json=body, headers=job.headers, timeout=self.timeout)
        if resp.status_code >= 500:
            raise UpstreamFailure(f"answered {resp.status_code}: {resp.text[:200]}", down=False)
        self._count(inst, resp.status_code)
        return resp

    def _count(self, inst: Instance, status: int) -> None:
        self.metrics.upstream.labels(inst.url, inst.role.value, "ok" if status < 400 else "client_error").inc()

    async def _open(self, inst: Instance, job: Job, body: dict[str, Any]) -> OpenStream:
        request = self.client.build_request("POST", inst.url + job.path, json=body, headers=job.headers,
                                            timeout=self.timeout)
        with upstream_errors():
            resp = await self.client.send(request, stream=True)
        try:
            if resp.status_code != 200:
                await resp.aread()
                if resp.status_code >= 500:
                    raise UpstreamFailure(f"answered {resp.status_code}: {resp.text[:200]}", down=False)
                self._count(inst, resp.status_code)
                raise Relay.of(resp)
            lines = resp.aiter_lines()
            first = await first_event(lines)
            if first is None or first.startswith("data: {\"error\""):
                raise UpstreamFailure(f"the stream ended before its first token: {first}", down=False)
        except httpx.HTTPError as e:
            await resp.aclose()
            raise UpstreamFailure(f"{describe(e)} before the first token", down=False) from None
        except BaseException:
            await resp.aclose()
            raise
        self._count(inst, 200)
        return OpenStream(inst, resp, lines, first, job.prompt_tokens)

    # --- the request's steps ---------------------------------------------------------------
    async def prefill(self, job: Job) -> dict[str, Any] | None:
        """P/D: have a producer compute the prompt; its kv_transfer_params, or None when no
        prefill instance could (the decode instance then computes the prompt itself).

        The call is not cut short when the caller is cancelled (the client left): a producer
        that already finished the prompt holds its KV and has answered (or is answering) with
        the only name of it, so the call runs on in the background and whatever it returns is
        released. Cutting the connection instead would leave every prompt that finished before
        the producer saw the disconnect held until ``producer_block_timeout_s``."""
        call = asyncio.ensure_future(self._prefill(job))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            self._detached.add(call)
            call.add_done_callback(self._release_detached)
            raise

    def _release_detached(self, call: asyncio.Future[dict[str, Any] | None]) -> None:
        """The prefill call of a client that left ended: free what the producer holds for it."""
        self._detached.discard(call)
        if call.cancelled() or call.exception() is not None:
            return  # no answer: the producer aborted the request (its connection closed) or failed
        params = call.result()
        if params is not None:
            self._release(params)

    async def _prefill(self, job: Job) -> dict[str, Any] | None:
        body = prefill_body(job.body)
        try:
            _, resp = await self._attempts(Role.PREFILL, job, lambda i: self._post(i, job, body))
        except Relay as e:
            if e.status != 503:
                raise
            self.metrics.prefill_fallbacks.inc()
            logger.warning("no prefill instance could compute a prompt; the decode instance will")
            return None
        if resp.status_code != 200:
            raise Relay.of(resp)
        params = resp.json().get("kv_transfer_params")
        return params if isinstance(params, dict) else None

    def release_kv(self, job: Job) -> None:
        """P/D: the generating step of ``job`` did not answer; tell the producer holding its
        prompt's KV (if any) to free it. Non-blocking."""
        self._release(job.body.get("kv_transfer_params"))

    def _release(self, params: Any) -> None:
        remote = RemotePrefill.parse(params)
        if remote is not None and not self.zmq_ctx.closed:  # closed: the router is shutting down
            send_release(self.zmq_ctx, remote.host, remote.port, [remote.request_id], remote.tp_size)
            self.metrics.kv_releases.inc()

    # --- the dispatch queue ----------------------------------------------------------------
    async def _wait_turn(self, job: Job) -> None:
        """With --queue: wait for a batch slot (the caller releases it)."""
        assert self.queue is not None
        cost = await self.predicted_cost(job) if self.queue.order == "predicted" else 0.0
        waited = await self.queue.acquire(cost)
        self.metrics.queue_wait.observe(waited)

    async def predicted_cost(self, job: Job) -> float:
        """The request's predicted work in decode tokens: PREFILL_TOKEN_COST x prompt tokens +
        predicted output tokens (at most max_tokens; exactly max_tokens for a request that cannot
        stop early, as the engine counts it), times n. The prompt's tokens and the
        prediction come from a generating instance's /tokenize; when it cannot say (token-id or
        batched prompts, an instance without a length predictor, an error), the prompt is
        estimated from its size and the output counts as UNKNOWN_OUTPUT_TOKENS."""
        body = job.body
        prompt_tokens, output = job.prompt_tokens, UNKNOWN_OUTPUT_TOKENS
        ask: dict[str, Any] | None = None
        if job.path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
            ask = {"messages": body["messages"]}
        elif isinstance(body.get("prompt"), str):
            ask = {"prompt": body["prompt"]}
        insts = [i for i in self.pool.by_role(self.config.generating_role) if i.healthy]
        if ask is not None and insts:
            inst = min(insts, key=lambda i: i.in_flight)
            if "model" in body:
                ask["model"] = body["model"]
            try:
                resp = await self.client.post(inst.url + "/tokenize", json=ask, headers=job.headers,
                                              timeout=self.config.poll_timeout_s)
                if resp.status_code == 200:
                    data = resp.json()
                    prompt_tokens = int(data["count"])
                    if data.get("predicted_output_tokens") is not None:
                        output = int(data["predicted_output_tokens"])
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                logger.debug("%s/tokenize: no prediction (%s)", inst.url, describe(e))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(limit, int) and limit > 0:
            exact = runs_to_max_tokens(body.get("ignore_eos"), body.get("stop"), body.get("stop_token_ids"))
            output = limit if exact else min(output, limit)
        n = body.get("n", 1)
        return (n if isinstance(n, int) and n > 0 else 1) * (PREFILL_TOKEN_COST * prompt_tokens + output)

    # --- answers ---------------------------------------------------------------------------
    async def generate(self, job: Job) -> Response:
        """A non-streaming answer."""
        if self.queue is not None:
            await self._wait_turn(job)
        try:
            _, resp = await self._attempts(self.config.generating_role, job, lambda i: self._post(i, job, job.body))
        finally:
            if self.queue is not None:
                self.queue.release()
        return Relay.of(resp).response()

    async def open_stream(self, job: Job) -> OpenStream:
        """A stream whose first event has arrived; the caller must ``close`` it."""
        if self.queue is not None:
            await self._wait_turn(job)
        try:
            _, stream = await self._attempts(self.config.generating_role, job,
                                             lambda i: self._open(i, job, job.body), keep=True)
        except BaseException:
            if self.queue is not None:
                self.queue.release()
            raise
        if self.queue is not None:
            stream.on_close = self.queue.release
        return stream

    async def events(self, stream: OpenStream) -> AsyncIterator[str]:
        """The upstream events as they come; a failure (or an end without [DONE]) becomes an
        OpenAI error event and [DONE]."""
        yield stream.first + "\n\n"
        done = stream.first == "data: [DONE]"
        problem = "the instance closed the stream early"
        try:
            async for line in stream.lines:
                if line:
                    yield line + "\n\n"
                    done = line == "data: [DONE]"
        except httpx.HTTPError as e:
            problem = f"the instance failed mid-stream ({describe(e)})"
        if not done:
            self.metrics.stream_errors.inc()
            logger.warning("%s: %s", stream.instance.url, problem)
            yield "data: " + json.dumps(error_body(problem, "server_error", "upstream_error")) + "\n\n" + SSE_DONE

    async def get(self, job: Job) -> Response:
        """A GET (``/v1/models``) answered by any healthy generating instance."""
        async def attempt(inst: Instance) -> httpx.Response:
            try:
                resp = await self.client.get(inst.url + job.path, headers=job.headers, timeout=self.timeout)
            except httpx.HTTPError as e:
                raise UpstreamFailure(describe(e), down=not isinstance(e, httpx.TimeoutException)) from None
            if resp.status_code >= 500:
                raise UpstreamFailure(f"answered {resp.status_code}", down=False)
            return resp

        _, resp = await self._attempts(self.config.generating_role, job, attempt)
        return Relay.of(resp).response()
