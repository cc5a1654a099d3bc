"""te_core.make_graphed_callables on the CPU: the capture is emulated by a fake graph API that,
like a real graph, replays constants without running any te_core Python, so these tests see
what the graphed callable itself must do (schedule the scale updates of both directions).
The real capture runs on the GPU in backends/cuda/tests/test_cuda_graphs.py and test_graphs_model.py;
whole models, weight caching and FP8 weights around an emulated capture: test_graphs_model.py."""
import warnings

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


def test_capture_queues_no_backward_update_and_restores_the_state(fake_graphs, monkeypatch):
    from te_core.quantization import scaling

    queued = []
    monkeypatch.setattr(scaling._BACKWARD_PENDING, "add", lambda group, pg: queued.append(group))
    lin, x = _linear()
    with te.autocast(recipe=RECIPE):  # an existing state, with history, must come back unchanged
        lin(x).sum().backward()
    queued.clear()
    before = {role: (g.amax_history.clone(), g.scale.clone()) for role, g in lin._recipe_state.groups.items()}
    assert any(h.ne(0).any() for h, _ in before.values())
    graphs.make_graphed_callables(lin, (x,), num_warmup_iters=2, enabled=True, recipe=RECIPE)
    assert queued == []  # an update queued while capturing would end up inside the backward graph
    for role, group in lin._recipe_state.groups.items():
        assert torch.equal(group.amax_history, before[role][0]) and torch.equal(group.scale, before[role][1])


def test_capture_flag_reaches_autograd_threads(fake_graphs, monkeypatch):
    """The backward of a real capture runs on autograd's device thread: the flag is process-wide."""
    import threading

    from te_core.quantization import scaling

    queued = []
    monkeypatch.setattr(scaling._BACKWARD_PENDING, "add", lambda group, pg: queued.append(group))
    with graph_capture():
        worker = threading.Thread(target=lambda: scaling.schedule_backward_update(None, None))
        worker.start()
        worker.join()
    assert queued == []


def test_fresh_state_made_during_capture_starts_fresh(fake_graphs):
    lin, x = _linear()
    graphs.make_graphed_callables(lin, (x,), enabled=True, recipe=RECIPE)
    for group in lin._recipe_state.groups.values():
        assert group.amax_history.eq(0).all() and group.scale.eq(1).all()


def test_replay_schedules_both_directions_updates(fake_graphs):
    lin, x = _linear()
    graphed = graphs.make_graphed_callables(lin, (x,), enabled=True, recipe=RECIPE)
    groups = graphed._recipe_state.groups
    for i, group in enumerate(groups.values()):  # the replay records nothing: seed the amaxes
        group.amax_history[0] = 2.0 + i
    before = {role: g.amax_history.clone() for role, g in groups.items()}
    with te.autocast(recipe=RECIPE):
        y = graphed(x)
    for role, group in groups.items():  # forward groups updated at the autocast exit, backward ones not yet
        rolled = role is not te.quantization.roles.Role.GRAD_OUTPUT
        assert torch.equal(group.amax_history, _rolled(before[role]) if rolled else before[role]), role
    y.backward(torch.randn_like(y))
    for role, group in groups.items():
        assert torch.equal(group.amax_history, _rolled(before[role])), role
        torch.testing.assert_close(group.scale, group.fp8_max / before[role].amax(dim=0), rtol=1.3e-6, atol=0)


class _DictOut(torch.nn.Module):
    """A te.Linear whose forward returns a dict, as model classes return their own output types."""

    def __init__(self):
        super().__init__()
        self.lin = _linear()[0]

    def forward(self, x):
        y = self.lin(x)
        return {"y": y, "mean": y.mean()}


