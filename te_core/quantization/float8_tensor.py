"""Float8Tensor: per-tensor scaled FP8 data (delayed and current scaling), and its compile-time
twin Float8Operand (the same methods on a plain object; see QuantizedOperand)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import ops
from ..dtype import DType
from .float8_views import FLOAT8_VIEW_OPS
from .lent_scales import is_lent
from .te_storage import TEStorageMethods, byte_alias, te_alias
from .tensor import TENSOR, GemmOperand, QuantizedOperand, QuantizedTensor, gather_rows


class _Float8Layout(TEStorageMethods):
    """x ~= _data * _scale_inv. `_data` has x's shape (FP8); `_transpose` is the column-wise
    copy (K, M) of a 2-D tensor, kept only when a backward GEMM needs it; `_scale_inv` is a
    1-element float32 snapshot taken at quantization (later scale updates don't change it),
    which a delayed-scaling quantizer lends to every cast of its step (lent_scales). TE's
    storage methods and its byte-level name `_rowwise_data` work on it (te_storage)."""

    _data: Tensor
    _scale_inv: Tensor
    _transpose: Optional[Tensor]
    _TE_LAYOUT = ("_data", "_transpose")
    _TE_SAVED = ("_data", "_transpose", "_scale_inv")  # TE's order
    # `_data` as uint8 bytes, for code that moves raw bytes (Megatron's FSDP prefers this name)
    _rowwise_data = te_alias("_rowwise_data")

    @classmethod
    def make(cls, data: Tensor, scale_inv: Tensor, transpose: Optional[Tensor], *, nominal_dtype: torch.dtype,
             quantizer=None, strides=None) -> "Float8Tensor":
        """`strides`: a view's (data's), which its wrapper reports (float8_views); else contiguous."""
        if cls._traced_twin is not None and torch.compiler.is_compiling():
            cls = cls._traced_twin
        if strides is not None and issubclass(cls, Tensor):  # (a traced Float8Operand has no strides)
            self = cls.__new__(cls, data.shape, nominal_dtype, data.device, quantizer, strides)
        else:
            self = cls.__new__(cls, data.shape, nominal_dtype, data.device, quantizer)
        self._data, self._transpose = data, transpose
        self._scale_inv = scale_inv if scale_inv.dim() == 1 else scale_inv.reshape(1)
        return self

    def _dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        data = self._row_bytes()
        if not data.is_contiguous():  # a view's bytes (w.t(), w[:, 2:5]): backends' kernels read dense rows
            data = data.contiguous()
        return ops.dequantize_fp8(data, self._scale_inv, dtype or self.dtype).reshape(self.shape)

    @property
    def fp8_dtype(self) -> torch.dtype:
        return (self._data if self._data is not None else self._transpose).dtype

    # Transformer Engine's Float8Tensor attributes for the same facts, which TE code (its tests,
    # integrations handling FP8 parameters) reads
    @property
    def _fp8_dtype(self) -> DType:
        """The data's format as Transformer Engine's DType."""
        return DType.cast(self.fp8_dtype)

    @property
    def _transpose_invalid(self) -> bool:
        """Whether no column-wise copy is held (one is made from the row-wise data when a GEMM
        needs it)."""
        return self._transpose is None

    @_transpose_invalid.setter
    def _transpose_invalid(self, invalid: bool) -> None:
        # TE code sets it after writing _data in place: the copy held no longer matches it
        if invalid and self._data is not None:
            self._transpose = None

    def _create_transpose(self) -> None:
        """TE's: make the column-wise copy again from the row-wise data (nothing without it)."""
        if self._data is not None:
            self._transpose = None
            self.columnwise()

    def _te_make(self, rowwise: bool) -> None:
        if rowwise:  # one scale for both layouts: the transpose of the transpose is exact
            self._data = self.rowwise().data.reshape(self.shape)
        else:
            self.columnwise()

    def _te_drop(self, rowwise: bool) -> None:
        if rowwise:
            self._data = None
        else:
            self._transpose = None

    def _row_bytes(self) -> Tensor:
        # not `_rowwise_data`: integrations (Megatron's fp8_get/set_raw_data) read that attribute
        # when present and `_data` otherwise; TE's Float8Tensor has only `_data`
        if self._data is None:  # kept column-wise only: the transpose of the transpose is exact
            return self._transpose.t()
        return self._data

    def rowwise(self) -> GemmOperand:
        if self._data is None:
            return GemmOperand(ops.transpose_fp8(self._transpose), self._scale_inv, TENSOR)
        data = self._data if self._data.dim() == 2 else self._data.reshape(-1, self._data.shape[-1])
        return GemmOperand(data if data.is_contiguous() else data.contiguous(), self._scale_inv, TENSOR)

    def columnwise_only(self) -> "Float8Tensor":
        transpose = self._transpose if self._transpose is not None else self.columnwise().data
        twin = self._same_kind()
        twin._transpose, twin._data = transpose, None
        if getattr(twin, "_view_of", None) is not None:  # (getattr: the traced Float8Operand shares this code)
            twin._view_of = None  # its bytes are a copy of its own (a view's transpose)
        return twin

    def columnwise(self) -> GemmOperand:
        if self._transpose is None:
            # Same scale for both layouts, so the transpose of the FP8 data is exact.
            self._transpose = ops.transpose_fp8(self.rowwise().data)
        return GemmOperand(self._transpose, self._scale_inv, TENSOR)

    @property
    def has_columnwise(self) -> bool:
        return self._transpose is not None

    def drop_columnwise(self) -> bool:
        """Free the column-wise copy (an inference-only weight's: no backward reads it); a later
        backward remakes it exactly from the row-wise data (columnwise()). True when dropped."""
        if self._data is None:
            return False
        self._transpose = None
        return True

    def select_rows(self, source: Tensor, blank: Optional[Tensor] = None) -> "Float8Tensor":
        # one scale for all rows, so the selected rows keep its value, in a tensor of their own (a
        # write into either tensor requantizes its own scale); a GEMM that needs the column-wise copy
        # makes it from the new row-wise data, exactly
        data = gather_rows(self._row_bytes().reshape(self.shape), source, blank)
        return type(self).make(data, self._scale_inv.clone(), None, nominal_dtype=self.dtype,
                               quantizer=self._quantizer)

    def _payload(self) -> dict:
        return {"_data": self._data, "_scale_inv": self._scale_inv, "_transpose": self._transpose}

    def _holds_lent_scale(self) -> bool:
        return is_lent(self._scale_inv)

    def _own_scales(self) -> None:
        if is_lent(self._scale_inv):
            self._scale_inv = self._scale_inv.clone()

    def _writable_value(self, value: Optional[Tensor] = None) -> Tensor:
        # laid out as the wrapper reports: a view's put addresses its bytes' strides and offset
        # (float8_views makes FP8 views only where the two agree, DequantizedViews elsewhere)
        out = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device=self.device)
        return out.copy_((self.dequantize() if value is None else value).reshape(self.shape))

    def _payload_strides(self) -> Optional[tuple]:
        data = self._data
        return None if data is None or data.is_contiguous() else data.stride()

    def _follow_write(self, parent: "Float8Tensor") -> None:
        # the bytes this view shares were requantized with the parent's new scale; a column-wise
        # copy of its own was made from the old bytes (columnwise() makes it again, exactly)
        self._scale_inv = parent._scale_inv
        if self._data is not None:
            self._transpose = None


