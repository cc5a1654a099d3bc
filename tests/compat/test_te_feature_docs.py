"""Patterns of Transformer Engine's PyTorch feature documentation (low-precision training pages,
debug tools), on te-core's own small code through the stand-in (reference backend, CPU). Where
te-core refuses what a page does (NVFP4, the debug API) or the page does what Transformer Engine
itself refuses (`te.common`), the error must say what to do instead, and doing it must work."""
from __future__ import annotations

import importlib.util

import pytest
import torch

FP32 = dict(rtol=1.3e-6, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)
IN, OUT, TOKENS = 128, 64, 96  # multiples of 32 (MXFP8 blocks); IN: one 128-wide 2D weight block


def _linear_reference(layer, x):
    return x.double() @ layer.weight.double().T + layer.bias.double()


def test_te_common_is_refused_with_where_the_recipes_are(stand_in):
    """The blockwise-scaling page writes te.common.recipe.Format, which Transformer Engine's
    transformer_engine.pytorch has no attribute for either: the error says where the recipes are,
    and the page's recipe imported from there runs (forward and input gradient near float64)."""
    import transformer_engine.pytorch as te

    assert not hasattr(te, "common")
    with pytest.raises(AttributeError, match=r"has no 'common' either; import the recipes and Format from "
                                             r"transformer_engine\.common\.recipe"):
        te.common  # noqa: B018 - the access is the test
    from transformer_engine.common.recipe import Float8BlockScaling, Format

    recipe = Float8BlockScaling(fp8_format=Format.E4M3, x_block_scaling_dim=1, w_block_scaling_dim=2,
                                grad_block_scaling_dim=1)
    torch.manual_seed(0)
    layer = te.Linear(IN, OUT)
    x = torch.randn(TOKENS, IN, requires_grad=True)
    with te.autocast(enabled=True, recipe=recipe):
        out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.testing.assert_close(out.double(), _linear_reference(layer, x.detach()), **E4M3)
    torch.testing.assert_close(x.grad.double(), grad.double() @ layer.weight.double(), **E4M3)


def test_debug_api_import_says_what_to_do_instead(stand_in):
    """transformer_engine.debug (the precision debug tools' features, which nvdlfw_inspect loads)
    is refused naming the replacement for DisableFP8Layer; that replacement, a nested
    te.autocast(enabled=False), runs the layer in float32 inside an FP8 region."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    advice = r"nvdlfw_inspect.*run it under te\.autocast\(enabled=False\) nested in the FP8 one"
    with pytest.raises(ModuleNotFoundError, match=advice):
        import transformer_engine.debug  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match=advice):
        from transformer_engine.debug.features.api import TEConfigAPIMapper  # noqa: F401
    assert importlib.util.find_spec("transformer_engine.debug") is None

    torch.manual_seed(1)
    fp8_layer, kept_layer = te.Linear(IN, OUT), te.Linear(OUT, OUT)
    x = torch.randn(TOKENS, IN)
    with te.autocast(enabled=True, recipe=DelayedScaling()):
        hidden = fp8_layer(x)
        with te.autocast(enabled=False):
            out = kept_layer(hidden)
    torch.testing.assert_close(hidden.double(), _linear_reference(fp8_layer, x), **E4M3)
    expected = torch.nn.functional.linear(hidden, kept_layer.weight, kept_layer.bias)
    torch.testing.assert_close(out, expected, **FP32)


def test_nvfp4_refusal_names_the_recipe_to_use(stand_in):
    """The NVFP4 page's example fails at autocast entry, before any GEMM, naming MXFP8BlockScaling
    as the nearest recipe; that recipe runs the same layer (near float64)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import MXFP8BlockScaling, NVFP4BlockScaling

    advice = r"pass one of them as the recipe instead \(MXFP8BlockScaling\(\) is the nearest"
    torch.manual_seed(2)
    layer = te.Linear(IN, OUT)
    x = torch.randn(TOKENS, IN)
    with pytest.raises(NotImplementedError, match=advice):
        with te.autocast(enabled=True, recipe=NVFP4BlockScaling()):
            layer(x)
    available, reason = te.is_nvfp4_available(return_reason=True)
    assert not available and "MXFP8BlockScaling() is the nearest" in reason

    with te.autocast(enabled=True, recipe=MXFP8BlockScaling()):
        out = layer(x)
    torch.testing.assert_close(out.double(), _linear_reference(layer, x), **E4M3)
