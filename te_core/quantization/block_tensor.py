"""Block-scaled quantized tensors: 1x128 / 128x128 FP8 blocks, and MXFP8 (1x32, E8M0 scales).

Unlike a Float8Tensor, the column-wise copy cannot be derived from the row-wise data (blocks
run along the other dimension), so it is produced by the quantizer when asked for. Each
format has a compile-time twin (the same methods on a plain object; see QuantizedOperand).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import ops
from .block_views import BLOCK_VIEW_OPS
from .dequantized_view import dequantized_select, dequantized_slice
from .mxfp8_views import MXFP8_SPLIT_OPS
from .te_storage import TEStorageMethods, TEStorageNames
from .tensor import (BLOCK_1x128, BLOCK_128x128, MX_1x32, GemmOperand, QuantizedOperand, QuantizedTensor,
                     gather_rows)


class _TwoLayout(TEStorageNames, TEStorageMethods):
    """2-D data (M, K) with scale_inv, and optionally the column-wise pair (K, M); TE's names
    (`_rowwise_data`, `_columnwise_scale_inv`, ...) alias them, and TE's storage methods work
    on them (te_storage)."""

    _data: Tensor
    _scale_inv: Tensor
    _data_t: Optional[Tensor]
    _scale_inv_t: Optional[Tensor]
    _TE_LAYOUT = ("_data", "_data_t")
    _TE_SAVED = ("_data", "_data_t", "_scale_inv", "_scale_inv_t")  # TE's order

    def _te_make(self, rowwise: bool) -> None:
        if rowwise:
            raise ValueError(f"update_usage: this {type(self).__name__} holds only its column-wise copy, and "
                             f"{self._layout_name()} scales run along one direction, so the row-wise data cannot be "
                             "made from it; quantize again with rowwise=True")
        self.columnwise()  # (raises the clear error where the layout cannot be made)

    def _te_drop(self, rowwise: bool) -> None:
        if rowwise:
            self._data = self._scale_inv = None
        else:
            self._data_t = self._scale_inv_t = None

    def _layout_name(self) -> str:
        return "MXFP8"

    @classmethod
    def make(cls, data, scale_inv, data_t, scale_inv_t, *, nominal_dtype, quantizer=None, **extra):
        if cls._traced_twin is not None and torch.compiler.is_compiling():
            cls = cls._traced_twin
        self = cls.__new__(cls, data.shape, nominal_dtype, data.device, quantizer)
        self._data, self._scale_inv, self._data_t, self._scale_inv_t = data, scale_inv, data_t, scale_inv_t
        for name, value in extra.items():
            setattr(self, name, value)
        return self

    @property
    def fp8_dtype(self) -> torch.dtype:
        return (self._data if self._data is not None else self._data_t).dtype

    @property
    def has_columnwise(self) -> bool:
        return self._data_t is not None

    def _operand_kind(self, columnwise: bool) -> str:
        raise NotImplementedError

    def columnwise(self) -> GemmOperand:
        if self._data_t is None:
            raise RuntimeError(
                f"{type(self).__name__} of shape {tuple(self.shape)} was quantized without its column-wise copy; "
                "quantize it with columnwise=True when a dgrad/wgrad GEMM will read it"
            )
        return GemmOperand(self._data_t, self._scale_inv_t, self._operand_kind(True))

    def _payload(self) -> dict:
        return {"_data": self._data, "_scale_inv": self._scale_inv, "_data_t": self._data_t,
                "_scale_inv_t": self._scale_inv_t}

    def columnwise_only(self) -> "_TwoLayout":
        self.columnwise()  # raises the clear error when there is no column-wise copy
        twin = self._same_kind()
        twin._data = twin._scale_inv = None
        return twin

    def _dequantize_layout(self, data, scale_inv, dtype) -> Tensor:
        raise NotImplementedError

    def _scale_rows(self, scale_inv: Tensor, source: Tensor) -> Tensor:
        """The row-wise scale_inv of the rows `source` (zeros where source < 0), in its layout."""
        raise NotImplementedError

    def _settings(self) -> dict:
        """The format's own attributes that a tensor made from this one's data keeps."""
        return {}

    def select_rows(self, source: Tensor, blank: Optional[Tensor] = None) -> "_TwoLayout":
        # each row has scales of its own, which move with it; the column-wise copy's scales run
        # along the columns, across rows, so no selection of its rows exists
        data, scale_inv, _ = self.rowwise()  # (raises where only the column-wise copy is kept)
        if tuple(data.shape) != tuple(self.shape):
            raise ValueError(f"{type(self).__name__} of shape {tuple(self.shape)} holds its data as "
                             f"{tuple(data.shape)}: its rows are not the data's; select rows of a tensor "
                             "quantized in the 2-D shape it has")
        return type(self).make(gather_rows(data, source, blank), self._scale_rows(scale_inv, source), None, None,
                               nominal_dtype=self.dtype, quantizer=self._quantizer, **self._settings())

    def _dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        dtype = dtype or self.dtype
        if self._data is None:  # column-wise only: dequantize x.T, then transpose back (to the nominal shape)
            return self._dequantize_layout(self._data_t, self._scale_inv_t, dtype).t().reshape(self.shape)
        # a flattened view (block_views) keeps its 2-D payload under its own shape
        return self._dequantize_layout(self._data, self._scale_inv, dtype).reshape(self.shape)

    def rowwise(self) -> GemmOperand:
        if self._data is None:
            raise RuntimeError(f"{type(self).__name__} of shape {tuple(self.shape)} keeps only its column-wise copy "
                               "(saved for a backward GEMM); it cannot be a row-wise GEMM operand")
        return GemmOperand(self._data, self._scale_inv, self._operand_kind(False))


class _BlockwiseLayout(_TwoLayout):
    """FP8 with one float32 scale per 1x128 run (`_block_2d` False) or 128x128 tile (True)."""

    _block_2d: bool

    def _same_kind(self):
        twin = super()._same_kind()
        twin._block_2d = self._block_2d
        return twin

    def _operand_kind(self, columnwise: bool) -> str:
        return BLOCK_128x128 if self._block_2d else BLOCK_1x128

    def _layout_name(self) -> str:
        return "128x128" if self._block_2d else "1x128"

    def _te_make(self, rowwise: bool) -> None:
        if rowwise and self._block_2d and self._data_t is not None:
            # a 128x128 tile of x is the transpose of a tile of x.T, with its scale: exact
            self._data, self._scale_inv = self._data_t.t().contiguous(), self._scale_inv_t.t().contiguous()
            return
        super()._te_make(rowwise)

    def columnwise(self) -> GemmOperand:
        if self._data_t is None and self._block_2d and self._data is not None:
            # a 128x128 tile of x.T is the transpose of a tile of x, with its scale: exact (a weight
            # whose copy was dropped when its row-wise bytes were rewritten, te_core.distributed.master_weights)
            data_t, scale_inv_t = self._data.t().contiguous(), self._scale_inv.t().contiguous()
            if torch.compiler.is_compiling():
                return GemmOperand(data_t, scale_inv_t, BLOCK_128x128)
            self._data_t, self._scale_inv_t = data_t, scale_inv_t
        return super().columnwise()

    def _dequantize_layout(self, data, scale_inv, dtype) -> Tensor:
        return ops.dequantize_blockwise(data, scale_inv, self._block_2d, dtype)

    def _settings(self) -> dict:
        return {"_block_2d": self._block_2d}

    def _scale_rows(self, scale_inv: Tensor, source: Tensor) -> Tensor:
        if self._block_2d:
            raise ValueError(f"{type(self).__name__} of shape {tuple(self.shape)} has 128x128 blocks, whose scales "
                             "span 128 rows, so its rows cannot move alone; quantize it with 1x128 blocks "
                             "(Float8BlockQuantizer(block_2d=False), what Float8BlockScaling casts activations "
                             "and gradients with) or dequantize() it")
        # (rows, blocks) laid out column by column, as quantize_blockwise makes it
        return gather_rows(scale_inv, source).t().contiguous().t()


class _MXLayout(_TwoLayout):
    """MXFP8: FP8 data with a uint8 E8M0 scale (2^(s-127)) per 1x32 run of a row."""

    def _operand_kind(self, columnwise: bool) -> str:
        return MX_1x32

    def columnwise(self) -> GemmOperand:
        # a row piece's column-wise copy is a column slice of its tensor's (mxfp8_views); kernels
        # read contiguous operands, so such a piece's is copied when read (a no-op otherwise)
        data_t, scale_inv_t, kind = super().columnwise()
        return GemmOperand(data_t.contiguous(), scale_inv_t.contiguous(), kind)

    def _dequantize_layout(self, data, scale_inv, dtype) -> Tensor:
        return ops.dequantize_mxfp8(data.contiguous(), scale_inv.contiguous(), dtype)

    def _scale_rows(self, scale_inv: Tensor, source: Tensor) -> Tensor:
        return gather_rows(scale_inv, source)  # (an E8M0 byte 0 with zero data is a zero row)


class Float8BlockwiseTensor(_BlockwiseLayout, QuantizedTensor):
    __doc__ = _BlockwiseLayout.__doc__

    _view_ops = BLOCK_VIEW_OPS

    # FSDP2's all-gather extension points: a shard of a block-scaled FP8 primary weight is
    # all-gathered as its FP8 bytes and tile scales; see te_core.distributed.fsdp_block. Imported
    # at the call: the distributed layer builds on this one, not the reverse.
    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        from ..distributed.fsdp_block import pre_all_gather

        return pre_all_gather(self, mesh, orig_size)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        from ..distributed.fsdp_block import post_all_gather

        return post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)


class MXFP8Tensor(_MXLayout, QuantizedTensor):
    __doc__ = _MXLayout.__doc__

    # a split into 32-row pieces stays MXFP8 (mxfp8_views); no other view does: a select or slice
    # writes back (dequantized_view)
    _view_ops = {**QuantizedTensor._view_ops, torch.ops.aten.select.int: dequantized_select,
                 torch.ops.aten.slice.Tensor: dequantized_slice, **MXFP8_SPLIT_OPS}


class Float8BlockwiseOperand(_BlockwiseLayout, QuantizedOperand):
    """Float8BlockwiseTensor's twin while torch.compile traces."""


class MXFP8Operand(_MXLayout, QuantizedOperand):
    """MXFP8Tensor's twin while torch.compile traces."""


Float8BlockwiseTensor._traced_twin = Float8BlockwiseOperand
MXFP8Tensor._traced_twin = MXFP8Operand