def pytree_graph_api(callables, sample_args, num_warmup_iters=3, allow_unused_input=False):
    """fake_graph_api for outputs of any pytree structure: replays the captured step's outputs and
    gradients, handing autograd the same parameter-gradient buffers every time (as torch's does)."""
    for module, args in zip(callables, sample_args):
        sample_inputs = [a for a in args if a.requires_grad]
        params = [p for p in module.parameters() if p.requires_grad]
        leaves, spec = torch.utils._pytree.tree_flatten(module(*args))
        grads = torch.autograd.grad(leaves, sample_inputs + params, [torch.ones_like(t) for t in leaves])
        static = [t.detach() for t in leaves]
        module.grad_buffers = [g.detach() for g in grads[len(sample_inputs):]]

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *tensors):
                return tuple(t.clone() for t in static)

            @staticmethod
            def backward(ctx, *dys):
                return (*grads[:len(sample_inputs)], *(b.detach() for b in module.grad_buffers))

        module.forward = lambda *a, _i=sample_inputs + params, _R=Replay, _s=spec: torch.utils._pytree.tree_unflatten(
            list(_R.apply(*_i)), _s)
    return tuple(callables)


def test_a_replay_returning_a_dict_schedules_its_updates_and_copies_gradients(monkeypatch):
    """The backward-update hook and the gradient copies find the tensors of any output structure
    (a model's dict-like output), not only a tensor or a tuple: else the gradient scales would
    never update, and `.grad` would be the graphs' buffer, which the next backward overwrites."""
    seen = []
    monkeypatch.setattr(graphs, "_graph_api", lambda device: lambda *a, **k: seen.extend(pytree_graph_api(*a, **k))
                        or tuple(seen))
    module = _DictOut()
    x = torch.randn(16, 32, requires_grad=True)
    graphed = graphs.make_graphed_callables(module, (x,), enabled=True, recipe=RECIPE)
    groups = module.lin._recipe_state.groups
    buffer = seen[0].grad_buffers[0]
    captured = buffer.clone()
    for step in range(2):
        for i, group in enumerate(groups.values()):  # the replay records nothing: seed the amaxes
            group.amax_history[0] = 2.0 + i + step
        before = {role: g.amax_history.clone() for role, g in groups.items()}
        with te.autocast(recipe=RECIPE):
            out = graphed(x)
        out["y"].sum().backward()
        for role, group in groups.items():  # both directions updated once per step
            assert torch.equal(group.amax_history, _rolled(before[role])), (step, role)
    assert module.lin.weight.grad.data_ptr() != buffer.data_ptr() and torch.equal(buffer, captured)
    torch.testing.assert_close(module.lin.weight.grad, 2 * captured, rtol=1.3e-6, atol=1e-5)


def test_updates_of_captured_groups_leave_scale_inv_to_the_graphs(fake_graphs):
    """A replay computes scale_inv from the live scale, so an update takes no snapshot for a
    captured group; a cast outside the graphs still gets 1 / the updated scale."""
    lin, x = _linear()
    graphed = graphs.make_graphed_callables(lin, (x,), enabled=True, recipe=RECIPE)
    groups = graphed._recipe_state.groups
    assert all(g.captured for g in groups.values())
    for i, group in enumerate(groups.values()):
        group.amax_history[0] = 3.0 + i
    with te.autocast(recipe=RECIPE):
        y = graphed(x)
    y.backward(torch.randn_like(y))
    for group in groups.values():
        assert group._scale_inv_version is None  # no snapshot taken at the update
        assert not group.scale.eq(1).all()  # the update ran
        torch.testing.assert_close(group.scale_inv(), 1 / group.scale, rtol=1.3e-6, atol=0)
    eager_lin, _ = _linear()
    with te.autocast(recipe=RECIPE):
        eager_lin(x).sum().backward()
    assert not any(g.captured for g in eager_lin._recipe_state.groups.values())


