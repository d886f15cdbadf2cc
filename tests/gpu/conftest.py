"""The GPU-path tests run Triton's kernels in its interpreter on the CPU (CI has no GPU).
TRITON_INTERPRET must be set before triton is first imported, which a conftest does before its
folder's test modules are imported; every test here is marked ``gpu``."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.gpu)
