"""te-core backend plugin for Moore Threads GPUs (entry point `musa` in `te_core.backends`).

Importing this module imports no vendor library: te-core loads it on every machine. torch_musa
is imported by the availability hook, inside a guard that turns failure into a reason.
"""
from __future__ import annotations

import dataclasses

import torch
from te_core.backend import hookimpl
from te_core.backend.types import BackendInfo

from . import capabilities as caps
from . import ops as native
from . import runtime
from .triton_kernels import triton_ops

NAME = "musa"
DEVICE_TYPE = "musa"


@hookimpl
def te_backend_info():
    return BackendInfo(
        name=NAME,
        device_type=DEVICE_TYPE,
        description="Moore Threads GPUs via torch_musa: torch._scaled_mm FP8 GEMM, muDNN fused ops, MCCL",
        vendor_versions=runtime.vendor_versions(),
    )


@hookimpl
def te_backend_available():
    module, why = runtime.import_torch_musa()
    if module is None:
        return False, why
    if not torch.musa.is_available():
        return False, (
            "torch_musa is installed but torch.musa.is_available() is False: no MUSA device or driver "
            "(check `mthreads-gmi` and MUSA_VISIBLE_DEVICES)"
        )
    count = torch.musa.device_count()
    if count < 1:
        return False, "torch_musa reports 0 MUSA devices (check `mthreads-gmi` and MUSA_VISIBLE_DEVICES)"
    arch = runtime.arch_of(None)
    name = torch.musa.get_device_name(runtime.device_index(None))
    version = runtime.installed_version("torch_musa", "torch-musa") or getattr(module, "__version__", "unknown")
    return True, f"{count} MUSA device(s), current: {name} ({runtime.arch_name(arch)}), torch_musa {version}"


@hookimpl
def te_backend_capabilities(device):
    arch = runtime.arch_of(device)
    name = torch.musa.get_device_name(runtime.device_index(device))
    base = caps.capabilities_for(arch, name, caps.has_fp8_dtypes())
    _, missing = native.native_ops()
    notes = [f"not in this torch_musa build, so the reference runs instead: {feature}" for feature in missing]
    _, triton_why = triton_ops(arch)
    if triton_why:
        notes.append(f"Triton kernels off: {triton_why}")
    return dataclasses.replace(base, notes=base.notes + tuple(notes))


@hookimpl
def te_backend_ops():
    ops, _ = native.native_ops()
    extra, _ = triton_ops(runtime.arch_of(None))
    return native.merge(ops, extra)


@hookimpl
def te_backend_device_module():
    return runtime.device_module()