def test_graphed_module_names_wrong_autocast(fake_graphs):
    lin, x = _linear()
    graphed = graphs.make_graphed_callables(lin, (x,), enabled=True, recipe=RECIPE)
    with pytest.raises(RuntimeError, match="inside te_core.autocast"):
        graphed(x)
    with pytest.raises(RuntimeError, match="bake in the captured recipe"):
        with te.autocast(recipe=te.recipe.DelayedScaling(amax_history_len=16)):
            graphed(x)
    with te.autocast(recipe=te.recipe.DelayedScaling(amax_history_len=4)):  # an equal recipe is fine
        graphed(x)
    lin2, x2 = _linear()
    plain = graphs.make_graphed_callables(lin2, (x2,))
    with pytest.raises(RuntimeError, match="captured in high precision"):
        with te.autocast(recipe=RECIPE):
            plain(x2)
    plain(x2).sum().backward()  # high precision outside autocast is fine
    with pytest.raises(TypeError, match="is_first_microbatch"):
        plain(x2, is_first_microbatch=True)


def test_bad_arguments_name_the_problem(fake_graphs):
    lin, x = _linear()
    with pytest.raises(ValueError, match="cache_quantized_params=True caches FP8 weights, so it needs enabled"):
        graphs.make_graphed_callables(lin, (x,), cache_quantized_params=True)
    with pytest.raises(TypeError, match="cache_quantized_params must be a bool"):
        graphs.make_graphed_callables(lin, (x,), enabled=True, cache_quantized_params="yes")
    with pytest.raises(ValueError, match="enabled has 1 entries for 2 modules"):
        graphs.make_graphed_callables((lin, _linear()[0]), ((x,), (x,)), enabled=(True,))
    with pytest.raises(TypeError, match="enabled must be a bool or a tuple of bools"):
        graphs.make_graphed_callables(lin, (x,), enabled=1)
    with pytest.raises(TypeError, match="recipe must be a te_core.recipe recipe"):
        graphs.make_graphed_callables(lin, (x,), enabled=True, recipe="delayed")
    with pytest.raises(TypeError, match="calibrating must be a bool"):
        graphs.make_graphed_callables(lin, (x,), calibrating=1)
    with pytest.raises(ValueError, match="2 forward and 0 backward pass"):
        graphs.make_graphed_callables(lin, (x,), _order=[1, 1])
    with pytest.raises(ValueError, match="_order entry -0.5 is neither a chunk number nor -k-0.5"):
        graphs.make_graphed_callables(lin, (x,), _order=[1, -1, -0.5])
    with pytest.raises(ValueError, match="weight-gradient pass of chunk 1, but none of its layers was built with"):
        graphs.make_graphed_callables(lin, (x,), _order=[1, -1, -1.5])
    with pytest.raises(ValueError, match="_num_layers_per_chunk describes the pipeline schedule in _order"):
        graphs.make_graphed_callables(lin, (x,), _num_layers_per_chunk=1)
    with pytest.raises(ValueError, match="_reuse_graph_input_output_buffers shares .* so it needs _order"):
        graphs.make_graphed_callables(lin, (x,), _reuse_graph_input_output_buffers=True)
    with pytest.raises(TypeError, match="retain_graph_in_backward must be a bool"):
        graphs.make_graphed_callables(lin, (x,), retain_graph_in_backward="yes")
    with pytest.raises(ValueError, match=r"capture_time_hooks\[0\] must be a dict with keys among forward_pre_hooks"):
        graphs.make_graphed_callables(lin, (x,), capture_time_hooks=[{"pre_forward": {}}])
    with pytest.raises(ValueError, match="one entry per module"):
        graphs.make_graphed_callables(lin, (x,), capture_time_hooks=[None, None])
    with pytest.raises(TypeError, match=r"capture_time_hooks\[0\]\['forward_hooks'\] must be a dict of"):
        graphs.make_graphed_callables(lin, (x,), capture_time_hooks=[{"forward_hooks": [print]}])
    with pytest.raises(TypeError, match="_reuse_graph_input_output_buffers must be a bool"):
        graphs.make_graphed_callables(lin, (x,), _order=[1, -1], _reuse_graph_input_output_buffers="yes")
    with pytest.raises(TypeError, match="unexpected keyword arguments fp8_weights"):
        graphs.make_graphed_callables(lin, (x,), fp8_weights=True)
    lin.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="Linear has hooks registered"):
        graphs.make_graphed_callables(lin, (x,))
    lin, x = _linear()
    with pytest.raises(TypeError, match="nn.Module"):
        graphs.make_graphed_callables(lambda t: t, (x,))
    with pytest.raises(ValueError, match="2 modules but 1 sets"):
        graphs.make_graphed_callables((lin, lin), ((x,),))
    with pytest.raises(TypeError, match="sample_args must be tensors"):
        graphs.make_graphed_callables(lin, (3,))
    with pytest.raises(ValueError, match="parameter on"):
        graphs.make_graphed_callables(lin, (torch.randn(16, 32, device="meta"),))
    with_buffer = torch.nn.Sequential(_linear()[0])
    with_buffer.register_buffer("running", torch.zeros(3, requires_grad=True))
    with pytest.raises(RuntimeError, match=r"has buffers that require grad \(running\)"):
        graphs.make_graphed_callables(with_buffer, (x,))
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="torch.autocast is on with its cast cache"):
            graphs.make_graphed_callables(lin, (x,))


