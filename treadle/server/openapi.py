"""The OpenAPI document, made to match what the server does: every error is the OpenAI
error body with the status the server really sends (400, never FastAPI's 422), Bearer
auth is declared, streams are text/event-stream and /metrics is text/plain."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from treadle.server.protocol import ErrorResponse

OPEN_PATHS = ("/health", "/metrics", "/version", "/load")  # reachable without the API key


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


_BAD_REQUEST = _error("Invalid request (OpenAI error body; `param` names the field)")
_UNAUTHORIZED = _error("Missing or wrong API key (only when the server has one)")
_NOT_FOUND = _error("Unknown model")
_TOO_LARGE = _error("Request body larger than the server's limit")
_UNAVAILABLE = _error("Overloaded, draining, or engine unhealthy; retry after Retry-After seconds")

_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"event": {"type": "string"},
                             "data": {"type": "string", "description": "a JSON chunk, an error body, or [DONE]"}}}
BODY_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _BAD_REQUEST, 401: _UNAUTHORIZED, 404: _NOT_FOUND, 413: _TOO_LARGE,
}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The whole response (JSON), or with `stream: true` server-sent events of chunks "
                         "ending with `data: [DONE]`",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
    **BODY_RESPONSES,
    500: _error("The engine failed while running this request"),
    503: _UNAVAILABLE,
}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {503: _error("Draining, or the engine is dead or stuck")}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition format",
          "content": {"text/plain": {"schema": {"type": "string"}}}},
}


def install_openapi(app: FastAPI, api_key_required: bool) -> None:
    """Replace ``app.openapi`` with a builder that drops FastAPI's 422 validation responses
    and declares the Bearer scheme (required when ``api_key_required``)."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _drop_validation_errors(schema)
            _declare_security(schema, api_key_required)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]


def _drop_validation_errors(schema: dict[str, Any]) -> None:
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    schemas = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def _declare_security(schema: dict[str, Any], required: bool) -> None:
    components = schema.setdefault("components", {})
    components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
    schema["security"] = [{"bearerAuth": []}] if required else [{"bearerAuth": []}, {}]
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            if path in OPEN_PATHS:
                operation["security"] = []
            elif not required:
                operation.get("responses", {}).pop("401", None)
