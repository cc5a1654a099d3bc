"""A CPU backend for the twin tests: the reference ops run eagerly, the given twins while
torch.compile traces, so that a compiled module takes the twins without a GPU."""
import contextlib
import types

import torch

from te_core import backend
from te_core.backend import hookimpl, registry
from te_core.backend.types import BackendInfo, OpImpl
from te_core.reference import plugin as ref_plugin


@contextlib.contextmanager
def cpu_backend_with(monkeypatch, name, twins):
    """Select backend `name` (the reference's ops, `twins`: op name -> twin) for the block."""
    for var in ("TE_BACKEND", "TE_BACKEND_STRICT", "TE_BACKEND_OVERRIDES", "TE_BACKEND_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    ops = {op: OpImpl(fn, None, twins.get(op)) for op, fn in ref_plugin.implementations().items()}
    plugin = types.SimpleNamespace(
        te_backend_info=hookimpl(lambda: BackendInfo(name=name, device_type="cpu")),
        te_backend_available=hookimpl(lambda: (True, "the CPU")),
        te_backend_capabilities=hookimpl(lambda device: ref_plugin.te_backend_capabilities(device)),
        te_backend_ops=hookimpl(lambda: ops))
    entry_point = types.SimpleNamespace(name=name, dist=None, load=lambda: plugin)
    monkeypatch.setattr(registry, "_entry_points", lambda: [entry_point])
    registry.REGISTRY.reset()
    backend.set_backend(name)
    torch._dynamo.reset()
    try:
        yield
    finally:
        monkeypatch.undo()
        registry.REGISTRY.reset()
        torch._dynamo.reset()
