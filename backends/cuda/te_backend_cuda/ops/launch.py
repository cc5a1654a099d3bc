"""Where a kernel launches and what it is given: the tensor's GPU, descriptor (TMA) configs
for large tensors on GPUs that have TMA, a pooled zero for an FP8 output's amax."""
from __future__ import annotations

import contextlib
import functools

import torch

from .. import configs
from ..amax_slots import fresh

_NO_GUARD = contextlib.nullcontext()
# The runtime's own call: torch.cuda.current_device() is Python around it (a lazy-init check, done
# by then: guard() only sees CUDA tensors), and every op of a step asks.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def guard(x):
    """The device guard for x's GPU, or none when that is the current one: entering a guard
    costs more host time than a small kernel's launch."""
    return _NO_GUARD if x.get_device() == _current_device() else torch.cuda.device(x.device)


def on_device(fn):
    """Launch on the tensor's GPU, not the current one."""
    def run(x, *args, **kwargs):
        with guard(x):
            return fn(x, *args, **kwargs)
    run.__name__ = fn.__name__
    return run


@functools.lru_cache(maxsize=None)
def tma_capable(index: int) -> bool:
    """TMA (the descriptor kernels' bulk copies) arrived with compute capability 9.0."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def tma_or(x, cfg, tma_cfg):
    """tma_cfg for a large enough tensor on a GPU with TMA, else cfg. The launchers still
    fall back to the pointer kernels where the tensors do not allow descriptors."""
    return tma_cfg if x.numel() >= configs.TMA_MIN_NUMEL and tma_capable(x.get_device()) else cfg


def fp8_amax(amax_out, x, fp8_dtype):
    """A pooled zero for the amax of an FP8 output (amax_slots); none without FP8 output."""
    return amax_out if fp8_dtype is None else fresh(amax_out, x)
