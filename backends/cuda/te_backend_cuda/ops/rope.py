"""Rotary position embedding, forward and backward, on te_triton's rope kernel (sbhd or bshd
layouts, split or interleaved halves)."""
from __future__ import annotations

from te_triton import rope

from .. import configs
from .checks import tensor_ok


def rope_fwd(x, freqs, *, tensor_format="sbhd", interleaved=False):
    return rope.rope_fwd(x, freqs, tensor_format=tensor_format, interleaved=interleaved,
                         cfg=configs.for_tensor(x).rope)


def rope_bwd(dy, freqs, *, tensor_format="sbhd", interleaved=False):
    return rope.rope_bwd(dy, freqs, tensor_format=tensor_format, interleaved=interleaved,
                         cfg=configs.for_tensor(dy).rope)


def rope_ok(x, freqs, *, tensor_format="sbhd", interleaved=False):
    if x.dim() != 4 or freqs.dim() != 4 or tensor_format not in ("sbhd", "bshd"):
        return False, "x and freqs must be 4-D, tensor_format sbhd or bshd"
    if x.shape[-2] * x.shape[-1] > 65536:
        return False, "heads x head_dim above 65536 do not fit one program"
    return tensor_ok(x)
