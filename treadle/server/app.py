"""The FastAPI app: ``build_app(llm, ...)`` wires state, auth, errors and routes.

Routes: /v1/completions, /v1/chat/completions (completions.py, chat.py) and, here,
/v1/models, /health, /metrics, /version, /tokenize, /detokenize. ``llm`` is any
EngineClient: the engine-core process client (``treadle serve``) or the in-thread
AsyncLLM (``--engine-in-process``, tests).
"""
from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

import treadle
from treadle.engine.engine_client import EngineClient
from treadle.server import chat, completions
from treadle.server.errors import APIError, install_error_handlers
from treadle.server.metrics import ServerMetrics
from treadle.server.protocol import DetokenizeRequest, TokenizeRequest
from treadle.server.state import ServerState, now

router = APIRouter()
_OPEN_PATHS = ("/health", "/metrics", "/version")  # reachable without the API key


def build_app(llm: EngineClient, served_model_name: str, api_key: str | None = None,
              max_waiting: int | None = None) -> FastAPI:
    """An app serving ``llm`` as ``served_model_name``. ``api_key``: required as a
    Bearer token on everything but /health, /metrics and /version. ``max_waiting``:
    new requests get 503 (Retry-After) while this many sequences wait."""
    app = FastAPI(title="Treadle", version=treadle.__version__, docs_url=None, redoc_url=None)
    app.state.treadle = ServerState(
        llm=llm, served_model_name=served_model_name, metrics=ServerMetrics(llm, served_model_name),
        api_key=api_key, max_waiting=max_waiting,
    )
    install_error_handlers(app)
    if api_key:
        app.add_middleware(_RequireKey, api_key=api_key)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(router)
    return app


class _RequireKey:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which would sit between streaming
    responses and the client's disconnect): a missing or wrong Bearer key is a 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = APIError(401, "invalid or missing API key (send it as 'Authorization: Bearer <key>')",
                                    None, "invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _state(request: Request) -> ServerState:
    return request.app.state.treadle


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    problem = "the server is shutting down" if state.draining else state.llm.health()
    if problem is not None:
        return APIError.unavailable(problem, "unhealthy").response()
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": treadle.__version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    card = {"id": state.served_model_name, "object": "model", "created": now(), "owned_by": "treadle",
            "root": state.served_model_name, "max_model_len": state.llm.max_model_len}
    return {"object": "list", "data": [card]}


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(body.model)
    tok = state.llm.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError.bad_request("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:
        ids = chat.chat_prompt(tok, body.messages, body.add_generation_prompt)["prompt_token_ids"]
    else:
        ids = tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": state.llm.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(body.model)
    vocab = state.llm.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError.bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": state.llm.tokenizer.decode(body.tokens, skip_special_tokens=False)}

