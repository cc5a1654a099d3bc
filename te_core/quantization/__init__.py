"""Device-independent quantization: recipes -> quantizers -> quantized tensors, scaling state,
autocast, and the GEMM helpers modules use. Every computation runs through te_core.ops."""
from .autocast import (
    AutocastContext,
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_align_size_for_quantization,
    get_autocast_context,
    get_default_recipe,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    quantized_model_init,
)
from ..recipe import is_nvfp4_available
from .block_tensor import Float8BlockwiseTensor, MXFP8Tensor
from .float8_tensor import Float8Tensor
from .gemm import check_gemm_dims, dgrad_gemm, fprop_gemm, keep_columnwise, quantized_gemm, wgrad_gemm
from .quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    Quantizer,
)
from .roles import BACKWARD, FORWARD, QuantizerSlot, Role, gemm_slots
from .scaling import ScalingGroup, flush_backward_updates
from .step import CalibrationStep, HighPrecisionStep, QuantizationStep
from .tensor import GemmOperand, QuantizedTensor

__all__ = [
    "AutocastContext", "autocast", "fp8_autocast", "fp8_model_init", "get_autocast_context", "get_default_recipe",
    "get_align_size_for_quantization",
    "is_bf16_available", "is_fp8_available",
    "is_fp8_block_scaling_available", "is_mxfp8_available", "is_nvfp4_available", "quantized_model_init",
    "Float8BlockwiseTensor", "MXFP8Tensor", "Float8Tensor", "QuantizedTensor", "GemmOperand",
    "check_gemm_dims", "keep_columnwise", "dgrad_gemm", "fprop_gemm", "quantized_gemm", "wgrad_gemm",
    "Quantizer", "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8BlockQuantizer", "MXFP8Quantizer",
    "Role", "QuantizerSlot", "gemm_slots", "FORWARD", "BACKWARD", "ScalingGroup", "flush_backward_updates",
    "HighPrecisionStep", "CalibrationStep", "QuantizationStep",
]
