"""Behaviour that Transformer Engine's unit tests (tests/pytorch: test_grouped_linear.py and others)
check through its public API, where running them against the stand-in showed te-core diverging."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.dtype import DType
from te_core.recipe import CustomRecipe

E4M3 = dict(rtol=0.125, atol=0.0675)  # Transformer Engine's tolerances for E4M3 results


def _current_scaling(role):
    fp8 = DType.kFloat8E5M2 if role.tensor_type == "grad_output" else DType.kFloat8E4M3
    return te.Float8CurrentScalingQuantizer(fp8, device="cpu")


def _aligned_splits(total, align, parts, gen):
    """TE's test_grouped_linear recipe for m_splits: random cut points on the alignment grid,
    one group empty."""
    cuts = sorted(torch.randint(0, total // align, (parts - 2,), generator=gen).tolist())
    cuts.append(cuts[-1])
    return [(b - a) * align for a, b in zip([0] + cuts, cuts + [total // align])]


def _float64_grouped(module, x, dy, splits):
    """Plain torch in float64: each group of rows through its own weight and bias."""
    x = x.double().requires_grad_()
    ws = [getattr(module, f"weight{i}").detach().double() for i in range(len(splits))]
    bs = [getattr(module, f"bias{i}").detach().double() for i in range(len(splits))]
    y = torch.cat([torch.nn.functional.linear(xi, w, b) for xi, w, b in zip(x.split(splits), ws, bs)])
    y.backward(dy.double())
    return y, x.grad


def test_align_size_for_quantization_is_public_and_follows_the_recipe(stand_in):
    """transformer_engine.pytorch.quantization.get_align_size_for_quantization (in TE's __all__):
    TE's grouped-linear tests size m_splits with it."""
    from transformer_engine.pytorch.quantization import get_align_size_for_quantization

    recipes = te.recipe
    assert get_align_size_for_quantization(recipes.DelayedScaling()) == 16
    assert get_align_size_for_quantization(recipes.Float8CurrentScaling()) == 16
    assert get_align_size_for_quantization(recipes.Float8BlockScaling()) == 16
    assert get_align_size_for_quantization(recipes.MXFP8BlockScaling()) == 32
    assert get_align_size_for_quantization(CustomRecipe(qfactory=_current_scaling, quantization_alignment=48)) == 48
    with pytest.raises(TypeError, match="expected a recipe"):
        get_align_size_for_quantization("mxfp8")


@pytest.mark.parametrize("recipe", ["mxfp8", "block"])
def test_grouped_linear_on_splits_aligned_for_the_recipe(stand_in, recipe):
    """TE's test_grouped_linear_accuracy: m_splits on the recipe's alignment grid (one group
    empty), GroupedLinear's output and input gradient against float64 torch."""
    import transformer_engine.pytorch as tep
    from transformer_engine.pytorch.quantization import get_align_size_for_quantization

    gen = torch.Generator().manual_seed(5)
    fp8_recipe = te.recipe.MXFP8BlockScaling() if recipe == "mxfp8" else te.recipe.Float8BlockScaling()
    splits = _aligned_splits(256, get_align_size_for_quantization(fp8_recipe), 4, gen)
    module = tep.GroupedLinear(4, 128, 64, params_dtype=torch.float32)
    with torch.no_grad():
        for i in range(4):
            getattr(module, f"bias{i}").normal_(generator=gen)
    x, dy = torch.randn(256, 128, generator=gen).requires_grad_(), torch.randn(256, 64, generator=gen)
    with tep.autocast(recipe=fp8_recipe):
        y = module(x, splits)
    y.backward(dy)
    ref_y, ref_dx = _float64_grouped(module, x.detach(), dy, splits)
    torch.testing.assert_close(y.double(), ref_y, **E4M3)
    torch.testing.assert_close(x.grad.double(), ref_dx, **E4M3)


def test_fp8_padding_under_a_custom_recipe_pads_to_its_alignment(stand_in):
    """TE's Fp8Padding(align_size=None) under a CustomRecipe pads each group to the recipe's
    quantization_alignment; padding -> GroupedLinear -> unpadding matches float64 torch on the
    unpadded rows."""
    import transformer_engine.pytorch as tep

    gen = torch.Generator().manual_seed(9)
    splits = [5, 70, 0, 21]
    recipe = CustomRecipe(qfactory=_current_scaling, quantization_alignment=64)
    pad, unpad = tep.Fp8Padding(4), tep.Fp8Unpadding(4)
    module = tep.GroupedLinear(4, 64, 32, params_dtype=torch.float32)
    with torch.no_grad():
        for i in range(4):
            getattr(module, f"bias{i}").normal_(generator=gen)
    x, dy = torch.randn(sum(splits), 64, generator=gen).requires_grad_(), torch.randn(sum(splits), 32, generator=gen)
    with tep.autocast(recipe=recipe):
        xp, padded = pad(x, splits)
        y = unpad(module(xp, padded), splits)
    y.backward(dy)

    assert padded == [64, 128, 0, 64] and pad.align_size == 64 and unpad.align_size == 64
    ref_y, ref_dx = _float64_grouped(module, x.detach(), dy, splits)
    torch.testing.assert_close(y.double(), ref_y, **E4M3)
    torch.testing.assert_close(x.grad.double(), ref_dx, **E4M3)


@pytest.mark.parametrize("supply", ["out", "dgrad_out", "both"])
def test_grouped_linear_writes_into_caller_buffers(stand_in, supply):
    """TE's test_grouped_linear_caller_output_buffers: forward(out=) returns the caller's buffer
    itself holding the output, backward writes the input gradient into dgrad_out=; both match
    float64 torch, and a buffer of the wrong row count is an error."""
    import transformer_engine.pytorch as tep

    gen = torch.Generator().manual_seed(13)
    splits, rows = [24, 0, 40], 64
    module = tep.GroupedLinear(3, 32, 48, params_dtype=torch.float32)
    with torch.no_grad():
        for i in range(3):
            getattr(module, f"bias{i}").normal_(generator=gen)
    x, dy = torch.randn(rows, 32, generator=gen).requires_grad_(), torch.randn(rows, 48, generator=gen)
    out = torch.full((rows, 48), 7.0) if supply != "dgrad_out" else None
    dgrad = torch.full((rows, 32), 7.0) if supply != "out" else None
    y = module(x, splits, out=out, dgrad_out=dgrad)
    y.backward(dy)

    ref_y, ref_dx = _float64_grouped(module, x.detach(), dy, splits)
    torch.testing.assert_close(y.double(), ref_y, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1.3e-6, atol=1e-5)
    if out is not None:
        assert y.data_ptr() == out.data_ptr()
        torch.testing.assert_close(out.double(), ref_y, rtol=1.3e-6, atol=1e-5)
    if dgrad is not None:
        torch.testing.assert_close(dgrad.double(), ref_dx, rtol=1.3e-6, atol=1e-5)
    with pytest.raises(ValueError, match="out= must be a"):
        module(x, splits, out=torch.empty(rows + 1, 48))
