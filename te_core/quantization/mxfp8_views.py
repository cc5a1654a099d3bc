"""Row pieces of an MXFP8Tensor that stay MXFP8: torch.split and torch.chunk along dim 0.

A row's 1x32 scales are its own, so rows a:b of the row-wise data with scale rows a:b are,
exactly, the MXFP8 value of those rows. The column-wise copy quantizes x.T (K, M) in 1x32 runs
along M: where a and b are multiples of 32, its columns a:b with scale columns a/32:b/32 are
the column-wise copy of the piece, exactly, and they are kept as views of the tensor's buffers
(no copy; MXFP8's columnwise() hands a GEMM a contiguous copy of such a view). A cut inside a
32-row run has no column-wise scale grid of its own, so, as Transformer Engine does, a split
is kept MXFP8 only where dim 0 and every piece are multiples of 32 rows (Transformer Engine
also asks for unswizzled scales; te-core's are never swizzled). Any other split, or one of a
tensor whose payload is laid out in another shape than its own (a flattened view), takes the
general path: DequantizedViews (see dequantized_view).

A piece is linked to the tensor it was cut from (ViewLink), as a plain tensor's split is a
view: an in-place op on it writes its rows of that tensor's value, requantized whole, whose
buffers (both layouts) it shares, so the piece reads the new value too.
"""
from __future__ import annotations

from typing import Optional

import torch

from .write_back import ViewLink

aten = torch.ops.aten

MX_BLOCK = 32  # rows of one column-wise 1x32 run (elements per E8M0 scale)


def _piece_sizes(t, split_size, dim: int) -> Optional[list]:
    """The row counts of the pieces where each can stay MXFP8, else None."""
    # (a payload under another nominal shape has other rows; a tensor kept column-wise only is
    # saved for a backward GEMM, which does not cut it)
    if dim not in (0, -2) or t._data is None or tuple(t._data.shape) != tuple(t.shape):
        return None
    rows = t.shape[0]
    if isinstance(split_size, int):  # torch.chunk's equal pieces too; the last one may be shorter
        if split_size <= 0:
            return None  # (torch's own error, from the general path)
        sizes = [split_size] * (rows // split_size) + ([rows % split_size] if rows % split_size else [])
    else:
        sizes = list(split_size)
        if sum(sizes) != rows or any(s < 0 for s in sizes):
            return None
    if rows % MX_BLOCK or any(s % MX_BLOCK for s in sizes):
        return None
    return sizes


def _piece(t, start: int, end: int):
    """Rows start:end of t (both multiples of 32) as an MXFP8Tensor sharing t's buffers."""
    data_t, scale_inv_t = t._data_t, t._scale_inv_t
    if data_t is not None:  # x.T's columns, and their 1x32 runs' scales
        data_t, scale_inv_t = data_t[:, start:end], scale_inv_t[:, start // MX_BLOCK:end // MX_BLOCK]
    return type(t).make(t._data[start:end], t._scale_inv[start:end], data_t, scale_inv_t, nominal_dtype=t.dtype,
                        quantizer=t._quantizer, _view_of=ViewLink(t, lambda value: value[start:end]))


def split_rows(t, split_size, dim: int = 0):
    """aten.split.Tensor / aten.split_with_sizes.default of an MXFP8Tensor (NotImplemented: the
    general path's DequantizedViews)."""
    # (traced, the pieces take the general path: a tuple of subclass tensors from a view op is not
    # something torch.compile's tracing of a subclass can return)
    sizes = None if torch.compiler.is_compiling() else _piece_sizes(t, split_size, dim)
    if sizes is None:
        return NotImplemented
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return tuple(_piece(t, start, end) for start, end in zip(bounds, bounds[1:]))


MXFP8_SPLIT_OPS = {aten.split.Tensor: split_rows, aten.split_with_sizes.default: split_rows}
