"""A fake torch_musa for CPU-only machines: just enough of torch.musa's API (the calls this
backend makes) to drive availability, capabilities and supports() decisions. Nothing here
runs a MUSA kernel."""
from __future__ import annotations

import os
import sys
import types

# te_triton's kernels run on the CPU only through Triton's interpreter, read when triton loads.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from te_backend_musa import runtime

DEVICE_NAMES = {(2, 1): "MTT S80", (2, 2): "MTT S4000", (3, 1): "MTT S5000"}


def make_fake_musa(arch=(3, 1), count=1, available=True):
    """A stand-in for the torch.musa module with one device architecture."""
    musa = types.SimpleNamespace()
    musa.is_available = lambda: available
    musa.device_count = lambda: count
    musa.current_device = lambda: 0
    musa.get_device_capability = lambda device=None: arch
    musa.get_device_name = lambda device=None: DEVICE_NAMES.get(arch, "MTT test device")
    musa.synchronize = lambda device=None: None
    return musa


@pytest.fixture
def fake_musa(monkeypatch):
    """Install a fake torch_musa + torch.musa; returns a function (arch, count, available)."""

    def install(arch=(3, 1), count=1, available=True):
        module = types.ModuleType("torch_musa")
        module.__version__ = "2.7.1+fake"
        monkeypatch.setitem(sys.modules, "torch_musa", module)
        monkeypatch.setattr(torch, "musa", make_fake_musa(arch, count, available), raising=False)
        monkeypatch.setattr(torch.version, "musa", "4.0.0", raising=False)
        runtime.clear_caches()
        return module

    yield install
    runtime.clear_caches()


@pytest.fixture
def no_torch_musa(monkeypatch):
    """Make `import torch_musa` fail as on a machine without it."""
    monkeypatch.setitem(sys.modules, "torch_musa", None)
    monkeypatch.delattr(torch, "musa", raising=False)
    runtime.clear_caches()
