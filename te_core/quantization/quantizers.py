"""Quantizers: how one tensor role is cast, one class per scaling kind, all through te_core.ops.

quantize(x, columnwise=...) returns a QuantizedTensor; `columnwise=True` also makes the copy
the backward GEMMs read (fused cast-transpose where the kind allows it).
"""
from __future__ import annotations

from operator import attrgetter
from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from .. import ops
from ..backend import declares, traces
from ..dtype import DType, fp8_torch_dtype
from ..recipe import GEMMS, default_split_accumulator
from .block_tensor import Float8BlockwiseTensor, MXFP8Tensor
from .float8_tensor import Float8Tensor
from .roles import Role
from .scaling import ScalingGroup, forward_amax_of
from .tensor import QuantizedTensor


def _shaped_like(data: Tensor, x: Tensor) -> Tensor:
    """data viewed with x's shape (no new view when it has it already: one host op less per cast)."""
    return data if data.shape == x.shape else data.reshape(x.shape)


def _as_2d(x: Tensor) -> Tensor:
    if x.dim() == 2:
        return x
    if x.dim() == 0:  # one row of one element, as Transformer Engine flattens a 0-d tensor
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1])


def joined(dy) -> Tensor:
    """A gradient given as a list of its column blocks, concatenated; a tensor as it is."""
    return torch.cat(dy, dim=-1) if isinstance(dy, (list, tuple)) else dy


def sharing_fields(*names: str) -> Callable[["Quantizer"], tuple]:
    """A quantizer class's _sharing_getter: its attributes `names`, with what every quantizer's
    cast carries to the GEMMs and the backward (format, wgrad precision, accumulation)."""
    return attrgetter("fp8_dtype", "wgrad_in_fp8", "backward_override", "_fast_accumulation_key", *names)


