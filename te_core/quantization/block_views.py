"""Views of a Float8BlockwiseTensor that stay FP8: the torch ops FSDP2 shards a parameter with.

A block-scaled tensor cut along dim 0 from a block boundary is, piece by piece, the FP8 bytes of
those rows with the scale_inv rows of their blocks (a 128x128 tile's scale covers 128 rows, a
1x128 run's one row), so such a piece is kept quantized, exactly, even where it ends inside a
tile (its last rows keep their tile's scale, as the last rows of a tensor whose rows are no
multiple of 128 do). A cut starting inside a tile has no scale grid of its own: as Transformer
Engine does, it falls back to the dequantized value, a DequantizedView (see below), for a slice,
a narrow, a split or a chunk alike. FSDP2's own shard of a weight is always such a narrow from
row 0 of a padded shard, so it stays a block tensor with the all-gather hooks; where its shards
cut tiles (ceil(rows / world size) or rows not a multiple of 128), that all-gather refuses it
(te_core.distributed.fsdp_block) on every rank, with what to do. Views carry only the row-wise
data and scales (the column-wise copy is another layout); an FSDP2 all-gather rebuilds it.

Such a piece is linked to the tensor it was cut from (ViewLink): an in-place op on it writes its
rows of that tensor's value, requantized whole, so that the column-wise copy the tensor holds
follows (the piece holds none). A select (`w[1]`, `w[:, 3]`), a slice along a row, or a cut
starting inside a tile is no block tensor: it is a DequantizedView, which writes back in the
same way.

A flattening view (FSDP2 keeps one of each padded shard) is the same payload under the 1-D
nominal shape: the row-major order of the elements is unchanged, so it dequantizes to the
flattened value. Linked to the tensor it flattens, an in-place op on it writes that tensor's
value, requantized whole, whose buffers it shares. Other views (another shape, t(), expand...)
take QuantizedTensor's general path: DequantizedViews, which write back alike.

`copy_` between two block tensors of one layout copies the source's FP8 bytes and scales into
the destination's buffers, which makes the destination's value the source's, exactly, and a
write into a view reaches the tensor it views (FSDP2 pads a shard by copying it into a view of
a zero tensor, which holds no column-wise copy). Every other copy requantizes (QuantizedTensor),
as does a copy into a piece of a tensor holding a column-wise copy, which the bytes would miss.
"""
from __future__ import annotations

import torch

from .dequantized_view import dequantized_select, dequantized_slice
from .float8_views import fsdp_view_ops
from .write_back import ViewLink

aten = torch.ops.aten

BLOCK = 128  # elements along each side of a 128x128 tile, and per 1x128 run


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _row_block(t) -> int:
    """Rows one scale_inv row covers."""
    return BLOCK if t._block_2d else 1


def _is_plain_2d(t) -> bool:
    """Row-wise data of t's own shape (not a flattened view, not column-wise only)."""
    return t._data is not None and t._data.dim() == 2 and tuple(t._data.shape) == tuple(t.shape)


