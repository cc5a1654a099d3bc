"""te.DotProductAttention: softmax(q k^T * scale + mask) v over heads, through ops.attention."""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .. import ops
from ._common import (
    HP_DTYPES,
    reject_unsupported,
    check_choice,
    check_divisible,
    check_positive,
    compute_dtype,
    no_torch_autocast,
)

QKV_FORMATS = ("sbhd", "bshd")
PADDING_MASKS = ("padding", "padding_causal")


class DotProductAttention(nn.Module):
    """Attention core with Transformer Engine's constructor and forward signature.

    q is (s, b, h, d) for qkv_format "sbhd" or (b, s, h, d) for "bshd"; k and v have
    num_gqa_groups heads. Returns (s, b, h * dv) or (b, s, h * dv). Attention runs in the
    inputs' (or torch.autocast's) precision; it is not quantized to FP8.
    """

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, Tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        tp_group=None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        softmax_scale: Optional[float] = None,
        **kwargs,
    ):
        super().__init__()
        name = "DotProductAttention"
        reject_unsupported(
            name,
            sequence_parallel=sequence_parallel,
            tp_size=tp_size,
            get_rng_state_tracker=get_rng_state_tracker,
            tp_group=tp_group,
            **kwargs,
        )
        self.num_attention_heads = check_positive(num_attention_heads, name="num_attention_heads", module=name)
        self.num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        check_positive(self.num_gqa_groups, name="num_gqa_groups", module=name)
        check_divisible(
            num_attention_heads, self.num_gqa_groups, what="num_attention_heads", by="num_gqa_groups", module=name
        )
        k_ch, v_ch = (kv_channels, kv_channels) if isinstance(kv_channels, int) else tuple(kv_channels)
        self.hidden_size_per_attention_head_k = check_positive(k_ch, name="kv_channels", module=name)
        self.hidden_size_per_attention_head_v = check_positive(v_ch, name="kv_channels", module=name)
        if not 0.0 <= attention_dropout < 1.0:
            raise ValueError(f"{name}: attention_dropout must be in [0, 1), got {attention_dropout!r}")
        if window_size not in (None, (-1, -1), (-1, 0)):
            raise NotImplementedError(f"{name}: sliding window attention (window_size={window_size}) is not supported")
        self.attention_dropout = float(attention_dropout)
        self.qkv_format = check_choice(qkv_format, QKV_FORMATS, name="qkv_format", module=name)
        self.attn_mask_type = check_choice(attn_mask_type, ops.ATTN_MASK_TYPES, name="attn_mask_type", module=name)
        self.softmax_scale = 1.0 / math.sqrt(k_ch) if softmax_scale is None else float(softmax_scale)
        self.layer_number = layer_number
        self.attention_type = attention_type

    def forward(
        self,
        query_layer: Tensor,
        key_layer: Tensor,
        value_layer: Tensor,
        attention_mask: Union[None, Tensor, Tuple[Tensor, Tensor]] = None,
        qkv_format: Optional[str] = None,
        attn_mask_type: Optional[str] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[Tensor] = None,
        **kwargs,
    ) -> Tensor:
        name = "DotProductAttention"
        fmt = check_choice(qkv_format or self.qkv_format, QKV_FORMATS, name="qkv_format", module=name)
        mask_type = check_choice(
            attn_mask_type or self.attn_mask_type, ops.ATTN_MASK_TYPES, name="attn_mask_type", module=name
        )
        if core_attention_bias_type != "no_bias" or core_attention_bias is not None:
            raise NotImplementedError(f"{name}: core_attention_bias_type={core_attention_bias_type!r} is not supported")
        q, k, v = (
            self._to_bhsd(t, arg, fmt)
            for t, arg in ((query_layer, "query_layer"), (key_layer, "key_layer"), (value_layer, "value_layer"))
        )
        self._check_heads(q, k, v)
        mask = self._check_mask(attention_mask, mask_type, q, k)
        dtype = compute_dtype(query_layer)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        dropout_p = self.attention_dropout if self.training else 0.0
        with no_torch_autocast(q.device.type):
            out = _core_attention(q, k, v, mask_type, mask, self.softmax_scale, dropout_p, checkpoint_core_attention)
        b, h, s, dv = out.shape
        if fmt == "sbhd":
            return out.permute(2, 0, 1, 3).reshape(s, b, h * dv)
        return out.permute(0, 2, 1, 3).reshape(b, s, h * dv)

    @staticmethod
    def _to_bhsd(t: Tensor, arg: str, fmt: str) -> Tensor:
        if not isinstance(t, Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"DotProductAttention: {arg} must be 4-D ({fmt}), got shape {shape}")
        if t.dtype not in HP_DTYPES:
            raise TypeError(f"DotProductAttention: {arg} has dtype {t.dtype}; expected float32, bfloat16 or float16")
        return t.permute(1, 2, 0, 3) if fmt == "sbhd" else t.permute(0, 2, 1, 3)

    def _check_heads(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        name = "DotProductAttention"
        d_k = self.hidden_size_per_attention_head_k
        if q.shape[1] != self.num_attention_heads or q.shape[3] != d_k:
            raise ValueError(
                f"{name}: query_layer has {q.shape[1]} heads of size {q.shape[3]}; expected "
                f"num_attention_heads={self.num_attention_heads} heads of kv_channels={d_k}"
            )
        for t, arg, d in (
            (k, "key_layer", self.hidden_size_per_attention_head_k),
            (v, "value_layer", self.hidden_size_per_attention_head_v),
        ):
            if t.shape[1] != self.num_gqa_groups or t.shape[3] != d:
                raise ValueError(
                    f"{name}: {arg} has {t.shape[1]} heads of size {t.shape[3]}; expected "
                    f"num_gqa_groups={self.num_gqa_groups} heads of size {d}"
                )
        if k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"{name}: batch / sequence sizes of query_layer, key_layer, value_layer do not agree")

    @staticmethod
    def _check_mask(mask, mask_type: str, q: Tensor, k: Tensor) -> Optional[Tensor]:
        name = "DotProductAttention"
        if isinstance(mask, (tuple, list)):  # (query mask, key/value mask): keys decide what is attended
            mask = mask[1]
        needs_mask = mask_type in PADDING_MASKS or mask_type == "arbitrary"
        if not needs_mask:
            return None
        if mask is None:
            raise ValueError(f"{name}: attn_mask_type={mask_type!r} needs attention_mask (bool, True = masked out)")
        if mask.dtype != torch.bool:
            raise TypeError(f"{name}: attention_mask must be a bool tensor (True = masked out), got {mask.dtype}")
        b, sk = q.shape[0], k.shape[2]
        if mask_type in PADDING_MASKS and tuple(mask.shape) != (b, 1, 1, sk):
            raise ValueError(
                f"{name}: a padding attention_mask must have shape {(b, 1, 1, sk)}, got {tuple(mask.shape)}"
            )
        return mask


def _core_attention(q, k, v, mask_type, mask, scale, dropout_p, checkpoint) -> Tensor:
    def run(q, k, v):
        return ops.attention(
            q, k, v, attn_mask_type=mask_type, attention_mask=mask, softmax_scale=scale, dropout_p=dropout_p
        )

    if checkpoint and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(run, q, k, v, use_reentrant=False)
    return run(q, k, v)
