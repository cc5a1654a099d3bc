"""Views of a Float8Tensor that stay FP8: the torch ops FSDP2 shards a parameter with.

With one scale for the whole tensor, any element-wise view of the FP8 data (a split, a slice, a
reshape, as_strided) is that view of the tensor's value, with the same scale_inv, so it is kept
quantized instead of being dequantized into a high-precision copy. The column-wise copy is not
carried into a view (a view of it would be another layout); a GEMM that needs it makes it again
from the row-wise data, exactly. An as_strided that is the identity keeps both layouts.

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

aten = torch.ops.aten


def _view(t, data: Tensor):
    """A Float8Tensor of `data` (a view of t's FP8 data) with t's scale_inv and quantizer."""
    return type(t).make(data, t._scale_inv, None, nominal_dtype=t.dtype, quantizer=t._quantizer)


def _split(t, split_size, dim: int = 0):
    return tuple(_view(t, part) for part in t._rowwise_data().split(split_size, dim))


def _slice(t, dim: int = 0, start=None, end=None, step: int = 1):
    return _view(t, aten.slice.Tensor(t._rowwise_data(), dim, start, end, step))


def _reshaped(t, size):
    return _view(t, t._rowwise_data().view(size))


def _as_strided(t, size, stride, storage_offset=None):
    data = t._rowwise_data()
    offset = data.storage_offset() if storage_offset is None else storage_offset
    if tuple(size) == tuple(t.shape) and tuple(stride) == data.stride() and offset == data.storage_offset():
        return t._same_kind()  # the identity (FSDP2 views each gathered parameter so): keeps both layouts
    return _view(t, data.as_strided(size, stride, storage_offset))


def _new_zeros(t, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    """Zeros of t's kind (FP8 zero is the zero byte); a request for another dtype, layout or
    device is a plain tensor's."""
    if dtype not in (None, t.dtype) or layout not in (None, torch.strided) or device not in (None, t.device):
        return NotImplemented
    data = torch.zeros(size, dtype=t.fp8_dtype, device=t.device, pin_memory=bool(pin_memory))
    return _view(t, data)


def _copy(dst, src, non_blocking: bool = False):
    if type(dst) is not type(src) or dst.shape != src.shape or dst.fp8_dtype != src.fp8_dtype:
        return NotImplemented
    if dst._scale_inv is not src._scale_inv and not torch.equal(dst._scale_inv, src._scale_inv):
        return NotImplemented
    # each of dst's buffers written in place (a view's parent, or a captured graph, reads them)
    if dst._data is not None:
        dst._data.copy_(src._rowwise_data(), non_blocking)
    if dst._transpose is not None:
        src_t = src._transpose if src._transpose is not None else src._rowwise_data().t()
        dst._transpose.copy_(src_t, non_blocking)
    return dst


def _pin_payload(t, device=None):
    return t._with_payload(lambda d: d.pin_memory())


def fsdp_view_ops(split, slice_, reshaped, as_strided, new_zeros, copy) -> dict:
    """The aten ops FSDP2 shards, pads and refills a parameter with, each mapped to a quantized
    tensor class's handler (the other ops dequantize)."""
    return {
        aten.split.Tensor: split,
        aten.split_with_sizes.default: split,
        aten.slice.Tensor: slice_,
        aten.view.default: reshaped,
        aten._unsafe_view.default: reshaped,
        aten.as_strided.default: as_strided,
        aten.new_zeros.default: new_zeros,
        aten.new_empty.default: new_zeros,  # FSDP2 makes a rank's empty shard with it
        aten.copy_.default: copy,
        aten._pin_memory.default: _pin_payload,
    }


FLOAT8_VIEW_OPS = fsdp_view_ops(_split, _slice, _reshaped, _as_strided, _new_zeros, _copy)
