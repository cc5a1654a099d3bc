"""LayerNormLinear / Linear(split_sizes=...): the output as views whose gradients the backward
reads in place. Same numbers as splitting the unsplit output, with every recipe; the delayed recipe's
gradient cast takes the parts without concatenating them."""

import copy

import pytest
import torch

import te_core.modules as tm
from te_core import ops, recipe
from te_core.quantization import autocast, quantizers

from ._compare import randomize_, seeded

RECIPES = {
    "none": lambda: None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
}
SPLIT = (32, 16, 16)


def _step(module, x, rec, split, dys):
    """Two fwd+bwd steps (delayed scaling calibrates on the first); the outputs and grads of the last."""
    for _ in range(2):
        module.zero_grad()
        x_in = x.clone().requires_grad_(True)
        with autocast(enabled=rec is not None, recipe=rec):
            out = module(x_in, split_sizes=split) if split else module(x_in)
        parts = out if split else out.split(SPLIT, dim=-1)
        sum((p * dy).sum() for p, dy in zip(parts, dys)).backward()
    return [p.detach() for p in parts], x_in.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("rec", list(RECIPES))
@pytest.mark.parametrize("used", [(0, 1, 2), (1,)])
@pytest.mark.parametrize("cls", [tm.LayerNormLinear, tm.Linear])
def test_split_output_equals_split_of_the_output(cls, rec, used):
    torch.manual_seed(0)
    module = cls(48, sum(SPLIT))
    randomize_(module, seed=3, std=0.2)
    twin = copy.deepcopy(module)
    x = torch.randn(4, 8, 48)
    g = seeded(5)
    # an unused part's gradient is zeros (autograd materializes it for the Function)
    dys = [torch.randn(4, 8, n, generator=g) * (i in used) for i, n in enumerate(SPLIT)]
    got = _step(module, x, RECIPES[rec](), SPLIT, dys)
    want = _step(twin, x, RECIPES[rec](), None, dys)
    for a, b in zip(got[0], want[0]):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(got[1], want[1])
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name
    assert got[1].abs().sum() > 0


def test_delayed_gradient_cast_reads_the_parts(monkeypatch):
    calls = []

    class Spy:
        def __getattr__(self, name):
            op = getattr(ops, name)
            return lambda *a, **k: (calls.append(name), op(*a, **k))[1]

    monkeypatch.setattr(quantizers, "ops", Spy())
    module = tm.LayerNormLinear(48, sum(SPLIT))
    x = torch.randn(16, 48, requires_grad=True)
    with autocast(recipe=recipe.DelayedScaling()):
        q, k, v = module(x, split_sizes=SPLIT)
    (q.sum() + 2 * k.sum() + 3 * v.sum()).backward()
    assert "dbias_cast_transpose_parts" in calls and "dbias_cast_transpose" not in calls


@pytest.mark.parametrize("kind,epilogue", [("current", "dbias_cast_transpose_current"),
                                            ("block", "dbias_cast_transpose_blockwise")])
@pytest.mark.parametrize("split", [SPLIT, None])
def test_gradient_cast_fuses_the_bias_gradient(monkeypatch, split, kind, epilogue):
    """Current and block scaling cast the output gradient and sum its bias gradient in one op,
    reading a split output's parts in place; the gradients equal those of the unfused path
    (cast, then torch's sum) bit for bit, but the bias gradient, which a backend may sum in
    another order."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            op = getattr(ops, name)
            return lambda *a, **k: (calls.append((name, a)), op(*a, **k))[1]

    def grads(fused):
        torch.manual_seed(0)
        module = tm.LayerNormLinear(48, sum(SPLIT))
        randomize_(module, seed=3, std=0.2)
        x = torch.randn(16, 48, requires_grad=True)
        with monkeypatch.context() as m:
            m.setattr(quantizers, "ops", Spy())
            if not fused:
                m.setattr(quantizers, "declares", lambda name: name != epilogue)
            with autocast(recipe=RECIPES[kind]()):
                out = module(x, split_sizes=split) if split else module(x).split(SPLIT, dim=-1)
            sum((i + 1) * p.square().sum() for i, p in enumerate(out)).backward()
        return {"x": x.grad, **{name: p.grad for name, p in module.named_parameters()}}

    unfused = grads(False)
    assert not any(name == epilogue for name, _ in calls)
    calls.clear()
    fused = grads(True)
    epilogues = [args for name, args in calls if name == epilogue]
    assert len(epilogues) == 1 and len(epilogues[0][0]) == (3 if split else 1)
    assert fused.keys() == unfused.keys()
    for name, grad in unfused.items():
        if name == "bias":
            torch.testing.assert_close(fused[name], grad, rtol=1.3e-6, atol=1e-5)
        else:
            assert torch.equal(fused[name], grad), name
    assert fused["bias"].abs().sum() > 0


def test_linear_split_without_grad_and_with_bias_returned():
    module = tm.Linear(16, 24, return_bias=True)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        (q, k), bias = module(x, split_sizes=(8, 16))
        whole, _ = module(x)
    assert torch.equal(torch.cat([q, k], dim=-1), whole) and bias is module.bias and q.shape == (2, 3, 8)


def test_split_with_layernorm_output():
    module = tm.LayerNormLinear(16, 24, return_layernorm_output=True)
    (q, k), ln_out = module(torch.randn(3, 16), split_sizes=(8, 16))
    assert q.shape == (3, 8) and k.shape == (3, 16) and ln_out.shape == (3, 16)


@pytest.mark.parametrize("sizes, match", [((8, 8), "sum to 16, not out_features=24"), ((24, 0), "positive integers"),
                                          ((12.0, 12), "positive integers"), ((), "positive integers")])
@pytest.mark.parametrize("cls", [tm.LayerNormLinear, tm.Linear])
def test_bad_split_sizes(cls, sizes, match):
    module = cls(16, 24)
    with pytest.raises(ValueError, match=match):
        module(torch.randn(2, 16), split_sizes=sizes)


def test_multihead_attention_without_input_layernorm_matches_plain():
    """MultiheadAttention's plain QKV Linear now returns q, k, v split: its gradients match the
    unfused computation done in float64 (fp32 tolerances, relative to the largest value)."""
    torch.manual_seed(0)
    s, b, h, heads = 6, 2, 32, 4
    mha = tm.MultiheadAttention(h, heads, attention_dropout=0.0, attn_mask_type="causal")
    randomize_(mha, seed=7, std=0.2)
    x = torch.randn(s, b, h, requires_grad=True)
    mha(x).pow(2).sum().backward()
    got = (x.grad, mha.qkv.weight.grad, mha.qkv.bias.grad)

    f64 = [t.detach().double().requires_grad_(True) for t in (x, mha.qkv.weight, mha.qkv.bias)]
    qkv = torch.nn.functional.linear(*f64)
    q, k, v = (t.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3) for t in qkv.split(h, dim=-1))
    ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    proj = [p.detach().double() for p in (mha.proj.weight, mha.proj.bias)]
    out = torch.nn.functional.linear(ctx.permute(2, 0, 1, 3).reshape(s, b, h), *proj)
    want = torch.autograd.grad(out.pow(2).sum(), f64)
    for g, ref in zip(got, want):
        scale = ref.abs().max()
        assert g.abs().sum() > 0
        torch.testing.assert_close(g.double() / scale, ref / scale, rtol=1.3e-6, atol=1e-5)
