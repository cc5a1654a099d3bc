"""Transformer Engine's storage interface on te-core's quantized tensors: TE's attribute names
for the raw storage, and the storage methods TE code calls.

Integrations swap a quantized parameter's raw storage through TE's private names (Megatron's
FSDP: `fp8_get_raw_data` reads `_rowwise_data` / `_columnwise_data` where a tensor has them and
`_data` otherwise, copies the bytes into a uint8 buffer's slice, checks that the dtypes agree,
then sets the slice back under the same name). TE keeps FP8 bytes as uint8, te-core in torch's
float8 dtypes, so the data names answer with a uint8 alias of te-core's own tensor (the same
storage, no `_base`, as a tensor of its own would be) and take uint8 or the held dtype back; a
write through either is what te-core's GEMMs and dequantize() read. Float8Tensor answers
`_rowwise_data` too (TE's has only `_data`, which here stays in the float8 dtype), so that such
code moves its bytes rather than converting their values.

The layouts are te-core's, not TE's: the column-wise data is x.T (K, M) for both formats (TE
keeps MXFP8's as (M, K)), and the scales are unpadded: (M, ceil(K/128)) column-major for 1x128
blocks (TE: its transpose, padded to a multiple of 4), (ceil(M/128), ceil(K/128)) for 128x128,
(M, K/32) for MXFP8 (TE pads to multiples of 128 and 4). A get-then-set of the same tensor
round-trips; code that builds these tensors from TE's shapes gets the setter's error instead.

TEStorageMethods gives TE's storage methods (get_data_tensors, get_usages, update_usage,
prepare_for_saving / restore_from_saved, and Float8Tensor's _create_transpose) over the same
tensors, with te-core's dtypes.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

# TE's name -> te-core's attribute, and what it holds (for errors)
_ALIASES = {
    "_rowwise_data": ("_data", "row-wise data"),
    "_columnwise_data": ("_data_t", "column-wise data"),
    "_rowwise_scale_inv": ("_scale_inv", "row-wise scale_inv"),
    "_columnwise_scale_inv": ("_scale_inv_t", "column-wise scale_inv"),
}
_BYTES = ("_rowwise_data", "_columnwise_data")  # the names TE keeps as uint8


def byte_alias(t: Optional[Tensor]) -> Optional[Tensor]:
    """t's bytes as a uint8 tensor of t's shape and strides on t's storage, with no `_base` (TE's
    raw FP8 data is a tensor of its own; integrations check that before moving it); t itself
    when it is None, uint8 already, or wider than a byte."""
    if t is None or t.dtype == torch.uint8 or t.element_size() != 1:
        return t
    alias = torch.empty(0, dtype=torch.uint8, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def _check_replacement(t, te_name: str, held, value) -> None:
    """`value` may stand in for `held` only as the same storage layout: te-core's kernels and
    views read the tensor by the shape, dtype and strides it was quantized with."""
    own, what = _ALIASES[te_name]
    kind = type(t).__name__
    if held is None:
        raise ValueError(f"{kind}.{te_name}: this tensor holds no {what} ({own} is None), so there is none to "
                         "replace; quantize it with columnwise=True to hold the column-wise pair")
    if not isinstance(value, Tensor):
        raise TypeError(f"{kind}.{te_name} replaces the {what} with a Tensor of the same shape, dtype and "
                        f"layout; got {type(value).__name__}. To drop a layout, quantize again without it")
    bytes_ok = te_name in _BYTES and value.dtype == torch.uint8 and held.element_size() == 1
    expected = (tuple(held.shape), held.dtype, held.device, _strides(held))
    given = (tuple(value.shape), held.dtype if bytes_ok else value.dtype, value.device, _strides(value))
    if expected != given:
        accepted = f"{held.dtype} or uint8" if te_name in _BYTES else str(held.dtype)
        raise ValueError(f"{kind}.{te_name}: the {what} held has (shape, dtype, device, strides) {expected}, the "
                         f"replacement {given}; give one laid out as the tensor held, in {accepted} (get it, copy "
                         "into your buffer viewed in that shape, set that)")


def _strides(t: Tensor) -> tuple:
    # a size-1 dimension's stride is never used to address an element
    return tuple(s for s, n in zip(t.stride(), t.shape) if n != 1)


def te_alias(te_name: str) -> property:
    """The property TE's name `te_name` is on a te-core tensor (see the module docstring)."""
    own, what = _ALIASES[te_name]
    raw = te_name in _BYTES

    def get(self):
        held = getattr(self, own)
        return byte_alias(held) if raw else held

    def set(self, value) -> None:
        held = getattr(self, own)
        _check_replacement(self, te_name, held, value)
        setattr(self, own, value.view(held.dtype) if raw and value.dtype != held.dtype else value)

    kind = "its bytes as uint8, as TE keeps them" if raw else "te-core's layout"
    return property(get, set, doc=f"Transformer Engine's name of `{own}`, the {what} ({kind}).")


