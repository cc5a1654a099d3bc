"""Transformer Engine's quantizer classes, with TE's constructors and the methods TE code calls.

TE code builds quantizers itself (`Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device)`)
to cast tensors by hand or to return from a CustomRecipe factory. Each class here is te-core's
quantizer of the same scaling kind (quantizers.py) with TE's constructor in front, so a cast runs
the very code te-core's recipes run and gives bit-identical tensors for the same scale.

Two callers, one `quantize`:
- TE code: `q(x)` / `q.quantize(x)` casts with the usage flags (rowwise / columnwise, set at
  construction or by set_usage), keeps x's shape, and passes gradients straight through to x,
  as TE's quantizers do.
- te-core's modules (under CustomRecipe): `quantize(x, columnwise=...)`, te-core's own
  signature; the module decides the layouts and the usage flags are not read.
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Iterable, Optional, Union

import torch
from torch import Tensor

from .. import ops
from ..dtype import DType, fp8_torch_dtype
from . import quantizers as core
from .block_tensor import Float8BlockwiseTensor, MXFP8Tensor
from .float8_tensor import Float8Tensor
from .tensor import QuantizedTensor
from .write_back import requantize_with

__all__ = ["Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8BlockQuantizer", "MXFP8Quantizer",
           "QUANTIZER_CLASSES", "te_quantizer_of"]

BLOCK = 128  # Float8BlockQuantizer's block edge (TE's block_len)
MX_BLOCK = 32


def _check_bool(owner: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def _set_pow_2_scales(self, value) -> None:
    self.power_2_scale = _check_bool(type(self).__name__, "force_pow_2_scales", value)


def _check_block_scaling_dim(owner: str, value) -> int:
    if isinstance(value, bool) or value not in (1, 2):
        raise ValueError(f"{owner}: block_scaling_dim must be 1 (1x128 blocks) or 2 (128x128 tiles), got {value!r}")
    return int(value)


class _QuantizeFunction(torch.autograd.Function):
    """The cast as an autograd node: its gradient reaches the high-precision input unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, quantizer) -> QuantizedTensor:
        return quantizer._cast_for_user(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _with_shape(result: QuantizedTensor, shape) -> QuantizedTensor:
    """`result` (a block format, whose payload is 2-D) under the nominal `shape` of the tensor
    it was cast from: TE keeps the input's shape, and dequantize() reshapes the payload to it."""
    if result.shape == shape:
        return result
    twin = type(result).__new__(type(result), shape, result.dtype, result.device, result._quantizer)
    twin.__dict__.update({k: v for k, v in result.__dict__.items() if k != "_quantizer"})
    return twin


class _TEQuantizer:
    """TE's quantizer interface over a te-core quantizer class (the next class in the MRO)."""

    tensor_class: type = QuantizedTensor  # what quantize() returns and update_quantized() writes

    def _init_te(self, fp8_dtype, rowwise, columnwise) -> torch.dtype:
        owner = type(self).__name__
        dtype = fp8_torch_dtype(fp8_dtype, owner=owner)
        self.rowwise_usage = _check_bool(owner, "rowwise", rowwise)
        self.columnwise_usage = _check_bool(owner, "columnwise", columnwise)
        self.internal = False  # TE's storage-only tensors: te-core always returns full tensors
        self.optimize_for_gemm = False
        return dtype

    @property
    def dtype(self) -> DType:
        """TE's name for the format, as a DType (te-core's quantizers hold it as fp8_dtype)."""
        return DType.cast(self.fp8_dtype)

    # --- usage
    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = _check_bool(type(self).__name__, "rowwise", rowwise)
        if columnwise is not None:
            self.columnwise_usage = _check_bool(type(self).__name__, "columnwise", columnwise)

    def get_usages(self) -> dict:
        return {"rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage}

    def copy(self):
        """A shallow copy (shared scale/amax tensors, as TE's copy())."""
        return copy.copy(self)

    def for_role(self, role):
        """A copy casting tensors of te-core `role` (a module slot's), for a CustomRecipe state."""
        twin = self.copy()
        twin.role = role
        return twin

    # --- casting
    def quantize(self, tensor: Tensor, *, out: Optional[QuantizedTensor] = None, dtype: Optional[torch.dtype] = None,
                 columnwise: Optional[bool] = None) -> QuantizedTensor:
        """TE's quantize (out=: write into that tensor; dtype: accepted and unused, as by TE's
        own quantizers of these kinds), or te-core's when `columnwise` is given (see the module
        docstring)."""
        if columnwise is not None:
            if out is not None:
                raise TypeError(f"{type(self).__name__}.quantize: out= and columnwise= do not go together")
            return self._cast(tensor, columnwise)
        if out is not None:
            return self.update_quantized(tensor, out)
        if not isinstance(tensor, Tensor) or isinstance(tensor, QuantizedTensor):
            raise TypeError(f"{type(self).__name__}: expected a high-precision torch.Tensor to quantize, "
                            f"got {type(tensor).__name__}")
        if torch.is_grad_enabled() and tensor.requires_grad:
            return _QuantizeFunction.apply(tensor, self)
        return self._cast_for_user(tensor)

    def __call__(self, tensor: Tensor) -> QuantizedTensor:
        return self.quantize(tensor)

    def multi_quantize(self, tensors):
        return [self.quantize(t) for t in tensors]

    def _cast(self, x: Tensor, columnwise: bool) -> QuantizedTensor:
        return super().quantize(x, columnwise=columnwise)

    def _cast_for_user(self, x: Tensor) -> QuantizedTensor:
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}: rowwise and columnwise usage are both False, so there is "
                             "nothing to produce; set_usage(rowwise=True) or set_usage(columnwise=True)")
        result = self._cast(x.detach(), self.columnwise_usage)
        result = _with_shape(result, x.shape)
        return result if self.rowwise_usage else result.columnwise_only()

    def update_quantized(self, src: Tensor, dst: QuantizedTensor, *, noop_flag: Optional[Tensor] = None
                         ) -> QuantizedTensor:
        """Cast `src` into `dst` in place (its buffers are reused where the layout allows), keeping
        dst's layouts."""
        owner = type(self).__name__
        if noop_flag is not None:
            raise NotImplementedError(f"{owner}.update_quantized: noop_flag is not supported by te-core; skip the "
                                      "call on the host instead")
        if not isinstance(dst, self.tensor_class):
            raise TypeError(f"{owner}.update_quantized: dst must be a {self.tensor_class.__name__}, "
                            f"got {type(dst).__name__}")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{owner}.update_quantized: src has shape {tuple(src.shape)}, dst {tuple(dst.shape)}")
        if dst._view_link() is not None:  # a view: the cast goes into the tensor it views, requantized whole
            requantize_with([(dst, src.to(device=dst.device), self)])
            return dst
        rowwise = dst._data is not None
        fresh = self._cast(src.detach().to(device=dst.device, dtype=dst.dtype), dst.has_columnwise)
        if not rowwise:
            fresh = fresh.columnwise_only()
        dst._take_payload(fresh)
        return dst

    def make_empty(self, shape: Iterable[int], *, dtype: torch.dtype = torch.float32,
                   device: Optional[Union[torch.device, str]] = None, requires_grad: bool = False,
                   pin_memory: bool = False) -> QuantizedTensor:
        """A quantized tensor of nominal `shape` and `dtype` with uninitialized data, in the layouts
        the usage flags ask for (on the selected backend's device when `device` is None)."""
        from ..backend import get_backend

        shape = torch.Size(shape)
        device = torch.device(device) if device is not None else get_backend().device
        empty = dict(device=device, pin_memory=pin_memory)
        result = self._empty(shape, dtype, empty)
        if not self.rowwise_usage:
            result = result.columnwise_only()
        return result.requires_grad_() if requires_grad else result

    def _empty(self, shape: torch.Size, dtype: torch.dtype, empty: dict) -> QuantizedTensor:
        raise NotImplementedError

    def calibrate(self, tensor: Tensor) -> None:
        """Record statistics without casting (only delayed scaling keeps any)."""

    def is_requantization_safe(self) -> bool:
        return self.reproducible

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dtype={self.dtype.name}, rowwise_usage={self.rowwise_usage}, "
                f"columnwise_usage={self.columnwise_usage})")