def test_sample_args_must_be_tuples_and_sample_kwargs_a_dict(fake_graphs):
    lin, x = _linear()
    # a bare tensor used to be split into its rows, one positional input each
    with pytest.raises(TypeError, match=r"sample_args must be a tuple of tensors, the positional inputs of one call "
                                        r"\(e.g. \(x,\)\), got a bare tensor"):
        graphs.make_graphed_callables(lin, x)
    with pytest.raises(TypeError, match=r"sample_args\[1\] must be a tuple of tensors.*got a bare tensor"):
        graphs.make_graphed_callables((lin, _linear()[0]), ((x,), x))
    with pytest.raises(TypeError, match=r"sample_args must be a tuple with one tuple of tensors per module or sample "
                                        r"\(e.g. \(\(x,\), \(y,\)\)\), got a bare tensor"):
        graphs.make_graphed_callables((lin, _linear()[0]), x)
    with pytest.raises(TypeError, match=r"sample_kwargs must be a dict, or a tuple of dicts \(one per module\), got int"):
        graphs.make_graphed_callables(lin, (x,), sample_kwargs=3)
    assert graphs.make_graphed_callables(lin, [x]) is lin  # a list of tensors is a tuple's equal


def test_sample_arguments_are_checked_before_the_device_graph_api():
    lin, x = _linear()
    with pytest.raises(TypeError, match=r"sample_kwargs must be a dict"):  # not the CPU's missing graph capture
        graphs.make_graphed_callables(lin, (x,), sample_kwargs="scale")


def test_pool_goes_to_the_device_graph_api(monkeypatch):
    """pool (TE's: graphs sharing memory with others) reaches the device's make_graphed_callables;
    without one the call passes none, so the graphs get a pool of their own."""
    seen = []

    def api_with_pool(callables, sample_args, num_warmup_iters=3, allow_unused_input=False, pool=None):
        seen.append(pool)
        return fake_graph_api(callables, sample_args, num_warmup_iters, allow_unused_input)

    monkeypatch.setattr(graphs, "_graph_api", lambda device: api_with_pool)
    handle = (7, 11)
    lin, x = _linear()
    graphed = graphs.make_graphed_callables(lin, (x,), pool=handle)
    lin2, _ = _linear()
    graphs.make_graphed_callables(lin2, (x,))
    assert seen == [handle, None]
    torch.testing.assert_close(graphed(x), _linear()[0](x), rtol=1.3e-6, atol=1e-5)


