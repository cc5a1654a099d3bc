"""return_residual: the fused norm modules hand back their input as the block's residual, and its
gradient is summed into dx by the norm's backward (layernorm_bwd_add / rmsnorm_bwd_add) instead
of by autograd. Same numbers as the plain residual, with and without the fused op."""

import copy

import pytest
import torch

import te_core.modules as tm
from te_core import backend, ops, recipe
from te_core.modules import _norm
from te_core.quantization import autocast

from ._compare import randomize_, seeded


def _block(kind, normalization):
    torch.manual_seed(0)
    if kind == "mlp":
        module = tm.LayerNormMLP(32, 64, normalization=normalization)
    else:
        module = tm.LayerNormLinear(32, 32, normalization=normalization)
    randomize_(module, seed=2, std=0.2)
    return module


def _residual_step(module, x, fused, rec=None):
    """out = residual + block(x); returns (out, x.grad, parameter grads)."""
    x = x.clone().requires_grad_(True)
    with autocast(enabled=rec is not None, recipe=rec):
        if fused:
            y, residual = module(x, return_residual=True)
        else:
            y, residual = module(x), x
    out = residual + y
    out.backward(torch.randn(out.shape, generator=seeded(3)))
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("kind", ["mlp", "linear"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("rec", [None, "delayed"])
def test_returned_residual_matches_the_input_as_residual(kind, normalization, rec):
    module = _block(kind, normalization)
    twin = copy.deepcopy(module)
    x = torch.randn(4, 4, 32)
    make = (lambda: None) if rec is None else (lambda: recipe.DelayedScaling())
    got = _residual_step(module, x, True, make())
    want = _residual_step(twin, x, False, make())
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1.3e-6, atol=1e-5)
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name


def test_norm_backward_takes_the_residual_gradient(monkeypatch):
    calls = []
    real = ops.layernorm_bwd_add
    monkeypatch.setattr(_norm.ops, "layernorm_bwd_add", lambda *a, **k: (calls.append(a[5]), real(*a, **k))[1])
    module = _block("mlp", "LayerNorm")
    x = torch.randn(4, 32, requires_grad=True)
    y, residual = module(x, return_residual=True)
    dout = torch.randn(4, 32)
    (residual + y).backward(dout)
    assert len(calls) == 1 and torch.equal(calls[0], dout)


def test_without_the_fused_op_the_sum_is_still_made(monkeypatch):
    module = _block("mlp", "RMSNorm")
    twin = copy.deepcopy(module)
    x = torch.randn(6, 32)
    want = _residual_step(twin, x, False)
    monkeypatch.setattr(backend, "declares", lambda name: False)
    got = _residual_step(module, x, True)
    torch.testing.assert_close(got[1], want[1], rtol=1.3e-6, atol=1e-5)


def test_cast_input_keeps_its_own_residual():
    """Under torch.autocast the block computes in bf16; the residual stays the fp32 input."""
    module = _block("linear", "LayerNorm")
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y, residual = module(x, return_residual=True)
    assert residual.dtype == torch.float32 and torch.equal(residual, x)
    (residual + y.float()).sum().backward()
    assert x.grad is not None


def test_transformer_layer_residuals_come_from_the_norms(monkeypatch):
    """Both residual gradients of a TransformerLayer step go through the norms' backward."""
    added = []
    real = ops.rmsnorm_bwd_add
    monkeypatch.setattr(_norm.ops, "rmsnorm_bwd_add", lambda *a, **k: (added.append(1), real(*a, **k))[1])
    torch.manual_seed(0)
    layer = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm")
    layer(torch.randn(6, 2, 32, requires_grad=True)).sum().backward()
    assert len(added) == 2
