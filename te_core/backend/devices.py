"""Whether this torch build can use a device.

The registry asks it before trusting a backend that claims to be available, and modules ask it
for a device they are given (by allocating on it), so that a device torch lacks (or was not built with) is a clear
error naming what is usable here rather than an assertion deep inside torch.
"""
from __future__ import annotations

from typing import Iterable, Optional, Set, Union

import torch

_USABLE: Set[str] = set()  # devices that held a tensor once: the check is not repeated


def probe(device: Union[str, torch.device]) -> Optional[str]:
    """None when torch can allocate on `device`, else what torch said."""
    key = str(device)
    if key in _USABLE:
        return None
    try:
        torch.empty(1, device=device)
    except Exception as exc:  # whatever torch raises (AssertionError, RuntimeError) is the reason
        return f"{type(exc).__name__}: {exc}".strip()
    _USABLE.add(key)
    return None


def backend_device_problem(device: torch.device) -> Optional[str]:
    """None when `device` is usable for a backend that claims it, else why not.

    Where torch has a device module for the type, its answer (is_available, device_count) is
    taken: it creates no device context, whereas an allocation would create one on the current
    device before a distributed script has chosen its device. Other types are probed."""
    try:
        module = torch.get_device_module(device.type)
    except (RuntimeError, AttributeError):  # no torch module for this type: allocate
        return probe(device)
    available = getattr(module, "is_available", None)
    if not callable(available):
        return probe(device)
    try:
        if not available():
            return f"torch.{device.type}.is_available() is False in this torch build"
        count = module.device_count() if callable(getattr(module, "device_count", None)) else None
    except Exception as exc:  # torch's own error is the reason
        return f"{type(exc).__name__}: {exc}".strip()
    if count is not None and device.index is not None and device.index >= count:
        return f"torch.{device.type} has {count} device(s), so index {device.index} does not exist"
    return None


def require(device: Union[str, torch.device], backends: Iterable) -> torch.device:
    """`device` as a torch.device, or a RuntimeError saying it is unusable and what is usable.

    `backends`: the installed backends, for the list of device types that are available here."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise RuntimeError(f"device={device!r} is not a torch device ({exc})") from None
    reason = probe(parsed)
    if reason is None:
        return parsed
    usable = {}
    for backend in backends:
        if backend.available:
            usable.setdefault(backend.device_type, []).append(backend.name)
    listing = "; ".join(f"{kind} (backends: {', '.join(names)})" for kind, names in sorted(usable.items()))
    raise RuntimeError(
        f"device={device!r} is not available in this torch build (torch {torch.__version__}): {reason}. "
        f"Device types usable here: {listing or 'cpu'}. Pass one of them, or leave device=None to use the "
        f"selected backend's device"
    ) from None
