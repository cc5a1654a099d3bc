"""Transformer Engine's quantizer factories (its `custom_recipes.quantizer_factories`): for each
built-in recipe, the `qfactory` whose CustomRecipe quantizes every tensor as that recipe does, a
starting point for a factory that changes some roles and keeps the rest.

    CustomRecipe(qfactory=current_scaling_factory)  # Float8CurrentScaling()'s results, bit for bit

Each factory makes, per role, the choices TE's makes, with te-core's TE-signature quantizers
(te_quantizers, identity). The two TE has that te-core cannot back raise NotImplementedError
when asked for a quantizer, naming what to use instead, rather than quantizing another way.
"""
from __future__ import annotations

from typing import Optional

from ..dtype import DType
from .custom import QuantizerRole
from .identity import IdentityQuantizer
from .te_quantizers import Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer

__all__ = ["high_precision_factory", "delayed_scaling_factory", "current_scaling_factory",
           "float8_block_scaling_factory", "mxfp8_factory", "nvfp4_factory"]

_LINEAR = ("linear", "grouped_linear")


def _fields(factory: str, role) -> tuple:
    """(module_type, tensor_type) of `role`; None (TE's factories accept it: no role known) is
    ("", "")."""
    if role is None:
        return "", ""
    if not (hasattr(role, "module_type") and hasattr(role, "tensor_type")):
        raise TypeError(f"{factory}: role must be a QuantizerRole (module_type, tensor_type, name) or None, got "
                        f"{role!r} ({type(role).__name__}); CustomRecipe passes one, or build it as "
                        "te.QuantizerRole('linear', 'weight')")
    return role.module_type, role.tensor_type


def high_precision_factory(role: Optional[QuantizerRole]) -> IdentityQuantizer:
    """Every tensor in high precision: the layer's GEMMs as outside te.autocast."""
    _fields("high_precision_factory", role)
    return IdentityQuantizer()


def delayed_scaling_factory(role: Optional[QuantizerRole]):
    """Not supported: TE's factory returns a DelayedScalingRequest, for which TE allocates amax
    histories and scales shared with its delayed-scaling reduction; te-core has no such request."""
    _fields("delayed_scaling_factory", role)
    raise NotImplementedError(
        "delayed_scaling_factory: te-core does not provide Transformer Engine's DelayedScalingRequest (delayed "
        "scaling asked for from a CustomRecipe factory, with amax histories and scales the recipe keeps), so it "
        "cannot back this factory. Use the built-in recipe, te.autocast(recipe=DelayedScaling()) (HYBRID: E4M3 "
        "forward, E5M2 backward, as this factory), or current_scaling_factory for a CustomRecipe that scales each "
        "tensor by its own amax")


def current_scaling_factory(role: Optional[QuantizerRole]) -> Float8CurrentScalingQuantizer:
    """Float8CurrentScaling()'s quantizers: E5M2 for output gradients, E4M3 for the rest, each
    tensor scaled by its own amax."""
    _, tensor_type = _fields("current_scaling_factory", role)
    fp8_dtype = DType.kFloat8E5M2 if tensor_type == "grad_output" else DType.kFloat8E4M3
    return Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=False, amax_epsilon=0.0)


def float8_block_scaling_factory(role: Optional[QuantizerRole]) -> Float8BlockQuantizer:
    """Float8BlockScaling()'s quantizers: E4M3 everywhere, power-of-2 scales, 128x128 tiles for a
    linear layer's weight and 1x128 blocks for every other tensor."""
    module_type, tensor_type = _fields("float8_block_scaling_factory", role)
    weight = module_type in _LINEAR and tensor_type == "weight"
    return Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, amax_epsilon=0.0,
                                force_pow_2_scales=True, block_scaling_dim=2 if weight else 1)


def mxfp8_factory(role: Optional[QuantizerRole]) -> MXFP8Quantizer:
    """MXFP8BlockScaling()'s quantizers: E4M3 everywhere, an E8M0 scale per 32 elements."""
    _fields("mxfp8_factory", role)
    return MXFP8Quantizer(DType.kFloat8E4M3)


def nvfp4_factory(role: Optional[QuantizerRole]):
    """Not supported: te-core has no NVFP4 (FP4 E2M1) quantizer."""
    _fields("nvfp4_factory", role)
    raise NotImplementedError(
        "nvfp4_factory: NVFP4 (FP4 E2M1 block scaling) is not supported by te-core yet, so it has no NVFP4Quantizer "
        "to return. For block-scaled FP8 use mxfp8_factory (MXFP8BlockScaling's quantizers) or "
        "float8_block_scaling_factory (Float8BlockScaling's)")