def aliasing_graph_api(callables, sample_args, num_warmup_iters=3, allow_unused_input=False):
    """As torch's make_graphed_callables hands gradients back: the replay (here the module run
    eagerly) returns its parameters' gradients in buffers of its own, the same ones every call."""
    for module, args in zip(callables, sample_args):
        params = tuple(module.parameters())
        buffers = [torch.zeros_like(p) for p in params]
        run = module.forward

        class Replay(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                ctx.inputs = [i.detach().requires_grad_() for i in inputs[:len(inputs) - len(params)]]
                with torch.enable_grad():
                    ctx.out = run(*ctx.inputs)
                return ctx.out.detach()

            @staticmethod
            def backward(ctx, dy):
                grads = torch.autograd.grad(ctx.out, ctx.inputs + list(params), dy)
                for buffer, grad in zip(buffers, grads[len(ctx.inputs):]):
                    buffer.copy_(grad)
                return (*grads[:len(ctx.inputs)], *(b.detach() for b in buffers))

        module.forward = lambda *a, _R=Replay, _p=params: _R.apply(*a, *_p)
        module.grad_buffers = buffers
    return tuple(callables)


@pytest.mark.parametrize("clone", [True, False])
def test_replayed_parameter_gradients_are_copies_unless_asked_otherwise(monkeypatch, clone):
    """clone_param_grads_on_return (TE's, default True): gradients accumulated over two backward
    passes into unallocated .grad add up as an eager module's do; with False, .grad is the
    graph's own buffer, which the second replay overwrites, as Transformer Engine documents."""
    seen = []
    monkeypatch.setattr(graphs, "_graph_api", lambda device: lambda *a, **k: seen.extend(aliasing_graph_api(*a, **k))
                        or tuple(seen))
    lin, x = _linear()
    eager = _linear()[0]
    graphed = graphs.make_graphed_callables(lin, (x,), clone_param_grads_on_return=clone)
    dys = [torch.randn(16, 16), torch.randn(16, 16)]
    for dy in dys:
        graphed(x.detach().requires_grad_()).backward(dy)
        eager(x.detach().requires_grad_()).backward(dy)
    buffers = seen[0].grad_buffers
    if clone:
        for p, q in zip(graphed.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1.3e-6, atol=1e-5)
        assert all(p.grad.data_ptr() != b.data_ptr() for p, b in zip(graphed.parameters(), buffers))
    else:  # the first backward's gradients were lost: .grad is the buffer, doubled by the second
        assert graphed.weight.grad.data_ptr() == buffers[0].data_ptr()
        assert not torch.allclose(graphed.weight.grad, eager.weight.grad, rtol=1e-3, atol=1e-3)
    with pytest.raises(TypeError, match="clone_param_grads_on_return must be a bool"):
        graphs.make_graphed_callables(_linear()[0], (x,), clone_param_grads_on_return="no")


def test_a_parameter_whose_gradients_its_module_delays_gets_the_graphs_own_buffer(monkeypatch):
    """A parameter marked skip_backward_post_hook (a module delaying its weight gradients manages
    their lifetime) is left out of clone_param_grads_on_return, as in Transformer Engine: its
    .grad is the graph's buffer, the same tensor at every replay; the others' are copies."""
    seen = []
    monkeypatch.setattr(graphs, "_graph_api", lambda device: lambda *a, **k: seen.extend(aliasing_graph_api(*a, **k))
                        or tuple(seen))
    lin, x = _linear()
    lin.weight.skip_backward_post_hook = True
    graphed = graphs.make_graphed_callables(lin, (x,))
    buffers = seen[0].grad_buffers
    for _ in range(2):
        graphed(x.detach().requires_grad_()).backward(torch.randn(16, 16))
        assert graphed.weight.grad.data_ptr() == buffers[0].data_ptr()
        assert graphed.bias.grad.data_ptr() != buffers[1].data_ptr()
        graphed.zero_grad(set_to_none=True)


@pytest.mark.parametrize("clone", [True, False])
def test_a_backward_after_a_later_forward_of_the_module_is_refused(monkeypatch, clone):
    """Graphs hold one call's activations and outputs: a second forward replay overwrites the
    first's, so the first call's backward would compute the second's gradients. It is refused by
    name; each call's own backward before the next forward works, also after an abandoned one.
    With weight caching the two graph pairs share memory, so a later microbatch counts too."""
    monkeypatch.setattr(graphs, "_graph_api", lambda device: aliasing_graph_api)
    later_call = r"belongs to a call whose saved activations and outputs the 1 later call\(s\) of the module"
    lin, x = _linear()
    graphed = graphs.make_graphed_callables(lin, (x,), clone_param_grads_on_return=clone)
    first, second = graphed(x), graphed(torch.randn_like(x))
    with pytest.raises(RuntimeError, match=later_call):
        first.sum().backward()
    second.sum().backward()  # the latest call's own backward
    abandoned = graphed(x)  # (never backpropagated)
    with torch.no_grad():
        graphed(x)  # a replay without gradients overwrites them too
    with pytest.raises(RuntimeError, match=later_call):
        abandoned.sum().backward()
    for _ in range(2):
        graphed(x).sum().backward()
    lin, x = _linear()
    cached = graphs.make_graphed_callables(lin, (x,), enabled=True, recipe=RECIPE, cache_quantized_params=True,
                                           clone_param_grads_on_return=clone)
    with te.autocast(recipe=RECIPE):
        first = cached(x, is_first_microbatch=True)
        second = cached(x, is_first_microbatch=False)
    with pytest.raises(RuntimeError, match=later_call):
        first.sum().backward()
    for flag in (True, False):  # one microbatch at a time
        with te.autocast(recipe=RECIPE):
            y = cached(x, is_first_microbatch=flag)
        y.sum().backward()


class _Logged(torch.nn.Module):
    """A te.Linear that logs its forward and backward passes under `name`."""

    def __init__(self, name, log):
        super().__init__()
        self.name, self.log, self.lin = name, log, _linear()[0]

    def forward(self, x):
        self.log.append(f"forward {self.name}")
        return _LogBackward.apply(self.lin(x), self.log, self.name)


class _LogBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, log, name):
        ctx.log, ctx.name = log, name
        return y.clone()

    @staticmethod
    def backward(ctx, dy):
        ctx.log.append(f"backward {ctx.name}")
        return dy, None, None


