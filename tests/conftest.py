"""Shared fixtures (tiny random checkpoints: tiny_models.py; one thread; 16-bit activations)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model


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
