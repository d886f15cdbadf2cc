"""The FastAPI app: ``build_app(llm, ...)`` wires state, auth, errors and routes.

Routes: /v1/completions, /v1/chat/completions (completions.py, chat.py) and, here,
/v1/models, /health, /metrics, /version, /tokenize, /detokenize. ``llm`` is any
EngineClient: the engine-core process client (``treadle serve``) or the in-thread
AsyncLLM (``--engine-in-process``, tests).
"""
from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

import treadle
from treadle.engine.client.engine_client import EngineClient
from treadle.server import chat, completions
from treadle.server.body_limit import BodyLimit
from treadle.server.errors import APIError, install_error_handlers
from treadle.server.metrics import ServerMetrics
from treadle.server.openapi import (
    BODY_RESPONSES,
    HEALTH_RESPONSES,
    METRICS_RESPONSES,
    OPEN_PATHS,
    install_openapi,
)
from treadle.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    LoadResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from treadle.server.state import ServerLimits, ServerState, default_max_request_bytes

router = APIRouter()


def build_app(llm: EngineClient, served_model_name: str, api_key: str | None = None,
              limits: ServerLimits | None = None, enable_tokenizer_info: bool = False) -> FastAPI:
    """An app serving ``llm`` as ``served_model_name``. ``api_key``: required as a
    Bearer token on everything but /health, /metrics and /version. ``limits``: what one
    request may ask for (see ServerLimits). ``enable_tokenizer_info``: serve
    GET /tokenizer_info (vLLM's opt-in; otherwise it is a 404)."""
    app = FastAPI(title="Treadle", version=treadle.__version__, docs_url=None, redoc_url=None)
    limits = limits or ServerLimits()
    app.state.treadle = ServerState(
        llm=llm, served_model_name=served_model_name, metrics=ServerMetrics(llm, served_model_name),
        limits=limits, api_key=api_key,
    )
    install_error_handlers(app)
    install_openapi(app, api_key_required=bool(api_key))
    max_bytes = limits.max_request_bytes or default_max_request_bytes(llm.max_model_len)
    app.add_middleware(BodyLimit, max_bytes=max_bytes)
    if api_key:  # added last, so outermost: no body is read for a client without the key
        app.add_middleware(_RequireKey, api_key=api_key)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(router)
    if enable_tokenizer_info:
        app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"], responses={401: BODY_RESPONSES[401]})
    return app


_NO_KEY_PATHS = (*OPEN_PATHS, "/openapi.json")  # probes, and the spec that says how to authenticate


class _RequireKey:
    """Pure ASGI middleware (not BaseHTTPMiddleware, which would sit between streaming
    responses and the client's disconnect): a missing or wrong Bearer key is a 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _NO_KEY_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = APIError(401, "invalid or missing API key (send it as 'Authorization: Bearer <key>')",
                                    None, "invalid_api_key").response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _state(request: Request) -> ServerState:
    return request.app.state.treadle


@router.get("/health", response_model=HealthResponse, responses=HEALTH_RESPONSES)
async def health(request: Request) -> Response:
    state = _state(request)
    problem = "the server is shutting down" if state.draining else state.llm.health()
    if problem is not None:
        return APIError.unavailable(problem, "unhealthy").response()
    return JSONResponse({"status": "ok"})


@router.get("/load", response_model=LoadResponse)
async def load(request: Request) -> dict[str, Any]:
    """A cheap load report for a router (P/D or multi-instance): queued prompt tokens, running
    and waiting sequences, KV usage, this instance's kv_role (null without kv_transfer), the
    predicted output tokens left (null without a length predictor) and its batch slots."""
    llm = _state(request).llm
    snap = llm.snapshot
    return {"waiting_prompt_tokens": snap.num_waiting_prompt_tokens, "running": snap.num_running,
            "waiting": snap.num_waiting, "kv_usage": snap.kv_usage,
            "role": None if snap.kv_transfer is None else snap.kv_transfer["role"],
            "predicted_remaining_tokens": snap.predicted_remaining_tokens, "max_num_seqs": llm.max_num_seqs}


@router.get("/version", response_model=VersionResponse)
async def version() -> dict[str, str]:
    return {"version": treadle.__version__}


@router.get("/metrics", response_class=PlainTextResponse, responses=METRICS_RESPONSES)
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", response_model=ModelList, responses={401: BODY_RESPONSES[401]})
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    card = {"id": state.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "treadle",
            "root": state.served_model_name, "max_model_len": state.llm.max_model_len}
    return {"object": "list", "data": [card]}


@router.post("/tokenize", response_model=TokenizeResponse, responses=BODY_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError.bad_request("give exactly one of prompt and messages", "prompt")
    ids = await asyncio.to_thread(_tokenize, state, body)
    predictor = state.llm.length_predictor
    return {"tokens": ids, "count": len(ids), "max_model_len": state.llm.max_model_len,
            "predicted_output_tokens": None if predictor is None else predictor.predict([ids])[0]}


def _tokenize(state: ServerState, body: TokenizeRequest) -> list[int]:
    """In a worker thread: the chat template and the tokenizer may take a while."""
    tok = state.tokenizer("messages" if body.messages is not None else "prompt")
    if body.messages is not None:
        text, special, param = chat.render_chat(tok, body.messages, body.add_generation_prompt), False, "messages"
    else:
        text, special, param = body.prompt or "", body.add_special_tokens, "prompt"
    if len(text) > state.max_prompt_chars:
        raise APIError(400, f"the text has {len(text)} characters, more than this model's context holds",
                       param, "context_length_exceeded")
    return tok.encode(text, add_special_tokens=special)


async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The tokenizer's description, as vLLM's /tokenizer_info gives it (behind
    --enable-tokenizer-info-endpoint): what a client needs to tokenize as the server does
    (special tokens, the chat template, the context length) without downloading it."""
    state = _state(request)
    tok = state.tokenizer("tokenizer_info")
    eos_ids = list(tok.eos_token_ids)
    return {"tokenizer_class": "PreTrainedTokenizerFast",  # a Hugging Face `tokenizers` backend, as that class
            "bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": None, "unk_token": None,
            "bos_token_id": tok.bos_token_id, "eos_token_id": eos_ids[0] if eos_ids else None,
            "eos_token_ids": eos_ids, "all_special_ids": sorted(tok.all_special_ids),
            "vocab_size": tok.vocab_size, "model_max_length": state.llm.max_model_len,
            "chat_template": tok.chat_template, "served_model_name": state.served_model_name}


@router.post("/detokenize", response_model=DetokenizeResponse, responses=BODY_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.check_model(body.model)
    vocab = state.llm.model_config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError.bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": state.tokenizer("tokens").decode(body.tokens, skip_special_tokens=False)}
