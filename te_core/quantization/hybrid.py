"""Transformer Engine's HybridQuantizer: one quantizer for a tensor's row-wise use, another for its
column-wise use, so a CustomRecipe can mix forward and backward precisions per tensor.

A linear layer's forward GEMM reads its input and weight row-wise; the dgrad and wgrad GEMMs read
them column-wise (quantization.gemm). A HybridQuantizedTensor holds the two directions, each as
its own quantizer made it (an FP8 tensor, or the plain tensor of an IdentityQuantizer), and a GEMM
reads the direction it needs (`gemm_operand`). What a module keeps for its backward
(keep_columnwise) is the column-wise direction alone.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import quantizers as core
from .identity import IdentityTensor
from .te_quantizers import _TEQuantizer
from .tensor import QUANTIZED, QuantizedOperand, QuantizedTensor

__all__ = ["HybridQuantizer", "HybridQuantizedTensor", "HybridOperand"]

COLUMNWISE_SOURCES = ("original", "rowwise_dequantized")


def _value(part: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The high-precision value of one direction (an FP8 tensor dequantized, a plain one as is)."""
    if isinstance(part, QUANTIZED):
        return part._dequantize(dtype)
    return part if dtype is None or part.dtype == dtype else part.to(dtype)


class _HybridLayout:
    """`_rowwise` / `_columnwise`: each direction as its quantizer cast it, or None where that
    direction was not asked for."""

    _rowwise: Optional[Tensor]
    _columnwise: Optional[Tensor]

    @classmethod
    def make(cls, rowwise: Optional[Tensor], columnwise: Optional[Tensor], like: Tensor,
             quantizer=None) -> "HybridQuantizedTensor":
        if cls._traced_twin is not None and torch.compiler.is_compiling():
            cls = cls._traced_twin  # (dynamo builds no wrapper subclass in a graph: see QuantizedOperand)
        self = cls.__new__(cls, like.shape, like.dtype, like.device, quantizer)
        self._rowwise, self._columnwise = rowwise, columnwise
        return self

    # Transformer Engine's names for the two directions
    rowwise_sub_storage = property(lambda self: self._rowwise)
    columnwise_sub_storage = property(lambda self: self._columnwise)

    def _dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        part = self._rowwise if self._rowwise is not None else self._columnwise
        return _value(part, dtype or self.dtype).reshape(self.shape)

    def gemm_operand(self, columnwise: bool) -> Tensor:
        """The direction a GEMM reads: an FP8 tensor, or a plain one (an identity direction)."""
        part = self._columnwise if columnwise else self._rowwise
        if part is None:
            direction = "columnwise" if columnwise else "rowwise"
            raise RuntimeError(f"HybridQuantizedTensor: a GEMM reads its {direction} direction, which was not "
                               f"made; quantize with {direction} usage (set_usage({direction}=True))")
        return part._hp_data if isinstance(part, IdentityTensor) else part

    def rowwise(self):
        raise NotImplementedError("HybridQuantizedTensor has no FP8 operand of its own: read a direction "
                                  "with gemm_operand(columnwise) (quantization.gemm does)")

    columnwise = rowwise

    @property
    def has_columnwise(self) -> bool:
        return self._columnwise is not None

    def columnwise_only(self) -> Tensor:
        """What a backward GEMM reads: the column-wise direction itself."""
        return self.gemm_operand(columnwise=True)

    def _payload(self) -> dict:
        return {"_rowwise": self._rowwise, "_columnwise": self._columnwise}


class HybridQuantizedTensor(_HybridLayout, QuantizedTensor):
    """A tensor quantized by a HybridQuantizer: one direction per sub-quantizer."""


class HybridOperand(_HybridLayout, QuantizedOperand):
    """HybridQuantizedTensor's twin while torch.compile traces (its directions are the sub-quantizers'
    traced forms: an FP8 operand, or the plain tensor of an IdentityQuantizer)."""


HybridQuantizedTensor._traced_twin = HybridOperand


def _check_part(direction: str, quantizer) -> None:
    if isinstance(quantizer, HybridQuantizer) or not isinstance(quantizer, _TEQuantizer):
        raise TypeError(
            f"HybridQuantizer: {direction}_quantizer must be one of te-core's Transformer Engine quantizers "
            "(te.Float8Quantizer, te.Float8CurrentScalingQuantizer, te.Float8BlockQuantizer, te.MXFP8Quantizer, "
            f"te.IdentityQuantizer), got {type(quantizer).__name__}")


