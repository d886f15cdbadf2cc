"""ASGI plumbing that the OpenAI server (``server/``) and the router (``router/``) share:
torch-free, engine-free, beneath both."""
