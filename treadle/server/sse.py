"""Server-sent events: one ``data:`` line per JSON chunk, an in-band error chunk when a
stream fails after its status line was sent, and the closing ``[DONE]``."""
from __future__ import annotations

import json
from typing import Any

from treadle.server.errors import APIError

SSE_DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"  # compact: ~10 % fewer bytes


def sse_error(e: BaseException) -> str:
    """An OpenAI error body as an event (the status line is already 200)."""
    err = e if isinstance(e, APIError) else APIError(500, f"the request failed: {e}", None, "engine_error")
    return sse(err.body())
