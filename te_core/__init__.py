"""te-core: a multi-vendor Transformer Engine for PyTorch.

`import te_core as te` gives the names Transformer Engine users know (`te.Linear`,
`te.autocast`, `te.recipe.DelayedScaling`, ...); vendor backends plug in through the registry
in te_core.backend, and every computation runs through the op contract in te_core.ops.
"""
__version__ = "0.1.0"

from . import _torch_fixes

_torch_fixes.apply()

from . import ops, optimizers, recipe
from .recipe import is_nvfp4_available
from .backend import get_backend, list_backends, set_backend
from .dtype import DType
from .compat.transformer_engine import install_as_transformer_engine
from .convert import convert_model
from .cpu_offload import ManualOffloadSynchronizer, get_cpu_offload_context, mark_not_offload
from .cross_entropy import parallel_cross_entropy
from .device_queries import get_cudnn_version, get_device_compute_capability
from .export import onnx_export
from .distributed import CudaRNGStatesTracker
from .graphs import make_graphed_callables
from .host_threads import pin_host_threads
from .permutation import (
    moe_permute,
    moe_permute_and_pad_with_probs,
    moe_permute_with_probs,
    moe_sort_chunks_by_index,
    moe_sort_chunks_by_index_with_probs,
    moe_unpermute,
)
from .modules import (
    DotProductAttention,
    Fp8Padding,
    Fp8Unpadding,
    GroupedLinear,
    InferenceParams,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    MultiheadAttention,
    RMSNorm,
    RotaryPositionEmbedding,
    TransformerLayer,
    apply_fused_qkv_rotary_pos_emb,
    apply_rotary_pos_emb,
    checkpoint,
    checkpoint_context,
    init_quantization_state,
)
from .quantization import (
    Float8BlockwiseTensor,
    Float8Tensor,
    MXFP8Tensor,
    QuantizedTensor,
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_default_recipe,
    is_bf16_available,
    is_fp8_available,
    is_fp8_block_scaling_available,
    is_mxfp8_available,
    quantized_model_init,
)
from .quantization.custom import QuantizerRole
# Transformer Engine's quantizer classes and constructors (te_core.quantization's classes of these
# names are te-core's role-based ones, which recipes build)
from .quantization.te_quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
)
from .quantization.identity import IdentityQuantizer, IdentityTensor
from .quantization.hybrid import HybridQuantizedTensor, HybridQuantizer

__all__ = [
    "__version__", "ops", "optimizers", "recipe", "get_backend", "set_backend", "list_backends", "convert_model",
    "make_graphed_callables", "install_as_transformer_engine", "pin_host_threads",
    "Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "Fp8Padding", "Fp8Unpadding", "LayerNorm", "RMSNorm", "DotProductAttention",
    "InferenceParams",
    "MultiheadAttention", "TransformerLayer", "RotaryPositionEmbedding", "apply_rotary_pos_emb",
    "apply_fused_qkv_rotary_pos_emb", "checkpoint",
    "checkpoint_context", "init_quantization_state", "autocast", "fp8_autocast", "quantized_model_init", "fp8_model_init",
    "get_default_recipe", "is_bf16_available", "is_fp8_available",
    "is_fp8_block_scaling_available", "is_mxfp8_available", "is_nvfp4_available",
    "Float8Tensor", "Float8BlockwiseTensor", "MXFP8Tensor", "QuantizedTensor",
    "moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
    "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs", "parallel_cross_entropy",
    "CudaRNGStatesTracker", "get_cpu_offload_context", "mark_not_offload", "ManualOffloadSynchronizer",
    "DType", "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8BlockQuantizer", "MXFP8Quantizer",
    "IdentityQuantizer", "IdentityTensor", "HybridQuantizer", "HybridQuantizedTensor",
    "QuantizerRole",
    "get_device_compute_capability", "get_cudnn_version", "onnx_export",
]
