"""The attention contract's masks and ALiBi bias as tensors: which keys each query sees and
what ALiBi adds, written once in plain torch so the reference and the backends that build
explicit masks agree by construction (Transformer Engine's semantics, see ops.attention).
"""
from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from .attention import ATTN_MASK_TYPES, BIAS_TYPES, CAUSAL_MASK_TYPES, PADDING_MASK_TYPES

Shift = Union[int, Tensor]  # an int, or (b, 1, 1, 1) per-sequence shifts under padding masks


class Padding(NamedTuple):
    """Padded keys (b, 1, 1, sk) and queries (b, 1, 1, sq), True = padding; either may be None."""

    kv: Optional[Tensor]
    q: Optional[Tensor]


def diagonal_bottom_right(attn_mask_type: str, bottom_right_diagonal: Optional[bool]) -> bool:
    """Whether the window and ALiBi diagonal is bottom-right aligned, as Transformer Engine
    decides: the causal types fix it (top-left for "causal"/"padding_causal", bottom-right for
    the *_bottom_right ones); the others follow bottom_right_diagonal, None meaning True."""
    if attn_mask_type in ("causal", "padding_causal"):
        return False
    if attn_mask_type.endswith("bottom_right") or bottom_right_diagonal is None:
        return True
    return bool(bottom_right_diagonal)


def resolve_window(attn_mask_type: str, window_size) -> Tuple[float, float]:
    """(left, right): how many keys left and right of its diagonal a query sees, math.inf for
    unbounded. As in Transformer Engine, causal types use right = 0 (another right warns and
    is replaced, except after an unbounded left: an error) and, for the other types, (-1, 0)
    means no window (with a warning) and one unbounded side alone is an error."""
    causal = attn_mask_type in CAUSAL_MASK_TYPES
    if window_size is None:
        left, right = -1, (0 if causal else -1)
    else:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
            raise ValueError(f"window_size must be a pair of ints >= -1 (left, right; -1 = unbounded), "
                             f"got {window_size!r}")
        left, right = window_size
    if causal and right != 0 and left == -1 and right != -1:
        raise ValueError(f"window_size={tuple(window_size)} with attn_mask_type={attn_mask_type!r}: a causal mask "
                         "takes (-1, 0) or (left >= 0, 0), as in Transformer Engine; give (-1, 0) for no window")
    if not causal and window_size is not None and (left == -1) != (right == -1) and (left, right) != (-1, 0):
        raise ValueError(f"window_size={tuple(window_size)} with attn_mask_type={attn_mask_type!r}: bound both "
                         "sides or neither, (-1, -1) or (left >= 0, right >= 0), as in Transformer Engine")
    if causal and right != 0:
        warnings.warn(f"window_size={tuple(window_size)} with attn_mask_type={attn_mask_type!r}: a causal mask "
                      f"sees no key right of the diagonal; using ({left}, 0)", stacklevel=3)
        right = 0
    elif not causal and window_size is not None and (left, right) == (-1, 0):
        warnings.warn(f"window_size=(-1, 0) with attn_mask_type={attn_mask_type!r} means no window, as in "
                      "Transformer Engine; use a causal attn_mask_type for causal attention", stacklevel=3)
        right = -1
    return (math.inf if left == -1 else left), (math.inf if right == -1 else right)


