"""The OpenAI-compatible HTTP server: ``build_app`` and the pieces it wires together."""
from treadle.server.app import build_app

__all__ = ["build_app"]
