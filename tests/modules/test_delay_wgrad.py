"""delay_wgrad_compute=True (Transformer Engine's split backward): backward() leaves the weight
gradients pending, module.backward_dw() computes them from the operands the backward captured, and
the result is bit for bit the immediate path's, in every precision and FP8 recipe, with
fuse_wgrad_accumulation and parameters_split."""
import pytest
import torch

import te_core.modules as tm
from te_core import recipe
from te_core.quantization import autocast

from ._compare import randomize_, seeded

IN, OUT, TOKENS = 64, 96, 64  # FP8-friendly: multiples of 32 (MXFP8's block)
# module name -> (constructor, forward, the parameters whose gradients backward_dw computes)
BUILD = {
    "Linear": (lambda **kw: tm.Linear(IN, OUT, **kw), lambda m, x: m(x), ("weight",)),
    "LayerNormLinear": (lambda **kw: tm.LayerNormLinear(IN, OUT, **kw), lambda m, x: m(x), ("weight",)),
    "LayerNormMLP": (lambda **kw: tm.LayerNormMLP(IN, OUT, activation="swiglu", **kw), lambda m, x: m(x),
                     ("fc1_weight", "fc2_weight")),
    # the second expert gets no tokens: its gradient is a deferred zero
    "GroupedLinear": (lambda **kw: tm.GroupedLinear(3, IN, OUT, **kw), lambda m, x: m(x, [32, 0, 32]),
                      ("weight0", "weight1", "weight2")),
}
PRECISIONS = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "delayed": (torch.float32, lambda: recipe.DelayedScaling(amax_history_len=4)),
    "current": (torch.float32, recipe.Float8CurrentScaling),
    "block": (torch.float32, recipe.Float8BlockScaling),
    "mxfp8": (torch.float32, recipe.MXFP8BlockScaling),
}


def _pair(name, dtype=torch.float32, **kw):
    """(immediate, delayed): the same module and weights, the second with delay_wgrad_compute=True."""
    build = BUILD[name][0]
    immediate = build(params_dtype=dtype, **kw)
    randomize_(immediate, seed=5, std=0.2)
    delayed = build(params_dtype=dtype, delay_wgrad_compute=True, **kw)
    delayed.load_state_dict(immediate.state_dict())
    return immediate, delayed


def _backward(module, name, x, dy_seed, rec):
    """x's gradient after one forward and backward, the output gradient drawn from `dy_seed`."""
    x = x.clone().requires_grad_(True)
    with autocast(enabled=rec is not None, recipe=rec):
        y = BUILD[name][1](module, x)
    y.backward(torch.randn(y.shape, generator=seeded(dy_seed)).to(y.dtype))
    return x.grad


def _grads(module):
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("name", list(BUILD))
def test_backward_dw_equals_the_immediate_path(name, precision):
    dtype, make_recipe = PRECISIONS[precision]
    immediate, delayed = _pair(name, dtype)
    weights = BUILD[name][2]
    rec_immediate, rec_delayed = (None, None) if make_recipe is None else (make_recipe(), make_recipe())
    for micro_batch in range(2):  # the second adds into .grad; delayed scaling's scales move in between
        x = torch.randn(TOKENS, IN, generator=seeded(micro_batch)).to(dtype)
        dy = 10 + micro_batch
        dx = _backward(immediate, name, x, dy, rec_immediate)
        before = _grads(delayed)
        dx_delayed = _backward(delayed, name, x, dy, rec_delayed)
        assert torch.equal(dx_delayed, dx)
        for w in weights:  # untouched until backward_dw
            after = dict(delayed.named_parameters())[w].grad
            assert (after is None) if before[w] is None else torch.equal(after, before[w]), w
        delayed.backward_dw()
        expected, got = _grads(immediate), _grads(delayed)
        for pname, grad in expected.items():
            assert torch.equal(got[pname], grad), f"{pname} after micro-batch {micro_batch}"
    assert all(expected[w].abs().sum() > 0 for w in weights if w != "weight1")


@pytest.mark.parametrize("name", list(BUILD))
def test_fuse_wgrad_accumulation_composes(name):
    """The deferred GEMM adds into main_grad, which backward leaves as it was."""
    immediate, delayed = _pair(name, fuse_wgrad_accumulation=True)
    weights = BUILD[name][2]
    params = {m: dict(mod.named_parameters()) for m, mod in (("immediate", immediate), ("delayed", delayed))}
    starts = {w: torch.randn(params["immediate"][w].shape, generator=seeded(20 + i)) for i, w in enumerate(weights)}
    for which in params.values():
        for w in weights:
            which[w].main_grad = starts[w].clone()
    x, dy = torch.randn(TOKENS, IN, generator=seeded(1)), 2
    _backward(immediate, name, x, dy, None)
    _backward(delayed, name, x, dy, None)
    for w in weights:
        assert params["delayed"][w].grad is None
        assert torch.equal(params["delayed"][w].main_grad, starts[w]), f"{w}.main_grad changed before backward_dw"
    delayed.backward_dw()
    for w in weights:
        assert params["delayed"][w].grad is None
        assert torch.equal(params["delayed"][w].main_grad, params["immediate"][w].main_grad), w
    assert not torch.equal(params["delayed"][weights[0]].main_grad, starts[weights[0]])


