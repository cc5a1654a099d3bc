"""DequantizedView: a view of a quantized tensor that its format cannot hold quantized.

A row or column of a block-scaled or MXFP8 tensor (a select: `w[1]`, `w[:, 3]`), or a slice
that cuts its blocks (`w[:, 0:64]`; any slice of an MXFP8 tensor), a reshape or flattening of
block-scaled or MXFP8 data, or a split of MXFP8 rows that cuts a 32-row run (mxfp8_views), is no
tensor of that format.
So is any other view op (t(), transpose, permute, expand, unsqueeze, as_strided...) that a
format's own handlers do not keep quantized. A dequantized copy would read right but silently
drop an in-place write through it (`w[1] = 0`, `w.select(1, 3).mul_(2)`, `w.t()[0].zero_()`), so
these return a DequantizedView instead: it reads as that view of the tensor's dequantized value,
and an in-place op on it writes its part of that value, which the tensor's quantizer then casts
whole (its ViewLink, see QuantizedTensor). A view of it is a DequantizedView of the same tensor,
the two view ops composed; any other op sees the dequantized value, as on every quantized tensor.

Its wrapper has the strides torch's view of the tensor would have (worked out on a meta tensor
laid out as the viewed one), so torch's own rules hold: a view that torch refuses for those
strides (`w[:, 2:5].view(-1)`) raises torch's error, and reshape, flatten or contiguous of a
non-contiguous view is a plain copy, as it is of a plain tensor.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .tensor import QuantizedTensor
from .write_back import ViewLink

aten = torch.ops.aten


class DequantizedView(QuantizedTensor):
    """A view of a quantized tensor's value that writes back into it (see the module docstring)."""

    _view_fn: Callable[[Tensor], Tensor]  # the parent's value -> this view of it

    @classmethod
    def of(cls, parent: QuantizedTensor, view_fn: Callable[[Tensor], Tensor]) -> "DequantizedView":
        if isinstance(parent, cls):  # a view of a view: both ops on the value of the tensor viewed
            inner, parent = parent._view_fn, parent._view_of.parent
            view_fn = (lambda outer: lambda value: outer(inner(value)))(view_fn)
        # laid out as parent's writable value (its wrapper's strides), as the puts address it
        meta = view_fn(torch.empty_strided(parent.shape, parent.stride(), device="meta"))
        self = cls.__new__(cls, meta.shape, parent.dtype, parent.device, parent._quantizer,
                           None if meta.is_contiguous() else meta.stride())
        self._view_fn = view_fn
        self._view_of = ViewLink(parent, view_fn)
        return self

    def _dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        parent = self._view_of.parent
        value = parent._dequantize(dtype)
        if value.stride() != parent.stride():  # (a view_fn reading strides: as_strided, view)
            value = torch.empty_strided(parent.shape, parent.stride(), dtype=value.dtype,
                                        device=value.device).copy_(value)
        return self._view_fn(value).contiguous()

    @property
    def has_columnwise(self) -> bool:
        return False

    def _payload(self) -> dict:
        return {"_view_fn": self._view_fn}

    @property
    def data(self) -> Tensor:
        return QuantizedTensor.data.fget(self)

    @data.setter
    def data(self, value: Tensor) -> None:
        raise RuntimeError(f"a {type(self).__name__} (a view of a {type(self._view_of.parent).__name__}) holds no "
                           "data of its own to replace; write into it (view.copy_(value)) or set the data of the "
                           "tensor it views")

    # a copy of a view is a plain tensor: it has no quantized data of its own to carry
    def __deepcopy__(self, memo):
        return self._dequantize()

    def __reduce_ex__(self, protocol):
        return self._dequantize().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _COPIES:
            return func(*[a._dequantize() if isinstance(a, cls) else a for a in args], **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


# QuantizedTensor's handlers would copy the (empty) payload: these take the dequantized value
_COPIES = (aten.clone.default, aten._to_copy.default, aten.empty_like.default, aten.new_zeros.default,
           aten.new_empty.default, aten._pin_memory.default)


def dequantized_select(t: QuantizedTensor, dim: int, index: int) -> DequantizedView:
    """aten.select.int of a block-scaled or MXFP8 tensor."""
    return DequantizedView.of(t, lambda value: value.select(dim, index))


def dequantized_slice(t: QuantizedTensor, dim: int = 0, start=None, end=None, step: int = 1) -> DequantizedView:
    """aten.slice.Tensor of a block-scaled or MXFP8 tensor where no block tensor can hold it."""
    return DequantizedView.of(t, lambda value: aten.slice.Tensor(value, dim, start, end, step))


def dequantized_views(func, args, kwargs):
    """A view op of args[0] as DequantizedViews: one, or one per piece of a split or unbind."""
    t, rest = args[0], args[1:]
    if func is aten.view.dtype:
        if rest[0] == t.dtype:
            return DequantizedView.of(t, lambda value: value)
        raise NotImplementedError(f"view({rest[0]}) of a {type(t).__name__}: its memory holds quantized data and "
                                  f"scales, not {t.dtype} elements to reinterpret; dequantize() it first (a copy)")
    if func is aten.as_strided.default and t._view_link() is not None and not isinstance(t, DequantizedView):
        # its storage offset would count from the start of its own bytes, not of the tensor it views
        raise NotImplementedError(f"as_strided of a view of a {type(t._view_link().parent).__name__}: call it on "
                                  "the tensor that view was taken of, or dequantize() first (a copy)")
    shapes = func(torch.empty_strided(t.shape, t.stride(), device="meta"), *rest, **kwargs)
    if isinstance(shapes, Tensor):
        return DequantizedView.of(t, lambda value: func(value, *rest, **kwargs))
    return tuple(DequantizedView.of(t, lambda value, i=i: func(value, *rest, **kwargs)[i]) for i in range(len(shapes)))