class Quantizer:
    """Base: casts tensors of one role to one FP8 format."""

    gemm_alignment = 16  # what every dimension of its FP8 GEMMs must be a multiple of

    def __init__(self, role: Role, fp8_dtype: Union[torch.dtype, DType]):
        self.role = role
        self.fp8_dtype = fp8_torch_dtype(fp8_dtype, owner=type(self).__name__)

    scaling_group: Optional[ScalingGroup] = None  # delayed scaling: the state this quantizer updates

    # gemm ("fprop", "dgrad", "wgrad") -> whether it accumulates in float32. The state holding the
    # quantizer sets its recipe's choice (Recipe.split_accumulator); elsewhere TE's fixed choice.
    _split_accumulator: Callable[[str], bool] = staticmethod(default_split_accumulator)
    # gemm -> not split_accumulator(gemm): what every FP8 GEMM asks (quantization.gemm), so taken
    # once, whenever split_accumulator is set, rather than asked of the recipe per GEMM.
    fast_accumulation: Dict[str, bool] = {gemm: not default_split_accumulator(gemm) for gemm in GEMMS}
    _fast_accumulation_key: Tuple[bool, ...] = tuple(fast_accumulation.values())  # (for sharing_key)

    @property
    def split_accumulator(self) -> Callable[[str], bool]:
        return self._split_accumulator

    @split_accumulator.setter
    def split_accumulator(self, choice: Callable[[str], bool]) -> None:
        self._split_accumulator = choice
        self.fast_accumulation = {gemm: not choice(gemm) for gemm in GEMMS}
        self._fast_accumulation_key = tuple(self.fast_accumulation.values())

    # Whether a weight-gradient GEMM reads this quantizer's FP8 output (its column-wise copy).
    # False for the inputs and output gradients of a recipe that runs the wgrad in high precision
    # (DelayedScaling's override_linear_precision): that GEMM reads the high-precision tensors
    # instead (gemm.wgrad_operand). The state holding the quantizer sets it from its recipe.
    wgrad_in_fp8: bool = True
    # the recipe's backward_override (None, "high_precision", "dequantized"); set with wgrad_in_fp8
    backward_override: Optional[str] = None

    # Whether quantizing the same tensor again later gives the same result: true where the scale
    # comes from the tensor itself. A module's backward may then cast its saved high-precision
    # input instead of keeping the forward's FP8 copy (save_original_input).
    reproducible: bool = True

    def quantize(self, x: Tensor, *, columnwise: bool = False) -> QuantizedTensor:
        raise NotImplementedError

    def requantize(self, x: Tensor, *, columnwise: bool = False) -> QuantizedTensor:
        """A quantized tensor's new value (an in-place write: copy_, an optimizer's update) cast
        for it; quantize() unless the quantizer's scaling treats such a write apart."""
        return self.quantize(x, columnwise=columnwise)

    # What a cast's result depends on besides its input, in a quantizer whose cast depends on
    # nothing else and records nothing: an attrgetter of them (sharing_fields), or None, where
    # casts are never shared. Each class declares its own: a subclass (a user's, whose cast may
    # draw random bits) shares only once it declares one.
    _sharing_getter: Optional[Callable[["Quantizer"], tuple]] = None

    def sharing_key(self) -> Optional[tuple]:
        """Layers whose quantizers give equal keys may share one cast of the same tensor
        (shared_cast); None: never shared (delayed scaling casts with a scale of its own and
        records an amax)."""
        getter = type(self).__dict__.get("_sharing_getter")
        return None if getter is None else (type(self), getter(self))

    def quantize_with_dbias(self, dy: Tensor, *, columnwise: bool = True) -> Tuple[QuantizedTensor, Tensor]:
        """A 2-D gradient quantized, with its bias gradient (sum over rows). dy may be a list
        of the gradient's column blocks (see QuantizationStep.grad_operand)."""
        dy = joined(dy)
        return self.quantize(dy, columnwise=columnwise), ops.dbias(dy)

    def quantize_primary(self, x: Tensor) -> QuantizedTensor:
        """A weight kept only in FP8 (quantized_model_init): both layouts."""
        return self.quantize(x, columnwise=x.dim() == 2)

    def load_primary(self, x: Tensor) -> Optional[QuantizedTensor]:
        """A primary weight's value loaded from a checkpoint, quantized without touching the
        scaling state (the checkpoint's extra state restores that); None where copy_ does it
        right because the quantizer takes its scales from the value itself."""
        return None

    def fused_cast_args(self) -> Optional[dict]:
        """Arguments for a norm/activation op to emit this quantizer's FP8 directly, or None
        when the scale is not known before the op runs (current, block, MXFP8 scaling)."""
        return None

    def wrap_fused(self, data: Tensor, amax: Tensor, *, nominal_dtype, columnwise: bool = False,
                   data_t: Optional[Tensor] = None) -> QuantizedTensor:
        raise NotImplementedError(f"{type(self).__name__} has no fused cast; fused_cast_args() returned None")

    def observe(self, x: Tensor) -> None:
        """Calibration: record statistics of x without quantizing (no-op without scaling state)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self.role.value}, fp8_dtype={self.fp8_dtype})"


class Float8Quantizer(Quantizer):
    """Delayed scaling: casts with the scale of earlier steps, records this step's amax."""

    reproducible = False  # the scale is updated between the forward and its backward
    gemm_alignment = 1  # tensor-wise: any shape (quantized_gemm pads the GEMM's operands)

    def __init__(self, role: Role, group: ScalingGroup, column: int):
        super().__init__(role, group.fp8_dtype)
        self.scaling_group = group
        self.column = column

    @property
    def scale(self) -> Tensor:
        return self.scaling_group.scale_of(self.column)

    def _record(self, amax: Tensor) -> None:
        self.scaling_group.record(self.column, amax)

    def _is_own_slot(self, amax: Tensor) -> bool:
        """Whether `amax` is this quantizer's history slot, as a fused op given amax_out returns it.
        Eager, the slot view is cached, so identity tells. Traced, amax_slot makes a fresh view per
        call, so a view of the history counts (an op's own amax is a fresh tensor): recording the
        slot into itself would be an out= write aliasing its input, which functionalization turns
        into a copy of the whole history, a graph-made buffer that CUDA graphs (reduce-overhead)
        then find alive after the graph."""
        if amax is self.scaling_group.amax_slot(self.column):
            return True
        return torch.compiler.is_compiling() and amax._base is self.scaling_group.amax_history

    def _wrap(self, data, data_t, nominal_dtype) -> Float8Tensor:
        scale_inv = self.scaling_group.scale_inv_snapshot()[1][self.column]  # scale_inv_of, inline
        return Float8Tensor.make(data, scale_inv, data_t, nominal_dtype=nominal_dtype, quantizer=self)

    def quantize(self, x: Tensor, *, columnwise: bool = False) -> Float8Tensor:
        # the op maxes this step's amax straight into the history slot (amax_out); scale_of and
        # amax_slot in one call, as every cast asks both
        scales, slots = self.scaling_group.column_views()
        scale, slot = scales[self.column], slots[self.column]
        if columnwise:
            x2d = _as_2d(x)
            data, data_t, _ = ops.cast_transpose_fp8(x2d, scale, self.fp8_dtype, amax_out=slot)
            data = _shaped_like(data, x)
        else:
            (data, _), data_t = ops.quantize_fp8(x, scale, self.fp8_dtype, amax_out=slot), None
        return self._wrap(data, data_t, x.dtype)

    def quantize_with_dbias(self, dy, *, columnwise: bool = True):
        scales, slots = self.scaling_group.column_views()
        scale, slot = scales[self.column], slots[self.column]
        if isinstance(dy, (list, tuple)) and declares("dbias_cast_transpose_parts"):
            data, data_t, dbias, _ = ops.dbias_cast_transpose_parts(dy, scale, self.fp8_dtype, amax_out=slot)
            return self._wrap(data, data_t, dy[0].dtype), dbias
        dy = joined(dy)  # a backend without the parts op still has its one-tensor kernel
        data, data_t, dbias, _ = ops.dbias_cast_transpose(dy, scale, self.fp8_dtype, amax_out=slot)
        return self._wrap(data, data_t, dy.dtype), dbias

    def quantize_primary(self, x: Tensor) -> Float8Tensor:
        # A fresh weight has no history yet: take its scale from its own amax, as current scaling does.
        weight, scale, amax = self._by_own_amax(x)
        self.scale.copy_(scale)
        self._record(amax)
        self.scaling_group.fresh.discard(self.column)
        self.scaling_group.init_scaled.add(self.column)
        return weight

    def requantize(self, x: Tensor, *, columnwise: bool = False) -> Float8Tensor:
        # A weight's whole new value before any update (pretrained weights copied into a model made
        # under quantized_model_init): scaled by its own amax, as at init, the init amax in the
        # history replaced by it. Afterwards delayed scaling: the current scale, the amax recorded
        # (also once compiled or captured graphs use the group: they update it where no flag is seen).
        group = self.scaling_group
        if self.column not in group.init_scaled or group._updated_in_graphs or group.captured:
            return self.quantize(x, columnwise=columnwise)
        self.scaling_group.amax_slot(self.column).zero_()
        weight = self.quantize_primary(x)
        if not columnwise:
            weight.drop_columnwise()
        return weight

    def load_primary(self, x: Tensor) -> Float8Tensor:
        # A checkpoint's FP8 weight was cast with the module's scale of then, which the checkpoint's
        # extra state has restored by now: cast with it, the saved bytes and scale come back exactly
        # (a resumed step equals the uninterrupted one). Where that scale does not give back the
        # loaded values (no extra state: the scale of a fresh init, which can saturate trained
        # values far larger), the value is cast by its own amax, as at init.
        x2d = _as_2d(x)
        scale = self.scale
        data, data_t, _ = ops.cast_transpose_fp8(x2d, scale, self.fp8_dtype)
        weight = Float8Tensor.make(_shaped_like(data, x), torch.reciprocal(scale), data_t, nominal_dtype=x.dtype,
                                   quantizer=self)
        if torch.equal(weight.dequantize(), x):
            return weight
        return self._by_own_amax(x)[0]

    def _by_own_amax(self, x: Tensor) -> Tuple[Float8Tensor, Tensor, Tensor]:
        """(x cast with the scale of its own amax, both layouts; that scale; the amax)."""
        # Values the format holds exactly at some power-of-two scale (FP8 values dequantized, as
        # Transformer Engine casts a fresh weight with scale 1 and its tests copy such values in)
        # are kept exactly by the largest power-of-two scale below fp8_max / amax; 448 / amax
        # itself would round them again. Other values take that scale, which rounds them least.
        # (No values to compare on a meta device or in a trace: the plain scale there.)
        try_pow2 = x.device.type != "meta" and not torch.compiler.is_compiling()
        x2d = _as_2d(x)
        for pow2 in (True, False)[0 if try_pow2 else 1:]:
            data, data_t, scale, scale_inv, amax = ops.quantize_fp8_current(
                x2d, self.fp8_dtype, with_transpose=True, force_pow2_scales=pow2)
            weight = Float8Tensor.make(_shaped_like(data, x), scale_inv, data_t, nominal_dtype=x.dtype,
                                       quantizer=self)
            if not pow2 or torch.equal(weight.dequantize(), x):
                break
        return weight, scale, amax

    def fused_cast_args(self) -> Optional[dict]:
        return {"fp8_scale": self.scale, "fp8_dtype": self.fp8_dtype,
                "amax_out": self.scaling_group.amax_slot(self.column)}

    def wrap_fused(self, data, amax, *, nominal_dtype, columnwise=False, data_t=None) -> Float8Tensor:
        """`data_t`: the column-wise copy when the fused op wrote one (else it is made here if needed)."""
        if not self._is_own_slot(amax):  # else the op maxed it in already
            self._record(amax)
        if not columnwise:
            data_t = None
        elif data_t is None:
            data_t = ops.transpose_fp8(_as_2d(data))
        return self._wrap(data, data_t, nominal_dtype)

    def observe(self, x: Tensor) -> None:
        self._record(forward_amax_of(x))
        if not torch.compiler.is_compiling():  # (a traced Function mutates no Python state)
            self.scaling_group.fresh.discard(self.column)  # the update sets the scale from this amax


