"""Cases for ops.softmax, ops.rope, ops.attention and ops.attention_varlen (forward and the q, k, v gradients).

Attention gets a slightly wider floor than TE's elementwise tolerances (fused kernels reorder
the softmax reductions): 1e-5 relative in float32, 1.6e-2 absolute in 16-bit types.
"""
from __future__ import annotations

import torch

from ..compare import Tol
from ..inputs import case, dims, randn, short

ATTN_TOL = {torch.float32: Tol(1e-5, 1e-5), torch.bfloat16: Tol(1.6e-2, 1.6e-2), torch.float16: Tol(1e-3, 1e-3)}


def _softmax_fwd(name, shape, dtype, scale, causal=False, mask_shape=None, masked_row=None):
    @case("softmax_fwd", f"{name}-{short(dtype)}-{dims(shape)}")
    def make(gen):
        x = randn(gen, *shape, dtype=dtype, std=3.0)
        kwargs = dict(causal=causal)
        if mask_shape is not None:
            mask = torch.rand(mask_shape, generator=gen) < 0.3
            if masked_row is not None:
                mask[masked_row] = True  # every position masked: the row must be all zeros
            kwargs["mask"] = mask
        return (x, scale), kwargs


_softmax_fwd("plain", (2, 3, 8, 8), torch.float32, 0.125)
_softmax_fwd("causal-sq-lt-sk", (2, 2, 5, 9), torch.bfloat16, 0.5, causal=True)
_softmax_fwd("mask-full-row", (2, 3, 6, 7), torch.float16, 1.0, mask_shape=(2, 1, 6, 7), masked_row=(1, 0, 2))
_softmax_fwd("causal-padding", (1, 2, 7, 7), torch.float32, 0.3, causal=True, mask_shape=(1, 1, 1, 7))


def _softmax_bwd(shape, dtype, scale):
    @case("softmax_bwd", f"{short(dtype)}-{dims(shape)}")
    def make(gen):
        y = torch.softmax(torch.randn(shape, generator=gen) * 3, dim=-1)
        y[..., -1] = 0.0  # a masked position, as the forward leaves it
        return (randn(gen, *shape, dtype=dtype), y.to(dtype), scale), {}


_softmax_bwd((2, 3, 8, 11), torch.float32, 0.125)
_softmax_bwd((1, 2, 5, 16), torch.bfloat16, 1.0)


