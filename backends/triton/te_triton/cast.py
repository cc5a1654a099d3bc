"""FP8 casts with amax: delayed scaling (given scale), cast-transpose, current scaling.

quantize_fp8 and cast_transpose_fp8 record amax in the same pass as the cast: each program
keeps a running max of |x| bits and does one integer atomic max at the end (see
_common.max_into). Current scaling is an amax pass and a cast pass whose programs make
the scale from that amax on the device: two launches, no host synchronisation.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, FP8_DTYPES, MAX_NUMEL, Config, abs_bits, amax_from_buffer, cdiv, check_scalar,
                      fp8_max, grid_size, max_into, new_amax_buffer, saturating_cast, scale_from_amax, as_float32)
from .launch import launcher

QUANTIZE_DEFAULT = Config(block=4096, num_warps=8)
CAST_TRANSPOSE_DEFAULT = Config(block_m=64, block_n=64, num_warps=4)


@triton.jit
def _cast_scale(scale_ptr, scale_inv_ptr, amax_ptr, fmax, eps, FROM_AMAX: tl.constexpr, POW2: tl.constexpr):
    """The scale a cast multiplies by: read from scale_ptr, or (FROM_AMAX, current scaling) made
    from the amax a previous pass left at amax_ptr, which program 0 then stores with its
    inverse: the scale needs no kernel of its own."""
    if FROM_AMAX:
        scale = scale_from_amax(tl.load(amax_ptr), fmax, eps, POW2)
        if tl.program_id(0) == 0:
            tl.store(scale_ptr, scale)
            tl.store(scale_inv_ptr, tl.math.div_rn(1.0, scale))
    else:
        scale = tl.load(scale_ptr)
    return scale


@launcher
@triton.jit
def _quantize_kernel(x_ptr, y_ptr, scale_ptr, amax_ptr, n, fmax, scale_inv_ptr, eps, BLOCK: tl.constexpr,
                     STORE: tl.constexpr, CLAMP: tl.constexpr, FROM_AMAX: tl.constexpr = False,
                     POW2: tl.constexpr = False):
    """STORE: cast x with the scale (see _cast_scale) into y; without FROM_AMAX, max |x| into
    amax_ptr (see max_into), which is all the kernel does without STORE."""
    fmax, eps = as_float32(fmax), as_float32(eps)
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    scale = _cast_scale(scale_ptr, scale_inv_ptr, amax_ptr, fmax, eps, FROM_AMAX, POW2)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if not FROM_AMAX:
            acc = tl.maximum(acc, abs_bits(v))
        if STORE:
            tl.store(y_ptr + offs, saturating_cast(v * scale, fmax, y_ptr.dtype.element_ty, CLAMP), mask=mask)
    if not FROM_AMAX:
        max_into(amax_ptr, tl.max(acc, axis=0))


def transpose_clamps(cfg: Config, x: torch.Tensor, transpose: bool = True) -> bool:
    """Whether a cast kernel of x clamps before its FP8 convert (`transpose`: it also writes the
    column-wise copy). Without cfg.hw_saturate it always does. With it, a cast without the copy
    leaves saturation to the hardware; one with the copy only for bf16 input: for a float32
    tile, Triton's code for the column-wise copy can give NaN where values beyond the FP8 max
    should saturate; bf16 input saturates correctly, and fp16 input keeps the clamp until a GPU
    test checks it."""
    return not cfg.hw_saturate or (transpose and x.dtype != torch.bfloat16)


@triton.jit
def _cast_transpose_tile(y_ptr, yt_ptr, v, tm, tn, M, N, scale, fmax, BM: tl.constexpr, BN: tl.constexpr,
                         CLAMP: tl.constexpr):
    """Store one (BM, BN) tile v (float32) cast to FP8, row-wise and column-wise."""
    rows = tm * BM + tl.arange(0, BM)
    cols = tn * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    q = saturating_cast(v * scale, fmax, y_ptr.dtype.element_ty, CLAMP)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
    mask_t = (cols[:, None] < N) & (rows[None, :] < M)
    tl.store(yt_ptr + cols[:, None] * M + rows[None, :], tl.trans(q), mask=mask_t)


@launcher
@triton.jit
def _cast_transpose_kernel(x_ptr, y_ptr, yt_ptr, scale_ptr, amax_ptr, M, N, fmax, scale_inv_ptr, eps,
                           BM: tl.constexpr, BN: tl.constexpr, CLAMP: tl.constexpr, FROM_AMAX: tl.constexpr = False,
                           POW2: tl.constexpr = False):
    """Both layouts of x cast with the scale (see _cast_scale); max |x| as _quantize_kernel."""
    fmax, eps = as_float32(fmax), as_float32(eps)
    pid = tl.program_id(0)
    n_tn = tl.cdiv(N, BN)
    n_tiles = tl.cdiv(M, BM) * n_tn
    scale = _cast_scale(scale_ptr, scale_inv_ptr, amax_ptr, fmax, eps, FROM_AMAX, POW2)
    acc = tl.zeros([], dtype=tl.int32)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        tm = t // n_tn
        tn = t % n_tn
        rows = tm * BM + tl.arange(0, BM)
        cols = tn * BN + tl.arange(0, BN)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        v = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        _cast_transpose_tile(y_ptr, yt_ptr, v, tm, tn, M, N, scale, fmax, BM, BN, CLAMP)
        if not FROM_AMAX:
            acc = tl.maximum(acc, tl.max(tl.max(abs_bits(v), axis=1), axis=0))
    if not FROM_AMAX:
        max_into(amax_ptr, acc)


def _check_x(x: torch.Tensor, two_d: bool) -> None:
    """x as the cast kernels index it (2-D where two_d)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous; call .contiguous() first")
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"x has {x.numel()} elements; these kernels index with int32 (at most {MAX_NUMEL})")
    if two_d and x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K) for a transposed output, got shape {tuple(x.shape)}")


