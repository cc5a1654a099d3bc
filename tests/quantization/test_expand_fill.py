"""fill_ and zero_ through a view whose elements overlap (an expand, an expand of a view, an
as_strided with a zero stride) write into the quantized tensor it views, as torch's do: every
shared element takes the one value, so torch allows them. Every other in-place write through
such a view raises, as torch's does. te-core refused the fills too."""
from __future__ import annotations

import pytest
import torch

from .conftest import randn
from .test_view_semantics import COLS, QUANTIZERS, ROWS

OVERLAPPING = {
    "expand_row": lambda t: t[0:1].expand(4, COLS),
    "expand_whole": lambda t: t.unsqueeze(0).expand(3, ROWS, COLS),
    "expand_select": lambda t: t[5].expand(3, COLS),
    "expand_column": lambda t: t.t()[2:3].expand(4, ROWS),
    "slice_of_expand": lambda t: t[7:8].expand(4, COLS)[1:3],
    "as_strided_zero_stride": lambda t: t.as_strided((4, COLS), (0, 1), 2 * COLS),
}
FILLS = {"fill_": lambda v: v.fill_(0.5), "zero_": lambda v: v.zero_()}
# formats whose scales keep 0.5 and 0 on the FP8 grid after requantizing (power-of-two scales,
# the delayed scale 56): exact; a current scale (448 / amax) rounds 0.5 and, where the fill
# lowers the amax, the rest
EXACT = ("delayed", "block2d", "block1d", "mxfp8")
REFUSED = {
    "add_": lambda v: v.add_(1.0),
    "mul_": lambda v: v.mul_(2.0),
    "copy_": lambda v: v.copy_(torch.full(v.shape, 0.5, dtype=v.dtype)),
}


@pytest.mark.parametrize("fill", list(FILLS))
@pytest.mark.parametrize("view", list(OVERLAPPING))
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_a_fill_through_an_overlapping_view_writes_the_tensor(kind, view, fill, gen):
    x = randn(gen, ROWS, COLS)
    t, twin = QUANTIZERS[kind]()(x), QUANTIZERS[kind]()(x)
    before = t.dequantize().double()
    model = before.clone()
    FILLS[fill](OVERLAPPING[view](model))  # (torch takes it)
    FILLS[fill](OVERLAPPING[view](t))
    got = t.dequantize().double()
    assert not torch.equal(got, before), "the fill was lost"
    # requantized as the same fill on the region of the tensor it covers (no overlap) is
    region = model != before
    with torch.no_grad():
        twin.masked_fill_(region, 0.5 if fill == "fill_" else 0.0)
    assert torch.equal(got, twin.dequantize().double())
    if kind in EXACT:
        assert torch.equal(got, model)
    scale = before.abs().max()  # (E4M3's tolerances, relative to the tensor's range)
    torch.testing.assert_close(got / scale, model / scale, rtol=0.125, atol=0.0675)


@pytest.mark.parametrize("view", list(OVERLAPPING))
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_other_writes_through_an_overlapping_view_raise_as_torch(kind, view, gen):
    for write, op in REFUSED.items():
        t = QUANTIZERS[kind]()(randn(gen, ROWS, COLS))
        before = t.dequantize().clone()
        with pytest.raises(RuntimeError, match="more than one element"):
            op(OVERLAPPING[view](before.clone()))
        with pytest.raises(RuntimeError, match=r"self-overlapping.* clone\(\) the view first"):
            op(OVERLAPPING[view](t))
        assert torch.equal(t.dequantize(), before), (write, "a refused write changed the tensor")


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_a_fill_with_a_tensor_value_through_an_expand_does_as_torch(kind, gen):
    """fill_(Tensor) is another op: torch decides whether an overlapping view takes it (torch 2.13 refuses)."""
    t = QUANTIZERS[kind]()(randn(gen, ROWS, COLS))
    model = t.dequantize().double().clone()
    value = torch.tensor(0.5)
    try:
        model[0:1].expand(4, COLS).fill_(value.double())
    except RuntimeError:
        with pytest.raises(RuntimeError, match="clone\\(\\) the view first"):
            t[0:1].expand(4, COLS).fill_(value)
        return
    t[0:1].expand(4, COLS).fill_(value)
    scale = model.abs().max()
    torch.testing.assert_close(t.dequantize().double() / scale, model / scale, rtol=0.125, atol=0.0675)
