"""Shared fixtures of the quantization tests: seeded inputs and a clean autocast/backend state."""
from __future__ import annotations

import pytest
import torch

from te_core import backend


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    """Every test here runs on the reference backend (CPU), whatever TE_BACKEND says."""
    for var in ("TE_BACKEND", "TE_BACKEND_STRICT", "TE_BACKEND_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    backend.set_backend("reference")
    yield


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20261130)


def randn(gen, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)