def _check_input(x: torch.Tensor, scale: torch.Tensor, two_d: bool) -> None:
    """x (see _check_x) and the scale a cast of it multiplies by."""
    _check_x(x, two_d)
    check_scalar(scale, x.device, "scale")


def current_slots(device, scale_out: Optional[torch.Tensor], scale_inv_out: Optional[torch.Tensor]):
    """(scale, scale_inv) that current scaling's cast pass writes: the caller's, else new ones."""
    if scale_out is not None:
        check_scalar(scale_out, device, "scale_out")
    else:
        scale_out = torch.empty(1, dtype=torch.float32, device=device)
    if scale_inv_out is not None:
        check_scalar(scale_inv_out, device, "scale_inv_out")
    else:
        scale_inv_out = torch.empty(1, dtype=torch.float32, device=device)
    return scale_out, scale_inv_out


# A cast pass's current-scaling arguments: (scale_inv to write, amax_epsilon, force_pow2_scales),
# or NO_CURRENT for a cast with a given scale.
NO_CURRENT = (None, 0.0, False)


def _quantize(x, scale, amax_buf, fp8_dtype, fmax, cfg: Config, current=NO_CURRENT) -> torch.Tensor:
    """The cast pass of quantize_fp8 (and of current scaling: see _cast_scale); fmax: fp8_dtype's max."""
    scale_inv, eps, pow2 = current
    y = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    n = x.numel()
    if n or scale_inv is not None:  # (current scaling: an empty x still gets its scale, 1)
        _quantize_kernel[(grid_size(cdiv(n, cfg.block), cfg),)](
            x, y, scale, amax_buf, n, fmax, scale if scale_inv is None else scale_inv, eps,
            BLOCK=cfg.block, STORE=True, CLAMP=not cfg.hw_saturate, FROM_AMAX=scale_inv is not None, POW2=pow2,
            num_warps=cfg.num_warps)
    return y


def _cast_transpose(x, scale, amax_buf, fp8_dtype, fmax, cfg: Config, current=NO_CURRENT):
    """The pass of cast_transpose_fp8 (and of current scaling: see _cast_scale): (data, data_t)."""
    scale_inv, eps, pow2 = current
    M, N = x.shape
    y = torch.empty((M, N), dtype=fp8_dtype, device=x.device)
    yt = torch.empty((N, M), dtype=fp8_dtype, device=x.device)
    if x.numel() or scale_inv is not None:
        n_tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
        _cast_transpose_kernel[(grid_size(n_tiles, cfg),)](
            x, y, yt, scale, amax_buf, M, N, fmax, scale if scale_inv is None else scale_inv, eps,
            BM=cfg.block_m, BN=cfg.block_n, CLAMP=transpose_clamps(cfg, x), FROM_AMAX=scale_inv is not None,
            POW2=pow2, num_warps=cfg.num_warps)
    return y, yt


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, cfg: Config = QUANTIZE_DEFAULT, *,
                 amax_out: Optional[torch.Tensor] = None):
    """(data, amax): saturate(x * scale) cast to fp8_dtype, and max|x| (NaN if x has one),
    maxed into `amax_out` when given (then returned as the amax)."""
    fmax = fp8_max(fp8_dtype)
    _check_input(x, scale, two_d=False)
    amax = new_amax_buffer(x.device, amax_out)
    return _quantize(x, scale, amax, fp8_dtype, fmax, cfg), amax_from_buffer(amax, amax_out)


