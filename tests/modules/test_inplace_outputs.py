"""Module outputs a model modifies in place before using them (`y *= scale` after a norm, as
Hugging Face's Mixtral, PhiMoE and Gemma blocks do; `y.add_(...)` after a Linear): autograd takes
them as it takes torch's own modules' outputs, and the gradients equal those of the same
computation written without the in-place op. An output that is a view made inside an autograd
Function could not be modified in place."""
import pytest
import torch

import te_core as te

FP32 = dict(rtol=1.3e-6, atol=1e-5)
BUILD = {
    "LayerNorm": lambda: te.LayerNorm(16),
    "RMSNorm": lambda: te.RMSNorm(16),
    "Linear": lambda: te.Linear(16, 8),
    "LayerNormLinear": lambda: te.LayerNormLinear(16, 8),
    "LayerNormMLP": lambda: te.LayerNormMLP(16, 32),
}


@pytest.mark.parametrize("shape", [(6, 16), (3, 2, 16)], ids=["2d", "3d"])
@pytest.mark.parametrize("name", list(BUILD))
def test_outputs_take_in_place_updates(name, shape):
    torch.manual_seed(0)
    module = BUILD[name]()
    x = torch.randn(shape)
    scale = torch.randn(shape[:-1] + (1,))
    grads = []
    for in_place in (True, False):
        xi = x.clone().requires_grad_()
        y = module(xi)
        if in_place:
            y *= scale
            y.add_(1.0)
        else:
            y = y * scale + 1.0
        y.square().sum().backward()
        grads.append([xi.grad] + [p.grad.clone() for p in module.parameters()])
        module.zero_grad(set_to_none=True)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("name", ["LayerNormLinear", "LayerNormMLP"])
def test_a_returned_norm_output_takes_in_place_updates(name):
    """return_layernorm_output=True: the norm output the module returns, modified in place by
    the caller (its GEMM has read it already under FP8, which keeps its own copy), carries its
    gradient back as the out-of-place computation's does."""
    torch.manual_seed(0)
    module = {"LayerNormLinear": lambda: te.LayerNormLinear(16, 16, return_layernorm_output=True),
              "LayerNormMLP": lambda: te.LayerNormMLP(16, 32, return_layernorm_output=True)}[name]()
    x = torch.randn(4, 2, 16)
    grads = []
    for in_place in (True, False):
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
            y, ln_out = module(xi)
        if in_place:
            ln_out *= 3.0
        else:
            ln_out = ln_out * 3.0
        (y.float().square().sum() + ln_out.float().sum()).backward()
        grads.append([xi.grad] + [p.grad.clone() for p in module.parameters()])
        module.zero_grad(set_to_none=True)
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, **FP32)