def _rope(op, fmt, shape, rotary_dim, dtype, interleaved=False, paired=True):
    """paired: freqs built as TE builds them (each rotated pair's two channels share an angle);
    otherwise every channel has its own, which the backward must transpose exactly too."""
    seq = shape[0] if fmt == "sbhd" else shape[1]
    name = (f"{fmt}-{'interleaved-' if interleaved else ''}{'' if paired else 'unpaired-'}{short(dtype)}-"
            f"{dims(shape)}-r{rotary_dim}")

    @case(op, name)
    def make(gen):
        if paired:
            angles = randn(gen, seq, 1, 1, rotary_dim // 2, std=3.0)
            freqs = torch.cat([angles, angles], dim=-1)
        else:
            freqs = randn(gen, seq, 1, 1, rotary_dim, std=3.0)
        return (randn(gen, *shape, dtype=dtype), freqs), dict(tensor_format=fmt, interleaved=interleaved)


for _op in ("rope_fwd", "rope_bwd"):
    _rope(_op, "sbhd", (7, 2, 3, 16), 16, torch.float32)
    _rope(_op, "bshd", (2, 7, 3, 32), 16, torch.bfloat16)
    _rope(_op, "sbhd", (5, 2, 2, 12), 8, torch.float32, interleaved=True)
    _rope(_op, "bshd", (2, 5, 2, 16), 16, torch.float16, interleaved=True)
    _rope(_op, "sbhd", (6, 2, 3, 16), 12, torch.float32, paired=False)
    _rope(_op, "bshd", (2, 6, 2, 16), 16, torch.float32, interleaved=True, paired=False)


def _attention(name, b, hq, hkv, sq, sk, d, dv=None, dtype=torch.float32, mask_type="no_mask", mask=None,
               softmax_scale=None, bias=None, sink=False, **options):
    """mask: None, "padding" ((b, 1, 1, sk), a few keys of each batch masked), "padding_both"
    (queries padded too) or "arbitrary" ((b, 1, sq, sk) random, one query row fully masked).
    bias: None or a core_attention_bias_type given a random (1, hq, sq, sk) bias; sink: a random
    float32 softmax_offset per head; `options` (window_size, bottom_right_diagonal,
    core_attention_bias_type="alibi") pass as they are."""

    @case("attention", f"{name}-{short(dtype)}", tol=ATTN_TOL[dtype], grad_of=(0, 1, 2))
    def make(gen):
        q = randn(gen, b, hq, sq, d, dtype=dtype)
        k = randn(gen, b, hkv, sk, d, dtype=dtype)
        v = randn(gen, b, hkv, sk, dv or d, dtype=dtype)
        kwargs = dict(attn_mask_type=mask_type, softmax_scale=softmax_scale)
        if mask in ("padding", "padding_both"):
            lengths = torch.randint(sk // 2, sk + 1, (b,), generator=gen)
            kwargs["attention_mask"] = (torch.arange(sk) >= lengths[:, None]).view(b, 1, 1, sk)
        if mask == "padding_both":
            lengths = torch.randint(sq // 2, sq + 1, (b,), generator=gen)
            kwargs["query_padding_mask"] = (torch.arange(sq) >= lengths[:, None]).view(b, 1, 1, sq)
        elif mask == "arbitrary":
            full = torch.rand(b, 1, sq, sk, generator=gen) < 0.3
            full[0, 0, 1] = True
            kwargs["attention_mask"] = full
        if bias is not None:
            kwargs.update(core_attention_bias_type=bias, core_attention_bias=randn(gen, 1, hq, sq, sk, dtype=dtype))
        if sink:
            kwargs["softmax_offset"] = randn(gen, hq, dtype=torch.float32)
        return (q, k, v), {**kwargs, **options}


_attention("no-mask-2x4x8x16", 2, 4, 4, 8, 8, 16)
_attention("causal-1x2x9x9", 1, 2, 2, 9, 9, 16, mask_type="causal")
_attention("causal-top-left-sq5-sk9", 1, 2, 2, 5, 9, 8, mask_type="causal")
_attention("causal-bottom-right-sq5-sk9", 2, 2, 2, 5, 9, 8, mask_type="causal_bottom_right")
_attention("padding-2x2x6x10", 2, 2, 2, 6, 10, 16, mask_type="padding", mask="padding")
_attention("padding-causal-2x2x6x6", 2, 2, 2, 6, 6, 16, mask_type="padding_causal", mask="padding")
_attention("arbitrary-full-row-2x2x7x7", 2, 2, 2, 7, 7, 16, mask_type="arbitrary", mask="arbitrary")
_attention("gqa-scale-2x4x2x7x7", 2, 4, 2, 7, 7, 16, softmax_scale=0.3)
_attention("mqa-dv8-causal-2x4x1x7x7", 2, 4, 1, 7, 7, 16, dv=8, mask_type="causal")
_attention("causal-1x2x16x16", 1, 2, 2, 16, 16, 32, dtype=torch.bfloat16, mask_type="causal")
_attention("padding-causal-bottom-right-2x4x2x6x9", 2, 4, 2, 6, 9, 16, mask_type="padding_causal_bottom_right",
           mask="padding_both")
_attention("window-causal-2x2x9x9", 2, 2, 2, 9, 9, 16, mask_type="causal", window_size=(3, 0))
_attention("window-top-left-1x2x6x9", 1, 2, 2, 6, 9, 16, window_size=(1, 2), bottom_right_diagonal=False)
_attention("post-scale-bias-gqa-2x4x2x7x7", 2, 4, 2, 7, 7, 16, mask_type="causal", bias="post_scale_bias")
_attention("pre-scale-bias-1x2x5x8", 1, 2, 2, 5, 8, 16, bias="pre_scale_bias")
_attention("alibi-padding-window-2x4x4x8x8", 2, 4, 4, 8, 8, 16, mask_type="padding", mask="padding_both",
           window_size=(2, 2), core_attention_bias_type="alibi")
_attention("sink-causal-gqa-2x4x2x7x7", 2, 4, 2, 7, 7, 16, mask_type="causal", sink=True)
_attention("sink-padding-both-bias-2x2x6x9", 2, 2, 2, 6, 9, 16, mask_type="padding", mask="padding_both",
           bias="post_scale_bias", sink=True)
_attention("sink-no-mask-1x2x16x16", 1, 2, 2, 16, 16, 32, dtype=torch.bfloat16, sink=True)


def _attention_varlen(name, lengths_q, lengths_kv, hq, hkv, d, dtype=torch.float32, mask_type="padding",
                      **options):
    """Packed sequences of the given lengths (a zero length is an empty sequence); `options`
    (window_size, bottom_right_diagonal, softmax_scale) pass as they are."""

    @case("attention_varlen", f"{name}-{short(dtype)}", tol=ATTN_TOL[dtype], grad_of=(0, 1, 2))
    def make(gen):
        q = randn(gen, sum(lengths_q), hq, d, dtype=dtype)
        k = randn(gen, sum(lengths_kv), hkv, d, dtype=dtype)
        v = randn(gen, sum(lengths_kv), hkv, d, dtype=dtype)
        cu_q, cu_kv = (torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
                       for lengths in (lengths_q, lengths_kv))
        args = (q, k, v, cu_q, cu_kv, max(lengths_q), max(lengths_kv))
        return args, dict(attn_mask_type=mask_type, **options)


_attention_varlen("self-4x2-d16", [5, 9, 3], [5, 9, 3], 4, 2, 16)
_attention_varlen("causal-bottom-right-gqa-d32", [3, 8, 6], [7, 8, 9], 4, 1, 32, dtype=torch.bfloat16,
                  mask_type="padding_causal_bottom_right")
_attention_varlen("causal-self-empty-seq-d64", [6, 0, 11], [6, 0, 11], 2, 2, 64, dtype=torch.bfloat16,
                  mask_type="padding_causal")
_attention_varlen("window-scale-d16", [10, 4], [10, 4], 2, 2, 16, dtype=torch.float16, window_size=(2, 1),
                  softmax_scale=0.2)
_attention_varlen("causal-top-left-sq-lt-sk", [3, 5], [6, 5], 2, 2, 8, mask_type="padding_causal")