def test_warmup_runs_in_te_order_between_the_hooks(monkeypatch):
    """TE's warm-up: pre_warmup_hook, then per step every forward in order and every backward in
    reverse, then post_warmup_hook; the device's make_graphed_callables then warms up nothing itself."""
    log = []

    def recording_graph_api(callables, sample_args, num_warmup_iters, allow_unused_input):
        log.append(f"capture after {num_warmup_iters} warm-up steps of its own")
        return callables

    monkeypatch.setattr(graphs, "_graph_api", lambda device: recording_graph_api)
    first, second = _Logged("a", log), _Logged("b", log)
    xa, xb = torch.randn(16, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    graphs.make_graphed_callables((first, second), ((xa,), (xb,)), num_warmup_iters=2, enabled=True, recipe=RECIPE,
                                  pre_warmup_hook=lambda: log.append("pre"), post_warmup_hook=lambda: log.append("post"))
    step = ["forward a", "forward b", "backward b", "backward a"]
    assert log == ["pre", *step, *step, "post", "capture after 0 warm-up steps of its own"]
    assert xa.grad is None and first.lin.weight.grad is None  # warm-up gradients go nowhere (autograd.grad)


def test_warmup_without_hooks_or_steps(monkeypatch):
    log = []
    monkeypatch.setattr(graphs, "_graph_api", lambda device: lambda c, s, num_warmup_iters, allow_unused_input: c)
    module = _Logged("a", log)
    graphs.make_graphed_callables(module, (torch.randn(16, 32, requires_grad=True),), num_warmup_iters=0)
    assert log == []
    graphs.make_graphed_callables(_Logged("b", log), (torch.randn(16, 32),))  # no input needs grad: weights do
    assert log == ["forward b", "backward b"] * 3  # TE's and torch's default: 3 steps


def test_garbage_collection_paused_while_capturing(monkeypatch):
    """As in TE: a collection during a capture could free an old graphed module's graphs (a
    reference cycle) and end the capture; the collector is paused around it and restored after,
    also when the capture fails."""
    import gc

    seen = []

    def recording_graph_api(callables, sample_args, num_warmup_iters, allow_unused_input):
        seen.append(gc.isenabled())
        if len(seen) == 2:
            raise RuntimeError("capture failed")
        return callables

    monkeypatch.setattr(graphs, "_graph_api", lambda device: recording_graph_api)
    assert gc.isenabled()
    graphs.make_graphed_callables(_linear()[0], (torch.randn(16, 32),), num_warmup_iters=0)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(RuntimeError, match="capture failed"):
        graphs.make_graphed_callables(_linear()[0], (torch.randn(16, 32),), num_warmup_iters=0)
    assert gc.isenabled()
    gc.disable()
    try:  # a collector the caller turned off stays off
        graphs.make_graphed_callables(_linear()[0], (torch.randn(16, 32),), num_warmup_iters=0)
        assert seen[-1] is False and not gc.isenabled()
    finally:
        gc.enable()


def test_a_graphed_module_captured_again_captures_the_module(fake_graphs):
    """The error for a replay under another recipe says to capture again: doing so captures the
    module's own forward (not the old replay, which would refuse the new recipe while warming up)."""
    lin, x = _linear()
    twin = te.Linear(32, 16, params_dtype=torch.float32)
    twin.load_state_dict(lin.state_dict())
    current = te.recipe.Float8CurrentScaling()
    graphed = graphs.make_graphed_callables(lin, (x,), enabled=True, recipe=RECIPE)
    with pytest.raises(RuntimeError, match="capture again with the new one"), te.autocast(recipe=current):
        graphed(x)
    again = graphs.make_graphed_callables(graphed, (x,), enabled=True, recipe=current)
    with te.autocast(recipe=current):
        y, want = again(x), twin(x)
    assert torch.equal(y, want)
    with pytest.raises(RuntimeError, match="captured with Float8CurrentScaling"), te.autocast(recipe=RECIPE):
        again(x)


def test_warmup_arguments_name_the_problem(fake_graphs):
    lin, x = _linear()
    with pytest.raises(TypeError, match="pre_warmup_hook must be a callable taking no arguments"):
        graphs.make_graphed_callables(lin, (x,), pre_warmup_hook="setup")
    with pytest.raises(TypeError, match="post_warmup_hook must be a callable"):
        graphs.make_graphed_callables(lin, (x,), post_warmup_hook=1)
    with pytest.raises(ValueError, match="num_warmup_iters must be >= 0, got -1"):
        graphs.make_graphed_callables(lin, (x,), num_warmup_iters=-1)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="num_warmup_iters must be an int"):
            graphs.make_graphed_callables(lin, (x,), num_warmup_iters=bad)


