"""Shared fixtures (tiny random checkpoints: tiny_models.py; one thread; 16-bit activations), and
one TLS context for every httpx client the tests make."""
from __future__ import annotations

import functools
import ssl
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import make_tiny_model


def _one_default_ssl_context() -> None:
    """Every httpx client (``httpx.get``/``post``/``stream`` each make one, and so does every
    ``openai.OpenAI``) built its own verifying TLS context, loading the whole CA bundle: ~45 ms of
    CPU for each plain-HTTP request to 127.0.0.1 the tests send (a server polled every 20 ms
    kept a core busy). The default context is now made once and shared, as an SSLContext may be;
    other ``verify`` or ``cert`` values are made as before. The tests talk to no HTTPS server."""
    try:  # httpx's private module: another httpx layout leaves it be (slower, the same requests)
        import httpx._transports.default as httpx_transport
    except ImportError:
        return
    make = getattr(httpx_transport, "create_ssl_context", None)
    if make is None:  # another httpx layout: leave it be (slower, the same requests)
        return
    made: dict[bool, ssl.SSLContext] = {}

    @functools.wraps(make)
    def shared(verify: ssl.SSLContext | str | bool = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in made:
            made[trust_env] = make(verify=True, cert=None, trust_env=trust_env)
        return made[trust_env]

    httpx_transport.create_ssl_context = shared


_one_default_ssl_context()


@pytest.fixture
def sixteen_bit_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF kernels with 16-bit activations (``TREADLE_ACTIVATION_BITS=16``), for tests whose
    oracle is the dequantized weights times 16-bit-rounded activations (the default; pinned so
    that ``TREADLE_ACTIVATION_BITS=8`` in the environment, which trades accuracy for speed, cannot
    change them: tests/test_q8_activations.py, test_quantized_models.py)."""
    monkeypatch.setenv("TREADLE_ACTIVATION_BITS", "16")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: tiny models run faster on one, and on a shared 2-core machine
    OpenMP workers spinning against other processes cost far more than the second core
    gains. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