def amax(x: torch.Tensor, cfg: Config = QUANTIZE_DEFAULT, *, amax_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max|x| as a 0-dim float32 tensor (NaN if x has one), one pass; maxed into `amax_out`
    when given (then returned as the amax)."""
    _check_x(x, two_d=False)
    buf = new_amax_buffer(x.device, amax_out)
    n = x.numel()
    if n:
        _quantize_kernel[(grid_size(cdiv(n, cfg.block), cfg),)](
            x, x, buf, buf, n, 1.0, buf, 0.0, BLOCK=cfg.block, STORE=False, CLAMP=True, FROM_AMAX=False,
            POW2=False, num_warps=cfg.num_warps)
    return amax_from_buffer(buf, amax_out)


def cast_transpose_fp8(x, scale, fp8_dtype, cfg: Config = CAST_TRANSPOSE_DEFAULT, *,
                       amax_out: Optional[torch.Tensor] = None):
    """(data (M,K), data_t (K,M), amax) for a 2-D x, one pass over x."""
    fmax = fp8_max(fp8_dtype)
    _check_input(x, scale, two_d=True)
    amax_buf = new_amax_buffer(x.device, amax_out)
    y, yt = _cast_transpose(x, scale, amax_buf, fp8_dtype, fmax, cfg)
    return y, yt, amax_from_buffer(amax_buf, amax_out)


def quantize_fp8_current(
    x, fp8_dtype, *, with_transpose=False, force_pow2_scales=False, amax_epsilon=0.0,
    cfg: Config = QUANTIZE_DEFAULT, ct_cfg: Config = CAST_TRANSPOSE_DEFAULT, amax_out: Optional[torch.Tensor] = None,
    scale_out: Optional[torch.Tensor] = None, scale_inv_out: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, data_t or None, scale, scale_inv, amax): an amax pass, then a cast pass whose
    programs make the scale from that amax on the device (no host synchronisation, and no
    kernel for the scale alone). `amax_out` as for amax(); `scale_out` / `scale_inv_out`:
    1-element float32 tensors the scale and its inverse are written into (else new ones)."""
    fmax = fp8_max(fp8_dtype)
    if with_transpose and x.dim() != 2:
        _check_x(x, two_d=True)
    scale, scale_inv = current_slots(x.device, scale_out, scale_inv_out)
    amax_t = amax(x, cfg, amax_out=amax_out)
    current = (scale_inv, float(amax_epsilon), bool(force_pow2_scales))
    if with_transpose:
        data, data_t = _cast_transpose(x, scale, amax_t, fp8_dtype, fmax, ct_cfg, current)
    else:
        data, data_t = _quantize(x, scale, amax_t, fp8_dtype, fmax, cfg, current), None
    return data, data_t, scale, scale_inv, amax_t


@launcher
@triton.jit
def _dequantize_kernel(x_ptr, s_ptr, y_ptr, n, BLOCK: tl.constexpr):
    s = tl.load(s_ptr)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32) * s
        tl.store(y_ptr + offs, v.to(y_ptr.dtype.element_ty), mask=offs < n)


def check_dequantize_args(data: torch.Tensor, out_dtype: torch.dtype) -> None:
    if data.dtype not in FP8_DTYPES:
        raise TypeError(f"data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if not data.is_contiguous():
        raise ValueError("data must be contiguous; call .contiguous() first")
    if data.numel() > MAX_NUMEL:
        raise ValueError(f"data has {data.numel()} elements; these kernels index with int32 (at most {MAX_NUMEL})")


def dequantize_fp8(data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype,
                   cfg: Config = QUANTIZE_DEFAULT) -> torch.Tensor:
    """data * scale_inv in float32, cast to out_dtype (as te_core.ops.dequantize_fp8): one pass."""
    check_dequantize_args(data, out_dtype)
    check_scalar(scale_inv, data.device, "scale_inv")
    y = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    n = data.numel()
    if n:
        _dequantize_kernel[(grid_size(cdiv(n, cfg.block), cfg),)](data, scale_inv, y, n, BLOCK=cfg.block,
                                                                          num_warps=cfg.num_warps)
    return y


TRANSPOSE_DEFAULT = Config(block_m=64, block_n=128, num_warps=4)


@launcher
@triton.jit
def _transpose_kernel(x_ptr, y_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    # FP8 pointers moved as bytes: the kernel takes the FP8 tensors themselves (a uint8 view of
    # each would be two more torch calls per transpose on the host) and copies their bits
    x_ptr = x_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    y_ptr = y_ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
    pid = tl.program_id(0)
    n_tn = tl.cdiv(N, BN)
    rows = (pid // n_tn) * BM + tl.arange(0, BM)
    cols = (pid % n_tn) * BN + tl.arange(0, BN)
    v = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < N))
    tl.store(y_ptr + cols[:, None] * M + rows[None, :], tl.trans(v), mask=(cols[:, None] < N) & (rows[None, :] < M))


def transpose_fp8(data: torch.Tensor, cfg: Config = TRANSPOSE_DEFAULT) -> torch.Tensor:
    """data.t().contiguous() for a contiguous 2-D FP8 tensor, moved as bytes (bit for bit)."""
    if data.dtype not in FP8_DTYPES:
        raise TypeError(f"data must be float8_e4m3fn or float8_e5m2, got {data.dtype}")
    if data.dim() != 2 or not data.is_contiguous():
        raise ValueError(f"data must be a contiguous 2-D tensor, got shape {tuple(data.shape)} "
                         f"(contiguous: {data.is_contiguous()})")
    if data.numel() > MAX_NUMEL:
        raise ValueError(f"data has {data.numel()} elements; these kernels index with int32 (at most {MAX_NUMEL})")
    M, N = data.shape
    out = torch.empty((N, M), dtype=data.dtype, device=data.device)
    if data.numel():
        grid = (cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n),)
        _transpose_kernel[grid](data, out, M, N, BM=cfg.block_m, BN=cfg.block_n, num_warps=cfg.num_warps)
    return out
