"""te_core.make_graphed_callables on the CPU: the capture is emulated by a fake graph API that,
like a real graph, replays constants without running any te_core Python, so these tests see
what the graphed callable itself must do (schedule the scale updates of both directions).
The real capture runs on the GPU in backends/cuda/tests/test_cuda_graphs.py."""
import pytest
import torch

import te_core as te
from te_core import graphs
from te_core.quantization.scaling import ScalingGroup, graph_capture

RECIPE = te.recipe.DelayedScaling(amax_history_len=4)


def fake_graph_api(callables, sample_args, num_warmup_iters=3, allow_unused_input=False):
    """Warm-up steps, one "captured" step, then a forward that returns that step's results."""
    for module, args in zip(callables, sample_args):
        inputs = [a for a in args if a.requires_grad] + [p for p in module.parameters() if p.requires_grad]
        for _ in range(num_warmup_iters + 1):
            y = module(*args)
            grads = torch.autograd.grad(y, inputs, torch.ones_like(y))
        static_y, static_grads = y.detach(), grads

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *tensors):
                return static_y.clone()

            @staticmethod
            def backward(ctx, dy):
                return tuple(g.clone() for g in static_grads)

        module.forward = lambda *a, _inputs=inputs, _R=Replay: _R.apply(*_inputs)
    return tuple(callables)


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(graphs, "_graph_api", lambda device: fake_graph_api)


def _linear():
    torch.manual_seed(0)
    lin = te.Linear(32, 16, params_dtype=torch.float32)
    x = torch.randn(16, 32, requires_grad=True)
    return lin, x


def _rolled(history):
    want = torch.roll(history, shifts=-1, dims=0)
    want[0] = 0
    return want


def test_capture_updates_forward_scales_once_and_backward_scales_never(fake_graphs):
    lin, x = _linear()
    graphs.make_graphed_callables(lin, (x,), num_warmup_iters=2, fp8_enabled=True, fp8_recipe=RECIPE)
    groups = lin._recipe_state.groups
    fwd, bwd = groups[te.quantization.roles.Role.INPUT], groups[te.quantization.roles.Role.GRAD_OUTPUT]
    # the forward groups were updated once, at the capture's autocast exit: their last row holds the amax
    assert fwd.amax_history[-1].gt(0).all() and fwd.amax_history[0].eq(0).all()
    # backward updates are not queued while capturing (they must not end up inside a graph)
    assert bwd.amax_history[0].gt(0).all() and bwd.amax_history[1:].eq(0).all()


def test_replay_schedules_both_directions_updates(fake_graphs):
    lin, x = _linear()
    graphed = graphs.make_graphed_callables(lin, (x,), fp8_enabled=True, fp8_recipe=RECIPE)
    state = graphed._recipe_state
    before = {role: (g.amax_history.clone(), g.scale.clone()) for role, g in state.groups.items()}
    with te.autocast(recipe=RECIPE):
        y = graphed(x)
    y.backward(torch.randn_like(y))
    for role, group in state.groups.items():
        history, _ = before[role]
        assert torch.equal(group.amax_history, _rolled(history)), role  # replay recorded nothing; update rolled
    grad_group = state.groups[te.quantization.roles.Role.GRAD_OUTPUT]
    expected = 448.0 / before[te.quantization.roles.Role.GRAD_OUTPUT][0].amax(dim=0)
    if grad_group.fp8_dtype == torch.float8_e5m2:
        expected = 57344.0 / before[te.quantization.roles.Role.GRAD_OUTPUT][0].amax(dim=0)
    torch.testing.assert_close(grad_group.scale, expected, rtol=1.3e-6, atol=0)


def test_graphed_module_names_wrong_autocast(fake_graphs):
    lin, x = _linear()
    graphed = graphs.make_graphed_callables(lin, (x,), fp8_enabled=True, fp8_recipe=RECIPE)
    with pytest.raises(RuntimeError, match="inside te_core.autocast"):
        graphed(x)
    lin2, x2 = _linear()
    plain = graphs.make_graphed_callables(lin2, (x2,))
    with pytest.raises(RuntimeError, match="captured in high precision"):
        with te.autocast(recipe=RECIPE):
            plain(x2)
    plain(x2).sum().backward()  # high precision outside autocast is fine


def test_bad_arguments_name_the_problem(fake_graphs):
    lin, x = _linear()
    with pytest.raises(NotImplementedError, match="fp8_weight_caching"):
        graphs.make_graphed_callables(lin, (x,), fp8_weight_caching=True)
    with pytest.raises(TypeError, match="nn.Module"):
        graphs.make_graphed_callables(lambda t: t, (x,))
    with pytest.raises(ValueError, match="2 modules but 1 sets"):
        graphs.make_graphed_callables((lin, lin), ((x,),))
    with pytest.raises(TypeError, match="sample_args must be tensors"):
        graphs.make_graphed_callables(lin, (3,))
    with pytest.raises(ValueError, match="parameter on"):
        graphs.make_graphed_callables(lin, (torch.randn(16, 32, device="meta"),))


def test_no_graph_capture_on_the_cpu():
    lin, x = _linear()
    with pytest.raises(NotImplementedError, match="no graph capture for device type 'cpu'"):
        te.make_graphed_callables(lin, (x,))


def test_scale_inv_is_recomputed_while_capturing():
    group = ScalingGroup(["a", "b"], torch.float8_e4m3fn, RECIPE, torch.device("cpu"))
    assert group.scale_inv() is group.scale_inv()  # eager: one snapshot until the scale changes
    with graph_capture():
        first, second = group.scale_inv(), group.scale_inv()
        assert first is not second  # each capture records its own reciprocal of the live scale
        torch.testing.assert_close(second, 1 / group.scale)
