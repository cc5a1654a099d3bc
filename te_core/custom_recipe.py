"""Transformer Engine's CustomRecipe: the user's factory chooses each tensor's quantizer.

`qfactory(role)` gets a QuantizerRole (te_core.quantization.custom: TE's role fields, and the
role string older TE releases passed) and returns one of te-core's TE-signature quantizers
(`te.Float8CurrentScalingQuantizer(...)`, ...). te-core asks it for the tensors its modules
quantize: each GEMM's input, weight and output gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .recipe import (
    Format,
    Recipe,
    _check_backward_override,
    _check_block_recipe_flags,
    _check_number,
    _convert,
    _env_str,
    _ignores_unknown_arguments,
)

__all__ = ["CustomRecipe"]


@_ignores_unknown_arguments
@dataclass(frozen=True)
class CustomRecipe(Recipe):
    """Quantizers from `qfactory(role)`, one per tensor a module quantizes. fp8_format is kept for
    code that reads it (as in Transformer Engine, the factory's quantizers decide the formats);
    quantization_alignment is TE's padding hint for grouped GEMMs."""

    qfactory: Callable[..., Any] = None
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_str("NVTE_BACKWARD_OVERRIDE", None))
    quantization_alignment: int = 128

    def __post_init__(self):
        _convert(self)
        if not callable(self.qfactory):
            raise TypeError(f"CustomRecipe: qfactory must be a callable role -> quantizer, got {self.qfactory!r}; "
                            "e.g. CustomRecipe(qfactory=lambda role: te.Float8CurrentScalingQuantizer("
                            "te.DType.kFloat8E5M2 if role.tensor_type == 'grad_output' else te.DType.kFloat8E4M3))")
        _check_block_recipe_flags(self)
        _check_backward_override(self)
        _check_number("CustomRecipe", "quantization_alignment", self.quantization_alignment, minimum=1, integer=True)

    def make_state(self, slots, device):
        from .quantization.custom import CustomRecipeState

        return CustomRecipeState(self, slots)

    def quantizer_for(self, role):
        raise NotImplementedError("CustomRecipe: quantizers come from qfactory per module slot (make_state), "
                                  "not per te-core role")
