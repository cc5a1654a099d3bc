"""Transformer Engine's device queries (`get_device_compute_capability`, `get_cudnn_version`),
answered by the selected backend's capabilities, so code ported from TE asks te-core's device
rather than one vendor's.

A backend whose device has no compute capability (the reference backend's CPU), or that runs
no cuDNN, answers with a BackendError that says so: a made-up number would steer TE code that
compares it (`>= (8, 9)`) into a branch chosen for hardware that is not there.
"""
from __future__ import annotations

from typing import Tuple

from ._tracing import run_while_tracing
from .backend import BackendError, get_backend

__all__ = ["get_device_compute_capability", "get_cudnn_version"]

_INSTEAD = ("te-core's own queries answer what it can run here on any backend: te.is_fp8_available(), "
            "te.is_mxfp8_available(), te.is_fp8_block_scaling_available(), te.is_bf16_available()")


@run_while_tracing
def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) of the selected backend's device, as its vendor numbers it (an H100 is
    (9, 0); a Moore Threads S5000 is (3, 1)). BackendError for a device that has none."""
    backend = get_backend()
    capability = backend.capabilities.compute_capability
    if not capability:
        raise BackendError(
            f"get_device_compute_capability: the selected backend {backend.name!r} runs on "
            f"{backend.device_type}, which has no compute capability (a GPU's (major, minor)). {_INSTEAD}. "
            "To run on a GPU, select its backend (TE_BACKEND=<name> or te.set_backend(<name>); "
            "'te-core info' lists them)")
    return capability[0], capability[1]


@run_while_tracing
def get_cudnn_version() -> Tuple[int, int, int]:
    """(major, minor, patch) of the cuDNN the selected backend runs, as loaded at run time.
    BackendError where the backend runs no cuDNN (only NVIDIA's backend does)."""
    backend = get_backend()
    libraries = backend.capabilities.library_versions
    version = libraries.get("cudnn")
    if version is None:
        others = ", ".join(f"{name} {'.'.join(map(str, v))}" for name, v in sorted(libraries.items()))
        raise BackendError(
            f"get_cudnn_version: the selected backend {backend.name!r} ({backend.device_type}) does not run "
            f"cuDNN{f' (it runs {others})' if others else ''}, so there is no cuDNN version to give. Code that "
            f"picks a cuDNN feature by version has no use for it here: te-core's backends choose their kernels "
            f"themselves. {_INSTEAD}")
    return version[0], version[1], version[2]
