"""te_core.ops.attention through torch's scaled_dot_product_attention, cuDNN first.

TE_CUDA_ATTENTION_BACKEND=cudnn|flash|efficient|math picks the preferred SDPA kernel (default
cudnn); the others follow as fallbacks, so a call the preferred one cannot run (a mask flash
does not take, a head size cuDNN lacks) still runs. Plain causal attention with sq == sk runs
as SDPA's is_causal; every other mask (padding, bottom-right causal, sliding window, arbitrary)
is built by te_core.ops.attention_masks, the same code the reference uses, and passed as an
explicit mask. Bias types ride on SDPA's float mask, which SDPA adds after scaling: post-scale
bias and ALiBi as they are, a pre-scale bias multiplied by the scale. Query rows with every
key masked are computed unmasked and then zeroed, which keeps NaN out of both passes.
Attention sinks (softmax_offset) are one more key and value of zeros whose float-mask column
holds the offset. supports() declines a bias or an offset that needs a gradient (not every SDPA
kernel returns one).
"""
from __future__ import annotations

import math
import os
from typing import List, Optional

import torch
import torch.nn.functional as F
from te_core.ops.attention import ATTN_MASK_TYPES, BIAS_TYPES
from te_core.ops.attention_masks import (
    alibi_bias,
    check_bias,
    check_padding,
    check_softmax_offset,
    diagonal_bottom_right,
    diagonal_shift,
    masked_keys,
    resolve_window,
)

ORDER = ("cudnn", "flash", "efficient", "math")
ENV = "TE_CUDA_ATTENTION_BACKEND"


def _backend_list() -> List:
    from torch.nn.attention import SDPBackend

    by_name = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    first = os.environ.get(ENV, "cudnn").strip().lower() or "cudnn"
    if first not in by_name:
        raise ValueError(f"{ENV}={first!r} is not an SDPA backend; use one of {', '.join(ORDER)}")
    return [by_name[first]] + [by_name[n] for n in ORDER if n != first]


def _kernel_context():
    from torch.nn.attention import sdpa_kernel

    backends = _backend_list()
    try:
        return sdpa_kernel(backends, set_priority=True)
    except TypeError:  # torch < 2.6 has no priority order: the list only allows
        return sdpa_kernel(backends)


def _float_bias(q, b, hq, sq, sk, scale, bias_type, bias, alibi_slopes, shift) -> Optional[torch.Tensor]:
    """The bias SDPA adds after scaling, in q's dtype, or None."""
    if bias_type == "post_scale_bias":
        return bias.to(q.dtype)
    if bias_type == "pre_scale_bias":
        return (bias.float() * scale).to(q.dtype)
    if bias_type == "alibi":
        return alibi_bias(alibi_slopes, b, hq, sq, sk, shift, q.device).to(q.dtype)
    return None


def _sink_inputs(q, k, v, masked, bias, softmax_offset):
    """Attention sinks as SDPA runs them: one more key and value of zeros, whose logit (its
    column of the float mask) is the head's offset and which no query is masked from."""
    b, hq, sq, _ = q.shape
    sk = k.shape[2]
    k = torch.cat([k, k.new_zeros(b, hq, 1, k.shape[3])], dim=2)
    v = torch.cat([v, v.new_zeros(b, hq, 1, v.shape[3])], dim=2)
    logits = q.new_zeros(1, 1, 1, sk) if bias is None else bias
    if masked is not None:
        logits = torch.where(masked, float("-inf"), logits)
    column = softmax_offset.to(q.dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)
    return k, v, torch.cat([logits.expand(b, hq, sq, sk), column], dim=-1)


