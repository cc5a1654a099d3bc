"""te_core.ops.attention_varlen through torch's FlashAttention-2 variable-length kernels
(torch.ops.aten._flash_attention_forward / _flash_attention_backward given the cumulative
sequence offsets): packed sequences run as they are, no padding is computed.

The kernels take GQA natively (kv heads are not repeated) and align the causal mask and the
sliding window to each sequence's bottom-right corner (query i sees up to key i + len_kv -
len_q). supports() declines, naming the reason, every call they would not compute as the
contract says, and the reference (which pads) runs it instead: float32 inputs, a head size
they lack, dropout, a bias, a top-left diagonal over sequences whose query and key lengths
differ, query rows that would see no key (the contract's zeros there are not the kernel's),
and GQA with max_seqlen_q == 1 (a kernel shortcut for decoding).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from te_core.ops.attention import CAUSAL_MASK_TYPES, PADDING_MASK_TYPES
from te_core.ops.attention_masks import diagonal_bottom_right, resolve_window
from te_core.ops.packed_sequences import host_readable

FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # FlashAttention-2's largest head size
MIN_CAPABILITY = (8, 0)  # FlashAttention-2 runs on Ampere and newer


def flash_window(attn_mask_type: str, window_size) -> Tuple[bool, Optional[int], Optional[int]]:
    """(is_causal, window_size_left, window_size_right) as the kernel takes them; None = unbounded."""
    left, right = resolve_window(attn_mask_type, window_size)
    return (attn_mask_type in CAUSAL_MASK_TYPES, None if left == math.inf else int(left),
            None if right == math.inf else int(right))


def _flash_forward(*args, **kwargs):
    """torch's FlashAttention-2 forward; its schema (torch 2.7 and later) returns out, the softmax
    logsumexp, the RNG state, an unused tensor and an empty debug mask."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def _flash_backward(*args, **kwargs):
    """torch's FlashAttention-2 backward: (dq, dk, dv)."""
    return torch.ops.aten._flash_attention_backward(*args, **kwargs)


class _FlashVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_kv, max_q: int, max_kv: int, scale: float, causal: bool,
                left: Optional[int], right: Optional[int]):
        out, lse, rng_state, unused, _ = _flash_forward(
            q, k, v, cu_q, cu_kv, max_q, max_kv, 0.0, causal, False,
            scale=scale, window_size_left=left, window_size_right=right)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_kv, rng_state, unused)
        ctx.options = (max_q, max_kv, scale, causal, left, right)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_kv, rng_state, unused = ctx.saved_tensors
        max_q, max_kv, scale, causal, left, right = ctx.options
        dq, dk, dv = _flash_backward(
            dout.contiguous(), q, k, v, out, lse, cu_q, cu_kv, max_q, max_kv, 0.0, causal, rng_state, unused,
            scale=scale, window_size_left=left, window_size_right=right)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, *, attn_mask_type="padding",
                     softmax_scale=None, dropout_p=0.0, window_size=None, bottom_right_diagonal=None,
                     core_attention_bias_type="no_bias", core_attention_bias=None, alibi_slopes=None):
    """te_core.ops.attention_varlen on the calls supports_attention_varlen accepts; differentiable."""
    causal, left, right = flash_window(attn_mask_type, window_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    cu_q, cu_kv = (cu.to(torch.int32).contiguous() for cu in (cu_seqlens_q, cu_seqlens_kv))
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _FlashVarlen.apply(q, k, v, cu_q, cu_kv, int(max_seqlen_q), int(max_seqlen_kv), scale, causal, left, right)


def _flash_available(device: torch.device) -> str:
    """Why torch's FlashAttention-2 cannot run on `device`, or ""."""
    built = getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)()
    if not built:
        return "this torch build has no FlashAttention kernels"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"FlashAttention-2 needs compute capability {MIN_CAPABILITY} or newer, this GPU has {capability}"
    return ""


