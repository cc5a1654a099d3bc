"""Fake plugins for registry tests, fed to the registry in place of installed entry points."""
from __future__ import annotations

import types

import pytest
import torch

from te_core.backend import hookimpl, registry
from te_core.backend.types import API_VERSION, BackendInfo, Capabilities, OpImpl


class FakeDist:
    def __init__(self, name: str, version: str = "9.9"):
        self.metadata = {"Name": name}
        self.version = version


class FakeEntryPoint:
    def __init__(self, name: str, plugin=None, dist: str = "te-backend-fake", error: Exception = None):
        self.name, self._plugin, self.dist, self._error = name, plugin, FakeDist(dist), error

    def load(self):
        if self._error is not None:
            raise self._error
        return self._plugin


class FakeDeviceModule:
    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def synchronize():
        return None


def make_plugin(name="fake", device_type="meta", available=(True, "fake device found"), ops=None,
                caps=None, api_version=API_VERSION, **extra_hooks):
    """A plugin object: a namespace of hookimpl-marked functions."""

    @hookimpl
    def te_backend_info():
        return BackendInfo(name=name, device_type=device_type, api_version=api_version)

    @hookimpl
    def te_backend_available():
        return available

    @hookimpl
    def te_backend_ops():
        return dict(ops or {})

    @hookimpl
    def te_backend_capabilities(device):
        return caps if caps is not None else Capabilities(
            fp8_formats={"E4M3": 448.0, "E5M2": 57344.0}, scaling_modes=frozenset({"tensorwise"}),
            arch="fake_1", device_name="Fake")

    @hookimpl
    def te_backend_device_module():
        return FakeDeviceModule

    hooks = dict(te_backend_info=te_backend_info, te_backend_available=te_backend_available,
                 te_backend_ops=te_backend_ops, te_backend_capabilities=te_backend_capabilities,
                 te_backend_device_module=te_backend_device_module)
    hooks.update(extra_hooks)
    return types.SimpleNamespace(**{k: v for k, v in hooks.items() if v is not None})


@pytest.fixture
def plugins(monkeypatch):
    """Install fake entry points: plugins([FakeEntryPoint(...), ...]); the registry is reset."""
    for var in ("TE_BACKEND", "TE_BACKEND_STRICT", "TE_BACKEND_OVERRIDES", "TE_BACKEND_PLUGINS"):
        monkeypatch.delenv(var, raising=False)

    def install(entry_points):
        monkeypatch.setattr(registry, "_entry_points", lambda: list(entry_points))
        registry.REGISTRY.reset()

    yield install
    monkeypatch.undo()
    registry.REGISTRY.reset()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


__all__ = ["FakeEntryPoint", "make_plugin", "OpImpl"]