def _rows(t, start: int, end: int):
    """Rows start:end of t (start on a block boundary) as a block tensor sharing t's buffers."""
    unit = _row_block(t)
    scale_inv = t._scale_inv[start // unit: _ceil_div(end, unit)]
    return type(t).make(t._data[start:end], scale_inv, None, None, nominal_dtype=t.dtype, quantizer=t._quantizer,
                        _block_2d=t._block_2d, _view_of=ViewLink(t, lambda value: value[start:end]))


def tile_cut_error(shape, piece: int, world: str) -> ValueError:
    """The FSDP2 all-gather's refusal of shards that cut tiles (raised by te_core.distributed.fsdp_block)."""
    return ValueError(
        f"FSDP2 FP8 all-gather of a block-scaled (Float8BlockScaling) weight of shape {tuple(shape)}: with world "
        f"size {world}, FSDP2 cuts dim 0 into shards of {piece} rows (ceil(rows / world size)), which cut its "
        "128x128 scale tiles. Each shard must hold whole tiles (the shard rows and dim 0 multiples of 128): make "
        "dim 0 a multiple of 128 x world size, or create this weight without te.quantized_model_init (FSDP2 then "
        "all-gathers it in high precision and the recipe quantizes it in each forward)")


def _cut(t, start: int, end: int):
    """Rows start:end of t (0 <= start <= end <= rows): a block tensor sharing t's buffers where
    start is on a block boundary, else a DequantizedView (no scale grid starts inside a block)."""
    if start % _row_block(t):
        return dequantized_slice(t, 0, start, end)
    return _rows(t, start, end)


def _split(t, split_size, dim: int = 0):
    if not _is_plain_2d(t):
        return NotImplemented
    if dim not in (0, -2):
        raise NotImplementedError(
            f"split of a block-scaled weight of shape {tuple(t.shape)} along dim {dim}: its FP8 pieces exist only "
            "along dim 0 (FSDP2's default Shard(0) placement; drop shard_placement_fn for FP8 primary weights). "
            "Dequantize it first (t.dequantize()) for a high-precision split")
    rows = t.shape[0]
    if isinstance(split_size, int):  # torch.chunk's equal pieces, and FSDP2's shards
        if split_size <= 0:
            return NotImplemented
        sizes = [split_size] * (rows // split_size) + ([rows % split_size] if rows % split_size else [])
    else:
        sizes = list(split_size)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return tuple(_cut(t, start, end) for start, end in zip(bounds, bounds[1:]))


def _slice(t, dim: int = 0, start=None, end=None, step: int = 1):
    if not _is_plain_2d(t):
        return NotImplemented
    if dim not in (0, -2) or step != 1:  # cuts the blocks along a row
        return dequantized_slice(t, dim, start, end, step)
    rows = t.shape[0]
    start, end = (0 if start is None else start), (rows if end is None else end)
    start, end = (min(max(0, i + rows if i < 0 else i), rows) for i in (start, end))
    return _cut(t, start, max(start, end))


def _reshaped(t, size):
    if tuple(size) == tuple(t.shape):
        return t._same_kind()
    if len(size) != 1 or size[0] not in (-1, t.numel()) or not _is_plain_2d(t):
        return NotImplemented  # another shape would misread the payload's blocks (or is not a view)
    flat = type(t).__new__(type(t), torch.Size([t.numel()]), t.dtype, t.device, t._quantizer)
    for name, value in t._payload().items():
        setattr(flat, name, value)
    flat._block_2d = t._block_2d
    flat._view_of = ViewLink(t, lambda value: value.view(-1))
    return flat


def _as_strided(t, size, stride, storage_offset=None):
    contiguous = torch.empty(t.shape, device="meta").stride()
    if tuple(size) == tuple(t.shape) and tuple(stride) == contiguous and not storage_offset:
        return t._same_kind()  # the identity (FSDP2 views each gathered parameter so): keeps both layouts
    return NotImplemented


def _new_zeros(t, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Zeros of t's kind for a 2-D size (FP8 zero is the zero byte, with unit scales); other
    sizes, dtypes, layouts or devices are a plain tensor's."""
    if dtype not in (None, t.dtype) or layout not in (None, torch.strided) or device not in (None, t.device):
        return NotImplemented
    if len(size) != 2:
        return NotImplemented
    rows, cols = size
    data = torch.zeros(size, dtype=t.fp8_dtype, device=t.device, pin_memory=bool(pin_memory))
    scale_inv = torch.ones((_ceil_div(rows, _row_block(t)), _ceil_div(cols, BLOCK)), dtype=torch.float32,
                           device=t.device, pin_memory=bool(pin_memory))
    return type(t).make(data, scale_inv, None, None, nominal_dtype=t.dtype, quantizer=t._quantizer,
                        _block_2d=t._block_2d)


def _copy(dst, src, non_blocking: bool = False):
    if (type(dst) is not type(src) or not (_is_plain_2d(dst) and _is_plain_2d(src)) or dst.shape != src.shape
            or dst.fp8_dtype != src.fp8_dtype or dst._block_2d != src._block_2d):
        return NotImplemented
    if dst._data_t is not None and src._data_t is None and not src._block_2d:
        return NotImplemented  # a 1x128 column-wise copy is another quantization: requantize
    if _viewed_columnwise(dst):
        return NotImplemented
    # each of dst's buffers written in place (a view's parent, or a captured graph, reads them)
    dst._data.copy_(src._data, non_blocking)
    dst._scale_inv.copy_(src._scale_inv, non_blocking)
    if dst._data_t is not None:  # a 128x128 tile of x.T is the transpose of a tile of x
        dst._data_t.copy_(src._data.t() if src._data_t is None else src._data_t, non_blocking)
        dst._scale_inv_t.copy_(src._scale_inv.t() if src._scale_inv_t is None else src._scale_inv_t, non_blocking)
    return dst


def _viewed_columnwise(t) -> bool:
    """Whether t is a piece of a tensor holding a column-wise copy."""
    link = t._view_link()
    while link is not None:
        t, link = link.parent, link.parent._view_link()
        if t.has_columnwise:
            return True
    return False


BLOCK_VIEW_OPS = {**fsdp_view_ops(_split, _slice, _reshaped, _as_strided, _new_zeros, _copy),
                  aten.select.int: dequantized_select}
