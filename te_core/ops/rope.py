"""Contract: rotary position embedding.

x is (s, b, h, d) for tensor_format "sbhd" or (b, s, h, d) for "bshd". freqs is float32
(s, 1, 1, r) of angles, r <= d, r even; dims r..d of x pass through unchanged.
Non-interleaved (default, as Transformer Engine and GPT-NeoX): freqs = cat(f, f) and
y = x * cos(freqs) + rotate_half(x) * sin(freqs) with rotate_half(x) = cat(-x2, x1) over the
halves of the first r dims. Interleaved (GPT-J), as Transformer Engine: channels (2i, 2i+1)
rotate as a pair and channel d reads its own angle freqs[..., d], so freqs is built as
[f0, f0, f1, f1, ...]: y[2i] = x[2i] cos(freqs[2i]) - x[2i+1] sin(freqs[2i]),
y[2i+1] = x[2i+1] cos(freqs[2i+1]) + x[2i] sin(freqs[2i+1]). The backward is the forward's exact
transpose for any angles: dx[c] = dy[c] cos(freqs[c]) - s dy[p] sin(freqs[p]), p the channel
paired with c and s the sign of p's term in y[c] (for a pair of equal angles, as built above,
that is dy rotated by the negated angle). Math in float32, y in x's dtype.
freqs may have more rows than the sequence; the first s are used.
"""
from __future__ import annotations

from torch import Tensor

from ._spec import contract_op


@contract_op("rope")
def rope_fwd(x: Tensor, freqs: Tensor, *, tensor_format: str = "sbhd", interleaved: bool = False) -> Tensor:
    """Returns y, rotated by +angle."""


@contract_op("rope")
def rope_bwd(dy: Tensor, freqs: Tensor, *, tensor_format: str = "sbhd", interleaved: bool = False) -> Tensor:
    """Returns dx, the transpose of the forward rotation applied to dy."""
