"""One cast of a tensor for every module that reads it: the last input cast under an autocast,
kept for the next module that casts the same tensor the same way.

Models often feed one tensor to several Linear layers in a row: a converted Hugging Face
attention block its query, key and value projections, its MLP the gate and up projections.
Where a cast's result depends on the tensor alone (current scaling, block and MXFP8 scaling:
`Quantizer.sharing_key`), those layers' casts are identical, so the first one serves them all:
less host time, bandwidth and saved memory, the same bytes. Delayed scaling casts with each
layer's own scale, so its casts are never shared.

One entry, not a table: sibling layers cast one after another. The entry refers to the tensor
it was cast from weakly (to the tensor a view was taken of, since each layer makes its own 2-D
view), and is dropped as soon as that tensor is: the kept cast never outlives its source, so it
adds no activation memory (a training step's layers keep their input casts for the backward
anyway), and no other tensor can take the source's memory while the entry stands. A hit needs
the same memory, shape, strides and dtype, and an unchanged version counter (an in-place write
between the two casts makes a miss; a write through `.data` bypasses the counter, as it
bypasses autograd's own checks of saved tensors).
"""
from __future__ import annotations

import weakref
from typing import Hashable, Optional

from torch import Tensor

from .tensor import QuantizedTensor


class SharedCast:
    """The outermost autocast's last shareable input cast (see the module docstring)."""

    __slots__ = ("_entry", "__weakref__")

    def __init__(self):
        # (weak reference to the source's base, data_ptr, shape, strides, dtype, version, key,
        # columnwise, result)
        self._entry = None

    def get(self, x: Tensor, key: Hashable, columnwise: bool) -> Optional[QuantizedTensor]:
        """The kept cast of `x` under `key`, with a column-wise copy where `columnwise`, or None."""
        entry = self._entry
        if entry is None or x.is_inference():
            return None
        source, ptr, shape, stride, dtype, version, kept_key, kept_columnwise, result = entry
        base = x._base if x._base is not None else x
        if (source() is not base or kept_key != key or (columnwise and not kept_columnwise)
                or x.data_ptr() != ptr or x.shape != shape or x.stride() != stride or x.dtype != dtype):
            return None
        # (a view shares its base's version counter)
        return result if x._version == version else None

    def put(self, x: Tensor, key: Hashable, columnwise: bool, result: QuantizedTensor) -> None:
        """Keep `result`, x's cast under `key`, while x (its base) lives; inference tensors carry no
        version counter to check, so theirs are not kept."""
        if x.is_inference():
            self._entry = None
            return
        base = x._base if x._base is not None else x
        owner = weakref.ref(self)
        source = weakref.ref(base, lambda _, owner=owner: _drop(owner))
        self._entry = (source, x.data_ptr(), x.shape, x.stride(), x.dtype, x._version, key, columnwise, result)

    def clear(self) -> None:
        self._entry = None


def _drop(owner: "weakref.ref[SharedCast]") -> None:
    """The source of a kept cast is gone: drop the entry (and with it the cast), unless a newer
    cast replaced it meanwhile (whose source is alive: its entry stays)."""
    shared = owner()
    if shared is not None and shared._entry is not None and shared._entry[0]() is None:
        shared._entry = None