@pytest.mark.parametrize("name", ["Linear", "LayerNormLinear"])
def test_parameters_split_parts_take_their_rows(name):
    split = {"query_": 32, "key_": 32, "value_": 32}
    immediate, delayed = _pair(name, parameters_split=split)
    x, dy = torch.randn(TOKENS, IN, generator=seeded(1)), 2
    _backward(immediate, name, x, dy, None)
    _backward(delayed, name, x, dy, None)
    assert delayed.query_weight.grad is None
    delayed.backward_dw()
    expected, got = _grads(immediate), _grads(delayed)
    assert set(got) >= {"query_weight", "key_weight", "value_weight"}
    for pname, grad in expected.items():
        assert torch.equal(got[pname], grad), pname


def test_backward_dw_follows_the_backwards_in_order():
    """Two backwards before any backward_dw: the first call computes the first backward's gradient."""
    reference, delayed = _pair("Linear")
    xs = [torch.randn(TOKENS, IN, generator=seeded(s)) for s in (1, 2)]
    dys = [3, 4]
    for x, dy in zip(xs, dys):
        _backward(delayed, "Linear", x, dy, None)
    _backward(reference, "Linear", xs[0], dys[0], None)
    delayed.backward_dw()
    assert torch.equal(delayed.weight.grad, reference.weight.grad)
    _backward(reference, "Linear", xs[1], dys[1], None)
    delayed.backward_dw()
    assert torch.equal(delayed.weight.grad, reference.weight.grad)


def test_backward_dw_with_nothing_pending_is_an_error():
    _, delayed = _pair("LayerNormLinear")
    with pytest.raises(RuntimeError, match=r"LayerNormLinear.backward_dw\(\): no weight gradient is pending"):
        delayed.backward_dw()
    _backward(delayed, "LayerNormLinear", torch.randn(TOKENS, IN), 0, None)
    delayed.backward_dw()
    with pytest.raises(RuntimeError, match="no weight gradient is pending"):
        delayed.backward_dw()


def test_backward_dw_without_delay_is_a_no_op():
    immediate, _ = _pair("Linear")
    assert not immediate.need_backward_dw()
    _backward(immediate, "Linear", torch.randn(TOKENS, IN), 0, None)
    grad = immediate.weight.grad.clone()
    immediate.backward_dw()
    assert torch.equal(immediate.weight.grad, grad)


def test_hooks_run_after_the_gradients_exist():
    _, delayed = _pair("LayerNormMLP")
    assert delayed.need_backward_dw()
    assert delayed.fc1_weight.skip_backward_post_hook and delayed.fc2_bias.skip_backward_post_hook
    assert not hasattr(delayed.layer_norm_weight, "skip_backward_post_hook")
    seen = []
    delayed.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append(delayed.fc1_weight.grad is not None))
    _backward(delayed, "LayerNormMLP", torch.randn(TOKENS, IN), 0, None)
    assert seen == []
    delayed.backward_dw()
    assert seen == [True]
    with pytest.raises(TypeError, match="hook must be callable"):
        delayed.register_wgrad_accumulation_and_reduce_hooks(None)


@pytest.mark.parametrize("name", list(BUILD))
def test_non_bool_is_rejected(name):
    with pytest.raises(TypeError, match=rf"{name}: delay_wgrad_compute must be True or False"):
        BUILD[name][0](delay_wgrad_compute=2)


def test_grouped_linear_backward_dw_with_nothing_pending_returns():
    """Transformer Engine's GroupedLinear.backward_dw returns when nothing is pending (its
    Linear-like modules raise): before any backward, after a forward without autograd, and
    after the pending gradient was taken; the gradient it took stays as it was."""
    from te_core.modules import GroupedLinear

    torch.manual_seed(0)
    layer = GroupedLinear(2, IN, 8, delay_wgrad_compute=True)
    layer.backward_dw()
    with torch.no_grad():
        layer(torch.randn(6, IN), [2, 4])
    layer.backward_dw()
    assert all(p.grad is None for p in layer.parameters() if p is not layer.bias0)
    x = torch.randn(6, IN)
    layer(x, [2, 4]).sum().backward()
    layer.backward_dw()
    grads = [layer.weight0.grad.clone(), layer.weight1.grad.clone()]
    layer.backward_dw()
    assert torch.equal(layer.weight0.grad, grads[0]) and torch.equal(layer.weight1.grad, grads[1])
    torch.testing.assert_close(grads[0], torch.ones(8, 2) @ x[:2], rtol=1.3e-6, atol=1e-5)