class TEStorageNames:
    """Mixin for the two-layout tensors: TE's four storage names as properties over `_data`,
    `_data_t`, `_scale_inv`, `_scale_inv_t`. A set replaces only that one tensor: the other layout
    is not remade (as in TE)."""

    _rowwise_data = te_alias("_rowwise_data")
    _columnwise_data = te_alias("_columnwise_data")
    _rowwise_scale_inv = te_alias("_rowwise_scale_inv")
    _columnwise_scale_inv = te_alias("_columnwise_scale_inv")


class TEStorageMethods:
    """Mixin: TE's storage methods over a tensor's two layouts. A class names its layouts'
    attributes in `_TE_LAYOUT` (row-wise data, column-wise data) and the tensors
    prepare_for_saving lists in `_TE_SAVED` (in TE's order), and says how to make and drop a
    layout (`_te_make`, `_te_drop`). Data comes back in te-core's float8 dtypes (TE: uint8)."""

    _TE_LAYOUT: Tuple[str, str]
    _TE_SAVED: Tuple[str, ...]

    def get_data_tensors(self, rowwise_data: bool = True, columnwise_data: bool = True):
        """The data tensors held (None for a layout not held): the pair, or the one asked for."""
        row, col = (getattr(self, name) for name in self._TE_LAYOUT)
        if rowwise_data and columnwise_data:
            return row, col
        if rowwise_data:
            return row
        if columnwise_data:
            return col
        raise ValueError("get_data_tensors: rowwise_data and columnwise_data are both False; ask for at least one")

    def get_usages(self) -> Dict[str, bool]:
        """Which layouts are held: {"rowwise": ..., "columnwise": ...}."""
        row, col = (getattr(self, name) for name in self._TE_LAYOUT)
        return {"rowwise": row is not None, "columnwise": col is not None}

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None) -> None:
        """Make the layouts asked for (True) that are not held, from the other, and drop those
        declined (False); None leaves a layout as it is. A layout that cannot be made from the
        other (1x128 blocks and MXFP8, whose scales run along one direction) is a clear error,
        as is declining both (the tensor would hold no data)."""
        for name, value in (("rowwise_usage", rowwise_usage), ("columnwise_usage", columnwise_usage)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"update_usage: {name} must be True, False or None, got {type(value).__name__}")
        held = self.get_usages()
        want = {"rowwise": held["rowwise"] if rowwise_usage is None else rowwise_usage,
                "columnwise": held["columnwise"] if columnwise_usage is None else columnwise_usage}
        if not (want["rowwise"] or want["columnwise"]):
            raise ValueError(f"update_usage: declining both layouts would leave this {type(self).__name__} with no "
                             "data; keep at least one (rowwise_usage=True or columnwise_usage=True)")
        if not want["rowwise"] and held["rowwise"] and self._view_link() is not None:
            raise ValueError(f"update_usage: this {type(self).__name__} is a view whose row-wise bytes are its base "
                             "tensor's; drop them on the base, or keep rowwise_usage")
        for layout in ("rowwise", "columnwise"):
            if want[layout] and not held[layout]:
                self._te_make(layout == "rowwise")
        for layout in ("rowwise", "columnwise"):
            if held[layout] and not want[layout]:
                self._te_drop(layout == "rowwise")

    def prepare_for_saving(self) -> Tuple[List[Optional[Tensor]], "TEStorageMethods"]:
        """(the storage tensors in TE's order, this tensor), which then holds none of them until
        restore_from_saved gives them back (TE's protocol for saving a tensor for backward)."""
        tensors = [getattr(self, name) for name in self._TE_SAVED]
        for name in self._TE_SAVED:
            setattr(self, name, None)
        return tensors, self

    def restore_from_saved(self, tensors: List[Optional[Tensor]]) -> List[Optional[Tensor]]:
        """Take back the tensors prepare_for_saving listed (from the front of `tensors`); returns the rest."""
        n = len(self._TE_SAVED)
        if len(tensors) < n:
            raise ValueError(f"restore_from_saved: a {type(self).__name__} takes back {n} tensors "
                             f"({', '.join(self._TE_SAVED)}), got {len(tensors)}; pass what prepare_for_saving returned")
        for name, tensor in zip(self._TE_SAVED, tensors):
            setattr(self, name, tensor)
        return list(tensors[n:])

    def _te_make(self, rowwise: bool) -> None:
        raise NotImplementedError

    def _te_drop(self, rowwise: bool) -> None:
        raise NotImplementedError


