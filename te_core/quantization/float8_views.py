"""Views of a Float8Tensor that stay FP8: every view op torch has for a tensor's elements (the
ones FSDP2 shards a parameter with, indexing's select and slice, t(), transpose, permute, expand,
unsqueeze, squeeze, diagonal, unfold, as_strided).

With one scale for the whole tensor, any element-wise view of the FP8 data is that view of the
tensor's value, with the same scale_inv, so it is kept quantized instead of being dequantized
into a high-precision copy. The column-wise copy is not carried into a view (a view of it would
be another layout); a GEMM that needs it makes it again from the row-wise data, exactly. An
as_strided that is the identity keeps both layouts.

A view's wrapper reports the strides of its FP8 bytes, so torch's own rules hold as for a plain
tensor: view() where those strides allow no view (`w[:, 2:5].view(-1)`) raises torch's error,
and reshape, flatten and contiguous of such a view copy (torch asks for a clone, then a view of
it). A view carries a ViewLink to the tensor whose bytes it views (a view of a view, to that same
tensor): an in-place op on it requantizes that tensor whole, since the view shares its one scale
(QuantizedTensor). A tensor whose wrapper and bytes are laid out differently (one kept column-wise
only) takes the general path: its views are DequantizedViews, which write back alike.

`copy_` between two Float8Tensors with equal scale_inv copies the FP8 bytes into the
destination's buffers (both layouts it has), so a write into a view reaches the tensor it views
(FSDP2 pads a shard by copying it into a view of a zero tensor). Every other copy requantizes
(QuantizedTensor).

Each handler returns NotImplemented where it does not apply, and the op then takes
QuantizedTensor's general path.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .write_back import ViewLink

aten = torch.ops.aten


def _view(t, data: Tensor):
    """A Float8Tensor of `data` (a view of t's FP8 data) with t's scale_inv and quantizer, linked
    to the tensor that holds those bytes."""
    t._own_scales()  # (a write into either is the other's)
    view = type(t).make(data, t._scale_inv, None, nominal_dtype=t.dtype, quantizer=t._quantizer,
                        strides=data.stride())
    link = t._view_link()
    view._view_of = _region_link(t if link is None else link.parent, data)
    return view


def _region_link(base, data: Tensor) -> ViewLink:
    """The link of a view whose FP8 bytes are `data`, inside base's row-wise data: the view's
    value goes to the same elements of base's value, laid out as those bytes
    (Float8Tensor._writable_value)."""
    rows = base._row_bytes()
    size, stride, offset = data.size(), data.stride(), data.storage_offset() - rows.storage_offset()
    layout = rows.stride()

    def region(value: Tensor) -> Tensor:
        if value.stride() != layout:
            raise RuntimeError("a write through a view of a Float8Tensor whose data has since been replaced "
                               "(it was requantized into another layout); take the view again")
        return value.as_strided(size, stride, value.storage_offset() + offset)

    return ViewLink(base, region)


def _bytes(t):
    """t's row-wise FP8 data where the wrapper reports its layout (then a view of one is the same
    view of the other), else None."""
    data = t._row_bytes()
    return data if data.stride() == t.stride() else None


def _viewing(func):
    """The handler of view op `func`: the same view of t's FP8 bytes, one or one per piece."""
    def handler(t, *args, **kwargs):
        data = _bytes(t)
        if data is None:
            return NotImplemented
        out = func(data, *args, **kwargs)  # (raises torch's error where the bytes' strides allow no view)
        return _view(t, out) if isinstance(out, Tensor) else tuple(_view(t, part) for part in out)
    return handler


def _unsafe_view(t, size):
    """What torch's reshape views a clone with (and other composites a fresh result): no alias
    of t to keep, so a copy where t's bytes cannot be viewed so, whose requantization must leave
    t's scale_inv alone."""
    data = _bytes(t)
    if data is None:
        return NotImplemented
    try:
        viewed = data.view(size)
    except RuntimeError:
        return type(t).make(data.reshape(size), t._scale_inv.clone(), None, nominal_dtype=t.dtype,
                            quantizer=t._quantizer)
    return _view(t, viewed)


def _clone(t, *, memory_format=None):
    """A copy of its own; contiguous where asked (what torch's contiguous() and reshape ask)."""
    if memory_format in (None, torch.preserve_format) or t.is_contiguous(memory_format=memory_format):
        return NotImplemented  # (QuantizedTensor's: every buffer cloned as it is laid out)
    return type(t).make(t._row_bytes().clone(memory_format=memory_format), t._scale_inv.clone(), None,
                        nominal_dtype=t.dtype, quantizer=t._quantizer)


