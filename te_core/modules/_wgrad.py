"""The weight gradient of a module's GEMM, returned or accumulated into `weight.main_grad`.

Transformer Engine's `fuse_wgrad_accumulation=True`: the wgrad GEMM adds its result straight
into a float32 buffer the user allocated as `weight.main_grad` (Megatron-style gradient
accumulation across micro-batches, without a low-precision `.grad` in between); autograd then
gets no gradient for the weight, so `weight.grad` stays None. On a first micro-batch
(`is_first_microbatch=True`) the GEMM writes main_grad instead, dropping what it held, as
Transformer Engine's does (main_grad_mode).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..quantization.gemm import wgrad_gemm, wgrad_operand
from ..quantization.tensor import QUANTIZED
from ._microbatch import first_microbatch


ACCUMULATE, OVERWRITE = 1, 2  # main_grad_mode's answers besides 0 (no fusion); both true


def main_grad_mode(fuse_wgrad_accumulation: bool, is_first_microbatch: Optional[bool],
                   weight: Optional[Tensor] = None) -> int:
    """What a forward hands its autograd Function for the wgrad: 0 (no fusion: a gradient for
    autograd), ACCUMULATE (added into main_grad) or OVERWRITE (written into main_grad: the first
    micro-batch, is_first_microbatch=True, or a `weight` that carries `overwrite_main_grad=True`,
    which Megatron-FSDP sets and Transformer Engine's modules read at forward)."""
    if not fuse_wgrad_accumulation:
        return 0
    if getattr(weight, "overwrite_main_grad", False):
        return OVERWRITE
    # (checked by the module's quantization_step: None or a bool-like; a graph capture may force it)
    first = first_microbatch(is_first_microbatch)
    return OVERWRITE if first is not None and bool(first) else ACCUMULATE


def weight_grad(dy_op, x_op, out_dtype: torch.dtype, fused_weight: Optional[Tensor], module: str,
                overwrite: bool = False) -> Optional[Tensor]:
    """dy^T x in `out_dtype` (the weight's dtype); with `fused_weight` (the weight of a module
    built with fuse_wgrad_accumulation=True) added into fused_weight.main_grad (written there
    with `overwrite`), returning None."""
    if fused_weight is None:
        return wgrad_gemm(dy_op, x_op, out_dtype=out_dtype)
    main_grad = getattr(fused_weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError(f"{module}(fuse_wgrad_accumulation=True): weight.main_grad is not set; assign a float32 "
                           f"buffer of shape {tuple(fused_weight.shape)} to weight.main_grad before backward")
    if tuple(main_grad.shape) != tuple(fused_weight.shape) or main_grad.device != fused_weight.device:
        raise RuntimeError(f"{module}(fuse_wgrad_accumulation=True): weight.main_grad has shape "
                           f"{tuple(main_grad.shape)} on {main_grad.device}; it must match the weight "
                           f"({tuple(fused_weight.shape)} on {fused_weight.device})")
    wgrad_gemm(dy_op, x_op, out_dtype=main_grad.dtype, out=main_grad, accumulate=not overwrite)
    return None


def main_grad_placeholder(weight: Tensor) -> Optional[Tensor]:
    """The gradient autograd gets for a weight whose wgrad went into main_grad: None, except for
    a weight that carries `grad_added_to_main_grad` (Megatron-LM's data-parallel wrapper sets it
    to False each step). Then, as Transformer Engine does, the flag is set and a placeholder of
    the weight's shape is returned, so that the wrapper's hook on the weight's gradient still
    runs (it marks the weight's bucket ready for its all-reduce, and asserts a gradient under
    overlap_grad_reduce) and, seeing the flag, does not add the placeholder into main_grad. The
    placeholder is zeros where the weight asks for it (`zero_out_wgrad`, whose hook adds it) and
    under torch.compile, where the flag cannot be set at run time (the hook then adds zeros)."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    compiled = torch.compiler.is_compiling()
    if not compiled:
        weight.grad_added_to_main_grad = True
    make = torch.zeros if compiled or getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.shape, dtype=weight.dtype, device=weight.device)


def check_original_input(step, slot: str, module: str) -> None:
    """save_original_input=True needs a quantizer that casts the kept input in the backward as
    the forward would have: not delayed scaling's, whose scale is updated in between."""
    if not step.reproducible(slot):
        raise ValueError(
            f"{module}: save_original_input=True does not work with DelayedScaling (nor does it in Transformer "
            "Engine): the backward would cast the saved input with a scale updated since the forward. Use "
            "Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling, or save_original_input=False")


def original_input_operand(step, slot: str, x2d: Tensor, dtype: torch.dtype, *, now: bool):
    """What the wgrad GEMM reads of an input kept as given (save_original_input): cast by the
    step as the forward would have cast it, or the input in the compute dtype. `now`: the GEMM
    runs at once (see gemm.wgrad_operand)."""
    op = step.wgrad_input(slot, x2d)
    return wgrad_operand(op, x2d, dtype, now=now) if isinstance(op, QUANTIZED) else op.to(dtype)
