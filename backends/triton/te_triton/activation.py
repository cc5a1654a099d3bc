"""Activations: forward (optionally FP8 out + amax), backward, and the fused backward epilogues
(dbias + cast-transpose, activation backward + dbias + cast-transpose).

Elementwise kernels work on a 2-D view (rows, cols) of x with the last dimension as cols, in
(block_m, block_n) tiles; gated kinds read a = x[:, :h] and b = x[:, h:] of a (rows, 2h) view.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import MAX_NUMEL, Config, abs_bits, amax_from_buffer, fp8_max, grid_size, new_amax_buffer, saturating_cast
from .cast import _cast_transpose_tile, _check_input, transpose_clamps

ELEMENTWISE_DEFAULT = Config(block_m=16, block_n=256, num_warps=8, max_programs=0)
KIND_IDS = {"gelu": 0, "relu": 1, "silu": 2, "qgelu": 3, "srelu": 4, "geglu": 0, "reglu": 1, "swiglu": 2}
GATED = ("swiglu", "geglu", "reglu")
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
# gelu(x) = 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3); as a
# power of two: exp(-2u) = 2^(x (GELU_K1 + GELU_K3 x^2))
GELU_K1 = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634)
GELU_K3 = tl.constexpr(-2.0 * 0.7978845608028654 * 1.4426950408889634 * 0.044715)
NEG_LOG2E = tl.constexpr(-1.4426950408889634)
QGELU_K = tl.constexpr(-1.702 * 1.4426950408889634)


@triton.jit
def _act(x, KIND: tl.constexpr):
    """Forward activations written as x / (1 + 2^(...)): one exp2 and one (non-IEEE, 2 ulp)
    division per element, which keeps the FP8-out forward kernels memory-bound."""
    if KIND == 0:
        return tl.fdiv(x, 1.0 + tl.exp2(x * (GELU_K1 + GELU_K3 * x * x)))
    elif KIND == 1:
        return tl.maximum(x, 0.0)
    elif KIND == 2:
        return tl.fdiv(x, 1.0 + tl.exp2(x * NEG_LOG2E))
    elif KIND == 3:
        return tl.fdiv(x, 1.0 + tl.exp2(x * QGELU_K))
    else:
        r = tl.maximum(x, 0.0)
        return r * r


@triton.jit
def _dact(x, KIND: tl.constexpr):
    if KIND == 0:
        u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
    elif KIND == 1:
        return tl.where(x > 0.0, 1.0, 0.0)
    elif KIND == 2:
        s = tl.sigmoid(x)
        return s + x * s * (1.0 - s)
    elif KIND == 3:
        s = tl.sigmoid(1.702 * x)
        return s + 1.702 * x * s * (1.0 - s)
    else:
        return 2.0 * tl.maximum(x, 0.0)


@triton.jit
def _tile(t, R, C, BM: tl.constexpr, BN: tl.constexpr):
    n_tn = tl.cdiv(C, BN)
    rows = (t // n_tn) * BM + tl.arange(0, BM)
    cols = (t % n_tn) * BN + tl.arange(0, BN)
    return rows, cols, (rows[:, None] < R) & (cols[None, :] < C)


@triton.jit
def _act_fwd_kernel(x_ptr, y_ptr, scale_ptr, amax_ptr, R, H, fmax, KIND: tl.constexpr, GATED: tl.constexpr,
                    FP8_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, CLAMP: tl.constexpr):
    """y (R, H) = act(a) [* b]; x is (R, H) or, gated, (R, 2H)."""
    x_cols = 2 * H if GATED else H
    n_tiles = tl.cdiv(R, BM) * tl.cdiv(H, BN)
    scale = tl.load(scale_ptr)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows, cols, mask = _tile(t, R, H, BM, BN)
        a_off = rows[:, None] * x_cols + cols[None, :]
        y = _act(tl.load(x_ptr + a_off, mask=mask, other=0.0).to(tl.float32), KIND)
        if GATED:
            y = y * tl.load(x_ptr + a_off + H, mask=mask, other=0.0).to(tl.float32)
        out = y_ptr + rows[:, None] * H + cols[None, :]
        if FP8_OUT:
            acc = tl.maximum(acc, abs_bits(y))
            tl.store(out, saturating_cast(y * scale, fmax, y_ptr.dtype.element_ty, CLAMP), mask=mask)
        else:
            tl.store(out, y.to(y_ptr.dtype.element_ty), mask=mask)
    if FP8_OUT:
        tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def _act_bwd_kernel(dy_ptr, x_ptr, dx_ptr, R, H, KIND: tl.constexpr, GATED: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    x_cols = 2 * H if GATED else H
    n_tiles = tl.cdiv(R, BM) * tl.cdiv(H, BN)
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows, cols, mask = _tile(t, R, H, BM, BN)
        a_off = rows[:, None] * x_cols + cols[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.load(x_ptr + a_off, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            b = tl.load(x_ptr + a_off + H, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_ptr + a_off, (dy * b * _dact(a, KIND)).to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_ptr + a_off + H, (dy * _act(a, KIND)).to(dx_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(dx_ptr + a_off, (dy * _dact(a, KIND)).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dbias_ct_load(g_ptr, x_ptr, tm, cols, M, N, BM: tl.constexpr, ACT: tl.constexpr):
    """Row tile tm of g (and of x when ACT), in their dtype; zeros beyond M."""
    rows = tm * BM + tl.arange(0, BM)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    off = rows[:, None] * N + cols[None, :]
    g = tl.load(g_ptr + off, mask=mask, other=0.0)
    if ACT:
        return g, tl.load(x_ptr + off, mask=mask, other=0.0)
    return g, g


@triton.jit
def _dbias_ct_kernel(g_ptr, x_ptr, y_ptr, yt_ptr, scale_ptr, amax_ptr, dbias_ptr, M, N, fmax, groups,
                     g1_ptr, g2_ptr, B1, B2,
                     ACT: tl.constexpr, KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     CLAMP: tl.constexpr, PREFETCH: tl.constexpr, PARTS: tl.constexpr):
    """Cast-transpose of a gradient with its column sums (dbias). ACT: the gradient is
    dx = g * act'(x) (non-gated), rounded to x's dtype as the unfused ops do; else it is g.

    A program owns one column strip and every `groups`-th row tile of it, so column sums and
    the amax build up element-wise in registers: one reduction and one atomic per program, and
    a (groups, N) partial-sum buffer, instead of a reduction per tile. PREFETCH loads the next
    tile before working on the current one.

    PARTS > 1: g is not one tensor but the column blocks g_ptr | g1_ptr | g2_ptr, starting at
    columns 0, B1 and B2, each a whole number of strips wide; a strip reads from its block."""
    pid = tl.program_id(0)
    tn = pid // groups
    cols = tn * BN + tl.arange(0, BN)
    src, src_cols, src_n = g_ptr, cols, N
    if PARTS > 1:
        if tn * BN >= B2:
            src, src_cols, src_n = g2_ptr, cols - B2, N - B2
        elif tn * BN >= B1:
            src, src_cols, src_n = g1_ptr, cols - B1, B2 - B1
        else:
            src_n = B1
    scale = tl.load(scale_ptr)
    colsum = tl.zeros([BM, BN], dtype=tl.float32)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    if PREFETCH:
        g_next, x_next = _dbias_ct_load(src, x_ptr, pid % groups, src_cols, M, src_n, BM, ACT)
    for tm in range(pid % groups, tl.cdiv(M, BM), groups):
        if PREFETCH:
            g, x = g_next, x_next
            g_next, x_next = _dbias_ct_load(src, x_ptr, tm + groups, src_cols, M, src_n, BM, ACT)
        else:
            g, x = _dbias_ct_load(src, x_ptr, tm, src_cols, M, src_n, BM, ACT)
        if ACT:
            v = (g.to(tl.float32) * _dact(x.to(tl.float32), KIND)).to(x.dtype).to(tl.float32)
        else:
            v = g.to(tl.float32)
        _cast_transpose_tile(y_ptr, yt_ptr, v, tm, tn, M, N, scale, fmax, BM, BN, CLAMP)
        colsum += v
        acc = tl.maximum(acc, abs_bits(v))
    tl.store(dbias_ptr + (pid % groups) * N + cols, tl.sum(colsum, axis=0), mask=cols < N)
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


def _dbias_cast_transpose(g, x, kind, scale, fp8_dtype, cfg: Config, amax_out, parts=None):
    """(data, data_t, dbias in x's dtype, amax) of g (x is None) or of activation_bwd(g, x, kind),
    or of the column blocks `parts` of g (at most three, each a whole number of block_n wide)."""
    fmax = fp8_max(fp8_dtype)
    blocks = [g] if parts is None else list(parts)
    g = blocks[0]
    src = g if x is None else x
    widths = [b.shape[1] for b in blocks]
    M, N = src.shape[0], sum(widths)
    starts = [min(sum(widths[:i]), N) for i in (1, 2)]  # where blocks 1 and 2 begin (N: no such block)
    blocks += [blocks[-1]] * (3 - len(blocks))
    y = torch.empty((M, N), dtype=fp8_dtype, device=src.device)
    yt = torch.empty((N, M), dtype=fp8_dtype, device=src.device)
    amax_buf = new_amax_buffer(src.device, amax_out)
    n_tm, n_tn = triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n)
    # row groups per column strip: enough programs to fill the GPU (cfg.max_programs), no more
    groups = max(1, min(n_tm, cfg.max_programs // n_tn)) if cfg.max_programs > 0 else n_tm
    partial = torch.empty((groups, N), dtype=torch.float32, device=src.device)
    if M * N:
        _dbias_ct_kernel[(groups * n_tn,)](
            g, src, y, yt, scale, amax_buf, partial, M, N, fmax, groups, blocks[1], blocks[2], starts[0], starts[1],
            ACT=x is not None, KIND=KIND_IDS.get(kind, 0), BM=cfg.block_m, BN=cfg.block_n,
            CLAMP=transpose_clamps(cfg, src), PREFETCH=cfg.prefetch, PARTS=1 if parts is None else len(parts),
            num_warps=cfg.num_warps)
    dbias = partial.sum(dim=0) if M else torch.zeros(N, dtype=torch.float32, device=src.device)
    return y, yt, dbias.to(src.dtype), amax_from_buffer(amax_buf, amax_out)


def _check(x: torch.Tensor, kind: str):
    if kind not in KIND_IDS:
        raise ValueError(f"unknown activation kind {kind!r}; use one of {', '.join(KIND_IDS)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous; call .contiguous() first")
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"x has {x.numel()} elements; these kernels index with int32 (at most {MAX_NUMEL})")
    gated = kind in GATED
    cols = x.shape[-1] if x.dim() else 1
    if gated and cols % 2:
        raise ValueError(f"gated activation {kind!r} needs an even last dimension, got {cols}")
    return gated, x.numel() // max(cols, 1), cols // 2 if gated else cols


def _grid(R, H, cfg):
    return (grid_size(triton.cdiv(R, cfg.block_m) * triton.cdiv(H, cfg.block_n), cfg),)


def activation_fwd(x, kind, *, fp8_scale=None, fp8_dtype=None, cfg: Config = ELEMENTWISE_DEFAULT, amax_out=None):
    """(y, amax or None) as te_core.ops.activation_fwd."""
    gated, R, H = _check(x, kind)
    fp8_out = fp8_dtype is not None
    if amax_out is not None and not fp8_out:
        raise ValueError("amax_out records the amax of an FP8 output: pass fp8_scale and fp8_dtype too")
    fmax = fp8_max(fp8_dtype) if fp8_out else 1.0
    y = torch.empty((*x.shape[:-1], H), dtype=fp8_dtype if fp8_out else x.dtype, device=x.device)
    amax_buf = new_amax_buffer(x.device, amax_out)
    if y.numel():
        _act_fwd_kernel[_grid(R, H, cfg)](
            x, y, fp8_scale if fp8_out else amax_buf, amax_buf, R, H, fmax, KIND=KIND_IDS[kind], GATED=gated,
            FP8_OUT=fp8_out, BM=cfg.block_m, BN=cfg.block_n, CLAMP=not cfg.hw_saturate, num_warps=cfg.num_warps)
    return y, amax_from_buffer(amax_buf, amax_out) if fp8_out else None


def activation_bwd(dy, x, kind, cfg: Config = ELEMENTWISE_DEFAULT):
    """dx as te_core.ops.activation_bwd."""
    gated, R, H = _check(x, kind)
    if dy.shape != (*x.shape[:-1], H) or not dy.is_contiguous():
        raise ValueError(f"dy must be contiguous with shape {(*x.shape[:-1], H)}, got {tuple(dy.shape)}")
    dx = torch.empty_like(x)
    if dy.numel():
        _act_bwd_kernel[_grid(R, H, cfg)](dy, x, dx, R, H, KIND=KIND_IDS[kind], GATED=gated, BM=cfg.block_m,
                                          BN=cfg.block_n, num_warps=cfg.num_warps)
    return dx


DBIAS_CAST_TRANSPOSE_DEFAULT = Config(block_m=32, block_n=128, num_warps=4, max_programs=1024)


def dbias_cast_transpose(dy, scale, fp8_dtype, cfg: Config = DBIAS_CAST_TRANSPOSE_DEFAULT, *, amax_out=None):
    """(data, data_t, dbias, amax) as te_core.ops.dbias_cast_transpose."""
    _check_input(dy, scale, two_d=True)
    return _dbias_cast_transpose(dy, None, None, scale, fp8_dtype, cfg, amax_out)


def dbias_cast_transpose_parts(parts, scale, fp8_dtype, cfg: Config = DBIAS_CAST_TRANSPOSE_DEFAULT, *,
                               amax_out=None):
    """(data, data_t, dbias, amax) as te_core.ops.dbias_cast_transpose_parts. The kernel reads
    up to three contiguous parts in place when each is a whole number of cfg.block_n columns
    wide (a strip then lies in one part); other parts are concatenated first."""
    parts = list(parts) if isinstance(parts, (list, tuple)) else parts
    if not isinstance(parts, list) or not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError("parts must be a non-empty list or tuple of 2-D tensors")
    for i, p in enumerate(parts):
        if p.dim() != 2 or p.shape[0] != parts[0].shape[0] or p.dtype != parts[0].dtype or p.device != parts[0].device:
            raise ValueError(f"parts[{i}] ({p.dtype}, shape {tuple(p.shape)}, {p.device}) is not a column block "
                             f"matching parts[0] ({parts[0].dtype}, {parts[0].shape[0]} rows, {parts[0].device})")
    direct = 1 < len(parts) <= 3 and all(p.is_contiguous() and p.shape[1] % cfg.block_n == 0 for p in parts)
    if not direct:
        dy = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return dbias_cast_transpose(dy, scale, fp8_dtype, cfg, amax_out=amax_out)
    for p in parts:
        _check_input(p, scale, two_d=True)
    if parts[0].shape[0] * sum(p.shape[1] for p in parts) > MAX_NUMEL:
        raise ValueError(f"the parts hold more than {MAX_NUMEL} elements; these kernels index with int32")
    return _dbias_cast_transpose(None, None, None, scale, fp8_dtype, cfg, amax_out, parts=parts)


def dbias_cast_transpose_parts_supports(parts, *args, **kwargs):
    """For backends binding the launcher generically: the parts' first tensor decides."""
    first = parts[0] if isinstance(parts, (list, tuple)) and parts else None
    if not isinstance(first, torch.Tensor) or first.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, "parts must be a non-empty list of float32, bfloat16 or float16 tensors"
    return True, ""


def activation_bwd_dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, cfg: Config = DBIAS_CAST_TRANSPOSE_DEFAULT,
                                        act_cfg: Config = ELEMENTWISE_DEFAULT, *, amax_out=None):
    """(data, data_t, dbias, amax) of dx = activation_bwd(dy, x, kind); one pass for
    non-gated kinds, activation_bwd then dbias_cast_transpose for gated ones."""
    gated, _, _ = _check(x, kind)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if gated:
        return dbias_cast_transpose(activation_bwd(dy, x, kind, act_cfg), scale, fp8_dtype, cfg, amax_out=amax_out)
    if dy.shape != x.shape or not dy.is_contiguous():
        raise ValueError(f"dy must be contiguous with x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    _check_input(dy, scale, two_d=True)
    return _dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, cfg, amax_out)