def _fp8_empty(quantizer, shape, dtype, empty, scale_inv: Tensor) -> Float8Tensor:
    data = torch.empty(shape, dtype=quantizer.fp8_dtype, **empty)
    rows, cols = _rows_cols(shape)
    transpose = torch.empty((cols, rows), dtype=quantizer.fp8_dtype, **empty) if quantizer.columnwise_usage else None
    return Float8Tensor.make(data, scale_inv.to(empty["device"]), transpose, nominal_dtype=dtype, quantizer=quantizer)


class Float8Quantizer(_TEQuantizer, core.Quantizer):
    """TE's delayed-scaling quantizer: casts with the caller's `scale` tensor and maxes each cast's
    amax into the caller's `amax` tensor (both 1-element float32 on the data's device); updating
    the scale from the amax is the caller's job, as in TE."""

    tensor_class = Float8Tensor
    reproducible = False  # the caller may change the scale between two casts
    gemm_alignment = 1

    def __init__(self, scale: Tensor, amax: Tensor, fp8_dtype, *, rowwise: bool = True, columnwise: bool = True):
        owner = type(self).__name__
        for name, value in (("scale", scale), ("amax", amax)):
            if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.numel() != 1:
                got = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
                raise TypeError(f"{owner}: {name} must be a 1-element float32 tensor, got {got}")
        if scale.device != amax.device:
            raise ValueError(f"{owner}: scale is on {scale.device} but amax on {amax.device}; put both on the device "
                             "of the tensors to cast")
        core.Quantizer.__init__(self, None, self._init_te(fp8_dtype, rowwise, columnwise))
        self.scale, self.amax = scale, amax

    def _cast(self, x: Tensor, columnwise: bool) -> Float8Tensor:
        scale, amax = self.scale.reshape(1), self.amax.reshape(1)
        if columnwise:
            data, data_t, _ = ops.cast_transpose_fp8(core._as_2d(x), scale,
                                                     self.fp8_dtype, amax_out=amax)
            data = core._shaped_like(data, x)
        else:
            (data, _), data_t = ops.quantize_fp8(x, scale, self.fp8_dtype, amax_out=amax), None
        return Float8Tensor.make(data, torch.reciprocal(scale), data_t, nominal_dtype=x.dtype, quantizer=self)

    def calibrate(self, tensor: Tensor) -> None:
        """The amax of `tensor` into `amax` (overwritten, as TE's calibrate does)."""
        self.amax.copy_(tensor.detach().abs().amax().float().reshape(self.amax.shape))

    def _empty(self, shape, dtype, empty):
        return _fp8_empty(self, shape, dtype, empty, torch.reciprocal(self.scale.reshape(1)))