def test_te_defaults_and_deprecated_names(fake_graphs):
    """TE's defaults of the arguments te-core does not implement ask for nothing; the fp8_* names
    warn, as in Transformer Engine, and giving both spellings of one argument is an error."""
    lin, x = _linear()
    graphs.make_graphed_callables(lin, (x,), sample_kwargs=None, pool=None, retain_graph_in_backward=False,
                                  clone_param_grads_on_return=True, calibrating=False, capture_time_hooks=None,
                                  pre_warmup_hook=None, post_warmup_hook=None)
    group = object()
    lin, x = _linear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = graphs.make_graphed_callables(lin, (x,), fp8_enabled=True, fp8_recipe=RECIPE, fp8_group=group,
                                            fp8_weight_caching=True)
    assert sorted(str(w.message) for w in caught if w.category is DeprecationWarning) == [
        f"make_graphed_callables: {old_name} is deprecated; use {new_name}" for old_name, new_name in (
            ("fp8_enabled", "enabled"), ("fp8_group", "amax_reduction_group"), ("fp8_recipe", "recipe"),
            ("fp8_weight_caching", "cache_quantized_params"))]
    with te.autocast(recipe=RECIPE, amax_reduction_group=group):
        old(x, is_first_microbatch=True)  # captured with caching: the flag is taken
    with pytest.raises(ValueError, match="fp8_recipe is the deprecated name of recipe; pass only recipe"):
        graphs.make_graphed_callables(lin, (x,), enabled=True, fp8_recipe=RECIPE, recipe=RECIPE)
    with pytest.raises(ValueError, match="fp8_weight_caching is the deprecated name of cache_quantized_params"):
        graphs.make_graphed_callables(lin, (x,), enabled=True, fp8_weight_caching=True, cache_quantized_params=True)


