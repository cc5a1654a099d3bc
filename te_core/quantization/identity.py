"""Transformer Engine's IdentityQuantizer: a CustomRecipe slot kept in high precision.

A qfactory returns it for the tensors it wants unquantized (every slot: the layer in high
precision; the output gradients only: an FP8 forward with a high-precision backward). Under
te-core's modules its cast is the tensor itself, so a GEMM with an identity operand runs in high
precision (ops.gemm), on the other operand dequantized where that one is quantized
(quantization.gemm), and one with identity operands only is the very GEMM the layer runs outside
autocast. TE code that calls the quantizer itself (`q(x)`) gets an IdentityTensor, whose
dequantize() is the held tensor, as in TE.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import quantizers as core
from .te_quantizers import _check_bool, _TEQuantizer
from .tensor import QuantizedTensor

__all__ = ["IdentityQuantizer", "IdentityTensor"]


class IdentityTensor(QuantizedTensor):
    """A high-precision tensor behind the quantized-tensor interface: `_hp_data` serves both
    GEMM directions (a GEMM transposes it for free), so there is no column-wise copy to keep."""

    _hp_data: Tensor

    @classmethod
    def make(cls, data: Tensor, quantizer=None) -> "IdentityTensor":
        self = cls.__new__(cls, data.shape, data.dtype, data.device, quantizer)
        self._hp_data = data
        return self

    def _dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        data = self._hp_data
        return data if dtype is None or dtype == data.dtype else data.to(dtype)

    def gemm_operand(self, columnwise: bool) -> Tensor:
        """What a GEMM reads of this tensor, in either direction: the held tensor."""
        return self._hp_data

    @property
    def has_columnwise(self) -> bool:
        return True

    def columnwise_only(self) -> "IdentityTensor":
        return self

    def _payload(self) -> dict:
        return {"_hp_data": self._hp_data}


def _check_dtype(owner: str, dtype) -> Optional[torch.dtype]:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"{owner}: dtype must be None (keep each tensor's dtype) or a high-precision floating "
                        f"torch.dtype (torch.bfloat16, torch.float16, torch.float32), got {dtype!r}")
    return dtype


class IdentityQuantizer(_TEQuantizer, core.Quantizer):
    """Keeps tensors in high precision: in `dtype` when given, else in their own dtype. The usage
    flags are kept for TE's interface; the one high-precision tensor serves both directions."""

    tensor_class = IdentityTensor
    gemm_alignment = 1  # high-precision GEMMs take any shape
    dtype: Optional[torch.dtype] = None  # TE's attribute: a torch dtype, not an FP8 format

    def __init__(self, *, dtype: Optional[torch.dtype] = None, rowwise: bool = True, columnwise: bool = True):
        owner = type(self).__name__
        self.dtype = _check_dtype(owner, dtype)
        self.rowwise_usage = _check_bool(owner, "rowwise", rowwise)
        self.columnwise_usage = _check_bool(owner, "columnwise", columnwise)
        self.internal = False
        self.optimize_for_gemm = False
        self.role = None
        self.fp8_dtype = None  # no FP8 format

    def _held(self, x: Tensor) -> Tensor:
        return x if self.dtype is None or x.dtype == self.dtype else x.to(self.dtype)

    def _cast(self, x: Tensor, columnwise: bool) -> Tensor:
        # te-core's modules: the operand stays a plain tensor, so its GEMMs are the high-precision ones
        return self._held(x)

    def _cast_for_user(self, x: Tensor) -> IdentityTensor:
        return IdentityTensor.make(self._held(x.detach()), self)

    # a weight kept "quantized" (quantized_model_init) or written in place stays an IdentityTensor
    def quantize_primary(self, x: Tensor) -> IdentityTensor:
        return self._cast_for_user(x)

    def requantize(self, x: Tensor, *, columnwise: bool = False) -> IdentityTensor:
        return self._cast_for_user(x)

    def load_primary(self, x: Tensor) -> IdentityTensor:
        return IdentityTensor.make(self._held(x.detach()).clone(), self)

    def update_quantized(self, src: Tensor, dst: IdentityTensor, *, noop_flag: Optional[Tensor] = None
                         ) -> IdentityTensor:
        """`src` written into `dst` (cast to dst's held dtype); skipped where `noop_flag` (a
        1-element tensor, an optimizer's overflow flag) is nonzero, as in TE."""
        owner = type(self).__name__
        if not isinstance(dst, IdentityTensor):
            raise TypeError(f"{owner}.update_quantized: dst must be an IdentityTensor, got {type(dst).__name__}")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{owner}.update_quantized: src has shape {tuple(src.shape)}, dst {tuple(dst.shape)}")
        if noop_flag is not None and noop_flag.item() != 0:  # (read on the host, as quantize_ does)
            return dst
        with torch.no_grad():
            dst._hp_data.copy_(src)
        return dst

    def _empty(self, shape: torch.Size, dtype: torch.dtype, empty: dict) -> IdentityTensor:
        return IdentityTensor.make(torch.empty(shape, dtype=self.dtype or dtype, **empty), self)

    def is_requantization_safe(self) -> bool:
        return True

    def __repr__(self) -> str:
        return (f"IdentityQuantizer(dtype={self.dtype}, rowwise_usage={self.rowwise_usage}, "
                f"columnwise_usage={self.columnwise_usage})")
