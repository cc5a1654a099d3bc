"""LayerNorm / RMSNorm over the last dimension: forward (optionally FP8 out + amax) and backward.

Forward: a program owns whole rows (the rows live in registers, BLOCK_N >= N), `cfg.rows` of
them per step, and loops over rows, so gamma/beta are loaded once per program (unless the config
asks to reload them each step) and amax costs one atomic per program.
Backward: a row loop, loading each next row while it reduces the current one, computes dx
and keeps float32 partial dgamma/dbeta per program; the launcher sums the (programs, N) partials.
With Config.tma_stages the launchers run norm_tma's kernels instead (rows through TMA
descriptors, software-pipelined) where the tensors allow.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import norm_tma
from ._common import (MAX_NUMEL, Config, abs_bits, amax_from_buffer, as_float32, cdiv, check_device, check_hp_input,
                      fp8_max, fp8_out_args, grid_size, max_into, new_amax_buffer, next_power_of_2, saturating_cast)
from ._norm_math import backward_step, norm_params, row_statistics, scale_shift
from .launch import launcher

NORM_DEFAULT = Config(num_warps=8, max_programs=1024)
MAX_N = 65536  # one row must fit in a program's registers
MAX_TILE = 16384  # rows x padded columns per step, at most
TILE_AMAX_ELEMENTS_PER_THREAD = 32  # beyond this, a per-element running amax costs too many registers


@launcher
@triton.jit
def _norm_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, scale_ptr, amax_ptr, M, N, eps, fmax,
                     BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                     FP8_OUT: tl.constexpr, AMAX_MODE: tl.constexpr, CHUNK: tl.constexpr, HOIST: tl.constexpr,
                     CLAMP: tl.constexpr, EVEN: tl.constexpr):
    """ROWS rows per step. The running amax (AMAX_MODE): 0, one block reduction per step (a
    block-wide barrier); 1, per element (one reduction at the end) when the tile fits registers;
    2, per CHUNK-element chunk (a thread-local max each step). HOIST keeps gamma/beta in
    registers across steps; else they are reloaded each step (cache hits), which frees
    registers for long rows. EVEN (N == BLOCK_N and M a multiple of ROWS): every step is a
    full tile, so loads, stores and the amax go without per-element masks. eps and fmax as
    float32 (as_float32: a launch from compiled code passes them as float64)."""
    eps, fmax = as_float32(eps), as_float32(fmax)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HOIST:
        g0, beta0 = norm_params(w_ptr, b_ptr, cols, cmask, RMS, ZERO_CENTERED)
    scale = tl.load(scale_ptr)
    if AMAX_MODE == 1:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.int32)
    elif AMAX_MODE == 2:
        acc = tl.zeros([ROWS * BLOCK_N // CHUNK], dtype=tl.int32)
    else:
        acc = tl.zeros([], dtype=tl.int32)
    for first in range(tl.program_id(0) * ROWS, M, tl.num_programs(0) * ROWS):
        rows = first + tl.arange(0, ROWS)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        if EVEN:
            x = tl.load(x_ptr + offs).to(tl.float32)
        else:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        xc, rstd = row_statistics(x, mask, rows, rmask, mean_ptr, rstd_ptr, N, eps, RMS, not EVEN)
        if HOIST:
            g, beta = g0, beta0
        else:
            g, beta = norm_params(w_ptr, b_ptr, cols, cmask, RMS, ZERO_CENTERED)
        y = scale_shift(xc, rstd, g, beta, RMS)
        if FP8_OUT:
            if EVEN:
                bits = abs_bits(y)
            else:
                bits = tl.where(mask, abs_bits(y), 0)  # a padding row would otherwise contribute beta
            if AMAX_MODE == 1:
                acc = tl.maximum(acc, bits)
            elif AMAX_MODE == 2:
                chunks = tl.reshape(bits, [ROWS * BLOCK_N // CHUNK, CHUNK], can_reorder=True)
                acc = tl.maximum(acc, tl.max(chunks, axis=1))
            else:
                acc = tl.maximum(acc, tl.max(tl.max(bits, axis=1), axis=0))
            out = saturating_cast(y * scale, fmax, y_ptr.dtype.element_ty, CLAMP)
        else:
            out = y.to(y_ptr.dtype.element_ty)
        if EVEN:
            tl.store(y_ptr + offs, out)
        else:
            tl.store(y_ptr + offs, out, mask=mask)
    if FP8_OUT:
        if AMAX_MODE == 1:
            max_into(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))
        elif AMAX_MODE == 2:
            max_into(amax_ptr, tl.max(acc, axis=0))
        else:
            max_into(amax_ptr, acc)


@launcher
@triton.jit
def _norm_bwd_kernel(dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, dx_ptr, dw_part_ptr, db_part_ptr, add_ptr, M, N,
                     BLOCK_N: tl.constexpr, RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, ADD: tl.constexpr):
    """Rows pid, pid + programs, ...; the launch has at most M programs. Each step loads the
    NEXT row's x and dy before reducing the current one, so a program's loads overlap its own
    block reduction. ADD: the row of
    `add` is added to dx in float32 (_norm_math.backward_step)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        g = g + 1.0
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_next = tl.load(x_ptr + pid * N + cols, mask=cmask, other=0.0)
    dy_next = tl.load(dy_ptr + pid * N + cols, mask=cmask, other=0.0)
    for row in range(pid, M, step):
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        following = row + step
        fmask = cmask & (cols * 0 + following < M)
        x_next = tl.load(x_ptr + following * N + cols, mask=fmask, other=0.0)
        dy_next = tl.load(dy_ptr + following * N + cols, mask=fmask, other=0.0)
        dw, db = backward_step(x, dy, g, row, mean_ptr, rstd_ptr, add_ptr, dx_ptr, cols, cmask, N, dw, db, RMS, ADD, 0)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cmask)
    if not RMS:
        tl.store(db_part_ptr + pid * N + cols, db, mask=cmask)


