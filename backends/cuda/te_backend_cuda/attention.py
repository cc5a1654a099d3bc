"""te_core.ops.attention through torch's scaled_dot_product_attention, cuDNN first.

TE_CUDA_ATTENTION_BACKEND=cudnn|flash|efficient|math picks the preferred SDPA kernel (default
cudnn); the others follow as fallbacks, so a call the preferred one cannot run (a mask flash
does not take, a head size cuDNN lacks) still runs. Masks are turned into SDPA's boolean
"True = attend" form; query rows with every key masked are computed unmasked and then
zeroed, which keeps NaN out of both passes.
"""
from __future__ import annotations

import os
from typing import List, Optional

import torch
import torch.nn.functional as F

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


def _keep_mask(attn_mask_type: str, attention_mask, b, hq, sq, sk, device) -> Optional[torch.Tensor]:
    """Boolean mask, True where a query may attend a key, or None for no mask."""
    keep = None
    if attn_mask_type in ("causal", "padding_causal", "causal_bottom_right"):
        shift = sk - sq if attn_mask_type == "causal_bottom_right" else 0
        keep = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=shift)
    if attn_mask_type in ("padding", "padding_causal", "arbitrary"):
        if attention_mask is None:
            raise ValueError(f"attn_mask_type={attn_mask_type!r} needs attention_mask (bool, True = masked out)")
        allowed = ~attention_mask.to(device=device, dtype=torch.bool)
        keep = allowed if keep is None else keep & allowed
    return keep


def attention(q, k, v, *, attn_mask_type="no_mask", attention_mask=None, softmax_scale=None, dropout_p=0.0):
    """te_core.ops.attention; differentiable (SDPA's autograd)."""
    b, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    # SDPA's is_causal is top-left aligned; where sq == sk both alignments agree
    is_causal = attn_mask_type in ("causal", "causal_bottom_right") and sq == sk
    keep = None if attn_mask_type == "no_mask" or is_causal else _keep_mask(
        attn_mask_type, attention_mask, b, hq, sq, sk, q.device)
    dead = None
    if keep is not None:
        dead = ~keep.any(dim=-1, keepdim=True)
        if bool(dead.any()):
            keep = keep | dead
        else:
            dead = None
    with _kernel_context():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal,
                                             scale=softmax_scale)
    return out if dead is None else out.masked_fill(dead, 0.0)


def supports_attention(q, k, v, **_):
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return False, "tensors are not on a CUDA device"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False, "q, k, v must be 4-D (b, h, s, d)"
    return True, ""