@pytest.mark.reference_only
def test_no_graph_capture_on_the_cpu():
    lin, x = _linear()
    with pytest.raises(NotImplementedError, match="no graph capture for device type 'cpu'"):
        te.make_graphed_callables(lin, (x,))


def test_scale_inv_is_recomputed_while_capturing():
    group = ScalingGroup(["a", "b"], torch.float8_e4m3fn, RECIPE, torch.get_default_device())
    assert group.scale_inv() is group.scale_inv()  # eager: one snapshot until the scale changes
    with graph_capture():
        first, second = group.scale_inv(), group.scale_inv()
        assert first is not second  # each capture records its own reciprocal of the live scale
        torch.testing.assert_close(second, 1 / group.scale)


def test_amax_reduction_group_reaches_the_capture(monkeypatch):
    from te_core.quantization import get_autocast_context

    seen = []

    def recording_graph_api(callables, sample_args, num_warmup_iters, allow_unused_input):
        seen.append(get_autocast_context().amax_reduction_group)
        return callables

    monkeypatch.setattr(graphs, "_graph_api", lambda device: recording_graph_api)
    group = object()
    lin, x = _linear()
    graphs.make_graphed_callables(lin, (x,), enabled=True, recipe=RECIPE, amax_reduction_group=group)
    assert seen == [group]


def test_warm_up_and_capture_leave_the_random_states_as_they_were(fake_graphs):
    """As Transformer Engine's: the default generator and the tracker's states are put back after
    warm-up and capture (dropout draws in them), so later dropout masks are those without them."""
    tracker = te.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.1, attention_dropout=0.1, params_dtype=torch.float32,
                                get_rng_state_tracker=lambda: tracker)
    x = torch.randn(8, 2, 32, requires_grad=True)
    before, tracked = torch.get_rng_state(), tracker.get_states()["model-parallel-rng"].clone()
    graphs.make_graphed_callables(layer, (x,), enabled=False)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(tracker.get_states()["model-parallel-rng"], tracked)


def test_transformer_engines_arguments_are_taken_positionally(fake_graphs):
    """Every argument in Transformer Engine's order (enabled is its 11th, recipe its 13th); a
    value given both ways is an error."""
    lin, x = _linear()
    graphs.make_graphed_callables(lin, (x,), 3, False, None, None, None, None, None, None, True, None, RECIPE)
    assert lin._recipe_state is not None and lin._recipe_state.recipe == RECIPE
    lin, x = _linear()
    with pytest.raises(TypeError, match="multiple values for argument 'recipe'"):
        graphs.make_graphed_callables(lin, (x,), 3, False, None, None, None, None, None, None, True, None, RECIPE,
                                      recipe=RECIPE)



@pytest.mark.parametrize("make", [lambda: te.Linear(32, 16, delay_wgrad_compute=True),
                                  lambda: te.LayerNormMLP(32, 64, delay_wgrad_compute=True),
                                  lambda: te.GroupedLinear(2, 32, 16, delay_wgrad_compute=True)])
def test_a_module_delaying_its_weight_gradients_gets_copies_of_its_bias_gradients(make):
    """A module built with delay_wgrad_compute marks its weights and biases skip_backward_post_hook (as
    Transformer Engine does), but only its weight gradients wait for backward_dw: a bias's comes from
    the backward graph, whose buffer the next replay overwrites, so a replay hands autograd a copy of
    it (accumulated over backward passes as an eager twin's), and the graph's own buffer for weights."""
    from te_core._graph_hooks import copied_param_grads

    named = list(make().named_parameters())
    assert all(p.skip_backward_post_hook for n, p in named if not n.startswith("layer_norm_"))
    copied = copied_param_grads([p for _, p in named], clone=True)
    assert {n: c for (n, _), c in zip(named, copied)} == {
        n: "weight" not in n or n.startswith("layer_norm_") for n, _ in named}
    assert any("bias" in n for n, _ in named)
