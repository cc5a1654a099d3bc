"""Block-scaled FP8 casts (128-element blocks): 1x128 runs of a row, or 128x128 tiles.

A program owns one (BM, 128) tile: the row-wise amax of each 1x128 run (or the whole tile's,
for 2-D blocks) gives its scale, computed on the device exactly as current scaling does.
With a transpose, the tile is 128 rows tall so that its columns are the 1x128 runs of x.T:
one program gives both the row-wise and the column-wise quantization (1x128 runs: in
cfg.block_m-row, then cfg.block_m-column slices of the tile).

A gradient's epilogue (dbias_cast_transpose_blockwise) runs the 1x128 cast with the transpose
on each of its column blocks into that block's columns of the outputs, and sums the columns of
each tile as it reads them; the per-tile sums add up to the bias gradient afterwards.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (MAX_NUMEL, Config, abs_bits, cdiv, check_2d_input, check_device, column_blocks, fp8_max,
                      saturating_cast, scale_from_amax, as_float32)
from .cast import check_dequantize_args, transpose_clamps
from .launch import launcher

BLOCK = 128
BLOCKWISE_DEFAULT = Config(block_m=64, num_warps=8)


@triton.jit
def _amax_of_bits(bits, IN_DTYPE: tl.constexpr):
    """A max of _abs_bits_of as float32 (NaN above inf)."""
    if IN_DTYPE == tl.bfloat16:
        amax = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif IN_DTYPE == tl.float16:
        amax = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)  # a max may widen the int
    else:
        amax = bits.to(tl.float32, bitcast=True)
    return amax


@triton.jit
def _abs_bits_of(v, IN_DTYPE: tl.constexpr):
    """|v| (of dtype IN_DTYPE) as integer bits of its own width (NaN above inf)."""
    if IN_DTYPE == tl.float32:
        bits = abs_bits(v)
    else:
        bits = v.to(tl.int16, bitcast=True) & 0x7FFF
    return bits


@launcher
@triton.jit
def _blockwise_kernel(x_ptr, y_ptr, s_ptr, yt_ptr, st_ptr, db_ptr, M, K, MB, KB, y_row, s_row, s_col, st_row, st_col,
                      db_row, fmax, eps, c0, BM: tl.constexpr, BLOCK_2D: tl.constexpr, TRANSPOSE: tl.constexpr,
                      POW2: tl.constexpr, SUB: tl.constexpr, CLAMP: tl.constexpr, DBIAS: tl.constexpr):
    # c0: the column of the outputs where x's first column goes, a multiple of 128 (a gradient's
    # column blocks, each cast into its place in outputs as wide as all of them, y_row their
    # width: no views of the outputs to make per block, and the same whole buffers handed to
    # every launch, which compiled code needs to write them in place); DBIAS (1x128 with the
    # transpose): each program's column sums over its rows into row pm of db (float32, or the
    # bias gradient's dtype where a single row block makes the sums the gradient itself), summed
    # over the programs after.
    fmax, eps = as_float32(fmax), as_float32(eps)
    pm = tl.program_id(0)
    pk = tl.program_id(1)
    DT: tl.constexpr = x_ptr.dtype.element_ty
    rows = pm * BM + tl.arange(0, BM)
    cols = pk * 128 + tl.arange(0, 128)
    kb = c0 // 128 + pk  # this tile's column of the scale grids
    if not BLOCK_2D and TRANSPOSE:
        # 1x128 runs both ways from a 128x128 tile, SUB rows then SUB columns at a time: holding
        # the whole tile at once (with its float32 copy) spills registers. Each element is read
        # twice; the second read comes from cache.
        for h in tl.static_range(BM // SUB):
            r = pm * BM + h * SUB + tl.arange(0, SUB)
            m = (r[:, None] < M) & (cols[None, :] < K)
            v = tl.load(x_ptr + r[:, None] * K + cols[None, :], mask=m, other=0.0)
            scale = scale_from_amax(_amax_of_bits(tl.max(_abs_bits_of(v, DT), axis=1), DT), fmax, eps, POW2)
            q = saturating_cast(v.to(tl.float32) * scale[:, None], fmax, y_ptr.dtype.element_ty, CLAMP)
            tl.store(y_ptr + r[:, None] * y_row + c0 + cols[None, :], q, mask=m)
            tl.store(s_ptr + r * s_row + kb * s_col, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale), mask=r < M)
        for h in tl.static_range(128 // SUB):
            c = pk * 128 + h * SUB + tl.arange(0, SUB)
            m = (rows[:, None] < M) & (c[None, :] < K)
            v = tl.load(x_ptr + rows[:, None] * K + c[None, :], mask=m, other=0.0)
            scale_t = scale_from_amax(_amax_of_bits(tl.max(_abs_bits_of(v, DT), axis=0), DT), fmax, eps, POW2)
            qt = saturating_cast(v.to(tl.float32) * scale_t[None, :], fmax, yt_ptr.dtype.element_ty, CLAMP)
            mt = (c[:, None] < K) & (rows[None, :] < M)
            tl.store(yt_ptr + (c0 + c)[:, None] * M + rows[None, :], tl.trans(qt), mask=mt)
            tl.store(st_ptr + (c0 + c) * st_row + pm * st_col, tl.math.div_rn(tl.zeros_like(scale_t) + 1.0, scale_t),
                     mask=c < K)
            if DBIAS:
                tl.store(db_ptr + pm * db_row + c0 + c, tl.sum(v.to(tl.float32), axis=0), mask=c < K)
    else:
        # the input's own dtype in registers (its bits give the amax), float32 only for the
        # product: a float32 copy of the whole tile held from the load halves the bandwidth
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        v = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0)
        bits = _abs_bits_of(v, DT)
        if BLOCK_2D:
            # the max over integer bits keeps a NaN (a float max might drop it)
            scale = scale_from_amax(_amax_of_bits(tl.max(tl.max(bits, axis=1), axis=0), DT), fmax, eps, POW2)
            q = saturating_cast(v.to(tl.float32) * scale, fmax, y_ptr.dtype.element_ty, CLAMP)
            tl.store(y_ptr + rows[:, None] * y_row + c0 + cols[None, :], q, mask=mask)
            tl.store(s_ptr + pm * s_row + kb * s_col, tl.math.div_rn(1.0, scale))
            if TRANSPOSE:
                mask_t = (cols[:, None] < K) & (rows[None, :] < M)
                tl.store(yt_ptr + (c0 + cols)[:, None] * M + rows[None, :], tl.trans(q), mask=mask_t)
                tl.store(st_ptr + kb * st_row + pm * st_col, tl.math.div_rn(1.0, scale))
        else:
            scale = scale_from_amax(_amax_of_bits(tl.max(bits, axis=1), DT), fmax, eps, POW2)
            q = saturating_cast(v.to(tl.float32) * scale[:, None], fmax, y_ptr.dtype.element_ty, CLAMP)
            tl.store(y_ptr + rows[:, None] * y_row + c0 + cols[None, :], q, mask=mask)
            tl.store(s_ptr + rows * s_row + kb * s_col, tl.math.div_rn(tl.zeros_like(scale) + 1.0, scale),
                     mask=rows < M)


def _scales(rows: int, kb: int, column_major: bool, device) -> torch.Tensor:
    """A (rows, kb) float32 scale grid; `column_major` (1x128 grids, as te_core.ops.quantize_blockwise
    lays them out): strides (1, rows), the layout block-scaled cuBLASLt GEMMs read."""
    if column_major:  # (the strides of a contiguous (kb, rows) grid's .t(), in one torch call)
        return torch.empty_strided((rows, kb), (1, max(rows, 1)), dtype=torch.float32, device=device)
    return torch.empty((rows, kb), dtype=torch.float32, device=device)


def quantize_blockwise(x, fp8_dtype, *, block_2d=False, with_transpose=False, force_pow2_scales=True,
                       amax_epsilon=0.0, cfg: Config = BLOCKWISE_DEFAULT):
    """(data, scale_inv, data_t, scale_inv_t) as te_core.ops.quantize_blockwise, 1x128 scale grids
    laid out column by column as it says."""
    fmax = fp8_max(fp8_dtype)
    check_2d_input(x)
    M, K = x.shape
    MB, KB = cdiv(M, BLOCK), cdiv(K, BLOCK)
    BM = BLOCK if (block_2d or with_transpose) else cfg.block_m
    dev = x.device
    data = torch.empty((M, K), dtype=fp8_dtype, device=dev)
    scale_inv = _scales(MB if block_2d else M, KB, not block_2d, dev)
    data_t = torch.empty((K, M), dtype=fp8_dtype, device=dev) if with_transpose else None
    scale_inv_t = None
    if with_transpose:
        scale_inv_t = _scales(KB if block_2d else K, MB, not block_2d, dev)
    if x.numel():
        st = scale_inv if scale_inv_t is None else scale_inv_t
        _blockwise_kernel[(cdiv(M, BM), KB)](
            x, data, scale_inv, data if data_t is None else data_t, st, st, M, K, MB, KB, K,
            scale_inv.stride(0), scale_inv.stride(1), st.stride(0), st.stride(1), 0, fmax, float(amax_epsilon), 0,
            BM=BM, BLOCK_2D=bool(block_2d), TRANSPOSE=bool(with_transpose), POW2=bool(force_pow2_scales),
            SUB=min(cfg.block_m, BLOCK), num_warps=cfg.num_warps,
            CLAMP=transpose_clamps(cfg, x, with_transpose), DBIAS=False)
    return data, scale_inv, data_t, scale_inv_t


def parts_in_place(parts) -> bool:
    """Whether dbias_cast_transpose_blockwise casts these column blocks where they are: each
    contiguous, each but the last a whole number of 128-column blocks wide (else a 1x128 run
    would span two blocks)."""
    return all(p.is_contiguous() for p in parts) and not any(p.shape[1] % BLOCK for p in parts[:-1])


def dbias_cast_transpose_blockwise(parts, fp8_dtype, *, force_pow2_scales=True, amax_epsilon=0.0,
                                   cfg: Config = BLOCKWISE_DEFAULT):
    """(data, scale_inv, data_t, scale_inv_t, dbias) as te_core.ops.dbias_cast_transpose_blockwise:
    1x128 blocks both ways and the column sums, each part cast into its columns of the outputs
    (one launch per part). A part whose width is not a multiple of 128 but the last would share
    a block with the next: such parts are joined first."""
    parts = column_blocks(parts)
    if not parts_in_place(parts):
        parts = [torch.cat(parts, dim=1)]
    for part in parts:
        check_2d_input(part)
    first = parts[0]
    fmax = fp8_max(fp8_dtype)
    M, K = first.shape[0], sum(p.shape[1] for p in parts)
    if M * K > MAX_NUMEL:
        raise ValueError(f"the parts hold {M * K} elements; these kernels index with int32 (at most {MAX_NUMEL})")
    MB, KB = cdiv(M, BLOCK), cdiv(K, BLOCK)
    dev = first.device
    data = torch.empty((M, K), dtype=fp8_dtype, device=dev)
    data_t = torch.empty((K, M), dtype=fp8_dtype, device=dev)
    scale_inv, scale_inv_t = _scales(M, KB, True, dev), _scales(K, MB, True, dev)
    # one row block: the kernel's sums are the bias gradient, stored in its dtype (no reduction
    # and cast after it: two launches less on a step whose host time exceeds the kernel's)
    one = MB == 1
    partial = torch.empty((MB, K), dtype=first.dtype if one else torch.float32, device=dev)  # all written
    if M:
        off = 0
        for part in parts:
            k = part.shape[1]
            if k:
                _blockwise_kernel[(MB, cdiv(k, BLOCK))](
                    part, data, scale_inv, data_t, scale_inv_t, partial, M, k, MB, cdiv(k, BLOCK), K,
                    scale_inv.stride(0), scale_inv.stride(1), scale_inv_t.stride(0), scale_inv_t.stride(1), K, fmax,
                    float(amax_epsilon), off, BM=BLOCK, BLOCK_2D=False, TRANSPOSE=True, POW2=bool(force_pow2_scales),
                    SUB=min(cfg.block_m, BLOCK), num_warps=cfg.num_warps, CLAMP=transpose_clamps(cfg, part),
                    DBIAS=True)
            off += k
    dbias = partial[0] if one else partial.sum(dim=0).to(first.dtype)
    return data, scale_inv, data_t, scale_inv_t, dbias


@launcher
@triton.jit
def _dequantize_blockwise_kernel(x_ptr, s_ptr, y_ptr, M, K, s_row, s_col, BM: tl.constexpr, BLOCK_2D: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    pk = tl.program_id(1)
    cols = pk * 128 + tl.arange(0, 128)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    scale_row = rows // 128 if BLOCK_2D else rows
    s = tl.load(s_ptr + scale_row * s_row + pk * s_col, mask=rows < M, other=0.0)
    v = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32) * s[:, None]
    tl.store(y_ptr + rows[:, None] * K + cols[None, :], v.to(y_ptr.dtype.element_ty), mask=mask)


def dequantize_blockwise(data, scale_inv, block_2d, out_dtype, cfg: Config = BLOCKWISE_DEFAULT):
    """data times its block's scale_inv, in float32, cast to out_dtype (as
    te_core.ops.dequantize_blockwise)."""
    check_dequantize_args(data, out_dtype)
    if data.dim() != 2:
        raise ValueError(f"data must be 2-D (M, K), got shape {tuple(data.shape)}")
    M, K = data.shape
    MB, KB = cdiv(M, BLOCK), cdiv(K, BLOCK)
    expected = (MB, KB) if block_2d else (M, KB)
    if tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
        kind = "128x128" if block_2d else "1x128"
        raise ValueError(f"scale_inv must be float32 of shape {expected} for {kind} blocks of data "
                         f"{(M, K)}, got {scale_inv.dtype} {tuple(scale_inv.shape)}")
    check_device(scale_inv, data, "scale_inv", "data")
    y = torch.empty((M, K), dtype=out_dtype, device=data.device)
    if data.numel():
        _dequantize_blockwise_kernel[(cdiv(M, cfg.block_m), KB)](
            data, scale_inv, y, M, K, scale_inv.stride(0), scale_inv.stride(1), BM=cfg.block_m,
            BLOCK_2D=bool(block_2d), num_warps=cfg.num_warps)
    return y
