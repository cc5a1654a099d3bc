"""The building blocks of the ops' supports(): each returns (ok, why not).

A declined call runs on the reference, which converts what it can and names the problem
otherwise, so these only say what the kernels do not take: tensors off the GPU, dtypes the
kernels have no path for, non-contiguous inputs, sizes that overflow int32 indexing.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from te_triton import MAX_NUMEL, amax_out_ok

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OK = (True, "")


def first_failure(*checks):
    """The first failing (ok, why) of `checks`, else OK."""
    for ok, why in checks:
        if not ok:
            return ok, why
    return OK


def tensor_ok(x: torch.Tensor, name: str = "x"):
    if not x.is_cuda:
        return False, f"{name} is not on a CUDA device"
    return float_layout_ok(x, name)


def float_layout_ok(x: torch.Tensor, name: str = "x"):
    """tensor_ok of a tensor known to be on a CUDA device."""
    if x.dtype not in FLOAT_DTYPES:
        return False, f"{name} dtype {x.dtype} is not float32/bfloat16/float16"
    if not x.is_contiguous():
        return False, f"{name} is not contiguous"
    if x.numel() > MAX_NUMEL:
        return False, f"{name} has more than 2^31 elements"
    return OK


def all_ok(*named):
    """tensor_ok of each (tensor, name) pair, up to the first failure."""
    for t, name in named:
        ok, why = tensor_ok(t, name)
        if not ok:
            return ok, why
    return OK


@functools.lru_cache(maxsize=None)
def fp8_convert_ok(index: int):
    """The FP8-output kernels rely on the hardware convert (cvt.rn.satfinite, compute capability
    8.9 and up) to saturate: configs set hw_saturate. Older GPUs go to the reference."""
    cc = torch.cuda.get_device_capability(index)
    if cc < (8, 9):
        return False, f"the FP8-output kernels need compute capability >= 8.9 (GPU {index} is {cc[0]}.{cc[1]})"
    return OK


def scale_ok(scale, x, name="scale"):
    """The kernels read a 1-element float32 scale from x's device; anything else goes to the
    reference, which converts it or names the problem."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        return False, f"{name} is not a 1-element float32 tensor"
    if scale.device != x.device:
        return False, f"{name} is not on x's device"
    return OK


def fp8_out_device_ok(x):
    return fp8_convert_ok(x.get_device()) if x.is_cuda else OK


def fp8_out_ok(x, fp8_scale, fp8_dtype):
    """An optional FP8 output (norms, activations): scale and dtype together, on a GPU that saturates."""
    if (fp8_scale is None) != (fp8_dtype is None):
        return False, "fp8_scale and fp8_dtype go together (the reference explains)"
    if fp8_scale is None:
        return OK
    ok, why = scale_ok(fp8_scale, x, "fp8_scale")
    return fp8_out_device_ok(x) if ok else (ok, why)


def fp8_amax_out_ok(amax_out, x, fp8_dtype):
    """amax_out only goes with FP8 output; a stray one goes to the reference, which names it."""
    if amax_out is not None and fp8_dtype is None:
        return False, "amax_out given without FP8 output"
    return amax_out_ok(amax_out, x)


def _cast_args_why(scale, amax_out, device) -> Optional[str]:
    """scale_ok then amax_out_ok for a cast on `device`, their reasons, inlined (every FP8 cast
    of a training step runs this); None when both pass."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        return "scale is not a 1-element float32 tensor"
    if scale.device != device:
        return "scale is not on x's device"
    if amax_out is not None:
        if not isinstance(amax_out, torch.Tensor) or amax_out.dtype != torch.float32 or amax_out.numel() != 1:
            return "amax_out is not a 1-element float32 tensor"
        if amax_out.device != device:
            return "amax_out is not on x's device"
    return None


def fp8_cast_args_ok(x, scale, amax_out):
    """The scale and amax_out of a cast of x to FP8, and a GPU that saturates."""
    why = _cast_args_why(scale, amax_out, x.device)
    return (False, why) if why is not None else fp8_out_device_ok(x)


def fp8_cast_ok(x, scale, amax_out, *, two_d=False):
    """A cast of x (2-D where two_d) to FP8 by `scale`, maxing its amax into `amax_out`:
    fp8_cast_args_ok then tensor_ok, with x's device checked once. Every FP8 cast of a training
    step runs this, so the passing path calls as little as it can; a failure's reason comes from
    the check that owns it."""
    if two_d and x.dim() != 2:
        return False, "x is not 2-D"
    why = _cast_args_why(scale, amax_out, x.device)
    if why is not None:
        return False, why
    if not x.is_cuda:
        return False, "x is not on a CUDA device"
    ok, why = fp8_convert_ok(x.get_device())
    if not ok:
        return ok, why
    if x.dtype in FLOAT_DTYPES and x.is_contiguous() and x.numel() <= MAX_NUMEL:  # float_layout_ok's pass, inline
        return OK
    return float_layout_ok(x)
