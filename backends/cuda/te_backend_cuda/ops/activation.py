"""Activations (GELU, ReLU, SiLU and their gated forms) and the bias gradients of the layers
around them: the forward (optionally with FP8 output) and backward on te_triton's activation
kernels, dbias on torch's column reduction, the fused dbias + cast-transposes on te_triton's
dbias kernels."""
from __future__ import annotations

import torch
from te_triton import MAX_NUMEL, activation, blockwise
from te_triton import dbias as dbias_ct

from .. import configs
from ..amax_slots import fresh, fresh_current
from .checks import (FLOAT_DTYPES, OK, first_failure, fp8_amax_out_ok, fp8_cast_args_ok, fp8_cast_ok,
                     fp8_out_device_ok, fp8_out_ok, tensor_ok)
from .launch import fp8_amax, guard, tma_or


def activation_fwd(x, kind, *, fp8_scale=None, fp8_dtype=None, amax_out=None):
    return activation.activation_fwd(x, kind, fp8_scale=fp8_scale, fp8_dtype=fp8_dtype,
                                     cfg=fwd_cfg(configs.for_tensor(x), kind),
                                     amax_out=fp8_amax(amax_out, x, fp8_dtype))


def fwd_cfg(t: configs.Tuning, kind: str):
    """The forward's config of activation `kind` (of tuning t)."""
    return t.activation_fwd_gated if kind in activation.GATED else t.activation_fwd


def activation_bwd(dy, x, kind):
    return activation.activation_bwd(dy, x, kind, configs.for_tensor(x).elementwise)


def dbias(dy):
    """torch's own CUDA column reduction, accumulating in float32 without a float32 copy of dy:
    it is faster than a Triton column-strip kernel at the layer's sizes."""
    return dy.reshape(-1, dy.shape[-1]).sum(dim=0, dtype=torch.float32).to(dy.dtype)


def _dbias_ct_cfg(x):
    t = configs.for_tensor(x)
    return tma_or(x, t.dbias_cast_transpose, t.dbias_cast_transpose_tma)


def dbias_cast_transpose(dy, scale, fp8_dtype, *, amax_out=None):
    return dbias_ct.dbias_cast_transpose(dy, scale, fp8_dtype, _dbias_ct_cfg(dy), amax_out=fresh(amax_out, dy))


def dbias_cast_transpose_parts(parts, scale, fp8_dtype, *, amax_out=None):
    with guard(parts[0]):
        return dbias_ct.dbias_cast_transpose_parts(parts, scale, fp8_dtype, _dbias_ct_cfg(parts[0]),
                                                   amax_out=fresh(amax_out, parts[0]))


def dbias_cast_transpose_current(parts, fp8_dtype, *, force_pow2_scales=False, amax_epsilon=0.0):
    first = parts[0]
    amax_out, scale_out, scale_inv_out = fresh_current(first)
    with guard(first):
        return dbias_ct.dbias_cast_transpose_current(
            parts, fp8_dtype, _dbias_ct_cfg(first), force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon,
            amax_cfg=configs.for_tensor(first).quantize, amax_out=amax_out, scale_out=scale_out,
            scale_inv_out=scale_inv_out)


def dbias_cast_transpose_blockwise(parts, fp8_dtype, *, force_pow2_scales=True, amax_epsilon=0.0):
    with guard(parts[0]):
        return blockwise.dbias_cast_transpose_blockwise(
            parts, fp8_dtype, force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon,
            cfg=configs.for_tensor(parts[0]).blockwise_1d_transpose)


def activation_bwd_dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, *, amax_out=None):
    t = configs.for_tensor(x)
    if kind in activation.GATED:  # activation_bwd, then a plain dbias cast-transpose of its dx
        cfg = _dbias_ct_cfg(x)
    else:
        cfg = tma_or(x, t.dbias_cast_transpose, t.act_bwd_dbias_cast_transpose_tma)
    return dbias_ct.activation_bwd_dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, cfg, t.elementwise,
                                                        amax_out=fresh(amax_out, x))


# --- supports -------------------------------------------------------------------------------
def act_fwd_ok(x, kind, *, fp8_scale=None, fp8_dtype=None, amax_out=None, **params):
    # params: clamped_swiglu's limit/alpha, passed only for that kind, which has no kernel here
    if kind not in activation.KIND_IDS:
        return False, f"activation {kind!r} has no kernel"
    if kind in activation.GATED and (x.dim() == 0 or x.shape[-1] % 2):
        return False, "a gated activation needs an even last dimension"
    ok, why = first_failure(fp8_out_ok(x, fp8_scale, fp8_dtype), fp8_amax_out_ok(amax_out, x, fp8_dtype))
    return tensor_ok(x) if ok else (ok, why)


def act_bwd_ok(dy, x, kind, **params):
    if kind in activation.KIND_IDS and x.dim() > 0:
        h = x.shape[-1] // 2 if kind in activation.GATED else x.shape[-1]
        if dy.shape != (*x.shape[:-1], h):
            return False, "dy does not match the activation's output shape"
    ok, why = act_fwd_ok(x, kind)
    return (ok, why) if not ok else tensor_ok(dy, "dy")


def dbias_ok(dy):
    if dy.dim() < 1:
        return False, "dy is 0-dim"
    return tensor_ok(dy, "dy")


def dbias_ct_ok(dy, scale, fp8_dtype, *, amax_out=None):
    return fp8_cast_ok(dy, scale, amax_out, two_d=True)


def dbias_ct_parts_ok(parts, scale, fp8_dtype, *, amax_out=None):
    """Parts that are column blocks of one CUDA gradient; the launcher concatenates those it
    cannot read in place, so only what the reference must explain is declined."""
    ok, why = _parts_ok(parts)
    return fp8_cast_args_ok(parts[0], scale, amax_out) if ok else (ok, why)


def dbias_ct_self_scaled_ok(parts, fp8_dtype, **_):
    """The epilogues whose scales come from the gradient (current scaling's, block scaling's):
    column blocks of one CUDA gradient, on a GPU whose convert saturates."""
    ok, why = _parts_ok(parts)
    return fp8_out_device_ok(parts[0]) if ok else (ok, why)


def _parts_ok(parts):
    if not isinstance(parts, (list, tuple)) or not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        return False, "parts is not a non-empty list of tensors"
    first = parts[0]
    for p in parts:
        if p.dim() != 2 or p.shape[0] != first.shape[0] or p.dtype != first.dtype or p.device != first.device:
            return False, "the parts are not 2-D column blocks of one dtype, row count and device"
    # the launcher concatenates non-contiguous parts: only their device and dtype matter here
    if not first.is_cuda:
        return False, "the parts are not on a CUDA device"
    if first.dtype not in FLOAT_DTYPES:
        return False, f"the parts' dtype {first.dtype} is not float32/bfloat16/float16"
    if first.shape[0] * sum(p.shape[1] for p in parts) > MAX_NUMEL:
        return False, "the parts hold more than 2^31 elements"
    return OK


def act_bwd_dbias_ct_ok(dy, x, kind, scale, fp8_dtype, *, amax_out=None, **params):
    if x.dim() != 2:
        return False, "x is not 2-D"
    ok, why = fp8_cast_args_ok(x, scale, amax_out)
    return act_bwd_ok(dy, x, kind) if ok else (ok, why)
