"""LayerNormMLP's backward frees each forward intermediate (pre-activation, FP8 column-wise
copies) once it has used it, unless the graph is retained: the peak memory of a training
step is set at the end of this backward, where these used to be kept alive to the end."""

import weakref

import pytest
import torch

import te_core.modules as tm
from te_core import recipe
from te_core.modules import _saved, layernorm_mlp
from te_core.quantization import autocast

HOLDS_ON_CTX = pytest.mark.skipif(not _saved.HOLDS_INTERMEDIATES, reason=(
    "this torch (2.7) cannot tell whether saved-tensor hooks are active, so te-core saves intermediates "
    "through save_for_backward and frees none early"))


def _node_with_intermediates(t):
    todo = [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        if hasattr(node, "held_intermediates"):
            return node
        todo.extend(n for n, _ in node.next_functions)
    raise AssertionError("no LayerNormMLP backward node in the graph")


def _run(monkeypatch, fp8: bool, retain: bool):
    torch.manual_seed(0)
    mlp = tm.LayerNormMLP(32, 64)
    x = torch.randn(16, 32, requires_grad=True)
    dy = torch.randn(16, 32)
    rec = recipe.DelayedScaling() if fp8 else None
    if fp8:  # steps first, until the scales have settled: the same step then casts the same
        for _ in range(3):  # (each gradient's amax depends on the scales the step before used)
            with autocast(recipe=rec):
                mlp(x).backward(dy)
        mlp.zero_grad()
        x.grad = None
    with autocast(enabled=fp8, recipe=rec):
        y = mlp(x)
    held = _node_with_intermediates(y).held_intermediates
    refs = [weakref.ref(t) for t in held if t is not None]
    assert len(refs) == 5
    del held
    alive_at_norm_backward = []
    real = layernorm_mlp.norm_grads

    def spy(*args, **kwargs):
        alive_at_norm_backward.append([r() is not None for r in refs])
        return real(*args, **kwargs)

    monkeypatch.setattr(layernorm_mlp, "norm_grads", spy)
    y.backward(dy, retain_graph=retain)
    return alive_at_norm_backward[0], mlp, x, y, dy


@HOLDS_ON_CTX
@pytest.mark.parametrize("fp8", [False, True])
def test_intermediates_are_freed_before_the_norm_backward(monkeypatch, fp8):
    alive, *_ = _run(monkeypatch, fp8, retain=False)
    # (ln_out, fc1 weight, pre-activation, activation, fc2 weight): in high precision the
    # weights are the parameters themselves, which the module keeps
    assert not any(alive if fp8 else alive[0:1] + alive[2:4]), alive


@HOLDS_ON_CTX
@pytest.mark.parametrize("fp8", [False, True])
def test_retained_graph_keeps_them_and_backward_runs_again(monkeypatch, fp8):
    alive, mlp, x, y, dy = _run(monkeypatch, fp8, retain=True)
    assert all(alive), alive
    first = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    y.backward(dy)
    for before, t in zip(first, [x] + list(mlp.parameters())):
        torch.testing.assert_close(t.grad - before, before, rtol=1.3e-6, atol=1e-5)  # the same gradient again


@HOLDS_ON_CTX
def test_second_backward_without_retain_graph_names_the_fix(monkeypatch):
    *_, y, dy = _run(monkeypatch, fp8=False, retain=False)
    with pytest.raises(RuntimeError, match="second time"):
        y.backward(dy)


def test_fused_gradient_cast_is_not_transposed_again(monkeypatch):
    """activation_bwd_dbias_cast_transpose writes the column-wise copy itself: the backward
    must use it, not transpose the row-wise data once more (it did, costing a full pass)."""
    from te_core import ops

    torch.manual_seed(0)
    mlp = tm.LayerNormMLP(32, 64)
    x = torch.randn(16, 32, requires_grad=True)
    with autocast(recipe=recipe.DelayedScaling()):
        y = mlp(x)
    calls = []
    real = ops.transpose_fp8
    monkeypatch.setattr(ops, "transpose_fp8", lambda data: calls.append(data.shape) or real(data))
    y.backward(torch.randn(y.shape))
    assert calls == []


def _linear_step(rec, hooks: bool, kind: str = "Linear"):
    torch.manual_seed(0)
    lin = getattr(tm, kind)(32, 48)
    x = torch.randn(16, 32, requires_grad=True)
    dy = torch.randn(16, 48)
    packed = []

    def pack(t):
        packed.append(type(t).__name__)
        return t

    for _ in range(3):  # the scales settle first, as in _run
        with autocast(enabled=rec is not None, recipe=rec):
            lin(x).backward(dy)
    lin.zero_grad()
    x.grad = None
    with autocast(enabled=rec is not None, recipe=rec):
        if hooks:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = lin(x)
        else:
            y = lin(x)
    node = _node_with_intermediates(y)
    saved = [type(t).__name__ for t in node.saved_tensors if t is not None and "Float8" in type(t).__name__]
    held = [type(t).__name__ for t in (node.held_intermediates or []) if t is not None]
    y.backward(dy)
    return saved, held, packed, [p.grad for p in (x, *lin.parameters())], node


@HOLDS_ON_CTX
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
@pytest.mark.parametrize("name", ["delayed", "current", "block"])
def test_linear_holds_its_quantized_operands_on_ctx_and_lets_them_go(name, kind):
    """A Linear's (LayerNormLinear's) FP8 operands are held on ctx (not through autograd's
    saving of a tensor subclass), released by the backward; under saved-tensor hooks they go
    through the hooks, which see every one. Same gradients either way."""
    rec = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling}[name]()
    saved, held, packed, grads, node = _linear_step(rec, hooks=False, kind=kind)
    assert saved == [] and len(held) == 2 and all("Float8" in h for h in held), (saved, held)
    assert node.held_intermediates is not None and not isinstance(node.held_intermediates, list)  # released
    saved_h, held_h, packed_h, grads_h, _ = _linear_step(rec, hooks=True, kind=kind)
    assert held_h == [] and sum("Float8" in p for p in packed_h) == 2, packed_h
    for got, want in zip(grads_h, grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_linear_in_high_precision_still_saves_its_input_for_the_version_check():
    """x in high precision goes through save_for_backward: changing it in place before the
    backward is an error, as for nn.Linear, not a silently wrong weight gradient."""
    lin = tm.Linear(32, 32)
    x = torch.randn(16, 32, requires_grad=True)
    h = x * 1.0
    y = lin(h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
