"""fill_ and zero_ through a view whose elements overlap (an expand, an expand of a view, an
as_strided with a zero stride) write into the quantized tensor it views, as torch's do: every
shared element takes the one value, so torch allows them, and torch._foreach_zero_. Every other
in-place write through such a view raises, as torch's does. te-core refused the fills too."""
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
    "_foreach_add_": lambda v: torch._foreach_add_([v], 1.0),
    "_foreach_mul_": lambda v: torch._foreach_mul_([v], 0.0),
    "_foreach_copy_": lambda v: torch._foreach_copy_([v], [torch.full(v.shape, 0.5, dtype=v.dtype)]),
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


def _on_the_grid(gen) -> torch.Tensor:
    """Values every format requantizes to themselves after a zero: E4M3 values within 6 and one 7
    (a current scale of 448 / 7 = 64, a power of two) in the corner no view here writes, so that
    the amax, hence the current scale, stays."""
    x = randn(gen, ROWS, COLS, scale=2.0).clamp(-6, 6).to(torch.float8_e4m3fn).float()
    x[-1, -1] = 7.0
    return x


@pytest.mark.parametrize("view", list(OVERLAPPING))
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_foreach_zero_through_overlapping_views_does_as_torch(kind, view, gen):
    """torch._foreach_zero_ (what optimizer.zero_grad(set_to_none=False) calls) zeroes each tensor
    as zero_ does, an expand too (torch has no foreach fill_): here views of two quantized tensors,
    a quantized tensor and a plain one in one list, against torch's on the dequantized values."""
    t, other, whole = (QUANTIZERS[kind]()(_on_the_grid(gen)) for _ in range(3))
    plain = randn(gen, 3, 5)
    models = [q.dequantize().double() for q in (t, other, whole)]
    befores = [m.clone() for m in models]
    torch._foreach_zero_([OVERLAPPING[view](models[0]), models[1][9:10].expand(3, COLS), models[2]])  # (torch takes it)
    torch._foreach_zero_([OVERLAPPING[view](t), other[9:10].expand(3, COLS), whole, plain])
    for q, model, before in zip((t, other, whole), models, befores):
        got = q.dequantize().double()
        assert not torch.equal(got, before), "the zero was lost"
        assert torch.equal(got, model)
    assert torch.equal(plain, torch.zeros(3, 5))
