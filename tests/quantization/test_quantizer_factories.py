"""te_core.quantization.factories, Transformer Engine's custom_recipes.quantizer_factories: a
CustomRecipe from each factory runs as the built-in recipe it mirrors, bit for bit; the factories
te-core cannot back refuse with what to use instead."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.dtype import DType
from te_core.quantization.factories import (
    current_scaling_factory,
    delayed_scaling_factory,
    float8_block_scaling_factory,
    high_precision_factory,
    mxfp8_factory,
    nvfp4_factory,
)
from te_core.recipe import CustomRecipe, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

from .conftest import randn
from .test_custom_recipe import assert_bitwise, twins

GEMM_ROLES = ("input", "weight", "grad_output")


def run(module, x, dy, recipe):
    """Output, input gradient and parameter gradients; recipe None: outside te.autocast."""
    x = x.clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x)
    y.backward(dy)
    return y, x.grad, [p.grad for p in module.parameters()]


BUILT_IN = [(current_scaling_factory, Float8CurrentScaling()), (mxfp8_factory, MXFP8BlockScaling()),
            (float8_block_scaling_factory, Float8BlockScaling())]


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormMLP])
@pytest.mark.parametrize("factory, built_in", BUILT_IN, ids=["current", "mxfp8", "block"])
def test_each_factory_is_its_built_in_recipe(gen, factory, built_in, cls):
    """Output and every gradient equal the built-in recipe's bit for bit (Transformer Engine says
    they match), and they are FP8: not the layer's high-precision output."""
    a, b = twins(cls, 128, 256)
    x, dy = randn(gen, 64, 128, scale=2.0), randn(gen, 64, 128 if cls is te.LayerNormMLP else 256)
    got = run(b, x, dy, CustomRecipe(qfactory=factory))
    assert_bitwise(run(a, x, dy, built_in), got)
    with torch.no_grad():
        assert not torch.equal(got[0], a(x))


def cast(factory, tensor_type, t):
    """t's values after the factory's cast for a linear layer's `tensor_type`, in float64."""
    return factory(te.QuantizerRole("linear", tensor_type))(t).dequantize().double()


@pytest.mark.parametrize("factory", [current_scaling_factory, mxfp8_factory, float8_block_scaling_factory],
                         ids=["current", "mxfp8", "block"])
def test_a_factory_linear_is_the_float64_gemm_of_its_casts(gen, factory):
    """te.Linear under the factory's recipe computes x W^T + b on the FP8 values of x and W its
    quantizers make: the float64 product of those values, to float32 accumulation."""
    layer = te.Linear(256, 128, params_dtype=torch.float32)
    x, dy = randn(gen, 64, 256, scale=2.0), randn(gen, 64, 128)
    y, dx, (dw, db) = run(layer, x, dy, CustomRecipe(qfactory=factory))
    x8, w8 = cast(factory, "input", x), cast(factory, "weight", layer.weight.detach())
    want = x8 @ w8.T + layer.bias.double()
    torch.testing.assert_close(y.double(), want, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(db.double(), dy.double().sum(0), rtol=1.3e-6, atol=1e-5)
    if factory is current_scaling_factory:  # one scale per tensor: the backward's casts are these too
        dy8 = cast(factory, "grad_output", dy)
        torch.testing.assert_close(dx.double(), dy8 @ w8, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(dw.double(), dy8.T @ x8, rtol=1.3e-6, atol=1e-5)


def test_the_high_precision_factory_is_the_layer_outside_autocast(gen):
    a, b = twins(te.Linear, 96, 80)
    x, dy = randn(gen, 3, 16, 96, scale=2.0), randn(gen, 3, 16, 80)
    assert_bitwise(run(a, x, dy, None), run(b, x, dy, CustomRecipe(qfactory=high_precision_factory)))


@pytest.mark.parametrize("module_type", ["linear", "grouped_linear"])
def test_the_factories_choose_per_role_as_transformer_engines(module_type):
    """E4M3 forward / E5M2 gradients for current scaling; E4M3 everywhere for the block formats;
    128x128 tiles only for a weight; TE's scale options; a None role gets the forward choices."""
    roles = {t: te.QuantizerRole(module_type, t, "fc1") for t in GEMM_ROLES}
    for tensor_type, role in roles.items():
        current = current_scaling_factory(role)
        assert isinstance(current, te.Float8CurrentScalingQuantizer)
        assert current.fp8_dtype == (torch.float8_e5m2 if tensor_type == "grad_output" else torch.float8_e4m3fn)
        assert current.force_pow_2_scales is False and current.amax_epsilon == 0.0
        block = float8_block_scaling_factory(role)
        assert isinstance(block, te.Float8BlockQuantizer) and block.fp8_dtype == torch.float8_e4m3fn
        assert block.block_scaling_dim == (2 if tensor_type == "weight" else 1)
        assert block.force_pow_2_scales is True and block.amax_epsilon == 0.0
        assert block.rowwise_usage and block.columnwise_usage
        mx = mxfp8_factory(role)
        assert isinstance(mx, te.MXFP8Quantizer) and mx.fp8_dtype == torch.float8_e4m3fn
        assert type(high_precision_factory(role)) is te.IdentityQuantizer
    assert current_scaling_factory(None).fp8_dtype == torch.float8_e4m3fn
    assert float8_block_scaling_factory(None).block_scaling_dim == 1
    # a weight of a module other than a linear one (TE's attention roles) gets 1x128 blocks, as in TE
    assert float8_block_scaling_factory(te.QuantizerRole("dpa", "weight")).block_scaling_dim == 1


@pytest.mark.parametrize("factory, match", [
    (delayed_scaling_factory, r"does not provide Transformer Engine's DelayedScalingRequest.*"
                              r"te.autocast\(recipe=DelayedScaling\(\)\).*current_scaling_factory"),
    (nvfp4_factory, "NVFP4 .* is not supported by te-core yet.*mxfp8_factory.*float8_block_scaling_factory"),
])
def test_the_factories_te_core_cannot_back_refuse(gen, factory, match):
    with pytest.raises(NotImplementedError, match=match):
        factory(te.QuantizerRole("linear", "input"))
    with pytest.raises(NotImplementedError, match=match), te.autocast(recipe=CustomRecipe(qfactory=factory)):
        te.Linear(64, 32)(randn(gen, 16, 64))


def test_a_role_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="current_scaling_factory: role must be a QuantizerRole .* got 'linear_input'"):
        current_scaling_factory("linear_input")


def test_grad_output_is_e5m2_in_the_backward(gen):
    """The factory's E5M2 gradient cast is the one the backward runs: with an E4M3 gradient
    quantizer instead, the input gradient differs."""
    a, b = twins(te.Linear, 128, 64)
    x, dy = randn(gen, 32, 128), randn(gen, 32, 64, scale=3.0)

    def all_e4m3(role):
        return te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3)

    assert not torch.equal(run(a, x, dy, CustomRecipe(qfactory=current_scaling_factory))[1],
                           run(b, x, dy, CustomRecipe(qfactory=all_e4m3))[1])
