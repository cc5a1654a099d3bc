"""The memory-bound contract ops on te_triton kernels, with this backend's tuning configs.

Each op is an OpImpl whose supports() declines (so the reference runs) what the kernels do
not take: tensors off the GPU, non-contiguous inputs, int32-overflowing sizes, huge rows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Dict

import torch
import triton
from te_core.backend.types import OpImpl
from te_triton import activation, blockwise, cast, loss, norm, rope, scaling, softmax
from te_triton import dbias as dbias_ct
from te_triton._common import MAX_NUMEL, amax_out_ok

from . import configs, update_graph
from .amax_slots import fresh

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NO_GUARD = contextlib.nullcontext()


def _tensor_ok(x: torch.Tensor, name: str = "x"):
    if not x.is_cuda:
        return False, f"{name} is not on a CUDA device"
    if x.dtype not in FLOAT_DTYPES:
        return False, f"{name} dtype {x.dtype} is not float32/bfloat16/float16"
    if not x.is_contiguous():
        return False, f"{name} is not contiguous"
    if x.numel() > MAX_NUMEL:
        return False, f"{name} has more than 2^31 elements"
    return True, ""


def _all_ok(*named):
    for t, name in named:
        ok, why = _tensor_ok(t, name)
        if not ok:
            return ok, why
    return True, ""


def _guard(x):
    """The device guard for x's GPU, or none when that is the current one: entering a guard
    costs more host time than a small kernel's launch."""
    return _NO_GUARD if x.get_device() == torch.cuda.current_device() else torch.cuda.device(x.device)


def _on_device(fn):
    """Launch on the tensor's GPU, not the current one."""
    def run(x, *args, **kwargs):
        with _guard(x):
            return fn(x, *args, **kwargs)
    run.__name__ = fn.__name__
    return run


# --- cast ---------------------------------------------------------------------------------
def quantize_fp8(x, scale, fp8_dtype, *, amax_out=None):
    return cast.quantize_fp8(x, scale, fp8_dtype, configs.QUANTIZE, amax_out=fresh(amax_out, x))


def cast_transpose_fp8(x, scale, fp8_dtype, *, amax_out=None):
    return cast.cast_transpose_fp8(x, scale, fp8_dtype, configs.CAST_TRANSPOSE, amax_out=fresh(amax_out, x))


def quantize_fp8_current(x, fp8_dtype, *, with_transpose=False, force_pow2_scales=False, amax_epsilon=0.0):
    return cast.quantize_fp8_current(x, fp8_dtype, with_transpose=with_transpose, force_pow2_scales=force_pow2_scales,
                                     amax_epsilon=amax_epsilon, cfg=configs.QUANTIZE, ct_cfg=configs.CAST_TRANSPOSE,
                                     amax_out=fresh(None, x))


def transpose_fp8(data):
    return cast.transpose_fp8(data, configs.TRANSPOSE)


def dequantize_fp8(data, scale_inv, out_dtype):
    return cast.dequantize_fp8(data, scale_inv, out_dtype, configs.QUANTIZE)


def dequantize_blockwise(data, scale_inv, block_2d, out_dtype):
    return blockwise.dequantize_blockwise(data, scale_inv, block_2d, out_dtype, configs.BLOCKWISE)


def _fp8_data_ok(data, out_dtype):
    if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return False, f"data dtype {data.dtype} is not FP8"
    if out_dtype not in FLOAT_DTYPES:
        return False, f"out_dtype {out_dtype} is not float32/bfloat16/float16"
    if not data.is_contiguous():
        return False, "data is not contiguous"
    if data.numel() > MAX_NUMEL:
        return False, "data has more than 2^31 elements"
    if not data.is_cuda:
        return False, "data is not on a CUDA device"
    return True, ""


def _dequantize_ok(data, scale_inv, out_dtype):
    ok, why = _scale_ok(scale_inv, data, "scale_inv")
    return _fp8_data_ok(data, out_dtype) if ok else (ok, why)


