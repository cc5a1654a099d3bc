"""Row cuts of a Float8BlockScaling FP8 primary weight (slice, narrow, split, chunk) read as the
same cut of its dequantized value, as in Transformer Engine, which dequantizes for them: a cut
starting inside a 128x128 tile is a dequantized view, one starting on a tile boundary keeps the
FP8 bytes and tile scales. None of them raises, nor speaks of an FSDP2 all-gather."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core import recipe as R
from te_core.quantization import Float8BlockwiseTensor, QuantizedTensor

CUTS = {
    "w[3:5]": lambda w: w[3:5],
    "w[-2:]": lambda w: w[-2:],
    "w[200:]": lambda w: w[200:],
    "w[0:5]": lambda w: w[0:5],
    "w.narrow(0, 10, 5)": lambda w: w.narrow(0, 10, 5),
    "torch.chunk(w, 2)": lambda w: torch.chunk(w, 2),
    "torch.chunk(w, 3)": lambda w: torch.chunk(w, 3),
    "w.split(64)": lambda w: w.split(64),
    "w.split([100, 28, 172])": lambda w: w.split([100, 28, 172]),
}
# cuts at 128-row tile boundaries (or the end of the weight) keep the quantized form
TILE_CUTS = {
    "w[128:256]": lambda w: w[128:256],
    "w.narrow(0, 128, 172)": lambda w: w.narrow(0, 128, 172),
    "w.split(128)": lambda w: w.split(128),
    "w.split([256, 44])": lambda w: w.split([256, 44]),
}


def _weight(block_dim: int = 2):
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=R.Float8BlockScaling(w_block_scaling_dim=block_dim)):
        module = te.Linear(64, 300)
    assert isinstance(module.weight, Float8BlockwiseTensor)
    return module.weight


def _pieces(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _value(piece):
    return piece.dequantize() if isinstance(piece, QuantizedTensor) else piece


@pytest.mark.parametrize("name", list(CUTS) + list(TILE_CUTS))
@pytest.mark.parametrize("block_dim", [2, 1])
def test_cut_equals_cut_of_dequantized_weight(name, block_dim):
    cut = {**CUTS, **TILE_CUTS}[name]
    w = _weight(block_dim)
    got, want = _pieces(cut(w)), _pieces(cut(w.dequantize()))
    assert len(got) == len(want)
    for piece, expected in zip(got, want):
        assert piece.shape == expected.shape
        assert torch.equal(_value(piece), expected), name
        assert torch.equal(piece, expected), name  # (torch ops on a piece read its dequantized value)


@pytest.mark.parametrize("name", list(TILE_CUTS))
def test_cut_on_tile_boundaries_stays_fp8(name):
    w = _weight()
    for piece in _pieces(TILE_CUTS[name](w)):
        assert isinstance(piece, Float8BlockwiseTensor)
        assert piece._data.untyped_storage().data_ptr() == w._data.untyped_storage().data_ptr()


def test_cut_inside_a_tile_writes_back():
    """An in-place op on a cut starting inside a tile changes those rows of the weight (which is
    requantized whole), and no others beyond their tiles' requantization."""
    w = _weight()
    before = w.dequantize()
    with torch.no_grad():
        w[3:5].mul_(2.0)
        torch.chunk(w, 2)[1].zero_()
    after = w.dequantize()
    torch.testing.assert_close(after[3:5], before[3:5] * 2, rtol=0.13, atol=0.0)
    assert torch.equal(after[150:], torch.zeros_like(after[150:]))
    torch.testing.assert_close(after[128:150], before[128:150], rtol=0.13, atol=0.0)

