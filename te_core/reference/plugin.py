"""The embedded reference backend: every contract op in plain PyTorch, on any device.

It is the default on machines without an accelerator backend, the fallback for ops a backend
lacks or declines, and the oracle backends are tested against.
"""
from __future__ import annotations

import functools
import importlib

import torch

from ..backend.hookspecs import hookimpl
from ..backend.types import FP8_FORMATS, SCALING_MODES, BackendInfo, Capabilities
from ..ops import CONTRACT

NAME = "reference"


@functools.lru_cache(maxsize=None)
def implementations() -> dict:
    """op name -> reference function, one module per op family (te_core.reference.<family>)."""
    impls = {}
    for name, op in CONTRACT.items():
        module = importlib.import_module(f"{__package__}.{op.family}")
        impls[name] = getattr(module, name)
    return impls


@hookimpl
def te_backend_info():
    return BackendInfo(
        name=NAME,
        device_type="cpu",
        description="plain PyTorch on any device; the oracle and the fallback",
        vendor_versions={"torch": torch.__version__},
    )


@hookimpl
def te_backend_available():
    return True, "plain PyTorch, always available"


@hookimpl
def te_backend_capabilities(device):
    return Capabilities(
        fp8_formats={name: fmax for name, fmax in FP8_FORMATS.values()},
        scaling_modes=frozenset(SCALING_MODES),
        arch="",
        device_name=f"any ({device.type})",
        # torch.distributed's CPU library; on another device the reference names none (the
        # device's own backend plugin does)
        distributed_backend="gloo" if device.type == "cpu" else "",
    )


@hookimpl
def te_backend_ops():
    return dict(implementations())