def _float_as_text(name: str) -> property:
    """A float attribute kept as text: torch.compile(dynamic=True) makes a float attribute
    symbolic, and a symbolic float first read in the backward's trace (the output gradient's
    cast) fails dynamo's speculation of the backward; a float parsed from text is a constant of
    the trace (a changed value recompiles). A property, which dynamo reads on every supported
    torch (torch 2.7's cannot call a descriptor class's __get__)."""
    slot = "_" + name + "_text"

    def get(self) -> float:
        return float(getattr(self, slot))

    def set_(self, value) -> None:
        setattr(self, slot, repr(float(value)))

    return property(get, set_)


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: the scale comes from this tensor's amax, in the same op as the cast."""

    gemm_alignment = 1  # tensor-wise: any shape (quantized_gemm pads the GEMM's operands)

    _sharing_getter = sharing_fields("power_2_scale", "amax_epsilon")

    def __init__(self, role: Role, fp8_dtype: torch.dtype, power_2_scale: bool = False, amax_epsilon: float = 0.0):
        super().__init__(role, fp8_dtype)
        self.power_2_scale = power_2_scale
        self.amax_epsilon = amax_epsilon

    amax_epsilon = _float_as_text("amax_epsilon")

    def quantize(self, x: Tensor, *, columnwise: bool = False) -> Float8Tensor:
        src = _as_2d(x) if columnwise else x
        data, data_t, _scale, scale_inv, _amax = ops.quantize_fp8_current(
            src, self.fp8_dtype, with_transpose=columnwise,
            force_pow2_scales=self.power_2_scale, amax_epsilon=self.amax_epsilon,
        )
        return Float8Tensor.make(_shaped_like(data, x), scale_inv, data_t, nominal_dtype=x.dtype, quantizer=self)

    def quantize_with_dbias(self, dy, *, columnwise: bool = True):
        # One op where the backend fuses it: the amax pass, then the cast, its transpose and the
        # bias gradient in one pass over dy, whose column blocks it reads in place (no join).
        # Without a column-wise copy to make, the cast and torch's column sum do less.
        if not columnwise or not declares("dbias_cast_transpose_current"):
            return super().quantize_with_dbias(dy, columnwise=columnwise)
        parts = list(dy) if isinstance(dy, (list, tuple)) else [_as_2d(dy)]
        data, data_t, dbias, _scale, scale_inv, _amax = ops.dbias_cast_transpose_current(
            parts, self.fp8_dtype, force_pow2_scales=self.power_2_scale, amax_epsilon=self.amax_epsilon)
        if isinstance(dy, Tensor):
            data = _shaped_like(data, dy)
        return Float8Tensor.make(data, scale_inv, data_t, nominal_dtype=parts[0].dtype, quantizer=self), dbias


