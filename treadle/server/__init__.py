"""The OpenAI-compatible HTTP server: ``build_app`` and the pieces it wires together.

``build_app`` is imported lazily, so that a torch-free user of one of the server's own
torch-free modules (the router's ``treadle.server.connections``) does not load the engine."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from treadle.server.app import build_app

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from treadle.server.app import build_app

        return build_app
    raise AttributeError(f"module 'treadle.server' has no attribute {name!r}")
