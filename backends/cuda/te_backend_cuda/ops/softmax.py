"""Scaled, masked softmax (optionally causal) over the last dimension of (b, h, sq, sk) attention
scores, on te_triton's softmax kernels."""
from __future__ import annotations

import torch
from te_triton import softmax

from .. import configs
from .checks import all_ok, tensor_ok


def softmax_fwd(x, scale, *, mask=None, causal=False):
    return softmax.softmax_fwd(x, scale, mask=mask, causal=causal, cfg=configs.for_tensor(x).softmax)


def softmax_bwd(dy, y, scale):
    return softmax.softmax_bwd(dy, y, scale, configs.for_tensor(dy).softmax)


def softmax_fwd_ok(x, scale, *, mask=None, causal=False):
    if x.dim() != 4 or x.shape[-1] > softmax.MAX_SK:
        return False, f"x must be 4-D with at most {softmax.MAX_SK} keys per row"
    if mask is not None:
        if mask.dtype != torch.bool or mask.device != x.device or mask.dim() > 4:
            return False, "mask must be a bool tensor on x's device"
        try:
            if torch.broadcast_shapes(mask.shape, x.shape) != x.shape:
                return False, "mask does not broadcast to x"
        except RuntimeError:
            return False, "mask does not broadcast to x"
    return tensor_ok(x)


def softmax_bwd_ok(dy, y, scale):
    if dy.dim() != 4 or dy.shape != y.shape or dy.shape[-1] > softmax.MAX_SK:
        return False, "dy and y must be 4-D of one shape"
    return all_ok((dy, "dy"), (y, "y"))
