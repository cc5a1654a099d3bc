"""LayerNormMLP's backward frees each forward intermediate (pre-activation, FP8 column-wise
copies) once it has used it, unless the graph is retained: the peak memory of a training
step is set at the end of this backward, where these used to be kept alive to the end."""

import weakref

import pytest
import torch

import te_core.modules as tm
from te_core import recipe
from te_core.modules import layernorm_mlp
from te_core.quantization import autocast


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


@pytest.mark.parametrize("fp8", [False, True])
def test_intermediates_are_freed_before_the_norm_backward(monkeypatch, fp8):
    alive, *_ = _run(monkeypatch, fp8, retain=False)
    # (ln_out, fc1 weight, pre-activation, activation, fc2 weight): in high precision the
    # weights are the parameters themselves, which the module keeps
    assert not any(alive if fp8 else alive[0:1] + alive[2:4]), alive


@pytest.mark.parametrize("fp8", [False, True])
def test_retained_graph_keeps_them_and_backward_runs_again(monkeypatch, fp8):
    alive, mlp, x, y, dy = _run(monkeypatch, fp8, retain=True)
    assert all(alive), alive
    first = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    y.backward(dy)
    for before, t in zip(first, [x] + list(mlp.parameters())):
        torch.testing.assert_close(t.grad - before, before, rtol=1.3e-6, atol=1e-5)  # the same gradient again


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
