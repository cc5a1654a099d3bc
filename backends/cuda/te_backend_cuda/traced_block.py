"""Block-scaled FP8 casts (Float8BlockScaling's 1x128 runs and 128x128 tiles) in plain torch:
the twin torch.compile traces in place of the opaque quantize_blockwise (OpImpl.traced).

Left opaque, each block cast of a compiled step is a trip through torch.library and this
backend's Python, and a compiled block-scaled layer ran slower than its eager self. Traced, the
compiler fuses the cast with its producer and writes the row-wise and column-wise copies from
one read.

The math is the Triton kernel's (te_triton.blockwise), value for value: per block, amax
max|x| (NaN wins), the scale fp8_max / max(amax, epsilon) rounded once to float32 (inf ->
float32 max; 1 where amax is NaN or inf or the divisor 0; rounded down to a power of two
when asked), x times the scale clamped to the format's max and rounded to nearest even, and
scale_inv = 1 / scale rounded once. Partial edge blocks take their own elements (the padding
is zeros, which leave an amax alone). A 128x128 tile of x.T is the transpose of a tile of x,
so the 2-D transposed copy shares its scales; 1x128 runs of x.T are runs along x's columns,
with scales of their own. A bfloat16 input is read as stored (traced.as_stored), so that
the FP8 bytes are eager's where the compiler fuses the cast with its producer; a float16 one
stays the opaque op (traced.CAST_DTYPES).
"""
from __future__ import annotations

import torch
from te_core.reference.cast import column_major, pad_end

from . import traced, traced_kernels

BLOCK = 128


