"""The compatibility tests run on the reference backend (CPU), whatever TE_BACKEND says."""
from __future__ import annotations

import importlib.util
import sys

import pytest

import te_core
from te_core import backend
from te_core.compat.transformer_engine import uninstall_transformer_engine


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    for var in ("TE_BACKEND", "TE_BACKEND_STRICT", "TE_BACKEND_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    backend.set_backend("reference")


@pytest.fixture
def stand_in():
    """te-core installed as `transformer_engine` for the test (skipped where a real one is installed)."""
    if "transformer_engine" not in sys.modules and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("a real transformer_engine is installed here")
    uninstall_transformer_engine()
    yield te_core.install_as_transformer_engine()
    uninstall_transformer_engine()
