"""Transformer Engine's storage attribute names on te-core's block-scaled and MXFP8 tensors.

Integrations swap a quantized parameter's raw storage through TE's private names (Megatron's
FSDP: `fp8_get_raw_data` / `fp8_set_raw_data` read `_rowwise_data` / `_columnwise_data`, then
set a buffer's slice holding the same bytes). Here each name aliases te-core's own attribute,
so a write through it is what te-core's GEMMs and dequantize() read.

The layouts are te-core's, not TE's: the column-wise data is x.T (K, M) for both formats (TE
keeps MXFP8's as (M, K)), and the scales are unpadded: (M, ceil(K/128)) column-major for 1x128
blocks (TE: its transpose, padded to a multiple of 4), (ceil(M/128), ceil(K/128)) for 128x128,
(M, K/32) for MXFP8 (TE pads to multiples of 128 and 4). A get-then-set of the same tensor
round-trips; code that builds these tensors from TE's shapes gets the setter's error instead.
"""
from __future__ import annotations

from torch import Tensor

# TE's name -> te-core's attribute, and what it holds (for errors)
_ALIASES = {
    "_rowwise_data": ("_data", "row-wise data"),
    "_columnwise_data": ("_data_t", "column-wise data"),
    "_rowwise_scale_inv": ("_scale_inv", "row-wise scale_inv"),
    "_columnwise_scale_inv": ("_scale_inv_t", "column-wise scale_inv"),
}


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
    expected = (tuple(held.shape), held.dtype, held.device, _strides(held))
    given = (tuple(value.shape), value.dtype, value.device, _strides(value))
    if expected != given:
        hint = (f"; view uint8 bytes as {held.dtype} (te-core holds FP8 bytes in torch's float8 dtypes, TE in "
                "uint8)" if value.dtype != held.dtype and value.element_size() == held.element_size() else "")
        raise ValueError(f"{kind}.{te_name}: the {what} held has (shape, dtype, device, strides) {expected}, the "
                         f"replacement {given}; give one laid out as the tensor held (get it, copy into your "
                         f"buffer viewed in that shape, set that){hint}")


def _strides(t: Tensor) -> tuple:
    # a size-1 dimension's stride is never used to address an element
    return tuple(s for s, n in zip(t.stride(), t.shape) if n != 1)


def _alias(te_name: str) -> property:
    own, what = _ALIASES[te_name]

    def get(self):
        return getattr(self, own)

    def set(self, value) -> None:
        _check_replacement(self, te_name, getattr(self, own), value)
        setattr(self, own, value)

    return property(get, set, doc=f"Transformer Engine's name of `{own}`, the {what} (te-core's layout).")


class TEStorageNames:
    """Mixin: TE's four storage names as properties over `_data`, `_data_t`, `_scale_inv`, `_scale_inv_t`.
    A set replaces only that one tensor: the other layout is not remade (as in TE)."""

    _rowwise_data = _alias("_rowwise_data")
    _columnwise_data = _alias("_columnwise_data")
    _rowwise_scale_inv = _alias("_rowwise_scale_inv")
    _columnwise_scale_inv = _alias("_columnwise_scale_inv")
