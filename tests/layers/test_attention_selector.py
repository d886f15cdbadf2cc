"""Backend selection by name and device."""
from __future__ import annotations

import pytest
import torch

from treadle.config import TreadleError
from treadle.layers.attention import ReferenceBackend
from treadle.layers.attention.selector import BACKEND_NAMES, resolve_backend_name, select_backend


def test_auto_resolves_by_device() -> None:
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert resolve_backend_name("auto", torch.device("cuda", 0)) == "triton"  # triton is a test dependency
    assert resolve_backend_name("reference", "cuda") == "reference"


def test_backends_are_built_by_name() -> None:
    assert isinstance(select_backend("reference", "cpu"), ReferenceBackend)
    assert select_backend("cpu", "cpu").name == "cpu"
    assert select_backend("auto", "cpu").name == "cpu"


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(TreadleError) as err:
        select_backend("flash", "cpu")
    for name in BACKEND_NAMES:
        assert name in str(err.value)
