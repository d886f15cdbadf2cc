"""The router's FastAPI app: /v1/completions and /v1/chat/completions (streamed or not),
/v1/models, and its own /health and /metrics. Bad input that the router must read itself
(a body that is not a JSON object) is a 400 with an OpenAI error body; everything else is
checked by the instances, whose 4xx answers reach the client as they are."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

import treadle
from treadle.asgi.disconnect import until_disconnect
from treadle.router.config import Role, RouterConfig
from treadle.router.forward import Forwarder
from treadle.router.instances import FailurePolicy, Instance, InstancePool
from treadle.router.metrics import RouterMetrics
from treadle.router.upstream import Job, OpenStream, Relay, error_body

_PASSED_HEADERS = ("authorization",)
MAX_BODY_BYTES = 64 << 20  # the instances apply their own (smaller) limits; this one guards the router


def build_app(config: RouterConfig) -> FastAPI:
    """The router for ``config``'s instances; polling starts with the app (its lifespan)."""
    policy = FailurePolicy(config.max_failures, config.retry_backoff_s)
    pool = InstancePool([Instance(url, role, policy) for url, role in config.instances()], config.poll_interval_s,
                        config.poll_timeout_s)
    metrics = RouterMetrics(pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        zmq_ctx = zmq.Context()
        async with httpx.AsyncClient(limits=limits) as client, httpx.AsyncClient() as poll_client:
            app.state.forwarder = Forwarder(config, pool, metrics, client, zmq_ctx)
            await pool.poll_all(poll_client)
            poller = asyncio.create_task(pool.run(poll_client))
            try:
                yield
            finally:
                poller.cancel()
                await asyncio.gather(poller, return_exceptions=True)
                zmq_ctx.destroy(linger=0)

    app = FastAPI(title="Treadle router", version=treadle.__version__, docs_url=None, redoc_url=None,
                  lifespan=lifespan)
    app.state.pool, app.state.metrics = pool, metrics
    app.add_exception_handler(Relay, _relay)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    app.add_api_route("/v1/completions", _completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", _chat, methods=["POST"])
    app.add_api_route("/v1/models", _models, methods=["GET"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    return app


async def _relay(_: Request, exc: Relay) -> Response:
    return exc.response()


async def _unexpected(_: Request, exc: Exception) -> Response:
    return JSONResponse(error_body(f"internal error in the router: {exc!r}", "server_error", "internal_error"), 500)


async def _completions(request: Request) -> Response:
    return await _generate(request, "/v1/completions")


async def _chat(request: Request) -> Response:
    return await _generate(request, "/v1/chat/completions")


async def _models(request: Request) -> Response:
    return await request.app.state.forwarder.get(Job("/v1/models", {}, _headers(request)))


async def _health(request: Request) -> Response:
    pool: InstancePool = request.app.state.pool
    roles = {i.role for i in pool.instances}
    missing = sorted(r.value for r in roles if all(i.out for i in pool.by_role(r)))  # backing off still counts
    # P/D without a prefill instance still answers (decode instances compute prompts), if slower
    if missing and missing != [Role.PREFILL.value]:
        body = error_body(f"every {' and '.join(missing)} instance is out of rotation", "service_unavailable_error",
                          "unhealthy")
        return JSONResponse(body, 503, headers={"Retry-After": "1"})
    return JSONResponse({"status": "ok", "instances": {i.url: {"role": i.role.value, "healthy": i.healthy,
                                                               "failures": i.failures, "problem": i.problem}
                                                       for i in pool.instances}})


async def _metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _headers(request: Request) -> dict[str, str]:
    return {k: request.headers[k] for k in _PASSED_HEADERS if k in request.headers}


async def _json_body(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise Relay.error(413, f"the request body is larger than the router's limit ({MAX_BODY_BYTES} bytes)",
                          "invalid_request_error", "request_too_large")
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Relay.error(400, f"request body is not valid JSON: {e}", "invalid_request_error", "invalid_json") \
            from None
    if not isinstance(body, dict):
        raise Relay.error(400, "the request body must be a JSON object", "invalid_request_error", "invalid_body")
    return body


async def _generate(request: Request, path: str) -> Response:
    forwarder: Forwarder = request.app.state.forwarder
    job = Job(path, await _json_body(request), _headers(request))
    if job.body.get("stream") is True:
        stream = await until_disconnect(request, _start_stream(forwarder, job), _client_gone)
        return StreamingResponse(_stream_events(forwarder, stream), media_type="text/event-stream",
                                 background=BackgroundTask(stream.close))
    return await until_disconnect(request, _answer(forwarder, job), _client_gone)


async def _with_kv(forwarder: Forwarder, job: Job) -> Job:
    """P/D: the job for the decode step (with the producer's kv_transfer_params)."""
    if not forwarder.config.disaggregated:
        return job
    if job.body.get("echo") and job.body.get("logprobs") is not None or job.body.get("prompt_logprobs") is not None:
        return job  # the prompt's own logprobs: computed where they are answered, not loaded as KV
    params = await forwarder.prefill(job)
    return job if params is None else Job(job.path, {**job.body, "kv_transfer_params": params}, job.headers)


async def _answer(forwarder: Forwarder, job: Job) -> Response:
    job = await _with_kv(forwarder, job)
    try:
        resp = await forwarder.generate(job)
    except BaseException:  # the client left, or no decode instance answered: nobody will pull
        forwarder.release_kv(job)
        raise
    if resp.status_code != 200:
        forwarder.release_kv(job)
    return resp


async def _start_stream(forwarder: Forwarder, job: Job) -> OpenStream:
    job = await _with_kv(forwarder, job)
    try:
        return await forwarder.open_stream(job)
    except BaseException:  # the client left before the first event, or no decode instance took it
        forwarder.release_kv(job)
        raise


async def _stream_events(forwarder: Forwarder, stream: OpenStream) -> AsyncIterator[str]:
    try:
        async for event in forwarder.events(stream):
            yield event
            # Events already read from upstream come back to back without a suspension; once a
            # write to a client that left fails, the loop must run to mark it disconnected, or
            # every following write logs asyncio's "socket.send() raised exception".
            await asyncio.sleep(0)
    finally:
        await stream.close()


def _client_gone() -> Exception:
    return Relay.error(499, "client closed the connection", "invalid_request_error", "client_disconnected")
