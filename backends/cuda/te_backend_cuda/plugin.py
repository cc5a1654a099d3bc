"""The te-core backend plugin for NVIDIA GPUs (entry point `cuda` in `te_core.backends`).

Imports only torch at module level; te_triton (and so Triton) loads when the ops are asked
for, which happens only once the backend is available. Every native op is registered in one
table, te_backend_cuda.ops.
"""
from __future__ import annotations

import importlib.metadata
from typing import Optional

import torch
from te_core.backend.hookspecs import hookimpl
from te_core.backend.types import BackendInfo

NAME = "cuda"


def _triton_version() -> Optional[str]:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _cudnn_version() -> Optional[str]:
    try:
        v = torch.backends.cudnn.version()
    except (RuntimeError, AttributeError):
        return None
    return None if v is None else str(v)


@hookimpl
def te_backend_info():
    return BackendInfo(
        name=NAME,
        device_type="cuda",
        description="NVIDIA GPUs: cuBLASLt FP8 GEMMs (torch._scaled_mm), cuDNN attention (SDPA), Triton fused kernels",
        vendor_versions={"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": _cudnn_version(),
                         "triton": _triton_version()},
    )


@hookimpl
def te_backend_available():
    if getattr(torch.version, "hip", None):
        return False, f"this torch is a ROCm build (HIP {torch.version.hip}); te-backend-cuda needs a CUDA build"
    if torch.version.cuda is None:
        return False, "this torch has no CUDA support (CPU-only build); install a CUDA build of torch"
    if not torch.cuda.is_available():
        return False, "no NVIDIA GPU visible (torch.cuda.is_available() is False; check the driver and CUDA_VISIBLE_DEVICES)"
    if _triton_version() is None:
        return False, "triton is not installed; pip install triton (te-triton-kernels needs it)"
    index = torch.cuda.current_device()
    return True, f"{torch.cuda.get_device_name(index)} (compute capability {torch.cuda.get_device_capability(index)}), CUDA {torch.version.cuda}"


@hookimpl
def te_backend_capabilities(device):
    from .capabilities import capabilities_for

    index = device.index if device.index is not None else torch.cuda.current_device()
    return capabilities_for(index)


@hookimpl
def te_backend_ops():
    from .ops import native_ops

    return native_ops()


@hookimpl
def te_backend_device_module():
    return torch.cuda