def _blocks(x, fp8_dtype, rows: int, force_pow2_scales: bool, amax_epsilon: float):
    """(data, scale_inv) of a 2-D float32 x in blocks of `rows` x 128."""
    m, k = x.shape
    pad_m, pad_k = -m % rows, -k % BLOCK
    if pad_m or pad_k:
        x = pad_end(x, pad_k, pad_m)
    blocks = x.reshape(x.shape[0] // rows, rows, x.shape[1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    fmax = traced.fp8_max(fp8_dtype)
    scale = traced._current_scale(amax, fmax, amax_epsilon, force_pow2_scales)
    data = torch.clamp(blocks * scale[:, None, :, None], -fmax, fmax).to(fp8_dtype).reshape(x.shape)
    if pad_m or pad_k:
        data = data[:m, :k].contiguous()
    return data, traced._div_rn(torch.ones_like(scale), scale)


def _takes(x, fp8_dtype, block_2d, with_transpose, force_pow2_scales, amax_epsilon) -> bool:
    """2-D x of fewer than MAX_NUMEL elements on this backend's device, plain flags and a
    finite, non-negative epsilon; anything else stays the opaque op (which names a bad one)."""
    if not traced._takes(x, fp8_dtype) or x.dim() != 2:
        return False
    flags = all([isinstance(f, bool) for f in (block_2d, with_transpose, force_pow2_scales)])
    eps_ok = isinstance(amax_epsilon, (int, float)) and not isinstance(amax_epsilon, bool) \
        and 0.0 <= amax_epsilon < float("inf")
    # Inductor's CPU code generation (torch 2.11) fails on the exact float64 reciprocal of
    # scales that are not powers of two when both 1x128 passes read a row with a partial block;
    # that rare combination (Float8BlockScaling rounds its scales to powers of two) stays opaque
    # on every device, as a precaution: it has not been compiled on a GPU.
    odd = not force_pow2_scales and with_transpose and not block_2d and x.shape[1] % BLOCK != 0
    return flags and eps_ok and not odd


def quantize_blockwise(x, fp8_dtype, *, block_2d=False, with_transpose=False, force_pow2_scales=True,
                       amax_epsilon=0.0):
    if not _takes(x, fp8_dtype, block_2d, with_transpose, force_pow2_scales, amax_epsilon):
        return NotImplemented
    if traced_kernels.takes(x, symbolic=traced_kernels.SYMBOLIC_BLOCK):  # te_triton's kernel, from compiled code
        return traced_kernels.quantize_blockwise(x, fp8_dtype, block_2d=block_2d, with_transpose=with_transpose,
                                                 force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon)
    x32 = traced._as(traced.as_stored(x), torch.float32)
    rows = BLOCK if block_2d else 1
    data, scale_inv = _blocks(x32, fp8_dtype, rows, force_pow2_scales, float(amax_epsilon))
    if block_2d:
        return (data, scale_inv, data.t().contiguous(), scale_inv.t().contiguous()) if with_transpose else \
            (data, scale_inv, None, None)
    # 1x128 grids column by column, as the contract lays them out (and the GEMM reads them)
    if not with_transpose:
        return data, column_major(scale_inv), None, None
    data_t, scale_inv_t = _blocks(x32.t().contiguous(), fp8_dtype, 1, force_pow2_scales, float(amax_epsilon))
    return data, column_major(scale_inv), data_t, column_major(scale_inv_t)


def _parts_in_place(parts, fp8_dtype, force_pow2_scales, amax_epsilon) -> bool:
    """Whether te_triton's kernel casts these column blocks of a gradient in place, as the eager
    op reads them (traced_kernels.blockwise_parts_in_place): each block a cast the twin takes, and
    their joined size one the kernel takes (from KERNEL_MIN_NUMEL elements)."""
    if len(parts) == 1 or parts[0].shape[0] * sum([p.shape[1] for p in parts]) < traced_kernels.KERNEL_MIN_NUMEL:
        return False
    symbolic = traced_kernels.SYMBOLIC_BLOCK
    return (all([_takes(p, fp8_dtype, False, True, force_pow2_scales, amax_epsilon)
                 and traced_kernels.takes(p, min_numel=1, symbolic=symbolic) for p in parts])
            and traced_kernels.blockwise_parts_in_place(parts))


def dbias_cast_transpose_blockwise(parts, fp8_dtype, *, force_pow2_scales=True, amax_epsilon=0.0):
    """The gradient's column blocks, both 1x128 casts and the column sums: from KERNEL_MIN_NUMEL
    elements on te_triton's fused kernel (traced_kernels), reading the blocks in place where the
    eager op does (without the join, a pass over the whole gradient), else joined first; below it
    the compiler's cast (quantize_blockwise above) and sum. A gradient of MAX_NUMEL elements or
    more stays the opaque op."""
    if not isinstance(parts, (list, tuple)) or not parts or not all([traced._here(p) and p.dim() == 2 for p in parts]):
        return NotImplemented
    first = parts[0]
    if any([p.dtype != first.dtype or p.shape[0] != first.shape[0] or p.device != first.device for p in parts]):
        return NotImplemented  # (the opaque op names the mismatch)
    if first.shape[0] * sum([p.shape[1] for p in parts]) >= traced.MAX_NUMEL:
        return NotImplemented
    kwargs = dict(force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon)
    if _parts_in_place(parts, fp8_dtype, force_pow2_scales, amax_epsilon):
        return traced_kernels.dbias_cast_transpose_blockwise(first, fp8_dtype, parts=list(parts), **kwargs)
    dy = torch.cat(list(parts), dim=1) if len(parts) > 1 else first
    if not _takes(dy, fp8_dtype, False, True, force_pow2_scales, amax_epsilon):
        return NotImplemented
    if traced_kernels.takes(dy, symbolic=traced_kernels.SYMBOLIC_BLOCK):  # te_triton's kernel, from compiled code
        return traced_kernels.dbias_cast_transpose_blockwise(dy, fp8_dtype, **kwargs)
    data, scale_inv, data_t, scale_inv_t = quantize_blockwise(dy, fp8_dtype, with_transpose=True, **kwargs)
    dy = traced.as_stored(dy)
    return data, scale_inv, data_t, scale_inv_t, traced._as(traced._as(dy, torch.float32).sum(0), dy.dtype)


TRACED_BLOCK = {"quantize_blockwise": quantize_blockwise,
                "dbias_cast_transpose_blockwise": dbias_cast_transpose_blockwise}
