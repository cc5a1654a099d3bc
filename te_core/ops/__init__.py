"""The op contract: every op a backend may implement, grouped by family.

Calling an op (`te_core.ops.gemm_fp8(...)`) runs the selected backend's implementation, or
the reference one where the backend lacks it or declines the call. Each op's signature and
docstring in its family module is its specification; `CONTRACT` maps names to ops.
"""
from ._library import register_all
from ._spec import CONTRACT, Op
from .activation import (
    ACTIVATIONS,
    GATED_ACTIVATIONS,
    activation_bwd,
    activation_bwd_dbias_cast_transpose,
    activation_fwd,
    dbias,
    dbias_cast_transpose,
    dbias_cast_transpose_blockwise,
    dbias_cast_transpose_current,
    dbias_cast_transpose_parts,
)
from .attention import ATTN_MASK_TYPES, attention, attention_varlen
from .cast import (
    cast_transpose_fp8,
    dequantize_blockwise,
    dequantize_fp8,
    dequantize_mxfp8,
    quantize_blockwise,
    quantize_fp8,
    quantize_fp8_current,
    quantize_mxfp8,
    transpose_fp8,
)
from .gemm import gemm, gemm_fp8
from .loss import cross_entropy
from .norm import layernorm_bwd, layernorm_bwd_add, layernorm_fwd, rmsnorm_bwd, rmsnorm_bwd_add, rmsnorm_fwd
from .optimizer import multi_tensor_adam
from .rope import rope_bwd, rope_fwd
from .scaling import delayed_scaling_update
from .softmax import softmax_bwd, softmax_fwd

register_all(CONTRACT)  # the torch.library twins torch.compile records (te_core.ops._library)

FAMILIES = ("cast", "gemm", "norm", "activation", "softmax", "rope", "attention", "loss", "optimizer", "scaling")

__all__ = ["CONTRACT", "Op", "FAMILIES", "ACTIVATIONS", "GATED_ACTIVATIONS", "ATTN_MASK_TYPES", *CONTRACT]
