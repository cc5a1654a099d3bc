"""QuantizationStep: what one forward (and its backward) of a module quantizes, and when scales update.

A module asks for a step at the start of each forward and hands it to its autograd Function,
which calls the same methods whatever the recipe: `operand` / `weight_operand` /
`grad_operand` give FP8 operands under autocast and the plain tensors otherwise, so the
Function has one code path. The step records amaxes and schedules the delayed-scaling
updates (forward groups at the outermost autocast exit, backward groups at the end of backward).

`columnwise=True` on an input or output-gradient operand says that the wgrad GEMM reads it: the
column-wise copy is made only where that GEMM runs in FP8 (the quantizer's wgrad_in_fp8); else
the module keeps the high-precision tensor for it (gemm.wgrad_operand), and no fused
norm/activation cast (fused_cast_args) hides that tensor.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import ops
from .autocast import get_autocast_context
from .gemm import check_gemm_dims, keep_columnwise
from .quantizers import joined
from .roles import Role
from .scaling import (_CAPTURE, amax_of_parts, reduce_first_amax, reduces_first_amax, schedule_backward_update,
                      update_now)
from .tensor import QUANTIZED, QuantizedTensor
from .weight_refresh import gated_weight


class HighPrecisionStep:
    """No FP8: operands pass through (quantized primary weights are dequantized)."""

    fp8 = False
    backward_override = None  # the recipe's (see QuantizationStep)

    def quantizer(self, slot: str):
        """The slot's Quantizer, or None without a recipe."""
        return None

    def operand(self, slot: str, x: Tensor, *, columnwise: bool = False) -> Tensor:
        return x

    def weight_operand(self, slot: str, weight: Tensor, *, columnwise: bool = False) -> Tensor:
        return weight.dequantize() if isinstance(weight, QuantizedTensor) else weight

    def grad_operand(self, slot: str, dy: Tensor, *, columnwise: bool = False,
                     with_dbias: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """(operand, dbias or None). dy may be a list of the gradient's column blocks (a fused
        QKV projection's q, k and v gradients): the FP8 cast then reads them in place."""
        dy = joined(dy)
        return dy, (ops.dbias(dy) if with_dbias else None)

    def dgrad_weight(self, weight_operand, weight: Tensor, dtype: torch.dtype):
        """What the dgrad GEMM reads of a weight, to keep for the backward: the column-wise copy
        of `weight_operand` (keep_columnwise), or what the recipe's backward_override asks for
        (QuantizationStep). `weight`: the weight as given to weight_operand."""
        return keep_columnwise(weight_operand)

    def reproducible(self, slot: str) -> bool:
        """Whether wgrad_input can cast the slot's tensor again in the backward."""
        return True

    def wgrad_input(self, slot: str, x: Tensor) -> Tensor:
        """The wgrad GEMM's operand for an input the forward kept in high precision
        (save_original_input), cast now: high precision passes it through."""
        return x

    def fused_cast_args(self, slot: str) -> Optional[dict]:
        return None

    def wrap_fused(self, slot, data, amax, *, nominal_dtype, columnwise=False, data_t=None):
        raise RuntimeError("wrap_fused called without FP8: fused_cast_args() returned None, so the op "
                           "produced high-precision output; pass it to step.operand instead")

    def check_gemm_dims(self, m: int, n: int, k: int) -> None:
        """Only FP8 GEMMs have alignment rules."""

    def backward_done(self) -> None:
        """Nothing to update."""


HIGH_PRECISION = HighPrecisionStep()


class CalibrationStep(HighPrecisionStep):
    """calibrating=True without FP8: high-precision compute, amaxes recorded, scales updated."""

    def __init__(self, state, context, is_first_microbatch: Optional[bool]):
        self._state = state
        self._context = context
        self._weights_fresh = is_first_microbatch is not False
        self._backward_groups: Dict[int, object] = {}
        self._traced = torch.compiler.is_compiling()
        if self._traced:
            self._schedule_traced_forward()

    def _schedule_traced_forward(self) -> None:
        """While torch.compile traces, the forward groups are scheduled here, before the
        autograd Function runs (dynamo forbids a Function to mutate Python state): each group
        this step records into, the weights' only when they are quantized afresh."""
        for role, group in self._state.scaling_groups().items():
            if role is Role.INPUT or (role is Role.WEIGHT and self._weights_fresh):
                self._context.schedule_forward_update(group)
        # the backward group: updated at the end of the backward of its first use under this
        # autocast (backward_done), which runs after the later uses' backwards have recorded
        # their amaxes; a forward without autograd has no backward to claim it
        group = self._state.scaling_groups().get(Role.GRAD_OUTPUT)
        self._updates_backward = (group is not None and torch.is_grad_enabled()
                                  and self._context.forward_updates.claim_backward_update(group))

    def quantizer(self, slot: str):
        return self._state.quantizer(slot)

    def _used(self, quantizer) -> None:
        """Schedule the update of the scaling group `quantizer` recorded into (if it has one)."""
        group = quantizer.scaling_group
        if group is None or self._traced:  # traced: scheduled by _schedule_traced_forward / backward_done
            return
        if quantizer.role.direction == "forward":  # the context's schedule_forward_update, inline
            context = self._context
            context.forward_updates.add(group, context.amax_reduction_group)
        else:
            self._backward_groups[id(group)] = group

    def _observe(self, slot: str, x: Tensor) -> None:
        quantizer = self._state.quantizer(slot)
        quantizer.observe(x)
        self._used(quantizer)

    def operand(self, slot, x, *, columnwise=False):
        self._observe(slot, x)
        return x

    def weight_operand(self, slot, weight, *, columnwise=False):
        weight = super().weight_operand(slot, weight)
        if self._weights_fresh:
            self._observe(slot, weight)
        return weight

    def grad_operand(self, slot, dy, *, columnwise=False, with_dbias=False):
        dy = joined(dy)
        self._observe(slot, dy)
        return super().grad_operand(slot, dy, with_dbias=with_dbias)

    def backward_done(self) -> None:
        process_group = self._context.amax_reduction_group
        if self._traced:
            # A graph has no end-of-backward callback: while traced, the backward of the module's
            # first use under the autocast updates its backward group at its end
            # (_schedule_traced_forward), once however often the module ran.
            if self._updates_backward:
                update_now([(self._state.scaling_groups()[Role.GRAD_OUTPUT], process_group)])
            return
        for group in self._backward_groups.values():
            schedule_backward_update(group, process_group)
        self._backward_groups.clear()


class QuantizationStep(CalibrationStep):
    """FP8 compute per the module's recipe state. `weight_cache` (the module's) holds weights
    quantized with is_first_microbatch=True for reuse while it is False."""

    fp8 = True

    def __init__(self, state, context, is_first_microbatch: Optional[bool], weight_cache: Dict[str, QuantizedTensor],
                 refresh_flag: Optional[Tensor] = None):
        super().__init__(state, context, is_first_microbatch)
        self._is_first_microbatch = is_first_microbatch
        self._weight_cache = weight_cache
        # a caller-captured graph's device flag deciding each weight cast (weight_refresh), or None
        self._refresh_flag = refresh_flag
        # Transformer Engine's backward_override: the backward runs in high precision, on the
        # layer's original operands ("high_precision") or the forward's FP8 ones dequantized
        # ("dequantized"); the forward makes no column-wise copy and no output gradient is cast
        self.backward_override = getattr(state.recipe, "backward_override", None)
        # slots whose first cast quantized an op's output afterwards (see fused_cast_args)
        self._cast_after: frozenset = frozenset()

    def first_scale(self, quantizer, x) -> None:
        """For a quantizer that casts for the first time since its state was made (_is_fresh),
        set its scale from x's own amax before the cast (all-reduced over the autocast's
        amax_reduction_group where the recipe reduces amaxes, so the ranks agree). A fresh
        delayed-scaling scale is 1 (Transformer Engine's too), which flushes most of the first
        step's output gradients to zero in E5M2 and casts small weights to subnormals, and an update
        from such gradients sets training back for many steps after it. Scaled by its own amax, the first
        cast is a current-scaling cast; the history records that amax as usual, so the update
        after the step sets the same scale. Not fresh: a state loaded from a checkpoint (but for
        the slots a te-core checkpoint records as not cast yet),
        calibrated (autocast(calibrating=True)), or made by te_core.init_quantization_state (as
        torch.compile makes it: a graph cannot branch on Python state without recompiling) or
        captured by te_core.make_graphed_callables (a replay runs no Python)."""
        group, column = quantizer.scaling_group, quantizer.column
        process_group = self._context.amax_reduction_group
        if all(part.numel() == 0 for part in (x if isinstance(x, (list, tuple)) else (x,))) and not reduces_first_amax(
                group, process_group):
            return  # (no amax to scale by: the slot stays fresh for the first tensor that has elements)
        group.fresh.discard(column)
        amax = reduce_first_amax(group, amax_of_parts(x), process_group)
        group.take_first_scale(column, amax)

    def _is_fresh(self, quantizer) -> bool:
        # cheap tests first: this runs on every cast (traced, dynamo never reads `fresh`)
        group = quantizer.scaling_group
        if self._traced or group is None or not group.fresh or _CAPTURE.active:
            return False
        # (a quantizer of an FSDP shard has no column, and is never fresh)
        return getattr(quantizer, "column", None) in group.fresh

    def _quantize(self, slot: str, x: Tensor, columnwise: bool, quantizer=None) -> QuantizedTensor:
        quantizer = self._state.quantizer(slot) if quantizer is None else quantizer
        if self._is_fresh(quantizer):
            self.first_scale(quantizer, x)
        result = quantizer.quantize(x, columnwise=columnwise and quantizer.wgrad_in_fp8)
        self._used(quantizer)
        return result

    def operand(self, slot, x, *, columnwise=False):
        if isinstance(x, QUANTIZED):  # quantized already: an FP8 all-gather under sequence parallelism
            return x
        # The cast of a tensor the layer before cast the same way is that layer's (shared_cast).
        # Not traced (the compiler sees both casts), not in a capture (each graph keeps its own
        # memory), and only in the forward of the autocast that made the step (a recompute in the
        # backward, te.checkpoint's, runs outside it).
        if self._traced or _CAPTURE.active:
            return self._quantize(slot, x, columnwise)
        quantizer = self._state.quantizer(slot)
        key = quantizer.sharing_key()  # (None for delayed scaling, the default: nothing more to ask)
        if key is None or get_autocast_context() is not self._context:
            return self._quantize(slot, x, columnwise, quantizer)
        columnwise = columnwise and quantizer.wgrad_in_fp8
        shared = self._context.shared_cast
        result = shared.get(x, key, columnwise)
        if result is None:
            result = quantizer.quantize(x, columnwise=columnwise)
            shared.put(x, key, columnwise, result)
        return result

    def weight_operand(self, slot, weight, *, columnwise=False):
        if isinstance(weight, QUANTIZED):  # primary FP8 weight: already quantized
            if weight.quantizer is not None:
                self._used(weight.quantizer)
            return weight
        if self._refresh_flag is not None:  # whatever is_first_microbatch says, as Transformer Engine's
            columnwise = self.backward_override is None
            return gated_weight(lambda: self._quantize(slot, weight, columnwise=columnwise), self._state.quantizer(slot),
                                self._weight_cache, slot, self._refresh_flag)
        cached = self._weight_cache.get(slot)
        if self._is_first_microbatch is False and cached is not None:
            return cached  # amax not recorded, scale not updated: the weight did not change
        columnwise = self.backward_override is None and (columnwise or self._is_first_microbatch is not None)
        result = self._quantize(slot, weight, columnwise=columnwise)
        # None neither reads nor writes the cache (Transformer Engine passes no cache name then), so a
        # later False still reuses the weight cached at the last True. What makes a cached weight
        # stale otherwise (a recipe change, a checkpoint or state load, reset_parameters) clears the
        # cache where it happens (QuantizedModule), not here.
        if self._is_first_microbatch is not None:
            self._weight_cache[slot] = result
        return result

    def reproducible(self, slot):
        return self._state.quantizer(slot).reproducible

    def wgrad_input(self, slot, x):
        # The forward recorded nothing for this cast's sake and a reproducible quantizer has no
        # state to update: the cast alone, column-wise where the wgrad runs in FP8.
        quantizer = self._state.quantizer(slot)
        if not quantizer.reproducible:
            raise RuntimeError(f"wgrad_input: the {slot!r} quantizer ({type(quantizer).__name__}) cannot cast the "
                               "saved input again; check reproducible() in the forward")
        return quantizer.quantize(x, columnwise=quantizer.wgrad_in_fp8) if quantizer.wgrad_in_fp8 else x

    def dgrad_weight(self, weight_operand, weight, dtype):
        override = self.backward_override
        if override is None:
            return keep_columnwise(weight_operand)
        if override == "dequantized":  # the forward's FP8 weight, dequantized by the GEMM
            return weight_operand
        # high_precision: the weight as given (an FP8 primary weight is dequantized by the GEMM)
        return weight if isinstance(weight, QUANTIZED) or weight.dtype == dtype else weight.to(dtype)

    def grad_operand(self, slot, dy, *, columnwise=False, with_dbias=False):
        if self.backward_override is not None:  # the backward GEMMs run in high precision
            return HighPrecisionStep.grad_operand(self, slot, dy, with_dbias=with_dbias)
        quantizer = self._state.quantizer(slot)
        columnwise = columnwise and quantizer.wgrad_in_fp8
        if self._is_fresh(quantizer):
            self.first_scale(quantizer, dy)
        if with_dbias:
            result, dbias = quantizer.quantize_with_dbias(dy, columnwise=columnwise)
        else:
            result, dbias = quantizer.quantize(joined(dy), columnwise=columnwise), None
        self._used(quantizer)
        return result, dbias

    def fused_cast_args(self, slot: str) -> Optional[dict]:
        quantizer = self._state.quantizer(slot)
        # a high-precision wgrad reads the op's high-precision output, which a fused cast never
        # writes; a first cast needs the output's amax before its scale (operand() casts it then).
        # A recompute that replays this step (te.checkpoint) takes the path the forward took: a
        # fused cast rounds the op's float32 result once where the forward rounded it to the
        # output dtype first, which would move some FP8 values by one step.
        if not quantizer.wgrad_in_fp8 or slot in self._cast_after:
            return None
        if self._is_fresh(quantizer):
            self._cast_after = self._cast_after | {slot}
            return None
        return quantizer.fused_cast_args()

    def wrap_fused(self, slot, data, amax, *, nominal_dtype, columnwise=False, data_t=None):
        quantizer = self._state.quantizer(slot)
        result = quantizer.wrap_fused(data, amax, nominal_dtype=nominal_dtype, columnwise=columnwise, data_t=data_t)
        self._used(quantizer)
        return result

    def check_gemm_dims(self, m: int, n: int, k: int) -> None:
        align = self._state.gemm_alignment
        if m % align or n % align or k % align:  # (inline: the call below only builds the error)
            check_gemm_dims(m, n, k, align, what=f"FP8 GEMM ({type(self._state.recipe).__name__})")