def _tensor_reason(q, k, v, cu_seqlens_q, cu_seqlens_kv) -> str:
    """Why the kernels do not take these tensors, or ""."""
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_kv)
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        return "q, k, v and cu_seqlens are not all tensors on a CUDA device"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return "q, k, v must be 3-D (t, h, d)"
    if q.dtype not in FLASH_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"FlashAttention takes float16 or bfloat16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    d, hq, hkv = q.shape[-1], q.shape[1], k.shape[1]
    if k.shape[-1] != d or v.shape[-1] != d or d % 8 or d > MAX_HEAD_DIM:
        return (f"FlashAttention takes one head size for q, k, v, a multiple of 8 up to {MAX_HEAD_DIM}; got "
                f"{d}, {k.shape[-1]}, {v.shape[-1]}")
    if hkv == 0 or hq % hkv or v.shape[1] != hkv or v.shape[0] != k.shape[0]:
        return "k and v must agree and have a number of heads that divides q's"
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape != cu_seqlens_kv.shape or cu_seqlens_q.is_floating_point():
        return "cu_seqlens_q and cu_seqlens_kv must be 1-D integer offsets of one number of sequences"
    return _flash_available(q.device)


def _lengths_reason(cu_seqlens_q, cu_seqlens_kv, diagonal: Optional[str]) -> str:
    """Why the sequences' lengths keep the kernel from matching the contract, or "".
    diagonal: None (no causal mask nor window), "bottom_right" or "top_left"."""
    if cu_seqlens_q is cu_seqlens_kv:  # self-attention: equal lengths, every query sees a key
        return ""
    if not host_readable(cu_seqlens_q):
        return ("query and key offsets given apart cannot be compared under torch.compile or graph capture (the "
                "comparison reads them on the host); pass one tensor as both for self-attention")
    lengths_q, lengths_kv = cu_seqlens_q.diff(), cu_seqlens_kv.diff()
    if diagonal == "top_left":
        bad, reason = lengths_q != lengths_kv, ("a top-left diagonal over sequences whose query and key lengths "
                                                "differ (FlashAttention aligns it to the bottom right)")
    elif diagonal == "bottom_right":
        bad, reason = lengths_q > lengths_kv, ("a sequence with more queries than keys under a causal mask or "
                                               "window: its first queries see no key")
    else:
        bad, reason = (lengths_kv == 0) & (lengths_q > 0), "a sequence with queries but no keys"
    return reason if bool(bad.any()) else ""  # one host sync, on offsets of b + 1 integers


def supports_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None, *,
                              attn_mask_type="padding", softmax_scale=None, dropout_p=0.0, window_size=None,
                              bottom_right_diagonal=None, core_attention_bias_type="no_bias",
                              core_attention_bias=None, alibi_slopes=None, softmax_offset=None):
    reason = _tensor_reason(q, k, v, cu_seqlens_q, cu_seqlens_kv)
    if reason:
        return False, reason
    if attn_mask_type not in PADDING_MASK_TYPES:
        return False, f"attn_mask_type={attn_mask_type!r} is not a padding type"
    if core_attention_bias_type != "no_bias" or core_attention_bias is not None or alibi_slopes is not None:
        return False, f"core_attention_bias_type={core_attention_bias_type!r}: the varlen kernels take no bias"
    if dropout_p != 0.0:
        return False, "dropout_p > 0 (the varlen path runs without dropout)"
    if softmax_offset is not None:
        return False, "attention sinks (softmax_offset): the varlen kernels have no softmax offset"
    if max_seqlen_q is not None and int(max_seqlen_q) == 1 and q.shape[1] != k.shape[1]:
        # the kernel then regroups GQA queries as if every sequence held exactly one
        return False, "max_seqlen_q == 1 with GQA (the kernel's single-query regrouping assumes no empty sequence)"
    causal, left, right = flash_window(attn_mask_type, window_size)
    diagonal = None
    if causal or left is not None or right is not None:
        bottom_right = diagonal_bottom_right(attn_mask_type, bottom_right_diagonal)
        diagonal = "bottom_right" if bottom_right else "top_left"
    reason = _lengths_reason(cu_seqlens_q, cu_seqlens_kv, diagonal)
    return (False, reason) if reason else (True, "")