def _rows(x: torch.Tensor, weight: torch.Tensor):
    check_hp_input(x)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous; call .contiguous() first")
    N = x.shape[-1] if x.dim() else 0
    _check_param(weight, N, x, "weight")
    if N > MAX_N or x.numel() > MAX_NUMEL:
        raise ValueError(f"rows of {N} elements (or {x.numel()} in all) are too large for this kernel (max {MAX_N})")
    return x.numel() // max(N, 1), N


def _check_param(p: torch.Tensor, N: int, x: torch.Tensor, name: str) -> None:
    """weight or bias: the kernels read N consecutive elements of it on x's device."""
    if p.numel() != N:
        raise ValueError(f"{name} has {p.numel()} elements but x's last dimension is {N}")
    if not p.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    check_device(p, x, name)


def _check_stat(stat, x: torch.Tensor, name: str) -> None:
    """mean or rstd of the forward: the kernels read one float per row of x, in row order."""
    if stat is None or stat.shape != x.shape[:-1] or not stat.is_contiguous():
        got = "None" if stat is None else f"shape {tuple(stat.shape)}{'' if stat.is_contiguous() else ', strided'}"
        raise ValueError(f"{name} must be the forward's contiguous {name} of shape {tuple(x.shape[:-1])}, got {got}")
    check_device(stat, x, name)


def norm_fwd(x, weight, bias, eps, *, rms: bool, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None,
             cfg: Config = NORM_DEFAULT, amax_out=None):
    """(y, mean or None, rstd, amax or None) as te_core.ops.layernorm_fwd / rmsnorm_fwd."""
    M, N = _rows(x, weight)
    if not rms:  # (LayerNorm's kernel would read weight in bias's place)
        if bias is None:
            raise ValueError("LayerNorm needs a bias (rms=False); pass zeros for none")
        _check_param(bias, N, x, "bias")
    fp8_out = fp8_out_args(x, fp8_scale, fp8_dtype)
    fmax = fp8_max(fp8_dtype) if fp8_out else 1.0
    y = torch.empty(x.shape, dtype=fp8_dtype if fp8_out else x.dtype, device=x.device)
    stats_shape = x.shape[:-1]
    rstd = torch.empty(stats_shape, dtype=torch.float32, device=x.device)
    mean = None if rms else torch.empty(stats_shape, dtype=torch.float32, device=x.device)
    if amax_out is not None and not fp8_out:
        raise ValueError("amax_out records the amax of an FP8 output: pass fp8_scale and fp8_dtype too")
    # without FP8 out the kernel never touches scale or amax: rstd stands in, so no buffer is zeroed
    amax_buf = new_amax_buffer(x.device, amax_out) if fp8_out else rstd
    scale = fp8_scale if fp8_out else rstd
    # the views and descriptor checks only where the config asks for descriptors (a hot path)
    tma = M and fp8_out and cfg.tma_stages and norm_tma.forward(
        x.view(M, N), y.view(M, N), weight, bias, mean, rstd, scale, amax_buf, eps, fmax, rms=rms,
        zero_centered_gamma=zero_centered_gamma, cfg=cfg)
    if M and not tma:
        programs, meta = fwd_launch(M, N, cfg)
        _norm_fwd_kernel[(programs,)](
            x, weight, weight if bias is None else bias, y, rstd if mean is None else mean, rstd, scale, amax_buf,
            M, N, float(eps), fmax, RMS=rms, ZERO_CENTERED=bool(zero_centered_gamma), FP8_OUT=fp8_out, **meta)
    return y, mean, rstd, amax_from_buffer(amax_buf, amax_out) if fp8_out else None


