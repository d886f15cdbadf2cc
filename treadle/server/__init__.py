"""The OpenAI-compatible HTTP server: ``treadle.server.app.build_app`` and the pieces it wires
together. Nothing is imported here, so that a torch-free user of one of the server's own
torch-free modules (the router's ``treadle.server.connections``) does not load the engine."""
