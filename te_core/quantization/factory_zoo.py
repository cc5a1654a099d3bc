"""Transformer Engine's mixed-precision quantizer factories (its `custom_recipes.quantizer_factory_zoo`):
CustomRecipe factories that give a layer's forward and backward GEMMs different formats through
HybridQuantizer, e.g. MXFP8 forward with a high-precision backward.

    CustomRecipe(qfactory=mxfp8_fwd_high_precision_bwd_factory)  # MXFP8BlockScaling(backward_override="dequantized")

Each factory makes, per role, the choices TE's makes. Where TE's choice for a role is NVFP4 (or
a DelayedScalingRequest), which te-core cannot back, asking for that role raises
NotImplementedError naming what to use instead rather than quantizing another way; the roles for
which TE chooses a format te-core has get it, as in TE.
"""
from __future__ import annotations

from typing import Optional

from ..dtype import DType
from .custom import QuantizerRole
from .factories import _fields, mxfp8_factory
from .hybrid import HybridQuantizer
from .identity import IdentityQuantizer
from .te_quantizers import Float8CurrentScalingQuantizer

__all__ = ["high_precision_fwd_mxfp8_bwd_factory", "mxfp8_fwd_nvfp4_bwd_factory", "nvfp4_1d_weight_factory",
           "mxfp8_fwd_high_precision_bwd_factory", "nvfp4_row_scaled_fwd_mxfp8_bwd_factory",
           "nvfp4_row_scaled_fwd_high_precision_bwd_factory", "nvfp4_linear_fp8_dpa_factory"]

_LINEAR = ("linear", "grouped_linear")


def _no_nvfp4(factory: str, role, what: str, instead: str):
    raise NotImplementedError(
        f"{factory}: Transformer Engine's factory quantizes {what} with NVFP4 (FP4 E2M1 block scaling) for role "
        f"{role!r}, which te-core does not support yet, so it cannot back this factory. Use {instead} "
        "(te_core.quantization.factory_zoo / factories, TE's custom_recipes modules)")


def high_precision_fwd_mxfp8_bwd_factory(role: Optional[QuantizerRole]):
    """High-precision forward, MXFP8 backward: a linear layer's grad_output is MXFP8; every other
    tensor is read in high precision by the forward GEMM and as MXFP8 (cast from the original
    tensor) by the backward GEMMs."""
    module_type, tensor_type = _fields("high_precision_fwd_mxfp8_bwd_factory", role)
    if module_type in _LINEAR and tensor_type == "grad_output":
        return mxfp8_factory(role)
    return HybridQuantizer(rowwise_quantizer=IdentityQuantizer(), columnwise_quantizer=mxfp8_factory(role))


def mxfp8_fwd_high_precision_bwd_factory(role: Optional[QuantizerRole]):
    """MXFP8 forward, high-precision backward (TE's linear-layer counterpart of
    backward_override="dequantized"): a linear layer's input and weight are MXFP8 for the forward
    GEMM and, for the backward, the high-precision values of that MXFP8 cast; its grad_output stays
    in high precision; other roles are MXFP8."""
    module_type, tensor_type = _fields("mxfp8_fwd_high_precision_bwd_factory", role)
    if module_type in _LINEAR and tensor_type in ("input", "weight"):
        return HybridQuantizer(rowwise_quantizer=mxfp8_factory(role), columnwise_quantizer=IdentityQuantizer(),
                               columnwise_source="rowwise_dequantized")
    if module_type in _LINEAR and tensor_type == "grad_output":
        return IdentityQuantizer()
    return mxfp8_factory(role)


def mxfp8_fwd_nvfp4_bwd_factory(role: Optional[QuantizerRole]):
    """MXFP8 forward, NVFP4 backward. Not supported for linear roles (te-core has no NVFP4);
    other roles are MXFP8, as in TE."""
    module_type, _ = _fields("mxfp8_fwd_nvfp4_bwd_factory", role)
    if module_type in _LINEAR:
        _no_nvfp4("mxfp8_fwd_nvfp4_bwd_factory", role, "a linear layer's backward operands",
                  "mxfp8_factory (MXFP8 in both directions) or mxfp8_fwd_high_precision_bwd_factory (MXFP8 forward, "
                  "high-precision backward)")
    return mxfp8_factory(role)


