"""Fp8Padding / Fp8Unpadding: zero rows appended to each group up to the alignment and taken
off again, exact values and gradients; a grouped FP8 GEMM with unaligned groups runs through them."""
import pytest
import torch

import te_core as te
from te_core import recipe
from te_core.quantization import autocast


def test_padding_appends_zero_rows_per_group_and_unpadding_removes_them():
    x = torch.randn(3, 10, 8, requires_grad=True)  # 30 rows in groups 5, 0, 17, 8
    splits = [5, 0, 17, 8]
    pad, unpad = te.Fp8Padding(4), te.Fp8Unpadding(4)
    y, padded = pad(x, splits)
    assert padded == [16, 0, 32, 16] and y.shape == (64, 8)
    rows = x.detach().reshape(30, 8)
    starts, pstarts = [0, 5, 5, 22], [0, 16, 16, 48]
    for m, p, s, ps in zip(splits, padded, starts, pstarts):
        assert torch.equal(y[ps:ps + m], rows[s:s + m])
        assert not y[ps + m:ps + p].any()
    dz = torch.randn(30, 8)
    z = unpad(y * 2.0, splits)
    assert torch.equal(z, 2.0 * rows)
    z.backward(dz)
    assert torch.equal(x.grad, 2.0 * dz.reshape(3, 10, 8))


def test_aligned_splits_pass_through():
    x = torch.randn(48, 4)
    y, padded = te.Fp8Padding(2)(x, [16, 32])
    assert y is x and padded == [16, 32]
    assert te.Fp8Unpadding(2)(x, [16, 32]) is x


def test_alignment_follows_the_recipe_or_align_size():
    """align_size=None: the recipe of the autocast around the first forward decides (16 outside
    one, 32 for MXFP8), and the module keeps it, as Transformer Engine's; a module built outside
    any autocast, as models build them, pads for the recipe it then runs under."""
    pad, unpad = te.Fp8Padding(2), te.Fp8Unpadding(2)  # built outside any autocast
    assert pad.align_size is None
    x = torch.randn(25, 8)
    with autocast(recipe=recipe.MXFP8BlockScaling()):
        xp, padded = pad(x, [5, 20])
        assert padded == [32, 32] and pad.align_size == 32 and torch.equal(unpad(xp, [5, 20]), x)
    assert unpad.align_size == 32 and pad(x, [5, 20])[1] == [32, 32]  # kept after the autocast
    outside = te.Fp8Padding(2)
    assert outside(x, [5, 20])[1] == [16, 32] and outside.align_size == 16
    assert te.Fp8Unpadding(2, align_size=64).padded([1, 65]) == [64, 128]


def test_grouped_fp8_gemm_with_unaligned_groups():
    """GroupedLinear with groups of rows that are not multiples of 16: block scaling refuses them,
    padded with Fp8Padding they run and match float64 within E4M3, and tensor-wise scaling runs
    them unpadded (its GEMMs pad), to the padded result."""
    torch.manual_seed(0)
    splits = [7, 20, 3]
    x = torch.randn(30, 32, requires_grad=True)
    grouped = te.GroupedLinear(3, 32, 16, bias=False)
    pad, unpad = te.Fp8Padding(3), te.Fp8Unpadding(3)
    with pytest.raises(ValueError, match="multiple of 16"):
        with autocast(recipe=recipe.Float8BlockScaling()):
            grouped(x, splits)
    with autocast(recipe=recipe.Float8CurrentScaling()):
        xp, padded = pad(x, splits)
        y = unpad(grouped(xp, padded), splits)
        y_unpadded = grouped(x.detach(), splits)
    torch.testing.assert_close(y_unpadded, y.detach(), rtol=1.3e-6, atol=1e-5)
    ws = [getattr(grouped, f"weight{i}").detach().double() for i in range(3)]
    want = torch.cat([part @ w.T for part, w in zip(x.detach().double().split(splits), ws)])
    torch.testing.assert_close(y.double(), want, rtol=0.125, atol=0.0675)
    y.sum().backward()
    assert x.grad.shape == x.shape and x.grad.abs().sum() > 0


def test_bad_splits_are_errors():
    with pytest.raises(ValueError, match="m_splits must be 2 non-negative row counts"):
        te.Fp8Padding(2)(torch.randn(8, 4), [8])
    with pytest.raises(ValueError, match="m_splits sum to 7 but the input has 8 rows"):
        te.Fp8Padding(2)(torch.randn(8, 4), [3, 4])
    with pytest.raises(ValueError, match="m_splits sum to 32 but the input has 8 rows"):
        te.Fp8Unpadding(2)(torch.randn(8, 4), [3, 4])
    with pytest.raises(ValueError, match="align_size must be a positive integer"):
        te.Fp8Padding(2, align_size=0)
    for module in (te.Fp8Padding(2), te.Fp8Unpadding(2)):  # floats used to pass through int()
        with pytest.raises(TypeError, match=rf"{type(module).__name__}: m_splits must be a list of 2 non-negative ints"):
            module(torch.randn(8, 4), [4.0, 4.0])
