"""Layers reading the same tensor share its cast where the cast depends on the tensor alone
(current, block and MXFP8 scaling): a block built as Hugging Face builds Llama's (separate query,
key and value projections of one normed input; gate and up projections of another) casts each
shared input once, and computes exactly what it computes when every layer casts a copy of its own."""

import gc
import weakref

import pytest
import torch

import te_core as te
from te_core import recipe
from te_core.ops._spec import Op

RECIPES = {
    "delayed": recipe.DelayedScaling,
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
}
CASTS = {"quantize_fp8", "cast_transpose_fp8", "quantize_fp8_current", "quantize_blockwise", "quantize_mxfp8"}
HIDDEN, FFN, TOKENS, BATCH = 128, 256, 32, 2


class _LlamaStyleBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        kw = dict(bias=False, params_dtype=torch.float32)
        self.norm1, self.norm2 = te.RMSNorm(HIDDEN), te.RMSNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (te.Linear(HIDDEN, HIDDEN, **kw) for _ in range(4))
        self.gate, self.up = te.Linear(HIDDEN, FFN, **kw), te.Linear(HIDDEN, FFN, **kw)
        self.down = te.Linear(FFN, HIDDEN, **kw)

    def forward(self, x, own_copies=False):
        # own_copies: every layer reads a copy of its input of its own, so no cast is shared
        each = (lambda t: t.clone()) if own_copies else (lambda t: t)
        h = self.norm1(x)
        q, k, v = self.q(each(h)), self.k(each(h)), self.v(each(h))
        x = x + self.o(q * torch.sigmoid(k) + v)
        h = self.norm2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(each(h))) * self.up(each(h)))


def _step(block, rec, own_copies):
    torch.manual_seed(1)
    x = torch.randn(BATCH, TOKENS, HIDDEN, requires_grad=True)
    with te.autocast(recipe=rec):
        y = block(x, own_copies)
    y.backward(torch.randn_like(y))
    grads = [x.grad] + [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    return [y.detach(), *grads]


def _counting_casts(monkeypatch):
    calls = []
    real = Op.__call__

    def counted(op, *args, **kwargs):
        if op.name in CASTS:
            calls.append(op.name)
        return real(op, *args, **kwargs)

    monkeypatch.setattr(Op, "__call__", counted)
    return calls


@pytest.mark.parametrize("name", list(RECIPES))
def test_sibling_layers_share_a_cast_and_compute_the_same(name, monkeypatch):
    rec = RECIPES[name]()
    calls = _counting_casts(monkeypatch)
    shared_block, own_block = _LlamaStyleBlock(), _LlamaStyleBlock()
    for step in range(2):  # (delayed scaling: a fresh state's first step, then an updated one)
        calls.clear()
        got = _step(shared_block, rec, own_copies=False)
        shared_casts = len(calls)
        calls.clear()
        want = _step(own_block, rec, own_copies=True)
        own_casts = len(calls)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"step {step}, tensor {i}"
        # q, k and v read one input, gate and up another: 3 casts fewer (none with delayed
        # scaling, which casts with each layer's own scale)
        assert own_casts - shared_casts == (0 if name == "delayed" else 3), (shared_casts, own_casts)


def test_a_write_between_the_layers_casts_again(monkeypatch):
    rec = recipe.Float8CurrentScaling()
    calls = _counting_casts(monkeypatch)
    torch.manual_seed(0)
    a, b = te.Linear(HIDDEN, HIDDEN), te.Linear(HIDDEN, HIDDEN)
    x = torch.randn(TOKENS, HIDDEN)
    with te.autocast(recipe=rec):
        a(x)
        x.mul_(3.0)  # the version counter moves: b's cast must read the new values
        got = b(x)
        n = len(calls)
        want = b(x.clone())
    assert n == 4 and torch.equal(got, want)  # each layer's input and weight
    with te.autocast(recipe=rec):  # a view of another shape, or of other elements, is another tensor
        a(x)
        calls.clear()
        b(x[: TOKENS // 2])
        b(x[TOKENS // 2:])
    assert len(calls) == 4


def test_without_autograd_and_under_inference_mode(monkeypatch):
    rec = recipe.Float8BlockScaling()
    calls = _counting_casts(monkeypatch)
    torch.manual_seed(0)
    a, b = te.Linear(HIDDEN, HIDDEN), te.Linear(HIDDEN, HIDDEN)
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad(), te.autocast(recipe=rec):
        ya, yb = a(x), b(x)  # shared: 2 casts (the weights) and 1 of x
    assert len(calls) == 3
    with torch.no_grad(), te.autocast(recipe=rec):
        assert torch.equal(yb, b(x.clone()))
    calls.clear()
    with torch.inference_mode(), te.autocast(recipe=rec):
        xi = x.clone()  # an inference tensor carries no version counter: never shared
        za, zb = a(xi), b(xi)
    assert len(calls) == 4 and torch.equal(za, ya) and torch.equal(zb, yb)


def test_the_autocast_keeps_no_tensor_alive_after_it():
    torch.manual_seed(0)
    lin = te.Linear(HIDDEN, HIDDEN)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    h = x * 2.0
    alive = weakref.ref(h)
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        y = lin(h)
    del h
    gc.collect()
    # the forward saved h's FP8 copy, not h; the step saved for the backward holds the autocast's
    # context, whose shared cast must have let go of h at the autocast's exit
    assert alive() is None
    y.sum().backward()
    assert x.grad is not None


def test_a_kept_cast_dies_with_its_source():
    """Without autograd nothing else keeps a layer's input cast: the shared entry lets go of it
    as soon as the tensor it was cast from is gone, and never keeps that tensor alive."""
    torch.manual_seed(0)
    lin = te.Linear(HIDDEN, HIDDEN)
    casts = []
    real = Op.__call__
    with torch.no_grad(), te.autocast(recipe=recipe.Float8CurrentScaling()):
        h = torch.randn(BATCH, TOKENS, HIDDEN)  # a 3-D input: the layer casts its own 2-D view
        source = weakref.ref(h)
        try:
            Op.__call__ = lambda op, *a, **k: casts.append(real(op, *a, **k)) or casts[-1]
            lin(h)
        finally:
            Op.__call__ = real
        data = [weakref.ref(t) for out in casts for t in (out if isinstance(out, tuple) else (out,))
                if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn and t.shape[0] == BATCH * TOKENS]
        casts.clear()
        assert data and all(d() is not None for d in data)  # the entry keeps h's cast while h lives
        del h
        gc.collect()
        assert source() is None and all(d() is None for d in data)