class Float8Tensor(_Float8Layout, QuantizedTensor):
    __doc__ = _Float8Layout.__doc__ + """

    Made by a quantizer (`quantizer(x)`), or, as Transformer Engine code makes one from raw FP8
    bytes, with TE's keywords: `Float8Tensor(shape=..., dtype=..., data=..., fp8_scale_inv=...,
    fp8_dtype=..., data_transpose=None, quantizer=None, requires_grad=False, device=None)`
    (`data` / `data_transpose` in uint8 as TE keeps them, or in the FP8 dtype; `get_metadata()`
    gives those keywords back, `make_like(t)` a tensor on t's data)."""

    _view_ops = FLOAT8_VIEW_OPS

    def __new__(cls, shape, dtype=None, device=None, quantizer=None, strides=None, *, data=None,
                fp8_scale_inv=None, fp8_dtype=None, data_transpose=None, fake_dtype=None, requires_grad=False,
                **unused):
        if data is None and fp8_scale_inv is None and fp8_dtype is None and data_transpose is None:
            # te-core's own form (make, _same_kind): shape, nominal dtype, device, quantizer, strides
            return QuantizedTensor.__new__(cls, shape, dtype, device, quantizer, strides)
        return _from_te_keywords(cls, shape, dtype, device, quantizer, data, fp8_scale_inv, fp8_dtype,
                                 data_transpose, fake_dtype, requires_grad, unused)

    def get_metadata(self) -> dict:
        """Transformer Engine's keywords of this tensor (its bytes as uint8, as TE's): what
        `Float8Tensor(shape=..., dtype=..., **t.get_metadata())` takes."""
        return {"data": byte_alias(self._data), "fp8_scale_inv": self._scale_inv, "fp8_dtype": self._fp8_dtype,
                "data_transpose": byte_alias(self._transpose), "quantizer": self._quantizer, "fake_dtype": self.dtype}

    @classmethod
    def make_like(cls, tensor: "Float8Tensor", *, shape=None, dtype: Optional[torch.dtype] = None,
                  requires_grad: bool = False, data: Optional[Tensor] = None,
                  data_transpose: Optional[Tensor] = None) -> "Float8Tensor":
        """A Float8Tensor on `tensor`'s data (TE's make_like): its shape by default, or another
        shape of as many elements (the column-wise copy is then left to be made again). With
        `data` (FP8 bytes, uint8 or in the FP8 dtype: e.g. a contiguous copy of a sliced tensor's
        `_data`, as Megatron-LM's checkpoint reader makes one), on those bytes with tensor's scale,
        in data's shape unless `shape` is given, and with `data_transpose` as its column-wise copy
        where given; tensor's own copy, made from other bytes, is never kept beside new data."""
        if not isinstance(tensor, Float8Tensor):
            raise TypeError(f"Float8Tensor.make_like takes a Float8Tensor, got {type(tensor).__name__}")
        meta = tensor.get_metadata()
        meta["fake_dtype"] = dtype or tensor.dtype
        if data is not None:
            meta["data"], meta["data_transpose"] = data, data_transpose
            shape = data.shape if shape is None else shape
        elif data_transpose is not None:
            meta["data_transpose"] = data_transpose
        return cls(shape=tensor.shape if shape is None else shape, dtype=dtype or tensor.dtype,
                   requires_grad=requires_grad, device=tensor.device, **meta)

    # FSDP2's all-gather extension points (torch.distributed.fsdp.fully_shard): a shard of an FP8
    # primary weight is all-gathered as its FP8 bytes; see te_core.distributed.fsdp. Imported at
    # the call: the distributed layer builds on this one, not the reverse.
    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        from ..distributed.fsdp import pre_all_gather

        return pre_all_gather(self, mesh, orig_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from ..distributed.fsdp import post_all_gather

        return post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)