def _as_strided(t, size, stride, storage_offset=None):
    data = _bytes(t)
    if data is None:
        return NotImplemented
    offset = data.storage_offset() if storage_offset is None else storage_offset
    if tuple(size) == tuple(t.shape) and tuple(stride) == data.stride() and offset == data.storage_offset():
        t._own_scales()
        return t._same_kind()  # the identity (FSDP2 views each gathered parameter so): keeps both layouts
    return _view(t, data.as_strided(size, stride, storage_offset))


def _new_zeros(t, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Zeros of t's kind (FP8 zero is the zero byte); a request for another dtype, layout or
    device is a plain tensor's."""
    if dtype not in (None, t.dtype) or layout not in (None, torch.strided) or device not in (None, t.device):
        return NotImplemented
    data = torch.zeros(size, dtype=t.fp8_dtype, device=t.device, pin_memory=bool(pin_memory))
    # a tensor of its own: requantizing it must not rewrite t's scale (equal values still let a
    # copy_ between the two move bytes, as FSDP2's padding does)
    scale_inv = t._scale_inv.clone()
    if pin_memory:
        scale_inv = scale_inv.pin_memory()
    return type(t).make(data, scale_inv, None, nominal_dtype=t.dtype, quantizer=t._quantizer)


def _copy(dst, src, non_blocking: bool = False):
    if type(dst) is not type(src) or dst.shape != src.shape or dst.fp8_dtype != src.fp8_dtype:
        return NotImplemented
    same = dst._scale_inv is src._scale_inv or dst._scale_inv.is_meta or src._scale_inv.is_meta  # (meta: no values)
    if not same and not torch.equal(dst._scale_inv, src._scale_inv):
        if dst._view_link() is not None or dst._data is None or dst._scale_inv.shape != src._scale_inv.shape:
            return NotImplemented  # a part of a tensor keeps that tensor's scale: the value is requantized
        # a whole tensor takes the source's bytes and scale, as Transformer Engine's copy_ does: the
        # copy is exact, where requantizing with dst's scale (a delayed one, from other values)
        # would round every value again and could saturate them
        if dst._holds_lent_scale():
            # buffers of its own, whole (no alias reads them: QuantizedTensor._take_payload): other
            # tensors read the lent scale, and a saved column-wise twin the old bytes
            dst._scale_inv = torch.empty_like(dst._scale_inv)
            dst._data = torch.empty_like(dst._data)
            dst._transpose = None if dst._transpose is None else torch.empty_like(dst._transpose)
        dst._scale_inv.copy_(src._scale_inv, non_blocking)
    # each of dst's buffers written in place (a view's parent, or a captured graph, reads them)
    if dst._data is not None:
        dst._data.copy_(src._row_bytes(), non_blocking)
    if dst._transpose is not None:
        src_t = src._transpose if src._transpose is not None else src._row_bytes().t()
        dst._transpose.copy_(src_t, non_blocking)
    link = dst._view_link()
    if link is not None:  # the bytes went into a part of the viewed tensor: its column-wise copy follows
        base = link.parent
        if base._data is not None and base._transpose is not None:
            base._transpose.copy_(base._data.reshape(-1, base._data.shape[-1]).t(), non_blocking)
    return dst


def _pin_payload(t, device=None):
    return t._with_payload(lambda d: d.pin_memory())


def fsdp_view_ops(split, slice_, reshaped, as_strided, new_zeros, copy, unsafe_view=None) -> dict:
    """The aten ops FSDP2 shards, pads and refills a parameter with, each mapped to a quantized
    tensor class's handler (the other ops dequantize)."""
    return {
        aten.split.Tensor: split,
        aten.split_with_sizes.default: split,
        aten.slice.Tensor: slice_,
        aten.view.default: reshaped,
        aten._unsafe_view.default: unsafe_view or reshaped,
        aten.as_strided.default: as_strided,
        aten.new_zeros.default: new_zeros,
        aten.new_empty.default: new_zeros,  # FSDP2 makes a rank's empty shard with it
        aten.copy_.default: copy,
        aten._pin_memory.default: _pin_payload,
    }


# (t(), mT, movedim, narrow, flatten, unflatten, chunk, expand_as and view_as come to these)
_VIEWS = (aten.select.int, aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default,
          aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.diagonal.default,
          aten.unfold.default, aten.unbind.int, aten._reshape_alias.default)

FLOAT8_VIEW_OPS = {**fsdp_view_ops(_viewing(aten.split.Tensor), _viewing(aten.slice.Tensor),
                                   _viewing(aten.view.default), _as_strided, _new_zeros, _copy, _unsafe_view),
                   aten.split_with_sizes.default: _viewing(aten.split_with_sizes.default),
                   aten.clone.default: _clone,
                   **{op: _viewing(op) for op in _VIEWS}}
