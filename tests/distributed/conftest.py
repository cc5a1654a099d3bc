"""Multi-process tests: one pool of 4 gloo CPU processes per test file (see _pool.py); tests
with 2 tensor-parallel ranks run on the pair of ranks 0 and 1."""
from __future__ import annotations

import pytest

from te_core import backend

from ._pool import pool_of


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    for var in ("TE_BACKEND", "TE_BACKEND_STRICT", "TE_BACKEND_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    backend.set_backend("reference")


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(4)
