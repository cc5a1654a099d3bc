"""The compatibility tests run on the reference backend (CPU), whatever TE_BACKEND says."""
from __future__ import annotations

import pytest

from te_core import backend


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    for var in ("TE_BACKEND", "TE_BACKEND_STRICT", "TE_BACKEND_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    backend.set_backend("reference")
