"""Lazy access to torch_musa: importing it, asking what is installed, and device architecture.

Nothing here imports torch_musa at module import time: te-core loads every installed
backend plugin on every machine, and most machines have no MUSA stack. Each function says
why it cannot answer rather than raising, so availability can report the reason.
"""
from __future__ import annotations

import functools
import sys
from importlib import metadata
from typing import Any, Optional, Tuple

import torch

INSTALL_HINT = (
    "install Moore Threads' torch_musa wheel that matches your torch build (torch_musa 2.7.x pairs "
    "with torch 2.7.1; it ships with the MUSA SDK / Moore Threads' GitHub releases, not PyPI), "
    "then check `python -c 'import torch_musa; print(torch.musa.is_available())'`"
)

Arch = Tuple[int, int]


def import_torch_musa() -> Tuple[Optional[Any], str]:
    """(module, "") once torch_musa imports, else (None, why not)."""
    try:
        import torch_musa  # noqa: F401  (registers the "musa" device and torch.musa)
    except ImportError as exc:
        return None, f"torch_musa is not installed ({exc}); {INSTALL_HINT}"
    except Exception as exc:  # a broken install (torch mismatch, missing driver libs) is a reason, not a crash
        return None, f"torch_musa failed to import: {type(exc).__name__}: {exc}; {INSTALL_HINT}"
    if getattr(torch, "musa", None) is None:
        return None, "torch_musa imported but did not install torch.musa; reinstall torch_musa for this torch build"
    return sys.modules["torch_musa"], ""


def device_module() -> Any:
    """torch.musa: streams, events, RNG, synchronize, memory (torch_musa/core/*.py)."""
    return torch.musa


def installed_version(*names: str) -> Optional[str]:
    """Version of the first installed distribution among `names`, without importing it."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def vendor_versions() -> dict:
    """Library versions for BackendInfo, reading only what is already loaded or on disk."""
    versions = {
        "torch": torch.__version__,
        "torch_musa": installed_version("torch_musa", "torch-musa"),
        "musa": getattr(torch.version, "musa", None),  # set by torch_musa on import
        "mudnn": None,
    }
    if "torch_musa" in sys.modules:  # torch >= 2.1 autoloads it via the torch.backends entry point
        mudnn = getattr(torch.backends, "mudnn", None)
        version = getattr(mudnn, "version", None)
        versions["mudnn"] = str(version()) if callable(version) else None
    return versions


def device_index(device: Optional[torch.device]) -> int:
    """The MUSA device index `device` means (its index, else the current device)."""
    if device is not None and device.type == "musa" and device.index is not None:
        return device.index
    return torch.musa.current_device()


@functools.lru_cache(maxsize=None)
def _arch_of_index(index: int) -> Arch:
    major, minor = torch.musa.get_device_capability(index)
    return int(major), int(minor)


def arch_of(device: Optional[torch.device]) -> Arch:
    """(major, minor) of a MUSA device: (2, 1) S80/S3000, (2, 2) S4000, (3, 1) S5000."""
    return _arch_of_index(device_index(device))


def clear_caches() -> None:
    """Forget cached device facts (tests swap fake devices; real devices never change)."""
    _arch_of_index.cache_clear()


def arch_name(arch: Arch) -> str:
    return f"mp_{arch[0]}{arch[1]}"
