"""The module tests run on the reference backend (CPU), whatever TE_BACKEND says: with a GPU
backend selected, modules would put their parameters on its device while the tests feed CPU
inputs. The modules on the GPU are covered by backends/cuda/tests and the conformance kit."""
from __future__ import annotations

import pytest

from te_core import backend


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    for var in ("TE_BACKEND", "TE_BACKEND_STRICT", "TE_BACKEND_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    backend.set_backend("reference")
