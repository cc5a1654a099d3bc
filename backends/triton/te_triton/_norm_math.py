"""The per-row arithmetic of the norm kernels, shared by norm.py's pointer kernels and
norm_tma.py's descriptor kernels so that both compute the same values the same way. The
kernels keep their loads and stores, whose placement sets their register use."""
from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def _add_pair(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def norm_params(w_ptr, b_ptr, cols, cmask, RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """gamma (+1 when zero-centred) and beta (gamma again for RMSNorm, unused) as float32."""
    g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        g = g + 1.0
    if RMS:
        return g, g
    return g, tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)


@triton.jit
def row_statistics(x, mask, rows, rmask, mean_ptr, rstd_ptr, N, eps, RMS: tl.constexpr, MASKED: tl.constexpr):
    """(x centred, rstd) of the rows of a (rows, BLOCK_N) float32 tile whose padding reads as 0
    (RMSNorm: x itself), storing each row's mean (LayerNorm) and rstd for the backward. MASKED:
    `mask` marks the real elements, and the padding stays 0 once centred."""
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        xc = _centred(x, mean, mask, MASKED)
        tl.store(mean_ptr + rows, mean, mask=rmask)
    rstd = _inverse_std(xc, N, eps)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)
    return xc, rstd


@triton.jit
def _centred(x, mean, mask, MASKED: tl.constexpr):
    """LayerNorm's rows minus their means; MASKED: the padding (outside `mask`) stays 0."""
    if MASKED:
        return tl.where(mask, x - mean[:, None], 0.0)
    return x - mean[:, None]


@triton.jit
def _inverse_std(xc, N, eps):
    """1 / sqrt(mean square + eps) of each row of a tile whose padding is 0."""
    return 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)


@triton.jit
def scale_shift(xc, rstd, g, beta, RMS: tl.constexpr):
    """The normalized rows times gamma, plus beta (LayerNorm)."""
    y = xc * rstd[:, None] * g[None, :]
    if not RMS:
        y = y + beta[None, :]
    return y


@triton.jit
def _row_sums(a, b, AXIS: tl.constexpr):
    """Sums of one row held as a 1-D block (AXIS 0) or a [1, BLOCK_N] tile (AXIS 1), shaped to
    broadcast against it; both in one reduction (one round of block-wide barriers, not two)."""
    s1, s2 = tl.reduce((a, b), AXIS, _add_pair)
    if AXIS == 1:
        s1 = s1[:, None]
        s2 = s2[:, None]
    return s1, s2


@triton.jit
def _row_sum(a, AXIS: tl.constexpr):
    s = tl.sum(a, axis=AXIS)
    if AXIS == 1:
        s = s[:, None]
    return s


@triton.jit
def _backward_row(x, dy, g, mean, rstd, cmask, N, RMS: tl.constexpr, AXIS: tl.constexpr):
    """(dx, xhat) of one row (float32, padding 0), before any added gradient; `mean` is unused
    for RMSNorm."""
    if RMS:
        xhat = x * rstd
    else:
        xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
    wdy = dy * g
    if RMS:
        dx = (wdy - xhat * (_row_sum(xhat * wdy, AXIS) / N)) * rstd
    else:
        s1, s2 = _row_sums(xhat * wdy, wdy, AXIS)
        dx = (wdy - (xhat * (s1 / N) + s2 / N)) * rstd
    return dx, xhat


@triton.jit
def backward_step(x, dy, g, row, mean_ptr, rstd_ptr, add_ptr, dx_ptr, cols, cmask, N, dw, db, RMS: tl.constexpr,
                  ADD: tl.constexpr, AXIS: tl.constexpr):
    """One row of the norm backward, x and dy loaded (float32): stores dx (+ the row of `add`
    when ADD) and returns the running dgamma, dbeta partials. RMSNorm loads the added row before
    its reduction, which hides the load; LayerNorm loads it after its two-sum reduction, because
    holding the row across that reduction costs the pointer kernel so many registers that it
    runs slower than with the load exposed."""
    if ADD and RMS:
        extra = tl.load(add_ptr + row * N + cols, mask=cmask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    dx, xhat = _backward_row(x, dy, g, tl.load(mean_ptr + row), rstd, cmask, N, RMS, AXIS)
    if not RMS:
        db += dy
    dw += dy * xhat
    if ADD and not RMS:
        extra = tl.load(add_ptr + row * N + cols, mask=cmask, other=0.0).to(tl.float32)
    if ADD:
        dx += extra
    tl.store(dx_ptr + row * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
    return dw, db