def _kernel_readable(t: torch.Tensor) -> torch.Tensor:
    """t as it is where SDPA's kernels read it in place: unit-stride features, every other stride
    and the offset 16-byte aligned (as q, k and v sliced from a fused QKV projection are); else its
    contiguous copy. Other layouts make the kernels take other code, whose result then depends on
    the layout, or find none (cutlassF has no kernel for a slice at an odd offset)."""
    align = max(1, 16 // t.element_size())
    if torch.compiler.is_compiling():
        # A trace cannot read a view's storage offset (dynamo refuses the call: fullgraph fails)
        # and the compiler lays out the buffers it hands SDPA: only unit-stride features asked.
        return t if t.stride(-1) == 1 else t.contiguous()
    if t.stride(-1) == 1 and t.storage_offset() % align == 0 and all(n % align == 0 for n in t.stride()[:-1]):
        return t
    return t.contiguous()


def attention(q, k, v, *, attn_mask_type="no_mask", attention_mask=None, softmax_scale=None, dropout_p=0.0,
              query_padding_mask=None, window_size=None, bottom_right_diagonal=None,
              core_attention_bias_type="no_bias", core_attention_bias=None, alibi_slopes=None, softmax_offset=None):
    """te_core.ops.attention; differentiable (SDPA's autograd)."""
    q, k, v = _kernel_readable(q), _kernel_readable(k), _kernel_readable(v)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    padding = check_padding(attn_mask_type, attention_mask, query_padding_mask, b, sq, sk)
    check_bias(core_attention_bias_type, core_attention_bias, alibi_slopes, (b, hq, sq, sk))
    check_softmax_offset(softmax_offset, hq)
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    window = resolve_window(attn_mask_type, window_size)
    plain = core_attention_bias_type == "no_bias" and window[0] == math.inf and padding.kv is None \
        and softmax_offset is None
    # SDPA's is_causal is top-left aligned; where sq == sk both alignments agree
    is_causal = plain and attn_mask_type in ("causal", "causal_bottom_right") and sq == sk
    if plain and attn_mask_type == "no_mask" or is_causal:
        with _kernel_context():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal,
                                                  scale=softmax_scale)
    shift = diagonal_shift(diagonal_bottom_right(attn_mask_type, bottom_right_diagonal), sq, sk, padding)
    masked = masked_keys(attn_mask_type, attention_mask, padding, window, shift, sq, sk, q.device)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    bias = _float_bias(q, b, hq, sq, sk, scale, core_attention_bias_type, core_attention_bias, alibi_slopes, shift)
    if softmax_offset is not None:  # no row is fully masked: a padded query's output is the sink's zeros
        k, v, attn_mask = _sink_inputs(q, k, v, masked, bias, softmax_offset)
        with _kernel_context():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  scale=softmax_scale)
    dead = None
    if masked is not None:  # (no test of whether any row is dead: reading it would wait for the
        # device, and a CUDA graph capture forbids that)
        dead = masked.all(dim=-1, keepdim=True)
        masked = masked & ~dead  # a dead row attends everything, then is zeroed
    if bias is None:
        attn_mask = None if masked is None else ~masked
    else:
        attn_mask = bias if masked is None else torch.where(masked, float("-inf"), bias)
    with _kernel_context():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=softmax_scale)
    return out if dead is None else out.masked_fill(dead, 0.0)


def supports_attention(q, k, v, *, attn_mask_type="no_mask", core_attention_bias_type="no_bias",
                       core_attention_bias=None, softmax_offset=None, **_):
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return False, "tensors are not on a CUDA device"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False, "q, k, v must be 4-D (b, h, s, d)"
    if attn_mask_type not in ATTN_MASK_TYPES or core_attention_bias_type not in BIAS_TYPES:
        return False, f"attn_mask_type={attn_mask_type!r} / core_attention_bias_type={core_attention_bias_type!r}"
    if core_attention_bias is not None and core_attention_bias.requires_grad and torch.is_grad_enabled():
        return False, "core_attention_bias needs a gradient, which not every SDPA kernel returns"
    if softmax_offset is not None and softmax_offset.requires_grad and torch.is_grad_enabled():
        return False, "a learnable softmax_offset needs a gradient, which SDPA's float mask does not return"
    return True, ""