class Float8CurrentScalingQuantizer(_TEQuantizer, core.Float8CurrentScalingQuantizer):
    """TE's current-scaling quantizer: each tensor scaled by its own amax."""

    tensor_class = Float8Tensor

    def __init__(self, fp8_dtype, device=None, *, rowwise: bool = True, columnwise: bool = True,
                 use_existing_amax: bool = False, with_amax_reduction: bool = False, amax_reduction_group=None,
                 force_pow_2_scales: bool = False, amax_epsilon: float = 0.0, scale: Optional[Tensor] = None,
                 amax: Optional[Tensor] = None):
        owner = type(self).__name__
        dtype = self._init_te(fp8_dtype, rowwise, columnwise)
        if with_amax_reduction or amax_reduction_group is not None:
            raise NotImplementedError(
                f"{owner}: with_amax_reduction / amax_reduction_group are not supported by te-core's quantizer "
                "classes: a cast here scales by the local tensor's amax. Leave them unset (under te.autocast, "
                "amax_reduction_group reduces the amaxes of the recipes that reduce them)")
        if use_existing_amax or scale is not None or amax is not None:
            # TE ignores them too (kept there for old callers), and says so the same way
            warnings.warn(f"{owner} ignores use_existing_amax, scale and amax: each cast scales by the tensor's "
                          "own amax", DeprecationWarning, stacklevel=2)
        self.device = None if device is None else torch.device(device)  # TE's buffers' device; te-core keeps none
        self.with_amax_reduction, self.amax_reduction_group = False, None
        _check_bool(owner, "force_pow_2_scales", force_pow_2_scales)
        _check_epsilon(owner, amax_epsilon)
        core.Float8CurrentScalingQuantizer.__init__(self, None, dtype, force_pow_2_scales, float(amax_epsilon))

    force_pow_2_scales = property(lambda self: self.power_2_scale, _set_pow_2_scales,
                                  doc="TE's name for power_2_scale (a plain attribute in TE: factories set it)")

    def _empty(self, shape, dtype, empty):
        return _fp8_empty(self, shape, dtype, empty, torch.ones(1, device=empty["device"]))


