"""Transformer Engine's backward_override: the forward runs the recipe's FP8 GEMMs; the backward
runs in high precision on the layer's original operands ("high_precision") or on the forward's
FP8 operands dequantized ("dequantized"); no output gradient is cast."""
import math

import pytest
import torch

import te_core.modules as tm
from te_core import recipe
from te_core.quantization import autocast

from ._compare import seeded

RECIPES = {"current": recipe.Float8CurrentScaling, "block": recipe.Float8BlockScaling,
           "mxfp8": recipe.MXFP8BlockScaling}
FP32 = dict(rtol=1.3e-6, atol=1e-5)


def _grads(module, x, dy, rcp=None, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with autocast(enabled=rcp is not None, recipe=rcp):
        y = module(x, **kwargs)
    y.backward(dy)
    return y.detach(), x.grad, {name: p.grad for name, p in module.named_parameters()}


def _build(kind, seed):
    torch.manual_seed(seed)
    if kind == "Linear":
        return tm.Linear(128, 64, params_dtype=torch.float32), {}
    if kind == "LayerNormLinear":
        return tm.LayerNormLinear(128, 64, params_dtype=torch.float32), {}
    return tm.GroupedLinear(2, 128, 64, params_dtype=torch.float32), {"m_splits": [32, 32]}


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "GroupedLinear"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_high_precision_backward_is_the_high_precision_modules(kind, name):
    """backward_override="high_precision": the output is the recipe's FP8 forward bit for bit, and
    every gradient is bit for bit the one the same module computes without FP8 (the backward
    GEMMs read the layer's input and weight as given, on the output gradient as given)."""
    module, kwargs = _build(kind, 1)
    x = torch.randn(64, 128, generator=seeded(2))
    dy = torch.randn(64, 64, generator=seeded(3))
    y_fp8, _, _ = _grads(module, x, dy, RECIPES[name](), **kwargs)
    y, dx, dw = _grads(module, x, dy, RECIPES[name](backward_override="high_precision"), **kwargs)
    _, dx_hp, dw_hp = _grads(module, x, dy, None, **kwargs)
    assert torch.equal(y, y_fp8)
    torch.testing.assert_close(dx, dx_hp, rtol=0, atol=0)
    for param in dw:
        torch.testing.assert_close(dw[param], dw_hp[param], rtol=0, atol=0, msg=param)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_assigned_to_a_recipe_between_steps(name):
    """As Transformer Engine's tests set it (`recipe = copy.deepcopy(recipe); recipe.backward_override
    = ...`): the override assigned to the recipe object a module already ran with applies from the
    next step, and assigning None again restores the FP8 backward, bit for bit."""
    import copy

    module, _ = _build("Linear", 7)
    x = torch.randn(64, 128, generator=seeded(8))
    dy = torch.randn(64, 64, generator=seeded(9))
    rcp = copy.deepcopy(RECIPES[name]())
    _, dx_fp8, dw_fp8 = _grads(module, x, dy, rcp)
    rcp.backward_override = "high_precision"
    y, dx, dw = _grads(module, x, dy, rcp)
    _, dx_hp, dw_hp = _grads(module, x, dy, None)
    torch.testing.assert_close(dx, dx_hp, rtol=0, atol=0)
    torch.testing.assert_close(dw["weight"], dw_hp["weight"], rtol=0, atol=0)
    assert not torch.equal(dx_fp8, dx_hp)
    rcp.backward_override = None
    _, dx_again, dw_again = _grads(module, x, dy, rcp)
    assert torch.equal(dx_again, dx_fp8) and torch.equal(dw_again["weight"], dw_fp8["weight"])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_dequantized_backward_reads_the_forwards_fp8_operands(name):
    """backward_override="dequantized": dgrad = dy @ dequantized FP8 weight, wgrad = dy^T @
    dequantized FP8 input (the row-wise copies the forward GEMM read), in float32; not the
    high-precision gradients."""
    module, _ = _build("Linear", 4)
    x = torch.randn(64, 128, generator=seeded(5))
    dy = torch.randn(64, 64, generator=seeded(6))
    rcp = RECIPES[name](backward_override="dequantized")
    _, dx, dw = _grads(module, x, dy, rcp)
    state = module._recipe_state
    xq = state.quantizer("input").quantize(x).dequantize()
    wq = state.quantizer("weight").quantize(module.weight.detach()).dequantize()
    torch.testing.assert_close(dx, dy @ wq, **FP32)
    torch.testing.assert_close(dw["weight"], dy.t() @ xq, **FP32)
    torch.testing.assert_close(dw["bias"], dy.sum(0), **FP32)
    _, dx_hp, _ = _grads(module, x, dy, None)
    assert not torch.allclose(dx, dx_hp, **FP32)  # the FP8 weight, not the weight


class _MM(torch.autograd.Function):
    """x @ w.T computed on (xq, wq), its gradients on (xb, wb): the reference of one GEMM."""

    @staticmethod
    def forward(ctx, x, w, xq, wq, xb, wb):
        ctx.save_for_backward(xb, wb)
        return xq @ wq.t()

    @staticmethod
    def backward(ctx, dy):
        xb, wb = ctx.saved_tensors
        return dy @ wb, dy.t() @ xb, None, None, None, None


def _gelu(h):
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_layernorm_mlp_backward_follows_the_override(name, mode):
    """LayerNormMLP under each override against a float64 reference that runs the same FP8
    forward (operands quantized by the module's own quantizers) and takes each GEMM's gradients
    on the original operands (high_precision) or the dequantized ones (dequantized): relative L2
    error well below the gap between the two overrides. On an accelerator the FP8 GEMMs themselves
    differ from float64 (Hopper's tensor cores accumulate each K block of FP8 products in reduced
    precision: about 1e-4 relative at K=128 whatever the split), which moves the first GEMM's
    output and so some FP8 bytes of the second GEMM's input cast from it: there the bound is
    looser and the gap need only be several times the error."""
    torch.manual_seed(7)
    mlp = tm.LayerNormMLP(128, 256, params_dtype=torch.float32)
    x = torch.randn(64, 128, generator=seeded(8))
    dy = torch.randn(64, 128, generator=seeded(9))
    _, dx, dw = _grads(mlp, x, dy, RECIPES[name](backward_override=mode))
    state = mlp._recipe_state

    def q(slot, t):  # the module's cast of t, in float64
        return state.quantizer(slot).quantize(t.detach().float()).dequantize().double()

    def reference(which):
        xr = x.double().requires_grad_(True)
        params = {n: p.detach().double().requires_grad_(True) for n, p in mlp.named_parameters()}
        y1 = torch.nn.functional.layer_norm(xr, (128,), params["layer_norm_weight"], params["layer_norm_bias"],
                                            eps=mlp.eps)
        w1, w2 = params["fc1_weight"], params["fc2_weight"]
        q1, qw1 = q("fc1_input", y1), q("fc1_weight", w1)
        h = _MM.apply(y1, w1, q1, qw1, *((y1, w1) if which == "high_precision" else (q1, qw1))) + params["fc1_bias"]
        a = _gelu(h)
        q2, qw2 = q("fc2_input", a), q("fc2_weight", w2)
        y = _MM.apply(a, w2, q2, qw2, *((a, w2) if which == "high_precision" else (q2, qw2))) + params["fc2_bias"]
        y.backward(dy.double())
        return xr.grad, {n: p.grad for n, p in params.items()}

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    want_dx, want = reference(mode)
    other_dx, other = reference("dequantized" if mode == "high_precision" else "high_precision")
    for got, ref, alt, what in [(dx, want_dx, other_dx, "input"),
                                *((dw[n], want[n], other[n], n) for n in ("fc1_weight", "fc2_weight"))]:
        err, gap = rel(got, ref), rel(alt, ref)
        exact = x.device.type == "cpu"  # (the reference backend)
        assert err < (1e-4 if exact else 1e-2) and gap > (100 if exact else 4) * err, (what, err, gap)