def fwd_launch(M: int, N: int, cfg: Config):
    """(programs, keywords) of the pointer kernel's forward over M rows of N: its tile, amax mode
    and the config's choices, all but RMS, ZERO_CENTERED and FP8_OUT."""
    block_n = next_power_of_2(N)
    rows = max(1, min(cfg.rows, MAX_TILE // block_n))
    chunk = min(cfg.amax_chunk, rows * block_n)
    if chunk:
        amax_mode = 2
    else:
        amax_mode = 1 if rows * block_n <= TILE_AMAX_ELEMENTS_PER_THREAD * 32 * cfg.num_warps else 0
    return grid_size(cdiv(M, rows), cfg), dict(
        BLOCK_N=block_n, ROWS=rows, AMAX_MODE=amax_mode, CHUNK=max(chunk, 1), HOIST=cfg.hoist_params,
        CLAMP=not cfg.hw_saturate, EVEN=block_n == N and M % rows == 0, num_warps=cfg.num_warps)


def norm_bwd_add(dy, x, mean: Optional[torch.Tensor], rstd, weight, add, *, rms: bool, zero_centered_gamma=False,
                 cfg: Config = NORM_DEFAULT):
    """(dx, dweight, dbias or None) as te_core.ops.layernorm_bwd_add / rmsnorm_bwd_add."""
    if add is None:  # (norm_bwd checks a given one)
        raise TypeError(f"add must be a tensor of x's shape {tuple(x.shape)} and dtype {x.dtype}, got None")
    return norm_bwd(dy, x, mean, rstd, weight, rms=rms, zero_centered_gamma=zero_centered_gamma, cfg=cfg, add=add)


def norm_bwd(dy, x, mean: Optional[torch.Tensor], rstd, weight, *, rms: bool, zero_centered_gamma=False,
             cfg: Config = NORM_DEFAULT, add=None):
    """(dx, dweight, dbias or None) as te_core.ops.layernorm_bwd / rmsnorm_bwd (plus `add`, see norm_bwd_add)."""
    M, N = _rows(x, weight)
    if dy.shape != x.shape or not dy.is_contiguous():
        raise ValueError(f"dy must be contiguous with x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    check_device(dy, x, "dy")
    _check_stat(rstd, x, "rstd")
    if not rms:  # (without mean the kernel would read rstd in its place)
        _check_stat(mean, x, "mean")
    if add is not None:  # (the kernels read a row of it per row of x)
        if add.shape != x.shape or add.dtype != x.dtype or not add.is_contiguous():
            raise ValueError(f"add must be contiguous {x.dtype} with x's shape {tuple(x.shape)}, "
                             f"got {add.dtype} {tuple(add.shape)}")
        check_device(add, x, "add")
    dx = torch.empty_like(x)
    programs = grid_size(M, cfg)
    # every program (at most M of them) writes its whole partial row: nothing to zero first,
    # unless there are no rows (then no program runs and the sums must be 0)
    alloc = torch.empty if M else torch.zeros
    dw_part = alloc((programs, N), dtype=torch.float32, device=x.device)
    db_part = None if rms else alloc((programs, N), dtype=torch.float32, device=x.device)
    tma = M and cfg.tma_stages and norm_tma.backward(
        dy.view(M, N), x.view(M, N), mean, rstd, weight, dx, dw_part, db_part, add, rms=rms,
        zero_centered_gamma=zero_centered_gamma, cfg=cfg)
    if M and not tma:
        _norm_bwd_kernel[(programs,)](
            dy, x, rstd if mean is None else mean, rstd, weight, dx, dw_part, dw_part if db_part is None else db_part,
            x if add is None else add, M, N, BLOCK_N=next_power_of_2(N), RMS=rms,
            ZERO_CENTERED=bool(zero_centered_gamma), ADD=add is not None, num_warps=cfg.num_warps)
    dweight = dw_part.sum(dim=0).to(weight.dtype)
    dbias = None if rms else db_part.sum(dim=0).to(weight.dtype)
    return dx, dweight, dbias