def nvfp4_1d_weight_factory(role: Optional[QuantizerRole]):
    """NVFP4 with 1D weight scaling. Not supported: every role is NVFP4 in TE."""
    _fields("nvfp4_1d_weight_factory", role)
    _no_nvfp4("nvfp4_1d_weight_factory", role, "every tensor",
              "mxfp8_factory (MXFP8BlockScaling's quantizers) or float8_block_scaling_factory (Float8BlockScaling's)")


def nvfp4_row_scaled_fwd_mxfp8_bwd_factory(role: Optional[QuantizerRole]):
    """Row-scaled NVFP4 forward, MXFP8 backward for GroupedLinear's input and weight. Those two
    roles are not supported (te-core has no NVFP4); every other role, a plain Linear's included, is
    MXFP8 in TE and here."""
    module_type, tensor_type = _fields("nvfp4_row_scaled_fwd_mxfp8_bwd_factory", role)
    if module_type == "grouped_linear" and tensor_type in ("input", "weight"):
        _no_nvfp4("nvfp4_row_scaled_fwd_mxfp8_bwd_factory", role, "a GroupedLinear's forward input and weight",
                  "mxfp8_factory (MXFP8 in both directions, as this factory's other roles) or "
                  "high_precision_fwd_mxfp8_bwd_factory")
    return mxfp8_factory(role)


def nvfp4_row_scaled_fwd_high_precision_bwd_factory(role: Optional[QuantizerRole]):
    """Row-scaled NVFP4 forward, high-precision backward. Not supported except for a linear
    layer's grad_output (high precision, as in TE): every other role is NVFP4 in TE."""
    module_type, tensor_type = _fields("nvfp4_row_scaled_fwd_high_precision_bwd_factory", role)
    if module_type in _LINEAR and tensor_type == "grad_output":
        return IdentityQuantizer()
    _no_nvfp4("nvfp4_row_scaled_fwd_high_precision_bwd_factory", role, "the forward operands",
              "mxfp8_fwd_high_precision_bwd_factory (MXFP8 forward, the same high-precision backward)")


def nvfp4_linear_fp8_dpa_factory(role: Optional[QuantizerRole]):
    """NVFP4 for linear layers, FP8 for DotProductAttention (CustomRecipe(fp8_dpa=True), which
    te-core does not support). Attention roles TE scales per tensor get its Float8CurrentScaling
    quantizers (E5M2 for the backward's); S and dP (TE's DelayedScalingRequest) and every linear
    role (NVFP4) are refused."""
    module_type, tensor_type = _fields("nvfp4_linear_fp8_dpa_factory", role)
    name = getattr(role, "name", "") or ""
    is_dpa = module_type == "dpa"
    is_boundary = role is not None and not module_type and ("dpa_output" in name or "dpa_grad_input" in name)
    if is_dpa and tensor_type in ("s", "dp"):
        raise NotImplementedError(
            f"nvfp4_linear_fp8_dpa_factory: Transformer Engine's factory asks for delayed scaling "
            f"(DelayedScalingRequest) for attention role {role!r}, which te-core does not provide; te-core does not "
            "quantize DotProductAttention from a CustomRecipe (fp8_dpa) either, so run attention in high precision")
    if is_dpa or is_boundary:
        backward = (is_dpa and tensor_type in ("do", "dp", "dqkv")) or (is_boundary and "dpa_grad_input" in name)
        return Float8CurrentScalingQuantizer(DType.kFloat8E5M2 if backward else DType.kFloat8E4M3)
    _no_nvfp4("nvfp4_linear_fp8_dpa_factory", role, "the linear layers",
              "mxfp8_factory or current_scaling_factory for the linear layers (attention stays in high precision: "
              "te-core does not support fp8_dpa)")
