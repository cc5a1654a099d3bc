"""Functions of Transformer Engine's extension (`transformer_engine_torch`, which TE's
`pytorch.cpp_extensions` re-exports) that ported code calls directly, on te-core's op contract:
rmsnorm_fwd (Megatron-LM's inference layers normalize with it) and dequantize. Their arguments,
results and conventions are TE's bindings'; the math is te_core.ops' (float32 statistics).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from .. import ops
from ..dtype import DType
from ..quantization.tensor import QuantizedTensor

_HIGH_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def _output_dtype(otype, caller: str) -> torch.dtype:
    dtype = DType.cast(otype).torch_dtype
    if dtype not in _HIGH_PRECISION:
        raise ValueError(f"{caller}: otype must be a high-precision DType (kFloat32, kFloat16, kBFloat16), got "
                         f"{DType.cast(otype).name}; pass a quantizer for an FP8 output")
    return dtype


def _check_rmsnorm(input, weight, eps, sm_margin, zero_centered_gamma) -> None:
    caller = "rmsnorm_fwd"
    if not isinstance(input, Tensor) or isinstance(input, QuantizedTensor) or input.dtype not in _HIGH_PRECISION \
            or input.dim() < 1:
        got = f"a {input.dim()}-D {type(input).__name__} of {input.dtype}" if isinstance(input, Tensor) else \
            type(input).__name__
        raise TypeError(f"{caller}: input must be a float32, float16 or bfloat16 torch.Tensor (not quantized), "
                        f"got {got}")
    if not isinstance(weight, Tensor) or isinstance(weight, QuantizedTensor) or weight.dim() != 1 \
            or weight.numel() != input.shape[-1] or not weight.is_floating_point():
        got = f"shape {tuple(weight.shape)}" if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"{caller}: weight must be a high-precision 1-D tensor of input's last dimension "
                         f"({input.shape[-1]}), got {got}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"{caller}: eps must be a number >= 0, got {eps!r}")
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int) or sm_margin < 0:
        raise ValueError(f"{caller}: sm_margin must be an int >= 0 (multiprocessors left to other kernels), "
                         f"got {sm_margin!r}")
    if not isinstance(zero_centered_gamma, bool):
        raise TypeError(f"{caller}: zero_centered_gamma must be a bool, got {type(zero_centered_gamma).__name__}")


def _written(y: Tensor, out: Tensor, otype: torch.dtype) -> Tensor:
    if not isinstance(out, Tensor) or isinstance(out, QuantizedTensor) or out.shape != y.shape or out.dtype != otype:
        got = f"{type(out).__name__} of shape {tuple(out.shape)} and {out.dtype}" if isinstance(out, Tensor) else \
            type(out).__name__
        raise ValueError(f"rmsnorm_fwd: ln_out must be a plain tensor of input's shape {tuple(y.shape)} in otype "
                         f"({otype}) without a quantizer, got a {got}; pass ln_out=None for a new tensor")
    return out.copy_(y)


def rmsnorm_fwd(input: Tensor, weight: Tensor, eps: float, ln_out: Optional[Tensor], quantizer, otype,
                sm_margin: int, zero_centered_gamma: bool) -> List[Optional[Tensor]]:
    """RMSNorm of `input` over its last dimension, as Transformer Engine's binding returns it:
    [output, None, rsigma], rsigma the float32 1 / sqrt(mean(x^2) + eps) of each of the input's
    rows (input.numel() / input.shape[-1] of them). The output has input's shape, in `otype`, or
    quantized by `quantizer` (one of transformer_engine.pytorch's quantizer classes: computed in
    otype, then cast) into `ln_out` where given, else a new tensor. `sm_margin` (multiprocessors
    left free) has no meaning for te-core's ops and is only checked."""
    _check_rmsnorm(input, weight, eps, sm_margin, zero_centered_gamma)
    dtype = _output_dtype(otype, "rmsnorm_fwd")
    if quantizer is not None and not callable(getattr(quantizer, "update_quantized", None)):
        raise TypeError(f"rmsnorm_fwd: quantizer must be None or a quantizer of transformer_engine.pytorch "
                        f"(Float8Quantizer, Float8CurrentScalingQuantizer, Float8BlockQuantizer, MXFP8Quantizer), got "
                        f"{type(quantizer).__name__}")
    # float32 in: the op computes in float32 and then rounds once, straight to otype
    y, rstd, _ = ops.rmsnorm_fwd(input if input.dtype == dtype else input.float(), weight, float(eps),
                                 zero_centered_gamma=zero_centered_gamma)
    y = y.to(dtype)
    rsigma = rstd.reshape(-1)
    if quantizer is not None:
        return [quantizer.quantize(y, out=ln_out), None, rsigma]
    return [y if ln_out is None else _written(y, ln_out, dtype), None, rsigma]


def dequantize(input: QuantizedTensor, otype) -> Tensor:
    """A quantized tensor's values in `otype` (DType.kFloat32, kFloat16 or kBFloat16) as a new
    tensor, as Transformer Engine's binding returns them."""
    dtype = _output_dtype(otype, "dequantize")
    if not isinstance(input, QuantizedTensor):
        raise TypeError(f"dequantize: input must be a quantized tensor (Float8Tensor, MXFP8Tensor, "
                        f"Float8BlockwiseQTensor), got a {type(input).__name__}; a plain tensor needs only .to(dtype)")
    return input.dequantize(dtype)
