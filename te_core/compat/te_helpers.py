"""Small helpers of Transformer Engine's `pytorch.utils` and `pytorch.quantization` that ported
code (Megatron-LM, NeMo) imports and te-core has no name of its own for: bf16 and FP8 dtype
queries, checked division, casts, the default weight init. The stand-in maps them under TE's
names (te_core.compat.transformer_engine).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..dtype import DType

if TYPE_CHECKING:
    from ..recipe import Recipe


def is_bf16_compatible() -> bool:
    """Whether the selected backend's device computes in bfloat16 (TE asks the GPU's compute
    capability; te-core asks the backend, as te.is_bf16_available does)."""
    from ..quantization.autocast import is_bf16_available

    return bool(is_bf16_available())


def divide(numerator: int, denominator: int) -> int:
    """numerator // denominator, which must divide exactly (a head count or hidden size split over
    tensor-parallel ranks: a remainder would be silently dropped)."""
    if denominator == 0:
        raise ValueError(f"divide: cannot divide {numerator} by 0")
    if numerator % denominator != 0:
        raise ValueError(f"divide: {numerator} is not divisible by {denominator} (remainder "
                         f"{numerator % denominator}); choose sizes whose ratio is a whole number")
    return numerator // denominator


def cast_if_needed(tensor: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """`tensor` in `dtype`: itself when it has it already, None for None. The cast is recorded by
    autograd even under torch.no_grad(), as in TE (its callers cast parameters whose gradient
    must reach them)."""
    if tensor is None or tensor.dtype == dtype:
        return tensor
    with torch.enable_grad():
        return tensor.to(dtype=dtype)


def get_default_init_method() -> Callable[[torch.Tensor], None]:
    """The weight init te-core's modules use when given none: normal(0, 0.023), TE's."""
    from ..modules._common import default_init_method

    return default_init_method()


def _fp8_format(fp8_recipe: Recipe, caller: str):
    fmt = getattr(fp8_recipe, "fp8_format", None)
    if fmt is None:
        raise TypeError(f"{caller}: expected a recipe with an fp8_format (e.g. te_core.recipe.DelayedScaling()), "
                        f"got {fp8_recipe!r}")
    return fmt


def get_fp8_torch_dtype(fp8_recipe: Recipe, fprop_tensor: bool = True) -> torch.dtype:
    """The FP8 torch dtype of the recipe's forward tensors (fprop_tensor=True: activations,
    weights) or of its gradients: E4M3 for Format.E4M3 and HYBRID's forward, E5M2 otherwise."""
    fmt = _fp8_format(fp8_recipe, "get_fp8_torch_dtype")
    return fmt.forward_dtype if fprop_tensor else fmt.backward_dtype


def get_fp8_te_dtype(fp8_recipe: Recipe, fprop_tensor: bool = True) -> DType:
    """get_fp8_torch_dtype as Transformer Engine's DType (kFloat8E4M3 or kFloat8E5M2)."""
    fmt = _fp8_format(fp8_recipe, "get_fp8_te_dtype")
    return DType.cast(fmt.forward_dtype if fprop_tensor else fmt.backward_dtype)
