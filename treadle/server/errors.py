"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through ``APIError``; the handlers below
turn FastAPI's validation errors (422 by default) and Starlette's HTTP errors
into the same body, and make sure nothing unexpected leaves as a bare 500.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle.config import EngineDeadError, InvalidRequestError, QueueFullError, TreadleError

logger = logging.getLogger("treadle")

RETRY_AFTER_S = 1

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @staticmethod
    def bad_request(message: str, param: str | None = None) -> APIError:
        return APIError(400, message, param, "invalid_value" if param else None)

    @staticmethod
    def unavailable(message: str, code: str) -> APIError:
        return APIError(503, message, None, code, {"Retry-After": str(RETRY_AFTER_S)})


def engine_error(e: TreadleError) -> APIError:
    """Map an error from admitting or running a request to its HTTP answer."""
    if isinstance(e, QueueFullError):
        return APIError.unavailable(f"the server is overloaded: {e}", "queue_full")
    if isinstance(e, EngineDeadError):
        return APIError.unavailable(str(e), "engine_dead")
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), e.param, e.code)
    return APIError.bad_request(str(e))


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError.bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('msg', '')}", None, "invalid_json")
    param = _param_path(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"{param}: this field is not supported by this server (see docs/serving.md)",
                        param, "unsupported_field")
    message = f"{param or 'request body'}: {first.get('msg', 'invalid value')}"
    return APIError(400, message, param, "invalid_type" if param else "invalid_body")


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "body"}


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content'. Union members
    appear in ``loc`` as type tags ('str', 'list[int]', 'TextPart'); they are dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS and not part[0].isupper():
            path += f".{part}" if path else part
    return path or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and str(exc.detail).startswith("There was an error parsing the body"):
            # FastAPI's answer to a body json cannot decode (not UTF-8, nested too deeply)
            return APIError(400, "request body is not valid JSON (UTF-8 text, not nested too deeply)", None,
                            "invalid_json").response()
        return APIError(exc.status_code, str(exc.detail), None, None, dict(exc.headers or {})).response()

    @app.exception_handler(TreadleError)
    async def _treadle(_: Request, exc: TreadleError) -> JSONResponse:
        return engine_error(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in a request")
        return APIError(500, f"internal error: {exc!r}", None, "internal_error").response()
