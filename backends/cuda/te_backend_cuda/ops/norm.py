"""LayerNorm and RMSNorm, forward (optionally with FP8 output) and backward (optionally adding a
residual's gradient), on te_triton's norm kernels: one row per program step, the descriptor
kernels for large tensors on GPUs with TMA."""
from __future__ import annotations

import dataclasses
import functools

import torch
from te_triton import next_power_of_2, norm

from .. import configs
from .checks import OK, all_ok, first_failure, fp8_amax_out_ok, fp8_out_ok, tensor_ok
from .launch import fp8_amax, tma_or


def _norm_fwd_cfg(x, fp8_dtype, rms: bool):
    t = configs.for_tensor(x)
    if fp8_dtype is None:
        return t.norm_high_precision
    return tma_or(x, fp8_pointer_cfg(t, x.shape[-1], rms), t.norm_tma[rms, x.shape[-1] > 4096])


def fp8_pointer_cfg(t: configs.Tuning, n: int, rms: bool):
    """The pointer kernel's config of a forward with FP8 output over rows of n (of tuning t)."""
    return t.norm_layernorm_long_rows if n > 4096 and not rms else t.norm


def _norm_bwd_cfg(x, rms: bool):
    t = configs.for_tensor(x)
    n = x.shape[-1]
    cfg = tma_or(x, _bwd_pointer_cfg(t, n, rms), t.norm_bwd_tma_long_rows if n > 4096 else t.norm_bwd_tma)
    return _bwd_warps(cfg, n)


def pointer_bwd_cfg(t: configs.Tuning, n: int, rms: bool):
    """The pointer kernel's config of a backward over rows of n (of tuning t)."""
    return _bwd_warps(_bwd_pointer_cfg(t, n, rms), n)


def _bwd_pointer_cfg(t: configs.Tuning, n: int, rms: bool):
    return t.rmsnorm_bwd_long_rows if rms and n > 4096 else t.norm_bwd


def _bwd_warps(cfg, n: int):
    """The backward holds two rows of x and dy per program: at most 32 elements per thread
    (warps >= padded row / 1024), beyond which the kernel spills registers."""
    return _with_warps(cfg, min(32, max(cfg.num_warps, next_power_of_2(n) // 1024)))


@functools.lru_cache(maxsize=None)
def _with_warps(cfg, warps: int):
    """cfg with `warps` warps, made once per pair: the backward is on a host-bound path."""
    return cfg if warps == cfg.num_warps else dataclasses.replace(cfg, num_warps=warps)


def layernorm_fwd(x, weight, bias, eps, *, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, amax_out=None):
    return norm.norm_fwd(x, weight, bias, eps, rms=False, zero_centered_gamma=zero_centered_gamma,
                         fp8_scale=fp8_scale, fp8_dtype=fp8_dtype, cfg=_norm_fwd_cfg(x, fp8_dtype, rms=False),
                         amax_out=fp8_amax(amax_out, x, fp8_dtype))


def rmsnorm_fwd(x, weight, eps, *, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, amax_out=None):
    y, _, rstd, amax = norm.norm_fwd(x, weight, None, eps, rms=True, zero_centered_gamma=zero_centered_gamma,
                                     fp8_scale=fp8_scale, fp8_dtype=fp8_dtype,
                                     cfg=_norm_fwd_cfg(x, fp8_dtype, rms=True),
                                     amax_out=fp8_amax(amax_out, x, fp8_dtype))
    return y, rstd, amax


def layernorm_bwd(dy, x, mean, rstd, weight, *, zero_centered_gamma=False):
    return norm.norm_bwd(dy, x, mean, rstd, weight, rms=False, zero_centered_gamma=zero_centered_gamma,
                         cfg=_norm_bwd_cfg(x, rms=False))


def rmsnorm_bwd(dy, x, rstd, weight, *, zero_centered_gamma=False):
    dx, dw, _ = norm.norm_bwd(dy, x, None, rstd, weight, rms=True, zero_centered_gamma=zero_centered_gamma,
                              cfg=_norm_bwd_cfg(x, rms=True))
    return dx, dw


def layernorm_bwd_add(dy, x, mean, rstd, weight, add, *, zero_centered_gamma=False):
    return norm.norm_bwd_add(dy, x, mean, rstd, weight, add.contiguous(), rms=False,
                             zero_centered_gamma=zero_centered_gamma, cfg=_norm_bwd_cfg(x, rms=False))


def rmsnorm_bwd_add(dy, x, rstd, weight, add, *, zero_centered_gamma=False):
    dx, dw, _ = norm.norm_bwd_add(dy, x, None, rstd, weight, add.contiguous(), rms=True,
                                  zero_centered_gamma=zero_centered_gamma, cfg=_norm_bwd_cfg(x, rms=True))
    return dx, dw


# --- supports -------------------------------------------------------------------------------
def _rows_ok(x, weight):
    if x.dim() == 0 or x.shape[-1] > norm.MAX_N:
        return False, f"rows longer than {norm.MAX_N} elements do not fit the one-row-per-program kernel"
    if weight.numel() != x.shape[-1]:
        return False, "weight does not match x's last dimension"
    return all_ok((x, "x"), (weight, "weight"))


def norm_fwd_ok(x, weight, *args, fp8_scale=None, fp8_dtype=None, amax_out=None, **kwargs):
    bias = args[0] if len(args) > 1 else None  # layernorm: (bias, eps); rmsnorm: (eps,)
    ok, why = first_failure(fp8_out_ok(x, fp8_scale, fp8_dtype), fp8_amax_out_ok(amax_out, x, fp8_dtype),
                            tensor_ok(bias, "bias") if bias is not None else OK)
    return _rows_ok(x, weight) if ok else (ok, why)


def layernorm_bwd_ok(dy, x, mean, rstd, weight, **_):
    if dy.shape != x.shape or rstd.shape != x.shape[:-1] or (mean is not None and mean.shape != rstd.shape):
        return False, "dy, mean and rstd do not match x's shape"
    ok, why = _rows_ok(x, weight)
    return (ok, why) if not ok else tensor_ok(dy, "dy")


def rmsnorm_bwd_ok(dy, x, rstd, weight, **_):
    return layernorm_bwd_ok(dy, x, None, rstd, weight)


def _add_ok(add, x):
    if not isinstance(add, torch.Tensor) or add.shape != x.shape or add.dtype != x.dtype or add.device != x.device:
        return False, "add is not a tensor of x's shape, dtype and device"
    return OK


def layernorm_bwd_add_ok(dy, x, mean, rstd, weight, add, **_):
    ok, why = _add_ok(add, x)
    return layernorm_bwd_ok(dy, x, mean, rstd, weight) if ok else (ok, why)


def rmsnorm_bwd_add_ok(dy, x, rstd, weight, add, **_):
    return layernorm_bwd_add_ok(dy, x, None, rstd, weight, add)
