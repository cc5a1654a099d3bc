"""The backend's hooks: who it is, whether it can run here, what its device can do, its ops.

te-core's registry imports this module through the `te_core.backends` entry point and calls
each @hookimpl function. Keep imports of vendor libraries inside the hooks that need them
(`te_backend_available` and later), so a missing library makes the backend unavailable with
a reason instead of breaking discovery.
"""
from __future__ import annotations

import torch

from te_core.backend import BackendInfo, Capabilities, hookimpl
from te_core.backend.types import FP8_FORMATS, SCALING_MODES

from . import __version__

NAME = "template"
# Your torch device type, e.g. "xpu" or "privateuseone". `auto` selection never picks a "cpu"
# backend: until this changes, the backend runs only when named (TE_BACKEND=template).
DEVICE_TYPE = "cpu"


@hookimpl
def te_backend_info():
    # vendor_versions is shown by `te-core info`: your runtime, compiler, kernel library. So is the
    # description: rewrite it once your kernels replace the reference's (it says they do not).
    return BackendInfo(
        name=NAME,
        device_type=DEVICE_TYPE,
        description="template backend: every op it declares delegates to te-core's reference implementation",
        vendor_versions={"te-backend-template": __version__, "torch": torch.__version__},
    )


@hookimpl
def te_backend_available():
    # A real backend checks its device and runtime here, e.g. that torch.<device>.is_available()
    # and the vendor library imports, and says what it found or what is missing.
    return True, "template backend, always available (runs on the CPU)"


@hookimpl
def te_backend_capabilities(device):
    # Declare only what the hardware runs natively: the dispatcher falls back to the reference
    # (with a warning naming the reason) for FP8 formats and scaling modes left out here.
    # `te-core info` shows the notes: replace this one with what your device lacks.
    return Capabilities(
        fp8_formats={name: fmax for name, fmax in FP8_FORMATS.values()},
        scaling_modes=frozenset(SCALING_MODES),
        arch="",
        device_name=f"template ({device})",
        distributed_backend="gloo",
        notes=("every op delegates to the reference implementation",),
    )


@hookimpl
def te_backend_ops():
    from .ops import OPS  # imported lazily: only when the backend is available and used

    return OPS


@hookimpl
def te_backend_device_module():
    # The module-like object with synchronize(), Stream, Event, manual_seed, ... for
    # DEVICE_TYPE; returning None uses torch.get_device_module(DEVICE_TYPE).
    return None
