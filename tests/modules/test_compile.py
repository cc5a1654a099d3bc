"""torch.compile in high precision: the modules trace without graph breaks and match eager
(FP8 under te.autocast: test_compile_fp8.py). aot_eager keeps the test fast."""


import pytest
import torch

import te_core.modules as tm


def make_layer():
    torch.manual_seed(0)
    return tm.TransformerLayer(
        64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm", activation="swiglu"
    )


def fwd_bwd(fn, layer, x):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.pow(2).sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in layer.parameters()]


def assert_same(a, b, **tol):
    for ta, tb in zip([a[0], a[1], *a[2]], [b[0], b[1], *b[2]]):
        torch.testing.assert_close(ta, tb, **tol)


def test_high_precision_compiles_without_graph_breaks():
    layer = make_layer()
    x = torch.randn(32, 2, 64)
    eager = fwd_bwd(layer, layer, x)
    layer.zero_grad()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert_same(fwd_bwd(compiled, layer, x), eager, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("make", [
    lambda: tm.LayerNormLinear(64, 48, return_layernorm_output=True),
    lambda: tm.LayerNormMLP(64, 128, normalization="RMSNorm", activation="swiglu", return_layernorm_output=True),
], ids=["LayerNormLinear", "LayerNormMLP"])
def test_compiled_gradients_reach_every_output(make):
    """Every output's gradient, the norm output's included, reaches the parameters as in eager
    (on torch 2.11 a Function output made by a no-op .to(), or also saved for backward, got a
    zero gradient under torch.compile)."""
    torch.manual_seed(0)
    layer = make()
    x = torch.randn(16, 2, 64)

    def fwd_bwd_all(fn):
        inp = x.clone().requires_grad_(True)
        outs = fn(inp)
        sum(o.pow(2).sum() for o in outs).backward()
        grads = [inp.grad] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        return grads

    eager = fwd_bwd_all(layer)
    compiled = fwd_bwd_all(torch.compile(layer, backend="aot_eager", fullgraph=True))
    assert all(g.abs().sum() > 0 for g in eager)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
