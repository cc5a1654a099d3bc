"""The module tests run once per backend: on the reference backend with CPU tensors, and on every
installed accelerator backend (te-backend-cuda, te-backend-musa, ...) with tensors on its device.
An accelerator backend that is installed but not available here is skipped with the registry's
reason; `-k cuda` (the backend's name) picks one backend's runs.

On an accelerator the device becomes torch's default device for the test, so the tensors a test
creates land where the backend puts the modules' parameters; the plain-PyTorch twins and float64
computations the tests compare against run on that device too, outside te-core. A test whose
subject exists only on the CPU is marked `reference_only` and runs on the reference backend alone.
"""
from __future__ import annotations

from typing import List

import pytest
import torch

from te_core import backend

REFERENCE = "reference"


def pytest_configure(config):
    config.addinivalue_line("markers", "reference_only: run on the reference backend (CPU) only")


def _backend_names() -> List[str]:
    """The reference backend, then each installed backend that runs on an accelerator."""
    accelerators = sorted(b.name for b in backend.list_backends() if b.device_type != "cpu")
    return [REFERENCE, *accelerators]


def pytest_generate_tests(metafunc):
    if "module_backend" not in metafunc.fixturenames:
        return
    names = [REFERENCE] if metafunc.definition.get_closest_marker("reference_only") else _backend_names()
    metafunc.parametrize("module_backend", names, indirect=True)


@pytest.fixture(autouse=True)
def module_backend(request, monkeypatch):
    """Select the backend under test (whatever TE_BACKEND says) and put new tensors on its device."""
    for var in ("TE_BACKEND", "TE_BACKEND_STRICT", "TE_BACKEND_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    name = getattr(request, "param", REFERENCE)
    candidate = backend.get_backend(REFERENCE) if name == REFERENCE else _installed(name)
    if not candidate.available:
        pytest.skip(f"backend {name!r} is installed but not available here: {candidate.reason}")
    selected = backend.set_backend(name)
    if selected.device_type == "cpu":
        yield selected
        return
    previous = torch.get_default_device()
    torch.set_default_device(selected.device)
    try:
        yield selected
    finally:
        torch.set_default_device(previous)
        backend.set_backend(REFERENCE)


def _installed(name: str) -> backend.Backend:
    for candidate in backend.list_backends():
        if candidate.name == name:
            return candidate
    raise LookupError(f"backend {name!r} was installed at collection and is gone now")
