"""Views of a Float8BlockwiseTensor that stay FP8: the torch ops FSDP2 shards a parameter with.

A block-scaled tensor cut along dim 0 at block boundaries is, piece by piece, the FP8 bytes of
those rows with the scale_inv rows of their blocks (a 128x128 tile's scale covers 128 rows, a
1x128 run's one row), so such a piece is kept quantized, exactly. A cut through a 128x128 tile
cannot be: its rows would need the scale of a tile they only partly fill. FSDP2 cuts dim 0
with torch.chunk (pieces of ceil(rows / world size) rows, the last one shorter or empty, then
padded), so a cut that would split a tile is refused with what to do, instead of silently
making high-precision shards. Views carry only the row-wise data and scales (the column-wise
copy is another layout); an FSDP2 all-gather rebuilds it.

Such a piece is linked to the tensor it was cut from (ViewLink): an in-place op on it writes its
rows of that tensor's value, requantized whole, so that the column-wise copy the tensor holds
follows (the piece holds none). A select (`w[1]`, `w[:, 3]`) or a slice along a row is no block
tensor: it is a DequantizedView, which writes back in the same way.

A flattening view (FSDP2 keeps one of each padded shard) is the same payload under the 1-D
nominal shape: the row-major order of the elements is unchanged, so it dequantizes to the
flattened value. It has no quantizer, since a requantization of it would not reach the tensor
it views: an in-place op on it raises. Other reshapes take QuantizedTensor's general path.

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
from .tensor import ViewLink

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
                        _block_2d=t._block_2d, _view_of=ViewLink(t, lambda value, part: value[start:end].copy_(part)))


def world_size_of(rows: int, piece: int) -> str:
    """The FSDP world size that makes torch.chunk cut `rows` into pieces of `piece` rows."""
    n = _ceil_div(rows, piece)
    return str(n) if _ceil_div(rows, n + 1) != piece else f"{n} or more"


def tile_cut_error(shape, piece: int, world: str) -> ValueError:
    return ValueError(
        f"FSDP2 FP8 all-gather of a block-scaled (Float8BlockScaling) weight of shape {tuple(shape)}: with world "
        f"size {world}, FSDP2 cuts dim 0 into shards of {piece} rows (ceil(rows / world size)), which cut its "
        "128x128 scale tiles. Each shard must hold whole tiles (the shard rows and dim 0 multiples of 128): make "
        "dim 0 a multiple of 128 x world size, or create this weight without te.quantized_model_init (FSDP2 then "
        "all-gathers it in high precision and the recipe quantizes it in each forward)")


def _cut_error(t, start: int, end: int) -> ValueError:
    return ValueError(
        f"rows {start}:{end} of a block-scaled tensor of shape {tuple(t.shape)} cut a {_row_block(t)}-row block of "
        "scales; cut it at multiples of 128 rows, or dequantize it first (t.dequantize())")


def _split(t, split_size, dim: int = 0):
    if not _is_plain_2d(t):
        return NotImplemented
    if dim not in (0, -2):
        raise NotImplementedError(
            f"split of a block-scaled weight of shape {tuple(t.shape)} along dim {dim}: its FP8 pieces exist only "
            "along dim 0 (FSDP2's default Shard(0) placement; drop shard_placement_fn for FP8 primary weights). "
            "Dequantize it first (t.dequantize()) for a high-precision split")
    rows, unit = t.shape[0], _row_block(t)
    if isinstance(split_size, int):  # torch.chunk's equal pieces: how FSDP2 shards
        if split_size <= 0:
            return NotImplemented
        if rows > split_size and (split_size % unit or rows % split_size % unit):
            raise tile_cut_error(t.shape, split_size, world_size_of(rows, split_size))
        sizes = [split_size] * (rows // split_size) + ([rows % split_size] if rows % split_size else [])
    else:
        sizes = list(split_size)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    for start, end in zip(bounds, bounds[1:]):
        if start % unit or (end % unit and end != rows):
            raise _cut_error(t, start, end)
    return tuple(_rows(t, start, end) for start, end in zip(bounds, bounds[1:]))


def _slice(t, dim: int = 0, start=None, end=None, step: int = 1):
    if not _is_plain_2d(t):
        return NotImplemented
    if dim not in (0, -2) or step != 1:  # cuts the blocks along a row
        return dequantized_slice(t, dim, start, end, step)
    rows = t.shape[0]
    start, end = (0 if start is None else start), (rows if end is None else end)
    start, end = (min(max(0, i + rows if i < 0 else i), rows) for i in (start, end))
    end = max(start, end)
    if start % _row_block(t) or (end % _row_block(t) and end != rows):
        raise _cut_error(t, start, end)
    return _rows(t, start, end)


def _reshaped(t, size):
    if tuple(size) == tuple(t.shape):
        return t._same_kind()
    if len(size) != 1 or size[0] not in (-1, t.numel()) or not _is_plain_2d(t):
        return NotImplemented  # another shape would misread the payload's blocks (or is not a view)
    flat = type(t).__new__(type(t), torch.Size([t.numel()]), t.dtype, t.device, None)
    for name, value in t._payload().items():
        setattr(flat, name, value)
    flat._block_2d = t._block_2d
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