def check_padding(attn_mask_type: str, attention_mask, query_padding_mask, b: int, sq: int, sk: int) -> Padding:
    """The padding masks of a call, checked: bool, (b, 1, 1, sk) for keys, (b, 1, 1, sq) for queries."""
    if attn_mask_type not in ATTN_MASK_TYPES:
        raise ValueError(f"attn_mask_type={attn_mask_type!r} is not supported; allowed values: "
                         f"{', '.join(map(repr, ATTN_MASK_TYPES))}")
    needs_mask = attn_mask_type in PADDING_MASK_TYPES or attn_mask_type == "arbitrary"
    if needs_mask and attention_mask is None:
        raise ValueError(f"attn_mask_type={attn_mask_type!r} needs attention_mask (bool, True = masked out)")
    if not needs_mask and attention_mask is not None:
        raise ValueError(f"attention_mask was given but attn_mask_type={attn_mask_type!r} ignores it; "
                         "use a padding type or 'arbitrary'")
    if query_padding_mask is not None and attn_mask_type not in PADDING_MASK_TYPES:
        raise ValueError(f"query_padding_mask needs a padding attn_mask_type, got {attn_mask_type!r}")
    for name, mask, s in (("attention_mask", attention_mask, sk), ("query_padding_mask", query_padding_mask, sq)):
        if mask is None:
            continue
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"{name} must be a bool tensor (True = masked out), got {got}")
        if attn_mask_type in PADDING_MASK_TYPES and tuple(mask.shape) != (b, 1, 1, s):
            raise ValueError(f"attn_mask_type={attn_mask_type!r} needs {name} of shape {(b, 1, 1, s)}, "
                             f"got {tuple(mask.shape)}")
    if attn_mask_type in PADDING_MASK_TYPES:
        return Padding(attention_mask, query_padding_mask)
    return Padding(None, None)


def diagonal_shift(bottom_right: bool, sq: int, sk: int, padding: Padding) -> Shift:
    """Key offset of each query's diagonal: 0 top-left; sk - sq bottom-right; under padding
    masks, len_kv - len_q per sequence (the bottom right of its unpadded block)."""
    if not bottom_right:
        return 0
    if padding.kv is None:
        return sk - sq
    len_kv = (~padding.kv).sum(dim=-1, keepdim=True)
    len_q = sq if padding.q is None else (~padding.q).sum(dim=-1, keepdim=True)
    return len_kv - len_q


def _offsets(sq: int, sk: int, shift: Shift, device) -> Tensor:
    """j - (i + shift): each key's distance right of its query's diagonal, (1|b, 1, sq, sk)."""
    i = torch.arange(sq, device=device).view(1, 1, sq, 1)
    j = torch.arange(sk, device=device).view(1, 1, 1, sk)
    return j - i - (shift.to(device) if isinstance(shift, Tensor) else shift)


def masked_keys(attn_mask_type: str, attention_mask: Optional[Tensor], padding: Padding, window: Tuple[float, float],
                shift: Shift, sq: int, sk: int, device) -> Optional[Tensor]:
    """Bool mask broadcastable to (b, h, sq, sk), True where a query does not see a key; None
    when every query sees every key."""
    masked = attention_mask if attn_mask_type == "arbitrary" else None
    if padding.kv is not None:
        masked = padding.kv if masked is None else masked | padding.kv
    if padding.q is not None:
        rows = padding.q.transpose(-1, -2)
        masked = rows if masked is None else masked | rows
    left, right = window
    if left != math.inf or right != math.inf:
        offset = _offsets(sq, sk, shift, device)
        outside = (offset < -left) | (offset > right)
        masked = outside if masked is None else masked | outside
    return masked


def default_alibi_slopes(num_heads: int, device=None) -> Tensor:
    """Transformer Engine's (and the ALiBi paper's) slopes: a geometric sequence from 2^(-8/n)
    for the largest power of two n <= num_heads, the remaining heads interleaved from 2^(-4/n)."""
    n = 2 ** math.floor(math.log2(num_heads))
    # float64 on the host (not every device has it), also inside a torch.device(...) context
    slopes = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, 1 + n, dtype=torch.float64, device="cpu"))
    if n < num_heads:
        extra = torch.pow(2.0 ** (-4.0 / n), torch.arange(1, 1 + 2 * (num_heads - n), 2, dtype=torch.float64,
                                                          device="cpu"))
        slopes = torch.cat([slopes, extra])
    return slopes.to(dtype=torch.float32, device=device)


def alibi_bias(alibi_slopes: Optional[Tensor], b: int, h: int, sq: int, sk: int, shift: Shift, device) -> Tensor:
    """-slope * |j - (i + shift)| as float32 (1|b, h, sq, sk)."""
    slopes = default_alibi_slopes(h, device) if alibi_slopes is None else alibi_slopes.to(device, torch.float32)
    if tuple(slopes.shape) not in ((h,), (b, h)):
        raise ValueError(f"alibi_slopes must have shape ({h},) or ({b}, {h}), got {tuple(slopes.shape)}")
    slopes = slopes.view(-1, h, 1, 1)
    return -slopes * _offsets(sq, sk, shift, device).abs().to(torch.float32)


