"""The contract ops this backend runs natively, by family, and the one table that registers them.

Memory-bound families (cast, norm, activation, softmax, rope, loss, scaling) run te_triton
kernels with this GPU's tuning configs (te_backend_cuda.configs); GEMMs run cuBLASLt/cuBLAS
(scaled_mm), attention cuDNN through SDPA (attention) and packed sequences FlashAttention-2's
varlen kernels (attention_varlen), Adam torch's fused kernels (optimizer).
Each op's supports() declines (so the reference runs) what its kernel does not take.
Tensor-wise casts and GEMMs (traced), block casts (traced_block), norms, activations, their
backward epilogues and rotary embeddings (traced_fused) also have plain-torch twins that
torch.compile traces instead of the opaque op.

The op functions are importable by their contract names (`ops.quantize_fp8`, ...); they launch
on the current device, while the registered ones launch on their tensors' device.
"""
from __future__ import annotations

from typing import Dict

from te_core.backend.types import OpImpl

from .. import attention, attention_varlen, optimizer, scaled_mm
from ..traced import TRACED
from ..traced_block import TRACED_BLOCK
from ..traced_fused import TRACED_FUSED
from . import activation, cast, loss, norm, rope, scaling, softmax
from .activation import (activation_bwd, activation_bwd_dbias_cast_transpose, activation_fwd, dbias,
                         dbias_cast_transpose, dbias_cast_transpose_blockwise, dbias_cast_transpose_current,
                         dbias_cast_transpose_parts)
from .cast import (cast_transpose_fp8, dequantize_blockwise, dequantize_fp8, dequantize_mxfp8, quantize_blockwise,
                   quantize_fp8, quantize_fp8_current, quantize_mxfp8, transpose_fp8)
from .launch import on_device
from .loss import cross_entropy
from .norm import layernorm_bwd, layernorm_bwd_add, layernorm_fwd, rmsnorm_bwd, rmsnorm_bwd_add, rmsnorm_fwd
from .rope import rope_bwd, rope_fwd
from .scaling import delayed_scaling_update
from .softmax import softmax_bwd, softmax_fwd

__all__ = ["native_ops", "activation_bwd", "activation_bwd_dbias_cast_transpose", "activation_fwd", "dbias",
           "dbias_cast_transpose", "dbias_cast_transpose_blockwise", "dbias_cast_transpose_current",
           "dbias_cast_transpose_parts", "cast_transpose_fp8",
           "dequantize_blockwise", "dequantize_fp8", "dequantize_mxfp8", "quantize_blockwise", "quantize_fp8", "quantize_fp8_current",
           "quantize_mxfp8", "transpose_fp8",
           "cross_entropy", "layernorm_bwd", "layernorm_bwd_add", "layernorm_fwd", "rmsnorm_bwd", "rmsnorm_bwd_add",
           "rmsnorm_fwd", "rope_bwd", "rope_fwd", "delayed_scaling_update", "softmax_bwd", "softmax_fwd"]

# op name -> (function, supports); these launch inside a guard for their first tensor's device
_ON_TENSOR_DEVICE = {
    "quantize_fp8": (quantize_fp8, cast.cast_ok),
    "cast_transpose_fp8": (cast_transpose_fp8, cast.cast_2d_ok),
    "quantize_fp8_current": (quantize_fp8_current, cast.current_ok),
    "transpose_fp8": (transpose_fp8, cast.transpose_ok),
    "quantize_blockwise": (quantize_blockwise, cast.blockwise_ok),
    "dequantize_fp8": (dequantize_fp8, cast.dequantize_ok),
    "dequantize_blockwise": (dequantize_blockwise, cast.dequantize_blockwise_ok),
    "quantize_mxfp8": (quantize_mxfp8, cast.mxfp8_ok),
    "dequantize_mxfp8": (dequantize_mxfp8, cast.dequantize_mxfp8_ok),
    "layernorm_fwd": (layernorm_fwd, norm.norm_fwd_ok),
    "rmsnorm_fwd": (rmsnorm_fwd, norm.norm_fwd_ok),
    "layernorm_bwd": (layernorm_bwd, norm.layernorm_bwd_ok),
    "rmsnorm_bwd": (rmsnorm_bwd, norm.rmsnorm_bwd_ok),
    "layernorm_bwd_add": (layernorm_bwd_add, norm.layernorm_bwd_add_ok),
    "rmsnorm_bwd_add": (rmsnorm_bwd_add, norm.rmsnorm_bwd_add_ok),
    "activation_fwd": (activation_fwd, activation.act_fwd_ok),
    "activation_bwd": (activation_bwd, activation.act_bwd_ok),
    "dbias": (dbias, activation.dbias_ok),
    "dbias_cast_transpose": (dbias_cast_transpose, activation.dbias_ct_ok),
    "activation_bwd_dbias_cast_transpose": (activation_bwd_dbias_cast_transpose, activation.act_bwd_dbias_ct_ok),
    "softmax_fwd": (softmax_fwd, softmax.softmax_fwd_ok),
    "softmax_bwd": (softmax_bwd, softmax.softmax_bwd_ok),
    "rope_fwd": (rope_fwd, rope.rope_ok),
    "rope_bwd": (rope_bwd, rope.rope_ok),
    "cross_entropy": (cross_entropy, loss.cross_entropy_ok),
}

# op name -> (function, supports); these take lists or guard themselves
_AS_THEY_ARE = {
    "delayed_scaling_update": (delayed_scaling_update, scaling.scaling_ok),
    "dbias_cast_transpose_parts": (dbias_cast_transpose_parts, activation.dbias_ct_parts_ok),
    "dbias_cast_transpose_current": (dbias_cast_transpose_current, activation.dbias_ct_self_scaled_ok),
    "dbias_cast_transpose_blockwise": (dbias_cast_transpose_blockwise, activation.dbias_ct_self_scaled_ok),
    "gemm_fp8": (scaled_mm.gemm_fp8, scaled_mm.supports_gemm_fp8),
    "gemm": (scaled_mm.gemm, scaled_mm.supports_gemm),
    "attention": (attention.attention, attention.supports_attention),
    "attention_varlen": (attention_varlen.attention_varlen, attention_varlen.supports_attention_varlen),
    "multi_tensor_adam": (optimizer.multi_tensor_adam, optimizer.supports_multi_tensor_adam),
}


def native_ops() -> Dict[str, OpImpl]:
    """op name -> OpImpl for every op this backend runs natively."""
    twins = {**TRACED, **TRACED_FUSED, **TRACED_BLOCK}
    impls = {name: OpImpl(on_device(fn), supports, twins.get(name))
             for name, (fn, supports) in _ON_TENSOR_DEVICE.items()}
    impls.update((name, OpImpl(fn, supports, twins.get(name))) for name, (fn, supports) in _AS_THEY_ARE.items())
    return impls