def _check_epsilon(owner: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ValueError(f"{owner}: amax_epsilon must be a finite number >= 0, got {value!r}")


def _rows_cols(shape: torch.Size) -> tuple:
    """The 2-D payload's (rows, columns) for nominal `shape`; a 0-d tensor is one row of one
    element, as in Transformer Engine."""
    return (math.prod(shape[:-1]), shape[-1]) if len(shape) else (1, 1)


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


class Float8BlockQuantizer(_TEQuantizer, core.Float8BlockQuantizer):
    """TE's block-scaling quantizer: a float32 scale per 1x128 run of a row (block_scaling_dim=1)
    or per 128x128 tile (2)."""

    tensor_class = Float8BlockwiseTensor

    def __init__(self, fp8_dtype, *, rowwise: bool, columnwise: bool, amax_epsilon: float = 0.0,
                 force_pow_2_scales: bool = True, block_scaling_dim: int = 2):
        owner = type(self).__name__
        dtype = self._init_te(fp8_dtype, rowwise, columnwise)
        _check_block_scaling_dim(owner, block_scaling_dim)
        _check_bool(owner, "force_pow_2_scales", force_pow_2_scales)
        _check_epsilon(owner, amax_epsilon)
        self.block_len = BLOCK
        core.Float8BlockQuantizer.__init__(self, None, dtype, block_scaling_dim == 2, force_pow_2_scales,
                                           float(amax_epsilon))

    force_pow_2_scales = property(lambda self: self.power_2_scale, _set_pow_2_scales,
                                  doc="TE's name for power_2_scale (a plain attribute in TE: factories set it)")

    def _set_block_scaling_dim(self, value) -> None:
        self.block_2d = _check_block_scaling_dim(type(self).__name__, value) == 2

    block_scaling_dim = property(lambda self: 2 if self.block_2d else 1, _set_block_scaling_dim,
                                 doc="TE's name for block_2d: 2 or 1 (TE's factories set it per role)")

    def _scales(self, rows: int, cols: int, empty: dict) -> Tensor:
        shape = (_ceil(rows, BLOCK), _ceil(cols, BLOCK)) if self.block_2d else (rows, _ceil(cols, BLOCK))
        return torch.empty(shape, dtype=torch.float32, **empty)

    def _empty(self, shape, dtype, empty):
        rows, cols = _rows_cols(shape)
        data = torch.empty((rows, cols), dtype=self.fp8_dtype, **empty)
        data_t = scale_inv_t = None
        if self.columnwise_usage:
            data_t = torch.empty((cols, rows), dtype=self.fp8_dtype, **empty)
            scale_inv_t = self._scales(cols, rows, empty)
        result = Float8BlockwiseTensor.make(data, self._scales(rows, cols, empty), data_t, scale_inv_t,
                                            nominal_dtype=dtype, quantizer=self, _block_2d=self.block_2d)
        return _with_shape(result, shape)


class MXFP8Quantizer(_TEQuantizer, core.MXFP8Quantizer):
    """TE's MXFP8 quantizer: an E8M0 scale per 32 consecutive elements."""

    tensor_class = MXFP8Tensor

    def __init__(self, fp8_dtype, *, rowwise: bool = True, columnwise: bool = True,
                 with_2d_quantization: bool = False):
        owner = type(self).__name__
        dtype = self._init_te(fp8_dtype, rowwise, columnwise)
        if _check_bool(owner, "with_2d_quantization", with_2d_quantization):
            raise NotImplementedError(f"{owner}: with_2d_quantization=True (one scale per 32x32 tile) is not "
                                      "supported by te-core yet; every tensor gets one scale per 32 consecutive "
                                      "elements (with_2d_quantization=False)")
        self.with_2d_quantization = False
        core.MXFP8Quantizer.__init__(self, None, dtype)

    def _empty(self, shape, dtype, empty):
        rows, cols = _rows_cols(shape)
        if cols % MX_BLOCK or (self.columnwise_usage and rows % MX_BLOCK):
            raise ValueError(f"{type(self).__name__}.make_empty: MXFP8 needs the last dimension (and, with "
                             f"columnwise usage, the product of the others) to be a multiple of 32; got {tuple(shape)}")
        data = torch.empty((rows, cols), dtype=self.fp8_dtype, **empty)
        scales = torch.empty((rows, cols // MX_BLOCK), dtype=torch.uint8, **empty)
        data_t = scales_t = None
        if self.columnwise_usage:
            data_t = torch.empty((cols, rows), dtype=self.fp8_dtype, **empty)
            scales_t = torch.empty((cols, rows // MX_BLOCK), dtype=torch.uint8, **empty)
        result = MXFP8Tensor.make(data, scales, data_t, scales_t, nominal_dtype=dtype, quantizer=self)
        return _with_shape(result, shape)


QUANTIZER_CLASSES = (Float8Quantizer, Float8CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer)


def te_quantizer_of(tensor: QuantizedTensor):
    """Transformer Engine's quantizer of `tensor` (QuantizedTensor._get_quantizer): one of the
    classes above that casts as the tensor's own quantizer does (a delayed-scaling one with its
    module's scale, maxing into its amax history slot, as TE's quantizer of a module's weight
    does), in the layouts the tensor holds; the tensor's own where it is one already (a
    CustomRecipe factory's)."""
    q = tensor._quantizer
    if isinstance(q, _TEQuantizer) or q is None:
        return q
    usage = dict(rowwise=tensor._data is not None, columnwise=tensor.has_columnwise)
    if isinstance(q, core.Float8Quantizer):
        return Float8Quantizer(q.scale.reshape(1), q.scaling_group.amax_slot(q.column).reshape(1), q.fp8_dtype,
                               **usage)
    if isinstance(q, core.Float8CurrentScalingQuantizer):
        return Float8CurrentScalingQuantizer(q.fp8_dtype, tensor.device, force_pow_2_scales=q.power_2_scale,
                                             amax_epsilon=q.amax_epsilon, **usage)
    if isinstance(q, core.Float8BlockQuantizer):
        return Float8BlockQuantizer(q.fp8_dtype, force_pow_2_scales=q.power_2_scale, amax_epsilon=q.amax_epsilon,
                                    block_scaling_dim=2 if q.block_2d else 1, **usage)
    if isinstance(q, core.MXFP8Quantizer):
        return MXFP8Quantizer(q.fp8_dtype, **usage)
    raise NotImplementedError(f"{type(tensor).__name__}._get_quantizer: no Transformer Engine quantizer class "
                              f"for te-core's {type(q).__name__}")
