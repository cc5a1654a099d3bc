"""te-core modules: Transformer Engine's layers (class names, constructor arguments, parameter
names and forward signatures as in Transformer Engine), built on the registry ops."""

from ._base import init_quantization_state
from ._te_base import TransformerEngineBaseModule
from .attention import DotProductAttention
from .checkpoint import checkpoint, checkpoint_context
from .fp8_padding import Fp8Padding, Fp8Unpadding
from .grouped_linear import GroupedLinear
from .inference import InferenceParams
from .layernorm import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .multihead_attention import MultiheadAttention
from .rope import RotaryPositionEmbedding, apply_fused_qkv_rotary_pos_emb, apply_rotary_pos_emb
from .transformer_layer import TransformerLayer

__all__ = [
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "GroupedLinear",
    "Fp8Padding",
    "Fp8Unpadding",
    "LayerNorm",
    "RMSNorm",
    "DotProductAttention",
    "InferenceParams",
    "MultiheadAttention",
    "TransformerLayer",
    "RotaryPositionEmbedding",
    "apply_rotary_pos_emb",
    "apply_fused_qkv_rotary_pos_emb",
    "checkpoint",
    "checkpoint_context",
    "init_quantization_state",
    "TransformerEngineBaseModule",
]