def _dequantize_blockwise_ok(data, scale_inv, block_2d, out_dtype):
    if data.dim() != 2:
        return False, "data is not 2-D"
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.device != data.device:
        return False, "scale_inv is not a tensor on data's device"
    if scale_inv.dtype != torch.float32 or not scale_inv.is_contiguous():
        return False, "scale_inv is not contiguous float32"
    m, k = data.shape
    expected = (-(-m // 128) if block_2d else m, -(-k // 128))
    if tuple(scale_inv.shape) != expected:
        return False, f"scale_inv shape {tuple(scale_inv.shape)} is not {expected} (the reference explains)"
    return _fp8_data_ok(data, out_dtype)


def _transpose_ok(data):
    if data.dim() != 2 or not data.is_contiguous():
        return False, "data is not a contiguous 2-D tensor"
    if not data.is_cuda:
        return False, "data is not on a CUDA device"
    if data.numel() > MAX_NUMEL:
        return False, "data has more than 2^31 elements"
    return True, ""


@functools.lru_cache(maxsize=None)
def _fp8_convert_ok(index: int):
    """The FP8-output kernels rely on the hardware convert (cvt.rn.satfinite, compute capability
    8.9 and up) to saturate: configs set hw_saturate. Older GPUs go to the reference."""
    cc = torch.cuda.get_device_capability(index)
    if cc < (8, 9):
        return False, f"the FP8-output kernels need compute capability >= 8.9 (GPU {index} is {cc[0]}.{cc[1]})"
    return True, ""


def _scale_ok(scale, x, name="scale"):
    """The kernels read a 1-element float32 scale from x's device; anything else goes to the
    reference, which converts it or names the problem."""
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        return False, f"{name} is not a 1-element float32 tensor"
    if scale.device != x.device:
        return False, f"{name} is not on x's device"
    return True, ""


def _fp8_out_device_ok(x):
    return _fp8_convert_ok(x.get_device()) if x.is_cuda else (True, "")


def _fp8_out_ok(x, fp8_scale, fp8_dtype):
    if (fp8_scale is None) != (fp8_dtype is None):
        return False, "fp8_scale and fp8_dtype go together (the reference explains)"
    if fp8_scale is None:
        return True, ""
    ok, why = _scale_ok(fp8_scale, x, "fp8_scale")
    return _fp8_out_device_ok(x) if ok else (ok, why)


def _fp8_amax_out_ok(amax_out, x, fp8_dtype):
    """amax_out only goes with FP8 output; a stray one goes to the reference, which names it."""
    if amax_out is not None and fp8_dtype is None:
        return False, "amax_out given without FP8 output"
    return amax_out_ok(amax_out, x)


def _cast_ok(x, scale, *args, amax_out=None, **kwargs):
    for ok, why in (_scale_ok(scale, x), amax_out_ok(amax_out, x), _fp8_out_device_ok(x)):
        if not ok:
            return ok, why
    return _tensor_ok(x)


def _cast_2d_ok(x, scale, *args, amax_out=None, **kwargs):
    if x.dim() != 2:
        return False, "x is not 2-D"
    return _cast_ok(x, scale, amax_out=amax_out)


def _self_scaled_2d_ok(x, *args, **kwargs):
    if x.dim() != 2:
        return False, "x is not 2-D"
    return _tensor_ok(x)


def _current_ok(x, fp8_dtype, *, with_transpose=False, **_):
    ok, why = _self_scaled_2d_ok(x) if with_transpose else _tensor_ok(x)
    return _fp8_out_device_ok(x) if ok else (ok, why)


def quantize_blockwise(x, fp8_dtype, *, block_2d=False, with_transpose=False, force_pow2_scales=True,
                       amax_epsilon=0.0):
    return blockwise.quantize_blockwise(x, fp8_dtype, block_2d=block_2d, with_transpose=with_transpose,
                                        force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon,
                                        cfg=configs.BLOCKWISE_1D_TRANSPOSE if with_transpose and not block_2d
                                        else configs.BLOCKWISE)


# --- norm ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _tma_capable(index: int) -> bool:
    """TMA (the descriptor kernels' bulk copies) arrived with compute capability 9.0."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def _tma(x, cfg, tma_cfg):
    """tma_cfg for a large enough tensor on a GPU with TMA, else cfg. The launchers still
    fall back to the pointer kernels where the tensors do not allow descriptors."""
    return tma_cfg if x.numel() >= configs.TMA_MIN_NUMEL and _tma_capable(x.get_device()) else cfg


def _fp8_amax(amax_out, x, fp8_dtype):
    """A pooled zero for the amax of an FP8 output (amax_slots); none without FP8 output."""
    return amax_out if fp8_dtype is None else fresh(amax_out, x)


def _norm_fwd_cfg(x, fp8_dtype, rms: bool):
    if fp8_dtype is None:
        return configs.NORM_HIGH_PRECISION
    long_rows = x.shape[-1] > 4096
    cfg = configs.NORM_LAYERNORM_LONG_ROWS if long_rows and not rms else configs.NORM
    return _tma(x, cfg, configs.NORM_TMA[rms, long_rows])


def layernorm_fwd(x, weight, bias, eps, *, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, amax_out=None):
    return norm.norm_fwd(x, weight, bias, eps, rms=False, zero_centered_gamma=zero_centered_gamma,
                         fp8_scale=fp8_scale, fp8_dtype=fp8_dtype, cfg=_norm_fwd_cfg(x, fp8_dtype, rms=False),
                         amax_out=_fp8_amax(amax_out, x, fp8_dtype))


def rmsnorm_fwd(x, weight, eps, *, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None, amax_out=None):
    y, _, rstd, amax = norm.norm_fwd(x, weight, None, eps, rms=True, zero_centered_gamma=zero_centered_gamma,
                                     fp8_scale=fp8_scale, fp8_dtype=fp8_dtype,
                                     cfg=_norm_fwd_cfg(x, fp8_dtype, rms=True),
                                     amax_out=_fp8_amax(amax_out, x, fp8_dtype))
    return y, rstd, amax


def _norm_bwd_cfg(x, rms: bool):
    """The pointer backward holds two rows of x and dy per program: at most 32 elements per
    thread (warps >= padded row / 1024), beyond which the H200 run spilled."""
    n = x.shape[-1]
    cfg = configs.RMSNORM_BWD_LONG_ROWS if rms and n > 4096 else configs.NORM_BWD
    cfg = _tma(x, cfg, configs.NORM_BWD_TMA_LONG_ROWS if n > 4096 else configs.NORM_BWD_TMA)
    return _with_warps(cfg, min(32, max(cfg.num_warps, triton.next_power_of_2(n) // 1024)))


@functools.lru_cache(maxsize=None)
def _with_warps(cfg, warps: int):
    """cfg with `warps` warps, made once per pair: the backward is on a host-bound path."""
    return cfg if warps == cfg.num_warps else dataclasses.replace(cfg, num_warps=warps)


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


def _rows_ok(x, weight):
    if x.dim() == 0 or x.shape[-1] > norm.MAX_N:
        return False, f"rows longer than {norm.MAX_N} elements do not fit the one-row-per-program kernel"
    if weight.numel() != x.shape[-1]:
        return False, "weight does not match x's last dimension"
    return _all_ok((x, "x"), (weight, "weight"))


def _norm_fwd_ok(x, weight, *args, fp8_scale=None, fp8_dtype=None, amax_out=None, **kwargs):
    bias = args[0] if len(args) > 1 else None  # layernorm: (bias, eps); rmsnorm: (eps,)
    for ok, why in (_fp8_out_ok(x, fp8_scale, fp8_dtype), _fp8_amax_out_ok(amax_out, x, fp8_dtype),
                    _tensor_ok(bias, "bias") if bias is not None else (True, "")):
        if not ok:
            return ok, why
    return _rows_ok(x, weight)


def _layernorm_bwd_ok(dy, x, mean, rstd, weight, **_):
    if dy.shape != x.shape or rstd.shape != x.shape[:-1] or (mean is not None and mean.shape != rstd.shape):
        return False, "dy, mean and rstd do not match x's shape"
    ok, why = _rows_ok(x, weight)
    return (ok, why) if not ok else _tensor_ok(dy, "dy")


def _rmsnorm_bwd_ok(dy, x, rstd, weight, **_):
    return _layernorm_bwd_ok(dy, x, None, rstd, weight)


def _add_ok(add, x):
    if not isinstance(add, torch.Tensor) or add.shape != x.shape or add.dtype != x.dtype or add.device != x.device:
        return False, "add is not a tensor of x's shape, dtype and device"
    return True, ""


def _layernorm_bwd_add_ok(dy, x, mean, rstd, weight, add, **_):
    ok, why = _add_ok(add, x)
    return _layernorm_bwd_ok(dy, x, mean, rstd, weight) if ok else (ok, why)


def _rmsnorm_bwd_add_ok(dy, x, rstd, weight, add, **_):
    return _layernorm_bwd_add_ok(dy, x, None, rstd, weight, add)


# --- activation ---------------------------------------------------------------------------
def activation_fwd(x, kind, *, fp8_scale=None, fp8_dtype=None, amax_out=None):
    cfg = configs.ACTIVATION_FWD_GATED if kind in activation.GATED else configs.ACTIVATION_FWD
    return activation.activation_fwd(x, kind, fp8_scale=fp8_scale, fp8_dtype=fp8_dtype, cfg=cfg,
                                     amax_out=_fp8_amax(amax_out, x, fp8_dtype))


def activation_bwd(dy, x, kind):
    return activation.activation_bwd(dy, x, kind, configs.ELEMENTWISE)


def dbias(dy):
    # torch's own CUDA column reduction, accumulating in float32 without a float32 copy of dy,
    # beat the Triton column-strip kernel at every size measured on the H200 (16384 rows x 4096 /
    # 8192 / 16384 columns: 2338 / 3162 / 3768 GB/s against 1908 / 2676 / 3095;
    # benchmarks/results/probe-dbias-only-2026-11-30.log), so this op is that reduction
    return dy.reshape(-1, dy.shape[-1]).sum(dim=0, dtype=torch.float32).to(dy.dtype)


def _dbias_ok(dy):
    if dy.dim() < 1:
        return False, "dy is 0-dim"
    return _tensor_ok(dy, "dy")


def _dbias_ct_cfg(x):
    return _tma(x, configs.DBIAS_CAST_TRANSPOSE, configs.DBIAS_CAST_TRANSPOSE_TMA)


def dbias_cast_transpose(dy, scale, fp8_dtype, *, amax_out=None):
    return dbias_ct.dbias_cast_transpose(dy, scale, fp8_dtype, _dbias_ct_cfg(dy), amax_out=fresh(amax_out, dy))


def dbias_cast_transpose_parts(parts, scale, fp8_dtype, *, amax_out=None):
    with _guard(parts[0]):
        return dbias_ct.dbias_cast_transpose_parts(parts, scale, fp8_dtype, _dbias_ct_cfg(parts[0]),
                                                   amax_out=fresh(amax_out, parts[0]))


def activation_bwd_dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, *, amax_out=None):
    if kind in activation.GATED:  # activation_bwd, then a plain dbias cast-transpose of its dx
        cfg = _dbias_ct_cfg(x)
    else:
        cfg = _tma(x, configs.DBIAS_CAST_TRANSPOSE, configs.ACT_BWD_DBIAS_CAST_TRANSPOSE_TMA)
    return dbias_ct.activation_bwd_dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, cfg, configs.ELEMENTWISE,
                                                        amax_out=fresh(amax_out, x))


def _act_fwd_ok(x, kind, *, fp8_scale=None, fp8_dtype=None, amax_out=None):
    if kind not in activation.KIND_IDS:
        return False, f"activation {kind!r} has no kernel"
    if kind in activation.GATED and (x.dim() == 0 or x.shape[-1] % 2):
        return False, "a gated activation needs an even last dimension"
    for ok, why in (_fp8_out_ok(x, fp8_scale, fp8_dtype), _fp8_amax_out_ok(amax_out, x, fp8_dtype)):
        if not ok:
            return ok, why
    return _tensor_ok(x)


def _act_bwd_ok(dy, x, kind):
    if kind in activation.KIND_IDS and x.dim() > 0:
        h = x.shape[-1] // 2 if kind in activation.GATED else x.shape[-1]
        if dy.shape != (*x.shape[:-1], h):
            return False, "dy does not match the activation's output shape"
    ok, why = _act_fwd_ok(x, kind)
    return (ok, why) if not ok else _tensor_ok(dy, "dy")


def _dbias_ct_ok(dy, scale, fp8_dtype, *, amax_out=None):
    return _cast_2d_ok(dy, scale, amax_out=amax_out)


def _dbias_ct_parts_ok(parts, scale, fp8_dtype, *, amax_out=None):
    """Parts that are column blocks of one CUDA gradient; the launcher concatenates those it
    cannot read in place, so only what the reference must explain is declined."""
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
    for ok, why in (_scale_ok(scale, first), amax_out_ok(amax_out, first), _fp8_out_device_ok(first)):
        if not ok:
            return ok, why
    return True, ""


def _act_bwd_dbias_ct_ok(dy, x, kind, scale, fp8_dtype, *, amax_out=None):
    if x.dim() != 2:
        return False, "x is not 2-D"
    for ok, why in (_scale_ok(scale, x), amax_out_ok(amax_out, x), _fp8_out_device_ok(x)):
        if not ok:
            return ok, why
    return _act_bwd_ok(dy, x, kind)


# --- scaling ------------------------------------------------------------------------------
def delayed_scaling_update(amax_histories, scales, fp8_maxes, *, margin=0.0, amax_compute_algo="max"):
    if not amax_histories:
        return None
    first = amax_histories[0]
    key = (scaling.plan_key(amax_histories, scales, fp8_maxes), float(margin), amax_compute_algo, first.get_device())
    with _guard(first):
        update_graph.run(key, lambda: scaling.plan(amax_histories, scales, fp8_maxes, first.device),
                         lambda: scaling.delayed_scaling_update(amax_histories, scales, fp8_maxes, margin=margin,
                                                                amax_compute_algo=amax_compute_algo,
                                                                cfg=configs.SCALING))
    return None


def _scaling_ok(amax_histories, scales, fp8_maxes, *, margin=0.0, amax_compute_algo="max"):
    if not callable(amax_compute_algo) and amax_compute_algo not in ("max", "most_recent"):
        return False, f"amax_compute_algo {amax_compute_algo!r} has no kernel"
    if callable(amax_compute_algo):
        return False, "a callable amax_compute_algo runs on the reference path"
    if len(amax_histories) != len(scales):
        return False, "histories and scales do not pair up (the reference names the problem)"
    if scaling.planned(amax_histories, scales, fp8_maxes):  # checked when the kernel first ran on them
        return True, ""
    devices = {t.device for t in list(amax_histories) + list(scales)}
    if len(devices) > 1 or any(d.type != "cuda" for d in devices):
        return False, "histories and scales must all be on one CUDA device"
    for h, s in zip(amax_histories, scales):
        if h.dim() != 2 or h.dtype != torch.float32 or not h.is_contiguous() or not s.is_contiguous():
            return False, "histories must be contiguous float32 (L, n) tensors with contiguous scales"
    return True, ""


# --- softmax, rope -------------------------------------------------------------------------
def softmax_fwd(x, scale, *, mask=None, causal=False):
    return softmax.softmax_fwd(x, scale, mask=mask, causal=causal, cfg=configs.SOFTMAX)


def softmax_bwd(dy, y, scale):
    return softmax.softmax_bwd(dy, y, scale, configs.SOFTMAX)


def _softmax_fwd_ok(x, scale, *, mask=None, causal=False):
    if x.dim() != 4 or x.shape[-1] > softmax.MAX_SK:
        return False, f"x must be 4-D with at most {softmax.MAX_SK} keys per row"
    if mask is not None:
        if mask.dtype != torch.bool or mask.device != x.device or mask.dim() > 4:
            return False, "mask must be a bool tensor on x's device"
        try:
            if torch.broadcast_shapes(mask.shape, x.shape) != x.shape:
                return False, "mask does not broadcast to x"
        except RuntimeError:
            return False, "mask does not broadcast to x"
    return _tensor_ok(x)


def _softmax_bwd_ok(dy, y, scale):
    if dy.dim() != 4 or dy.shape != y.shape or dy.shape[-1] > softmax.MAX_SK:
        return False, "dy and y must be 4-D of one shape"
    return _all_ok((dy, "dy"), (y, "y"))


def rope_fwd(x, freqs, *, tensor_format="sbhd", interleaved=False):
    return rope.rope_fwd(x, freqs, tensor_format=tensor_format, interleaved=interleaved, cfg=configs.ROPE)


def rope_bwd(dy, freqs, *, tensor_format="sbhd", interleaved=False):
    return rope.rope_bwd(dy, freqs, tensor_format=tensor_format, interleaved=interleaved, cfg=configs.ROPE)


def _rope_ok(x, freqs, *, tensor_format="sbhd", interleaved=False):
    if x.dim() != 4 or freqs.dim() != 4 or tensor_format not in ("sbhd", "bshd"):
        return False, "x and freqs must be 4-D, tensor_format sbhd or bshd"
    if x.shape[-2] * x.shape[-1] > 65536:
        return False, "heads x head_dim above 65536 do not fit one program"
    return _tensor_ok(x)


def cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    return loss.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                              reduction=reduction, cfg=configs.LOSS)


def _cross_entropy_ok(logits, target, **_):
    if logits.dim() != 2 or target.dim() != 1 or target.dtype.is_floating_point or target.device != logits.device:
        return False, "logits must be 2-D and target 1-D integer on the same device"
    if not logits.is_cuda or logits.dtype not in FLOAT_DTYPES or not logits.is_contiguous():
        return False, "logits must be contiguous float32/bfloat16/float16 on a CUDA device"
    return True, ""


def ops() -> Dict[str, OpImpl]:
    table = {
        "quantize_fp8": (quantize_fp8, _cast_ok),
        "cast_transpose_fp8": (cast_transpose_fp8, _cast_2d_ok),
        "quantize_fp8_current": (quantize_fp8_current, _current_ok),
        "transpose_fp8": (transpose_fp8, _transpose_ok),
        "quantize_blockwise": (quantize_blockwise, _self_scaled_2d_ok),
        "dequantize_fp8": (dequantize_fp8, _dequantize_ok),
        "dequantize_blockwise": (dequantize_blockwise, _dequantize_blockwise_ok),
        "layernorm_fwd": (layernorm_fwd, _norm_fwd_ok),
        "rmsnorm_fwd": (rmsnorm_fwd, _norm_fwd_ok),
        "layernorm_bwd": (layernorm_bwd, _layernorm_bwd_ok),
        "rmsnorm_bwd": (rmsnorm_bwd, _rmsnorm_bwd_ok),
        "layernorm_bwd_add": (layernorm_bwd_add, _layernorm_bwd_add_ok),
        "rmsnorm_bwd_add": (rmsnorm_bwd_add, _rmsnorm_bwd_add_ok),
        "activation_fwd": (activation_fwd, _act_fwd_ok),
        "activation_bwd": (activation_bwd, _act_bwd_ok),
        "dbias": (dbias, _dbias_ok),
        "dbias_cast_transpose": (dbias_cast_transpose, _dbias_ct_ok),
        "activation_bwd_dbias_cast_transpose": (activation_bwd_dbias_cast_transpose, _act_bwd_dbias_ct_ok),
        "softmax_fwd": (softmax_fwd, _softmax_fwd_ok),
        "softmax_bwd": (softmax_bwd, _softmax_bwd_ok),
        "rope_fwd": (rope_fwd, _rope_ok),
        "rope_bwd": (rope_bwd, _rope_ok),
        "cross_entropy": (cross_entropy, _cross_entropy_ok),
    }
    impls = {name: OpImpl(_on_device(fn), supports) for name, (fn, supports) in table.items()}
    impls["delayed_scaling_update"] = OpImpl(delayed_scaling_update, _scaling_ok)
    impls["dbias_cast_transpose_parts"] = OpImpl(dbias_cast_transpose_parts, _dbias_ct_parts_ok)  # guards itself
    return impls
