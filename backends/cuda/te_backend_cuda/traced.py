"""Tensor-wise FP8 casts and GEMMs in plain torch operations: the ops' twins for torch.compile
(OpImpl.traced).

Under torch.compile each opaque op costs a trip through torch.library and this backend's
Python on every call, which on a host-bound step makes the compiled step slower than the eager
one. Traced in plain operations instead, the casts become kernels the compiler writes and
fuses (the cast, its amax and its transpose read x once), launched by its own launcher, and
the GEMM is one extern call of torch._scaled_mm.

The math is the Triton kernels': x times the float32 scale, clamped to the format's max (NaN
stays NaN), cast round-to-nearest-even; amax max|x| with NaN winning. So the FP8 bytes are
the eager ones; a bias gradient sums its rows in another order. Anything else (casts maxing
into an amax history slot, block scales, FP8 output of norms and activations, outputs written
into `out`) returns NotImplemented and stays the opaque op.
"""
from __future__ import annotations

import torch
from te_core.backend.types import FP8_FORMATS, TENSORWISE

from .configs import TMA_MIN_NUMEL as MAX_NUMEL  # where the Triton casts switch to descriptors
from .scaled_mm import fp8_gemm_layout_reason

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT32_MAX = torch.finfo(torch.float32).max


def _takes(x, fp8_dtype, scale=None, amax_out=None) -> bool:
    """Whether the twin takes the call. Not with `amax_out` (delayed scaling's history slot):
    the compiler's code for maxing a reduction into a slice of a graph input is slower than
    the opaque kernel, which maxes it in with one atomic. Not for tensors of MAX_NUMEL
    elements or more: steps with such tensors are GPU-bound, and there the Triton
    cast-transposes (one read, both layouts written) are faster than the compiler's cast,
    transpose and reduction."""
    if amax_out is not None or x.numel() >= MAX_NUMEL:
        return False
    if fp8_dtype not in FP8_FORMATS or x.dtype not in HP_DTYPES or not x.is_cuda or x.numel() == 0:
        return False
    return scale is None or (scale.numel() == 1 and scale.dtype == torch.float32)


def _as(t, dtype):
    """t in dtype, without a conversion that is a no-op: torch.compile records such a .to() as
    an alias of its input, and an autograd Function whose output is one got a zero gradient
    (torch 2.11)."""
    return t if t.dtype == dtype else t.to(dtype)


def _cast(x, scale, fp8_dtype):
    fmax = FP8_FORMATS[fp8_dtype][1]
    return torch.clamp(_as(x, torch.float32) * scale.reshape(()), -fmax, fmax).to(fp8_dtype)


def _amax(x):
    """max|x|, NaN if x has one."""
    return _as(x.abs().amax(), torch.float32)


def quantize_fp8(x, scale, fp8_dtype, *, amax_out=None):
    if not _takes(x, fp8_dtype, scale, amax_out):
        return NotImplemented
    return _cast(x, scale, fp8_dtype), _amax(x)


def cast_transpose_fp8(x, scale, fp8_dtype, *, amax_out=None):
    if not _takes(x, fp8_dtype, scale, amax_out) or x.dim() != 2:
        return NotImplemented
    data = _cast(x, scale, fp8_dtype)
    return data, data.t().contiguous(), _amax(x)


def dbias_cast_transpose(dy, scale, fp8_dtype, *, amax_out=None):
    if not _takes(dy, fp8_dtype, scale, amax_out) or dy.dim() != 2:
        return NotImplemented
    data = _cast(dy, scale, fp8_dtype)
    return data, data.t().contiguous(), _as(_as(dy, torch.float32).sum(0), dy.dtype), _amax(dy)


def _current_scale(amax, fmax, amax_epsilon, force_pow2_scales):
    """The Triton current-scale kernel's rules: fmax / max(amax, eps); inf -> float32 max;
    1 where amax is NaN or inf or the divisor 0; optionally rounded down to a power of two."""
    amax_eff = torch.clamp_min(amax, float(amax_epsilon))
    scale = torch.div(torch.full_like(amax_eff, fmax), amax_eff)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)
    bad = torch.isnan(amax) | torch.isinf(amax) | (amax_eff == 0)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if force_pow2_scales:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def quantize_fp8_current(x, fp8_dtype, *, with_transpose=False, force_pow2_scales=False, amax_epsilon=0.0):
    if not _takes(x, fp8_dtype) or (with_transpose and x.dim() != 2):
        return NotImplemented
    amax = _amax(x)
    scale = _current_scale(amax.reshape(1), FP8_FORMATS[fp8_dtype][1], amax_epsilon, force_pow2_scales)
    data = _cast(x, scale, fp8_dtype)
    data_t = data.t().contiguous() if with_transpose else None
    return data, data_t, scale, torch.div(torch.ones_like(scale), scale), amax


def transpose_fp8(data):
    if data.dtype not in FP8_FORMATS or data.dim() != 2 or not data.is_cuda:
        return NotImplemented
    return data.t().contiguous()


def dequantize_fp8(data, scale_inv, out_dtype):
    if data.dtype not in FP8_FORMATS or out_dtype not in HP_DTYPES or not data.is_cuda or scale_inv.numel() != 1:
        return NotImplemented
    return _as(data.float() * _as(scale_inv.reshape(()), torch.float32), out_dtype)


def gemm_fp8(a, b, a_scale_inv, b_scale_inv, *, out_dtype, scaling=TENSORWISE, bias=None, out=None,
             accumulate=False, fast_accumulation=False):
    if scaling != TENSORWISE or out is not None or accumulate or not (a.is_cuda and b.is_cuda):
        return NotImplemented
    a, b = a.contiguous(), b.contiguous()
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or fp8_gemm_layout_reason(a, b, out_dtype, scaling):
        return NotImplemented  # (a K mismatch: the opaque op's reference names it)
    kwargs = dict(out_dtype=out_dtype, use_fast_accum=bool(fast_accumulation))
    epilogue = bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
    if epilogue:
        kwargs["bias"] = bias
    # fresh 0-dim scales: cuBLASLt reads them with aligned loads
    y = torch._scaled_mm(a, b.t(), _as(a_scale_inv.reshape(()), torch.float32).clone(),
                         _as(b_scale_inv.reshape(()), torch.float32).clone(), **kwargs)
    if bias is not None and not epilogue:
        y = _add_bias(y, bias, out_dtype)
    return y


def _add_bias(y, bias, out_dtype):
    """y + bias in float32, rounded once to out_dtype."""
    return _as(torch.add(_as(y, torch.float32), _as(bias, torch.float32)), out_dtype)


TRACED = {
    "quantize_fp8": quantize_fp8,
    "cast_transpose_fp8": cast_transpose_fp8,
    "dbias_cast_transpose": dbias_cast_transpose,
    "quantize_fp8_current": quantize_fp8_current,
    "transpose_fp8": transpose_fp8,
    "dequantize_fp8": dequantize_fp8,
    "gemm_fp8": gemm_fp8,
}