def check_softmax_offset(softmax_offset: Optional[Tensor], heads: int) -> None:
    """softmax_offset: None, or one float32 sink logit per query head."""
    if softmax_offset is None:
        return
    if not isinstance(softmax_offset, Tensor) or softmax_offset.shape != (heads,) \
            or softmax_offset.dtype != torch.float32:
        got = (f"{tuple(softmax_offset.shape)} {softmax_offset.dtype}" if isinstance(softmax_offset, Tensor)
               else type(softmax_offset).__name__)
        raise ValueError(f"softmax_offset must be a float32 tensor of shape ({heads},), one sink logit per query "
                         f"head; got {got}")


def check_bias(core_attention_bias_type: str, bias: Optional[Tensor], alibi_slopes: Optional[Tensor],
               shape: Tuple[int, int, int, int]) -> None:
    """core_attention_bias given exactly for the explicit bias types, broadcasting to `shape`
    (b, h, sq, sk) from (b|1, h|1, sq|1, sk); alibi_slopes only with "alibi"."""
    if core_attention_bias_type not in BIAS_TYPES:
        raise ValueError(f"unknown core_attention_bias_type={core_attention_bias_type!r}; choose one of "
                         f"{', '.join(BIAS_TYPES)}")
    explicit = core_attention_bias_type in ("pre_scale_bias", "post_scale_bias")
    if explicit != (bias is not None):
        raise ValueError(f"core_attention_bias_type={core_attention_bias_type!r} "
                         + ("needs core_attention_bias" if explicit else "takes no core_attention_bias"))
    if alibi_slopes is not None and core_attention_bias_type != "alibi":
        raise ValueError("alibi_slopes needs core_attention_bias_type='alibi'")
    if bias is not None:
        b, h, sq, sk = shape
        ok = bias.dim() == 4 and bias.shape[0] in (1, b) and bias.shape[1] in (1, h) and bias.shape[2] in (1, sq) \
            and bias.shape[3] == sk and bias.is_floating_point()
        if not ok:
            raise ValueError(f"core_attention_bias must be a float tensor of shape (b|1, h|1, sq|1, sk) = "
                             f"({b}|1, {h}|1, {sq}|1, {sk}), got {tuple(bias.shape)} {bias.dtype}")


def attention_logits(q: Tensor, k: Tensor, *, attn_mask_type: str = "no_mask", attention_mask=None,
                     softmax_scale: Optional[float] = None, query_padding_mask=None, window_size=None,
                     bottom_right_diagonal=None, core_attention_bias_type: str = "no_bias", core_attention_bias=None,
                     alibi_slopes=None, **_) -> Tuple[Tensor, Optional[Tensor]]:
    """ops.attention's logits as the contract defines them, float32 (b, hq, sq, sk): q k^T
    scaled, with the bias types applied and each kv head repeated for its query heads; and
    which of them no query sees (masked_keys, None when none). The other attention arguments
    (dropout, sinks) do not enter the logits and are ignored."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    padding = check_padding(attn_mask_type, attention_mask, query_padding_mask, b, sq, sk)
    check_bias(core_attention_bias_type, core_attention_bias, alibi_slopes, (b, hq, sq, sk))
    window = resolve_window(attn_mask_type, window_size)
    shift = diagonal_shift(diagonal_bottom_right(attn_mask_type, bottom_right_diagonal), sq, sk, padding)
    masked = masked_keys(attn_mask_type, attention_mask, padding, window, shift, sq, sk, q.device)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scores = q.float() @ k.float().repeat_interleave(hq // k.shape[1], dim=1).transpose(-2, -1)
    if core_attention_bias_type == "pre_scale_bias":
        return (scores + core_attention_bias.float()) * scale, masked
    scores = scores * scale
    if core_attention_bias_type == "post_scale_bias":
        scores = scores + core_attention_bias.float()
    elif core_attention_bias_type == "alibi":
        scores = scores + alibi_bias(alibi_slopes, b, hq, sq, sk, shift, q.device)
    return scores, masked
