"""LayerNorm / RMSNorm kernels whose rows arrive through TMA descriptors (NVIDIA sm_90 and later).

Triton software-pipelines descriptor loads but not plain ones: in a `tl.range(..., num_stages=s)`
row loop a descriptor load becomes a bulk asynchronous copy into shared memory, issued s - 1
steps ahead, while a pointer load stays a synchronous ld.global (checked in the PTX for
sm_90). The rows in flight then wait in shared memory instead of registers, which is what
limits the pointer kernels of norm.py and their register-held prefetch, so long rows keep
more bytes in flight.

norm.py's launchers call these when the config asks (Config.tma_stages) and tma_ready() holds
for the tensors; the math is theirs, step for step. A box reaching past the last row or column
reads zeros and stores only what lies inside the tensor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (Config, abs_bits, cdiv, descriptor, grid_size, launched, max_into, next_power_of_2,
                      saturating_cast, tma_ready)
from ._norm_math import backward_step, norm_params, row_statistics, scale_shift
from .launch import launcher

MAX_TILE = 16384  # elements of a step's rows, as norm.py's kernels


@launcher
@triton.jit
def _fwd_kernel(x_desc, y_desc, w_ptr, b_ptr, mean_ptr, rstd_ptr, scale_ptr, amax_ptr, M, N, eps, fmax,
                BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                CHUNK: tl.constexpr, HOIST: tl.constexpr, CLAMP: tl.constexpr, STAGES: tl.constexpr):
    """FP8 output only. ROWS rows per step; the amax is kept per CHUNK-element chunk."""
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HOIST:
        g0, beta0 = norm_params(w_ptr, b_ptr, cols, cmask, RMS, ZERO_CENTERED)
    scale = tl.load(scale_ptr)
    acc = tl.zeros([ROWS * BLOCK_N // CHUNK], dtype=tl.int32)
    for first in tl.range(tl.program_id(0) * ROWS, M, tl.num_programs(0) * ROWS, num_stages=STAGES):
        x = x_desc.load([first, 0]).to(tl.float32)
        rows = first + tl.arange(0, ROWS)
        rmask = rows < M
        xc, rstd = row_statistics(x, cmask[None, :], rows, rmask, mean_ptr, rstd_ptr, N, eps, RMS, True)
        if HOIST:
            g, beta = g0, beta0
        else:
            g, beta = norm_params(w_ptr, b_ptr, cols, cmask, RMS, ZERO_CENTERED)
        y = scale_shift(xc, rstd, g, beta, RMS)
        bits = tl.where(rmask[:, None] & cmask[None, :], abs_bits(y), 0)  # rows past M would give beta
        acc = tl.maximum(acc, tl.max(tl.reshape(bits, [ROWS * BLOCK_N // CHUNK, CHUNK], can_reorder=True), axis=1))
        y_desc.store([first, 0], saturating_cast(y * scale, fmax, y_desc.dtype, CLAMP))
    max_into(amax_ptr, tl.max(acc, axis=0))


@launcher
@triton.jit
def _bwd_kernel(dy_desc, x_desc, mean_ptr, rstd_ptr, w_ptr, dx_ptr, dw_part_ptr, db_part_ptr, add_ptr, M, N,
                BLOCK_N: tl.constexpr, RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, ADD: tl.constexpr,
                STAGES: tl.constexpr):
    """Rows pid, pid + programs, ...; at most M programs. Rows stay [1, BLOCK_N] tiles as the
    descriptor loads them (a reshape to 1-D made the compiler shuffle them through shared
    memory and spill). `add` is read with plain loads (_norm_math.backward_step)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    cmask = cols < N
    g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        g = g + 1.0
    dw = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for row in tl.range(pid, M, tl.num_programs(0), num_stages=STAGES):
        x = x_desc.load([row, 0]).to(tl.float32)
        dy = dy_desc.load([row, 0]).to(tl.float32)
        dw, db = backward_step(x, dy, g, row, mean_ptr, rstd_ptr, add_ptr, dx_ptr, cols, cmask, N, dw, db, RMS, ADD, 1)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cmask)
    if not RMS:
        tl.store(db_part_ptr + pid * N + cols, db, mask=cmask)


def forward(x2, y2, weight, bias, mean, rstd, scale, amax_buf, eps, fmax, *, rms: bool, zero_centered_gamma: bool,
            cfg: Config) -> bool:
    """Fills y2 (M, N FP8), mean (LayerNorm), rstd and the amax buffer from x2 (M, N). False
    (nothing written) when the tensors or config do not allow it: the caller runs norm.py's kernel."""
    M, N = x2.shape
    block_n = next_power_of_2(N)
    rows = max(1, cfg.rows)
    if not _usable(cfg, rows * block_n, x2, y2):
        return False
    return launched(_fwd_kernel, (grid_size(cdiv(M, rows), cfg),),
                   descriptor(x2, (rows, block_n)), descriptor(y2, (rows, block_n)), weight,
                   weight if bias is None else bias, rstd if mean is None else mean, rstd, scale, amax_buf, M, N,
                   float(eps), fmax, BLOCK_N=block_n, ROWS=rows, RMS=rms, ZERO_CENTERED=bool(zero_centered_gamma),
                   CHUNK=min(max(cfg.amax_chunk, 8), rows * block_n), HOIST=cfg.hoist_params,
                   CLAMP=not cfg.hw_saturate, STAGES=cfg.tma_stages, num_warps=cfg.num_warps)


def backward(dy2, x2, mean, rstd, weight, dx, dw_part, db_part, add, *, rms: bool, zero_centered_gamma: bool,
             cfg: Config) -> bool:
    """Fills dx and the (programs, N) partial parameter gradients, programs = dw_part.shape[0].
    False (nothing written) as for forward."""
    M, N = x2.shape
    block_n = next_power_of_2(N)
    if not _usable(cfg, block_n, dy2, x2):
        return False
    return launched(_bwd_kernel, (dw_part.shape[0],),
                   descriptor(dy2, (1, block_n)), descriptor(x2, (1, block_n)), rstd if mean is None else mean, rstd,
                   weight, dx, dw_part, dw_part if db_part is None else db_part, x2 if add is None else add, M, N,
                   BLOCK_N=block_n, RMS=rms, ZERO_CENTERED=bool(zero_centered_gamma), ADD=add is not None,
                   STAGES=cfg.tma_stages, num_warps=cfg.num_warps)


def _usable(cfg: Config, tile: int, *tensors: torch.Tensor) -> bool:
    """The config asks for descriptor loads, a step's tile is one the pointer kernels would
    take too, and the tensors allow descriptors."""
    return cfg.tma_stages >= 2 and tile <= MAX_TILE and tma_ready(*tensors)
