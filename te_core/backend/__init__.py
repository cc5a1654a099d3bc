"""The backend registry: discovery, selection, capabilities, and per-op dispatch.

See te_core.backend.registry for the selection rule, te_core.backend.hookspecs for what a
plugin implements, and te_core.ops for the op contract.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import devices
from .dispatch import BackendFallbackWarning, resolution
from .hookspecs import ENTRY_POINT_GROUP, hookimpl
from .plugin import Backend, BackendError, BrokenPlugin
from .registry import REGISTRY
from .types import API_VERSION, BackendInfo, Capabilities, OpImpl

__all__ = [
    "API_VERSION", "Backend", "BackendError", "BackendFallbackWarning", "BackendInfo", "BrokenPlugin",
    "Capabilities", "ENTRY_POINT_GROUP", "OpImpl", "broken_plugins", "declares", "get_backend", "hookimpl",
    "is_fp8_available", "list_backends", "require_device", "reset", "selection_reason", "set_backend", "traces",
]


def get_backend(name: Optional[str] = None) -> Backend:
    """The selected backend, or the usable backend called `name` (BackendError if it is not)."""
    if name is None:
        return REGISTRY.selection().backend
    return REGISTRY.get(name)


def declares(op_name: str) -> bool:
    """Whether the selected backend implements `op_name` itself (it may still decline a call).
    Callers with a composite of other ops at hand use it to pick the fused op only where it
    is native, rather than take the reference's on an accelerator."""
    from ..ops import CONTRACT

    return resolution(CONTRACT[op_name]).fn is not None


def traces(op_name: str) -> bool:
    """Whether the selected backend gives `op_name` a twin that torch.compile traces in its place
    (it may still decline a call, which then records the opaque op). Callers that avoid a fused
    op under torch.compile because an opaque op there costs more than the composite use it to
    pick the fused op where it is traced."""
    from ..ops import CONTRACT

    return resolution(CONTRACT[op_name]).traced is not None


def require_device(device) -> torch.device:
    """`device` as a torch.device, or a RuntimeError when this torch build cannot use it, naming
    the device types the installed backends make usable here."""
    return devices.require(device, REGISTRY.backends().values())


def set_backend(name: str) -> Backend:
    """Select a backend from code, like TE_BACKEND=name ("auto" allowed)."""
    return REGISTRY.select(name)


def selection_reason() -> str:
    return REGISTRY.selection().why


def list_backends() -> List[Backend]:
    return list(REGISTRY.backends().values())


def broken_plugins() -> List[BrokenPlugin]:
    return REGISTRY.broken()


def reset() -> None:
    """Forget discovered plugins and the selection; the next use discovers and selects anew."""
    REGISTRY.reset()


_FP8_ANSWER: list = [None, (False, "")]  # [registry generation it was given at, answer]


def is_fp8_available() -> Tuple[bool, str]:
    """(True, "") when the selected backend runs E4M3 on its device, else (False, reason).
    Asked again only after the selection changed: te_core.autocast asks on every entry."""
    if _FP8_ANSWER[0] != REGISTRY.generation:
        reason = get_backend().capabilities.check_fp8_name("E4M3")
        _FP8_ANSWER[:] = [REGISTRY.generation, ((reason is None), (reason or ""))]  # generation after selecting
    return _FP8_ANSWER[1]