class Float8BlockQuantizer(Quantizer):
    """One float32 scale per 1x128 run of a row (block_2d=False) or per 128x128 tile."""

    amax_epsilon = _float_as_text("amax_epsilon")

    _sharing_getter = sharing_fields("block_2d", "power_2_scale", "amax_epsilon")

    def __init__(self, role, fp8_dtype, block_2d: bool, power_2_scale: bool = True, amax_epsilon: float = 0.0):
        super().__init__(role, fp8_dtype)
        self.block_2d = block_2d
        self.power_2_scale = power_2_scale
        self.amax_epsilon = amax_epsilon

    def quantize(self, x: Tensor, *, columnwise: bool = False) -> Float8BlockwiseTensor:
        data, scale_inv, data_t, scale_inv_t = ops.quantize_blockwise(
            _as_2d(x), self.fp8_dtype, block_2d=self.block_2d, with_transpose=columnwise,
            force_pow2_scales=self.power_2_scale, amax_epsilon=self.amax_epsilon,
        )
        return Float8BlockwiseTensor.make(data, scale_inv, data_t, scale_inv_t, nominal_dtype=x.dtype,
                                          quantizer=self, _block_2d=self.block_2d)

    def quantize_with_dbias(self, dy, *, columnwise: bool = True):
        # One op where the backend fuses it: both 1x128 casts and the bias gradient from one read
        # of dy, whose column blocks it casts in place (no join). A compiled step keeps the cast
        # and the column sum, which the compiler traces and fuses with their neighbours, unless
        # the backend gives the fused op a twin of its own.
        if (not columnwise or self.block_2d or not declares("dbias_cast_transpose_blockwise")
                or (torch.compiler.is_compiling() and not traces("dbias_cast_transpose_blockwise"))):
            return super().quantize_with_dbias(dy, columnwise=columnwise)
        parts = list(dy) if isinstance(dy, (list, tuple)) else [_as_2d(dy)]
        data, scale_inv, data_t, scale_inv_t, dbias = ops.dbias_cast_transpose_blockwise(
            parts, self.fp8_dtype, force_pow2_scales=self.power_2_scale, amax_epsilon=self.amax_epsilon)
        return Float8BlockwiseTensor.make(data, scale_inv, data_t, scale_inv_t, nominal_dtype=parts[0].dtype,
                                          quantizer=self, _block_2d=False), dbias


class MXFP8Quantizer(Quantizer):
    """MXFP8: an E8M0 power-of-two scale per 32 consecutive elements."""

    gemm_alignment = 32

    _sharing_getter = sharing_fields()

    def quantize(self, x: Tensor, *, columnwise: bool = False) -> MXFP8Tensor:
        x2d = _as_2d(x)
        rows, cols = x2d.shape
        if cols % 32 or (columnwise and rows % 32):
            need = "both dimensions" if columnwise else "the last dimension"
            raise ValueError(f"MXFP8 quantization needs {need} of the 2-D tensor to be multiples of 32 "
                             f"(one E8M0 scale per 32 elements); got shape {tuple(x2d.shape)}")
        data, scales, data_t, scales_t = ops.quantize_mxfp8(x2d, self.fp8_dtype, with_transpose=columnwise)
        return MXFP8Tensor.make(data, scales, data_t, scales_t, nominal_dtype=x.dtype, quantizer=self)