def prepare_for_saving(*tensors) -> Tuple[List[Optional[Tensor]], list]:
    """TE's save protocol over several tensors: (what save_for_backward is given, the objects that
    restore_from_saved puts the saved tensors back into). A tensor, te-core's quantized ones
    included (each is a torch.Tensor, as TE's QuantizedTensor is), and None go as they are, with
    None in the second list; any other object with a prepare_for_saving method (a storage
    object) gives its tensors, and is the second list's entry."""
    saved: List[Optional[Tensor]] = []
    objects: list = []
    for tensor in tensors:
        if tensor is None or isinstance(tensor, Tensor):
            saved.append(tensor)
            objects.append(None)
            continue
        if not callable(getattr(tensor, "prepare_for_saving", None)):
            raise TypeError(f"prepare_for_saving: expected tensors, None or storage objects with a "
                            f"prepare_for_saving method, got {type(tensor).__name__}")
        parts, holder = tensor.prepare_for_saving()
        saved.extend(parts)
        objects.append(holder)
    return saved, objects


def restore_from_saved(tensors: list, saved_tensors, return_saved_tensors: bool = False):
    """The inverse of prepare_for_saving: `tensors` is its second list, `saved_tensors` what
    autograd saved. Returns the tensors in order (and, with return_saved_tensors, the saved
    tensors left over)."""
    rest = list(saved_tensors)
    restored = []
    for holder in tensors:
        if holder is None or isinstance(holder, Tensor):
            if not rest:
                raise ValueError("restore_from_saved: fewer saved tensors than prepare_for_saving listed; pass "
                                 "ctx.saved_tensors of the same call")
            restored.append(rest.pop(0))
        else:
            rest = holder.restore_from_saved(rest)
            restored.append(holder)
    return (restored, rest) if return_saved_tensors else restored


def restore_from_func_ctx(ctx, return_saved_tensors: bool = False):
    """restore_from_saved(ctx.tensor_objects, ctx.saved_tensors), then drops ctx.tensor_objects
    (the function context would otherwise keep the storage objects alive)."""
    objects = getattr(ctx, "tensor_objects", None)
    if objects is None:
        raise AttributeError("restore_from_func_ctx: ctx has no tensor_objects; set ctx.tensor_objects to the second "
                             "list prepare_for_saving returned in the forward")
    out = restore_from_saved(objects, ctx.saved_tensors, return_saved_tensors=return_saved_tensors)
    ctx.tensor_objects = None
    return out