class Float8Operand(_Float8Layout, QuantizedOperand):
    """Float8Tensor's twin while torch.compile traces."""


Float8Tensor._traced_twin = Float8Operand


def _from_te_keywords(cls, shape, dtype, device, quantizer, data, scale_inv, fp8_dtype, data_t, fake_dtype,
                      requires_grad, unused) -> Float8Tensor:
    """A Float8Tensor from Transformer Engine's constructor keywords (see Float8Tensor), checked."""
    if unused:
        raise TypeError(f"Float8Tensor: unexpected keyword(s) {sorted(unused)}; Transformer Engine's are shape, "
                        "dtype, data, fp8_scale_inv, fp8_dtype, data_transpose, quantizer, requires_grad, device")
    if fp8_dtype is None or scale_inv is None or (data is None and data_t is None):
        raise ValueError("Float8Tensor from raw data needs fp8_dtype, fp8_scale_inv and data (or data_transpose, "
                         "for a column-wise-only tensor)")
    fp8 = DType.cast(fp8_dtype).torch_dtype
    if fp8 not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"Float8Tensor: fp8_dtype must be an FP8 format (E4M3 or E5M2), got {fp8_dtype!r}")
    nominal = dtype or fake_dtype or torch.float32
    if fake_dtype is not None and dtype is not None and fake_dtype != dtype:
        raise ValueError(f"Float8Tensor: fake_dtype ({fake_dtype}) does not match dtype ({dtype})")
    shape = torch.Size(shape)
    if not isinstance(scale_inv, Tensor) or scale_inv.numel() != 1 or scale_inv.dtype != torch.float32:
        raise ValueError("Float8Tensor: fp8_scale_inv must be a 1-element float32 tensor (1 / the cast's scale)")

    def as_fp8(t, name):
        if t is None:
            return None
        if not isinstance(t, Tensor) or t.dtype not in (torch.uint8, fp8):
            raise TypeError(f"Float8Tensor: {name} must be a uint8 tensor of FP8 bytes (or in {fp8}), got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        return t.view(fp8) if t.dtype == torch.uint8 else t

    data, data_t = as_fp8(data, "data"), as_fp8(data_t, "data_transpose")
    rows = shape.numel() // shape[-1] if len(shape) and shape[-1] else 0
    if data is not None:
        if data.numel() != shape.numel():
            raise ValueError(f"Float8Tensor: data has {data.numel()} elements, shape {tuple(shape)} needs "
                             f"{shape.numel()}")
        if data.shape != shape:
            data = data.reshape(shape)
    if data_t is not None and (len(shape) < 1 or tuple(data_t.shape) != (shape[-1], rows)):
        if data is None:
            raise ValueError(f"Float8Tensor: data_transpose has shape {tuple(data_t.shape)}; a tensor of shape "
                             f"{tuple(shape)} keeps it as ({shape[-1] if len(shape) else 0}, {rows})")
        data_t = None  # (another shape's transpose: made again from the data when a GEMM needs it)
    held = data if data is not None else data_t
    if device is not None and torch.device(device) != held.device:
        raise ValueError(f"Float8Tensor: device {device} differs from the data's, {held.device}")
    tensor = QuantizedTensor.__new__(cls, shape, nominal, held.device, quantizer)
    tensor._data, tensor._transpose, tensor._scale_inv = data, data_t, scale_inv.reshape(1)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor
