"""save_original_input=True on te.Linear and te.GroupedLinear: the backward keeps the input as
given (no FP8 copy of it) and casts it for the weight-gradient GEMM then, with the same results
as the default."""
import pytest
import torch

import te_core as te
from te_core import recipe

RECIPES = {
    "bf16": None,
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
}


def _pair(seed=0, **kwargs):
    torch.manual_seed(seed)
    a = te.Linear(64, 96, params_dtype=torch.bfloat16, **kwargs)
    b = te.Linear(64, 96, params_dtype=torch.bfloat16, save_original_input=True, **kwargs)
    b.load_state_dict(a.state_dict())
    return a, b


def _step(module, x, dy, rcp):
    x = x.detach().requires_grad_(True)
    with te.autocast(enabled=rcp is not None, recipe=rcp):
        y = module(x)
    y.backward(dy)
    return y, x.grad, module.weight.grad, module.bias.grad


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("shape", [(64, 64), (4, 32, 64)])
def test_same_outputs_and_gradients_as_the_default(name, shape):
    make = RECIPES[name]
    a, b = _pair(seed=1)
    torch.manual_seed(2)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    dy = torch.randn(*shape[:-1], 96, dtype=torch.bfloat16)
    for _ in range(2):  # a second step too: any scaling state moves on alike
        got = _step(b, x, dy, make() if make else None)
        want = _step(a, x, dy, make() if make else None)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        a.weight.grad = b.weight.grad = a.bias.grad = b.bias.grad = None


def _packed_during_forward(module, x, rcp):
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(enabled=rcp is not None, recipe=rcp):
            y = module(x)
    return packed, y


@pytest.mark.parametrize("name", ["current", "block"])
def test_the_backward_keeps_the_input_itself_not_an_fp8_copy(name):
    a, b = _pair()
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    kept, _ = _packed_during_forward(b, x, RECIPES[name]())
    assert any(t.data_ptr() == x.data_ptr() and t.dtype == x.dtype for t in kept), [type(t) for t in kept]
    default, _ = _packed_during_forward(a, x, RECIPES[name]())
    assert not any(t.data_ptr() == x.data_ptr() for t in default)  # there: the input's FP8 copy


def test_set_after_construction_takes_effect():
    """Megatron-LM turns it on by setting the attribute on a built module."""
    module = te.Linear(64, 64, params_dtype=torch.bfloat16)
    module.save_original_input = True
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    kept, _ = _packed_during_forward(module, x, recipe.Float8CurrentScaling())
    assert any(t.data_ptr() == x.data_ptr() for t in kept)


def test_delayed_scaling_is_refused_with_a_clear_error():
    module = te.Linear(64, 64, params_dtype=torch.bfloat16, save_original_input=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="save_original_input=True does not work with DelayedScaling"):
        with te.autocast(recipe=recipe.DelayedScaling()):
            module(x)
    with torch.no_grad(), te.autocast(recipe=recipe.DelayedScaling()):  # nothing kept for a backward: fine
        module(x)


def test_an_input_changed_in_place_before_the_backward_is_an_error():
    """The input is kept as given, so changing it in place would change the weight gradient:
    autograd's version check refuses that."""
    module = te.Linear(64, 64, params_dtype=torch.bfloat16, save_original_input=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    inp = x * 1.0
    with te.autocast(recipe=recipe.Float8CurrentScaling()):
        y = module(inp)
    inp.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_fp32_input_under_a_bf16_compute_dtype():
    """The input is kept in its own dtype and cast to the compute dtype (torch.autocast's) for the
    wgrad."""
    a, b = _pair(seed=3)
    x = torch.randn(32, 64)  # float32 input, bfloat16 parameters
    dy = torch.randn(32, 96, dtype=torch.bfloat16)
    for make in (None, recipe.Float8CurrentScaling):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            got, want = _step(b, x, dy, make and make()), _step(a, x, dy, make and make())
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        a.weight.grad = b.weight.grad = a.bias.grad = b.bias.grad = None


def test_delayed_wgrad_and_fused_accumulation():
    a, b = _pair(seed=4, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    for m in (a, b):
        m.weight.main_grad = torch.zeros(96, 64, dtype=torch.float32)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    dy = torch.randn(32, 96, dtype=torch.bfloat16)
    for m in (a, b):
        _step(m, x, dy, recipe.Float8BlockScaling())
        m.backward_dw()
    assert torch.equal(a.weight.main_grad, b.weight.main_grad) and a.weight.main_grad.abs().sum() > 0


def test_column_parallel_sequence_parallel_is_refused_before_the_gather():
    """Under sequence parallelism a column-parallel GEMM's input is all-gathered: the original is
    only this rank's shard, so the option is refused (before any collective runs)."""
    module = te.Linear(64, 64, parallel_mode="column", tp_size=2, sequence_parallel=True, save_original_input=True)
    x = torch.randn(32, 64, dtype=torch.float32, requires_grad=True)
    with pytest.raises(NotImplementedError, match="save_original_input=True with sequence_parallel=True"):
        module(x)


def test_bad_value_is_a_type_error():
    with pytest.raises(TypeError, match="save_original_input must be True or False"):
        te.Linear(64, 64, save_original_input="yes")


@pytest.mark.parametrize("name", ["current", "block"])
def test_compiled_equals_eager(name):
    """torch.compile(fullgraph=True) traces the backward's cast of the kept input: the gradients
    equal the eager ones bit for bit."""
    a, b = _pair(seed=5)
    a.save_original_input = True
    rcp = RECIPES[name]()

    def step(module, x):
        with te.autocast(recipe=rcp):
            return module(x)

    compiled = torch.compile(step, fullgraph=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    dy = torch.randn(32, 96, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    step(a, xa).backward(dy)
    compiled(b, xb).backward(dy)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(a.weight.grad, b.weight.grad)
    assert torch.equal(a.bias.grad, b.bias.grad)


def _grouped_pair(seed=6, **kwargs):
    torch.manual_seed(seed)
    a = te.GroupedLinear(3, 64, 96, params_dtype=torch.bfloat16, **kwargs)
    b = te.GroupedLinear(3, 64, 96, params_dtype=torch.bfloat16, save_original_input=True, **kwargs)
    b.load_state_dict(a.state_dict())
    return a, b


def _grouped_step(module, x, dy, m_splits, rcp):
    x = x.detach().requires_grad_(True)
    with te.autocast(enabled=rcp is not None, recipe=rcp):
        y = module(x, m_splits)
    y.backward(dy)
    grads = [getattr(module, f"weight{i}").grad for i in range(3)] + [getattr(module, f"bias{i}").grad for i in range(3)]
    return [y, x.grad, *grads]


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_linear_same_outputs_and_gradients_as_the_default(name):
    """An expert with no tokens included: its weight gradient is zero either way."""
    make = RECIPES[name]
    a, b = _grouped_pair()
    m_splits = [64, 0, 32]
    x = torch.randn(96, 64, dtype=torch.bfloat16)
    dy = torch.randn(96, 96, dtype=torch.bfloat16)
    got = _grouped_step(b, x, dy, m_splits, make() if make else None)
    want = _grouped_step(a, x, dy, m_splits, make() if make else None)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_grouped_linear_keeps_the_input_and_refuses_delayed_scaling():
    _, b = _grouped_pair()
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with te.autocast(recipe=recipe.Float8CurrentScaling()):
            b(x, [32, 32, 0])
    assert any(t.data_ptr() == x.data_ptr() for t in packed)  # the first expert's rows: x itself
    with pytest.raises(ValueError, match="GroupedLinear: save_original_input=True does not work with DelayedScaling"):
        with te.autocast(recipe=recipe.DelayedScaling()):
            b(x, [32, 32, 0])
    with pytest.raises(TypeError, match="save_original_input must be True or False"):
        te.GroupedLinear(2, 64, 64, save_original_input=2)