class HybridQuantizer(_TEQuantizer, core.Quantizer):
    """TE's constructor: keyword-only `rowwise_quantizer`, `columnwise_quantizer` (distinct
    objects, which it pins to their direction), and `columnwise_source`: "original" casts the
    column-wise direction from the tensor, "rowwise_dequantized" from the row-wise direction's
    value (the backward then reads what the forward computed with)."""

    tensor_class = HybridQuantizedTensor
    dtype = None  # (no single format)

    def __init__(self, *, rowwise_quantizer, columnwise_quantizer, columnwise_source: str = "original"):
        _check_part("rowwise", rowwise_quantizer)
        _check_part("columnwise", columnwise_quantizer)
        if rowwise_quantizer is columnwise_quantizer:
            raise ValueError("HybridQuantizer: rowwise_quantizer and columnwise_quantizer are one object; pass two "
                             "quantizer instances (it sets each one's usage to its direction)")
        if columnwise_source not in COLUMNWISE_SOURCES:
            raise ValueError(f"HybridQuantizer: columnwise_source must be one of {COLUMNWISE_SOURCES}, "
                             f"got {columnwise_source!r}")
        self.rowwise_quantizer, self.columnwise_quantizer = rowwise_quantizer, columnwise_quantizer
        self.columnwise_source = columnwise_source
        rowwise_quantizer.set_usage(rowwise=True, columnwise=False)
        columnwise_quantizer.set_usage(rowwise=False, columnwise=True)
        self.rowwise_usage = self.columnwise_usage = True
        self.internal = self.optimize_for_gemm = False
        self.role, self.fp8_dtype = None, None
        self.gemm_alignment = max(rowwise_quantizer.gemm_alignment, columnwise_quantizer.gemm_alignment)

    @property
    def sub_quantizers(self) -> tuple:
        return self.rowwise_quantizer, self.columnwise_quantizer

    @property
    def reproducible(self) -> bool:
        return all(q.reproducible for q in self.sub_quantizers)

    # the recipe's accumulation choice reaches the GEMMs through the directions' own quantizers
    @core.Quantizer.split_accumulator.setter
    def split_accumulator(self, choice) -> None:
        core.Quantizer.split_accumulator.fset(self, choice)
        for quantizer in self.sub_quantizers:
            quantizer.split_accumulator = choice

    def copy(self) -> "HybridQuantizer":
        twin = super().copy()
        twin.rowwise_quantizer, twin.columnwise_quantizer = (q.copy() for q in self.sub_quantizers)
        return twin

    def _columnwise_source(self, x: Tensor, rowwise: Optional[Tensor]) -> Tensor:
        if self.columnwise_source == "original":
            return x
        if rowwise is None:
            rowwise = self.rowwise_quantizer._cast(x, False)
        return _value(rowwise, x.dtype).reshape(x.shape)

    def _cast(self, x: Tensor, columnwise: bool) -> HybridQuantizedTensor:
        rowwise = self.rowwise_quantizer._cast(x, False)
        col = None
        if columnwise:
            col = self.columnwise_quantizer._cast(self._columnwise_source(x, rowwise), True)
            col = col.columnwise_only() if isinstance(col, QUANTIZED) else col
        return HybridQuantizedTensor.make(rowwise, col, x, self)

    def _cast_for_user(self, x: Tensor) -> HybridQuantizedTensor:
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError("HybridQuantizer: rowwise and columnwise usage are both False, so there is nothing "
                             "to produce; set_usage(rowwise=True) or set_usage(columnwise=True)")
        x = x.detach()
        rowwise = self.rowwise_quantizer._cast_for_user(x) if self.rowwise_usage else None
        col = None
        if self.columnwise_usage:
            col = self.columnwise_quantizer._cast_for_user(self._columnwise_source(x, rowwise))
        return HybridQuantizedTensor.make(rowwise, col, x, self)

    def quantize_primary(self, x: Tensor):
        raise NotImplementedError("HybridQuantizer for weights kept only in quantized form (te.quantized_model_init) "
                                  "is not supported by te-core yet; build the model without quantized_model_init "
                                  "(the recipe then quantizes the weights in each forward)")

    def update_quantized(self, src, dst, *, noop_flag=None):
        raise NotImplementedError("HybridQuantizer.update_quantized is not supported by te-core yet; quantize the "
                                  "new value with the quantizer (q(src)) instead")

    def make_empty(self, shape, **kwargs):
        raise NotImplementedError("HybridQuantizer.make_empty is not supported by te-core yet; quantize a "
                                  "tensor with the quantizer (q(x)) instead")

    def __repr__(self) -> str:
        return (f"HybridQuantizer(rowwise_quantizer={self.rowwise_quantizer!r}, "
                f"columnwise_quantizer={self.columnwise_quantizer!r}, columnwise_source={self.columnwise_source!r})")
