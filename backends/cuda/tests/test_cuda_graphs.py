"""te_core.make_graphed_callables captured for real (CUDA graphs), on the GPU only: replays must
match eager steps of an identical module bit for bit, scales and gradients included."""
import pytest
import torch

import te_core as te

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _twin_step(graphed, eager, x, recipe, scale):
    """One forward and backward of `graphed` (on its sample input `x`, refilled) and of `eager` on
    the same fresh random input and output gradient: (y graphed, dx graphed, y eager, dx eager)."""
    new_x = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16) * scale
    dy = torch.randn(x.shape[0], eager.out_features, device="cuda", dtype=torch.bfloat16)
    x.data.copy_(new_x)
    x.grad = None
    with te.autocast(recipe=recipe):
        y_graphed = graphed(x)
    y_graphed.backward(dy)
    x_eager = new_x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y_eager = eager(x_eager)
    y_eager.backward(dy)
    return y_graphed, x.grad, y_eager, x_eager.grad


@pytest.mark.parametrize("recipe", [te.recipe.DelayedScaling(amax_history_len=8), te.recipe.Float8CurrentScaling()])
def test_graphed_linear_matches_eager_steps(recipe):
    torch.manual_seed(0)
    graphed = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    eager = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (x,), fp8_enabled=True, fp8_recipe=recipe)
    eager.load_state_dict(graphed.state_dict())  # same weights and scaling state after the warm-up
    for module in (graphed, eager):  # allocated grads: accumulation never aliases a graph's static buffers
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
    for step in range(4):
        y_graphed, dx_graphed, y_eager, dx_eager = _twin_step(graphed, eager, x, recipe, step + 1)
        assert torch.equal(y_graphed, y_eager), step
        assert torch.equal(dx_graphed, dx_eager), step
    assert torch.equal(graphed.weight.grad, eager.weight.grad)
    assert torch.equal(graphed.bias.grad, eager.bias.grad)
    wrong = []
    for direction, slots in eager.quantization_state().items():
        for slot, state in slots.items():
            got = graphed.quantization_state()[direction][slot]
            for key in ("scale", "amax_history"):
                if not torch.equal(got[key], state[key]):
                    wrong.append(f"{slot}.{key}: graphed {got[key].flatten()[:4].tolist()} "
                                 f"eager {state[key].flatten()[:4].tolist()}")
    assert not wrong, wrong


def _histories(seed):
    g = torch.Generator().manual_seed(seed)
    hist = [torch.rand(16, 3, generator=g) * 100, torch.rand(1024, 1, generator=g), torch.rand(4, 2, generator=g)]
    scales = [torch.rand(h.shape[1], generator=g) + 0.5 for h in hist]
    return hist, scales


def _update_setup(seed):
    """The reference update, CPU histories and scales, their GPU copies; no cached update graphs."""
    from te_backend_cuda import update_graph
    from te_core.reference.plugin import implementations

    hist, scales = _histories(seed)
    update_graph.clear()
    return (implementations()["delayed_scaling_update"], hist, scales, [h.cuda() for h in hist],
            [s.cuda() for s in scales])


def test_scaling_update_replays_its_captured_graph_exactly():
    """From the second update of a set of tensors on, the backend replays a captured graph of the
    launch: every step must still match the reference update, histories and scales."""
    from te_backend_cuda import ops, update_graph

    ref_update, hist, scales, dev_hist, dev_scales = _update_setup(0)
    fmaxes = [448.0, 57344.0, 448.0]
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        for h, d in zip(hist, dev_hist):  # this step's amaxes in row 0, in place
            row = torch.rand(h.shape[1], generator=g) * 10 ** step
            h[0] = row
            d[0] = row.cuda()
        ref_update(hist, scales, fmaxes, margin=1.0)
        ops.delayed_scaling_update(dev_hist, dev_scales, fmaxes, margin=1.0)
        for want, got in zip(hist + scales, dev_hist + dev_scales):
            assert torch.equal(got.cpu(), want), f"step {step}"
    graphs = [entry[0] for entry in update_graph._GRAPHS.values()]
    assert len(graphs) == 1 and graphs[0] is not None  # steps 1.. replayed one graph


def test_scaling_update_inside_a_user_capture_launches_into_it():
    from te_backend_cuda import ops, update_graph

    ref_update, hist, scales, dev_hist, dev_scales = _update_setup(2)
    fmaxes = [448.0, 448.0, 448.0]
    ops.delayed_scaling_update(dev_hist, dev_scales, fmaxes)  # compiles; the next call would capture
    ref_update(hist, scales, fmaxes)
    user_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(user_graph):
        ops.delayed_scaling_update(dev_hist, dev_scales, fmaxes)
    assert all(entry[0] is None for entry in update_graph._GRAPHS.values())
    for _ in range(2):
        user_graph.replay()
        ref_update(hist, scales, fmaxes)
    torch.cuda.synchronize()
    for want, got in zip(hist + scales, dev_hist + dev_scales):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("recipe", [te.recipe.DelayedScaling(amax_history_len=8), te.recipe.Float8CurrentScaling()])
def test_graphs_sharing_a_pool_match_eager_steps(recipe):
    """Two layers captured by two calls that share one memory pool (TE's pool=), each step
    replayed in capture order as a shared pool requires, equal eager twins bit for bit."""
    torch.manual_seed(0)
    pool = torch.cuda.graph_pool_handle()
    layers = [te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    twins = [te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    samples = [torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    graphed = [te.make_graphed_callables(layer, (x,), enabled=True, recipe=recipe, pool=pool)
               for layer, x in zip(layers, samples)]
    for layer, twin in zip(graphed, twins):
        twin.load_state_dict(layer.state_dict())
        for p in list(layer.parameters()) + list(twin.parameters()):
            p.grad = torch.zeros_like(p)
    for step in range(3):
        for i, (layer, twin, x) in enumerate(zip(graphed, twins, samples)):
            y, dx, y_eager, dx_eager = _twin_step(layer, twin, x, recipe, step + i + 1)
            assert torch.equal(y, y_eager), (step, i)
            assert torch.equal(dx, dx_eager), (step, i)
    for layer, twin in zip(graphed, twins):
        assert torch.equal(layer.weight.grad, twin.weight.grad)
        for direction, slots in twin.quantization_state().items():
            for slot, state in slots.items():
                for key in ("scale", "amax_history"):
                    assert torch.equal(layer.quantization_state()[direction][slot][key], state[key]), (slot, key)


@pytest.mark.parametrize("recipe", [te.recipe.DelayedScaling(amax_history_len=8), te.recipe.Float8CurrentScaling()])
def test_replayed_gradients_accumulate_like_eager_ones(recipe):
    """Two microbatches' backward passes into gradients set to None: the replays hand autograd
    copies (clone_param_grads_on_return=True, TE's default), so .grad sums both microbatches as
    an eager twin's does, and holds none of the graph's buffers."""
    torch.manual_seed(0)
    graphed = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    eager = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (x,), enabled=True, recipe=recipe)
    eager.load_state_dict(graphed.state_dict())
    for step in range(2):
        for module in (graphed, eager):
            for p in module.parameters():
                p.grad = None
        for micro in range(2):
            _twin_step(graphed, eager, x, recipe, step + micro + 1)
        for p, q in zip(graphed.parameters(), eager.parameters()):
            assert torch.equal(p.grad, q.grad), step


def test_warmup_hooks_run_on_the_warmup_stream():
    """TE's pre_warmup_hook and post_warmup_hook run once each, around the warm-up, on its side
    stream; the capture that follows replays like an eager twin."""
    torch.manual_seed(0)
    recipe = te.recipe.DelayedScaling(amax_history_len=8)
    graphed = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    eager = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seen = []
    graphed = te.make_graphed_callables(graphed, (x,), enabled=True, recipe=recipe, num_warmup_iters=2,
                                        pre_warmup_hook=lambda: seen.append(("pre", torch.cuda.current_stream())),
                                        post_warmup_hook=lambda: seen.append(("post", torch.cuda.current_stream())))
    assert [tag for tag, _ in seen] == ["pre", "post"]
    assert seen[0][1] == seen[1][1] and seen[0][1] != torch.cuda.current_stream()
    eager.load_state_dict(graphed.state_dict())
    for step in range(2):
        y, dx, y_eager, dx_eager = _twin_step(graphed, eager, x, recipe, step + 1)
        assert torch.equal(y, y_eager) and torch.equal(dx, dx_eager), step


def test_a_graphed_linear_captured_again_for_another_recipe():
    """Capturing a graphed module again (another recipe) captures its own forward: the new graphs
    replay like an eager twin, and a replay's inputs must match the new sample."""
    torch.manual_seed(0)
    delayed, current = te.recipe.DelayedScaling(amax_history_len=8), te.recipe.Float8CurrentScaling()
    graphed = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    eager = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (x,), enabled=True, recipe=delayed)
    graphed = te.make_graphed_callables(graphed, (x,), enabled=True, recipe=current)
    eager.load_state_dict(graphed.state_dict())
    for step in range(2):
        y, dx, y_eager, dx_eager = _twin_step(graphed, eager, x, current, step + 1)
        assert torch.equal(y, y_eager) and torch.equal(dx, dx_eager), step
    with pytest.raises(ValueError, match="captured for torch.bfloat16 of shape"), te.autocast(recipe=current):
        graphed(x[:1])  # the replay's copy would have broadcast it


class _DictOutput(torch.nn.Module):
    """A te.Linear whose forward returns a dict, as model classes return their own output types."""

    def __init__(self):
        super().__init__()
        self.lin = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
        self.out_features = self.lin.out_features

    def forward(self, x):
        return {"y": self.lin(x)}


def test_a_graphed_module_returning_a_dict_updates_like_an_eager_twin():
    """A replay whose output is a dict still schedules delayed scaling's backward update and hands
    autograd gradient copies: outputs, gradients and scaling state equal an eager twin's."""
    torch.manual_seed(0)
    recipe = te.recipe.DelayedScaling(amax_history_len=8)
    graphed, eager = _DictOutput(), _DictOutput()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (x,), enabled=True, recipe=recipe)
    eager.load_state_dict(graphed.state_dict())
    for step in range(3):
        new_x = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16) * (step + 1)
        dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        x.data.copy_(new_x)
        with te.autocast(recipe=recipe):
            y = graphed(x)["y"]
        y.backward(dy)
        with te.autocast(recipe=recipe):
            y_eager = eager(new_x)["y"]
        y_eager.backward(dy)
        assert torch.equal(y, y_eager), step
    assert torch.equal(graphed.lin.weight.grad, eager.lin.weight.grad)
    for direction, slots in eager.lin.quantization_state().items():
        for slot, state in slots.items():
            for key in ("scale", "amax_history"):
                assert torch.equal(graphed.lin.quantization_state()[direction][slot][key], state[key]), (slot, key)


def test_the_backward_of_an_overwritten_call_is_refused():
    """Two forward replays, then the first call's backward: its activations were overwritten, so
    it raises; the latest call's own backward runs."""
    torch.manual_seed(0)
    recipe = te.recipe.DelayedScaling(amax_history_len=8)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda"), (x,),
                                        enabled=True, recipe=recipe)
    with te.autocast(recipe=recipe):
        first, second = graphed(x), graphed(x)
    with pytest.raises(RuntimeError, match="later call"):
        first.sum().backward()
    second.sum().backward()
    assert graphed.weight.grad is not None and torch.isfinite(graphed.weight.grad.float()).all()


PIPELINE_ORDER = [1, 2, 1, -2, 2, -1, -2, -1]  # two model chunks, two microbatches, 1F1B-like
# the same with deferred weight gradients (-k-0.5: chunk k's, after its backward)
WGRAD_ORDER = [1, 2, -2, -2.5, 1, -1, -1.5, 2, -2, -2.5, -1, -1.5]


def _linear_pair(n_out, delay):
    return tuple(te.Linear(256, n_out, params_dtype=torch.bfloat16, device="cuda", delay_wgrad_compute=delay)
                 for _ in range(2))


def _captured_pair(delay=False, **capture):
    """(a te.Linear(256, 128) captured with `capture`, an eager twin with its weights and scaling
    state, the sample input)."""
    torch.manual_seed(0)
    graphed, eager = _linear_pair(128, delay)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (x,), **capture)
    eager.load_state_dict(graphed.state_dict())
    return graphed, eager, x


def _assert_same_scaling_state(module, twin):
    for direction, slots in twin.quantization_state().items():
        for slot, state in slots.items():
            for key in ("scale", "amax_history"):
                assert torch.equal(module.quantization_state()[direction][slot][key], state[key]), (slot, key)


def _pipeline_matches_eager(recipe, order, reuse, delay):
    torch.manual_seed(0)
    (first, first_twin), (second, second_twin) = _linear_pair(256, delay), _linear_pair(128, delay)
    layers, twins = (first, second), (first_twin, second_twin)
    samples = tuple((torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
                    for _ in range(4))
    graphed = te.make_graphed_callables(layers, samples, enabled=True, recipe=recipe, _order=order,
                                        _reuse_graph_input_output_buffers=reuse)
    for layer, twin in zip(layers, twins):
        twin.load_state_dict(layer.state_dict())  # same weights and scaling state after the warm-up
        for module in (layer, twin):
            for p in module.parameters():
                p.grad = torch.zeros_like(p)
    done = {}
    flight, deferred = {}, {1: [], 2: []}  # (chunk, microbatch) -> tensors; chunk -> graphed callables to finish
    for step in range(2):
        for c in order:
            chunk = int(abs(c))
            if c != int(c):  # the deferred weight gradients of the chunk's oldest backward
                deferred[chunk].pop(0).backward_dw()
                twins[chunk - 1].backward_dw()
                continue
            mb = done.get(c, 0) % 2
            done[c] = done.get(c, 0) + 1
            if c > 0:
                x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * (step + 1)
                xg, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
                with te.autocast(recipe=recipe):
                    yg = graphed[(chunk - 1) * 2 + mb](xg)
                with te.autocast(recipe=recipe):
                    ye = twins[chunk - 1](xe)
                assert torch.equal(yg, ye), (step, c, mb)
                flight[chunk, mb] = (xg, yg, xe, ye)
            else:
                xg, yg, xe, ye = flight.pop((chunk, mb))
                dy = torch.randn(yg.shape, device="cuda", dtype=torch.bfloat16)
                yg.backward(dy)
                ye.backward(dy)
                assert torch.equal(xg.grad, xe.grad), (step, c, mb)
                deferred[chunk].append(graphed[(chunk - 1) * 2 + mb])
    for layer, twin in zip(layers, twins):
        assert torch.equal(layer.weight.grad, twin.weight.grad)
        assert torch.equal(layer.bias.grad, twin.bias.grad)
        _assert_same_scaling_state(layer, twin)


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("recipe", [te.recipe.DelayedScaling(amax_history_len=8), te.recipe.Float8CurrentScaling()])
def test_a_pipeline_schedule_captured_in_its_order_matches_eager_steps(recipe, reuse):
    """Transformer Engine's _order: one pair of graphs per (chunk, microbatch), captured and
    replayed in the schedule's order, each replay equal bit for bit to an eager twin run in the
    same order; with _reuse_graph_input_output_buffers the passes that never overlap share
    their input buffers."""
    _pipeline_matches_eager(recipe, PIPELINE_ORDER, reuse, delay=False)


@pytest.mark.parametrize("recipe", [te.recipe.DelayedScaling(amax_history_len=8), te.recipe.Float8CurrentScaling()])
def test_deferred_weight_gradients_in_a_pipeline_schedule_match_eager_steps(recipe):
    """Layers built with delay_wgrad_compute=True in a schedule with weight-gradient entries
    (-k-0.5): each gets a graph of its own, replayed by the returned callable's backward_dw."""
    _pipeline_matches_eager(recipe, WGRAD_ORDER, False, delay=True)


@pytest.mark.parametrize("recipe", [te.recipe.DelayedScaling(amax_history_len=8), te.recipe.Float8CurrentScaling()])
def test_a_graphed_module_deferring_its_weight_gradients_matches_eager_steps(recipe):
    """A captured module built with delay_wgrad_compute=True: its backward_dw replays the
    weight-gradient graph captured after its backward, gradients and scales equal to an eager
    twin's bit for bit."""
    graphed, eager, x = _captured_pair(delay=True, enabled=True, recipe=recipe)
    for step in range(3):
        y_graphed, dx_graphed, y_eager, dx_eager = _twin_step(graphed, eager, x, recipe, step + 1)
        assert torch.equal(y_graphed, y_eager) and torch.equal(dx_graphed, dx_eager), step
        graphed.backward_dw()
        eager.backward_dw()
        assert torch.equal(graphed.weight.grad, eager.weight.grad), step
    assert torch.equal(graphed.bias.grad, eager.bias.grad)


def test_capture_time_hooks_run_outside_the_capture_and_retain_graph_keeps_it():
    """capture_time_hooks run (with the module) around every warm-up and captured pass, never
    inside a capture; retain_graph_in_backward=True captures the backward with retain_graph."""
    lin = te.Linear(128, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    seen = []

    def hook(point):
        return lambda module: seen.append((point, module is lin, torch.cuda.is_current_stream_capturing()))

    points = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
    graphed = te.make_graphed_callables(lin, (x,), num_warmup_iters=2, retain_graph_in_backward=True,
                                        capture_time_hooks=[{p: {"h": hook(p)} for p in points}])
    assert seen == [(p, True, False) for p in points] * 3  # two warm-up steps, then the capture
    eager = te.Linear(128, 128, params_dtype=torch.bfloat16, device="cuda")
    eager.load_state_dict(graphed.state_dict())
    new_x = torch.randn_like(x)
    y = graphed(new_x.clone().requires_grad_())
    torch.testing.assert_close(y, eager(new_x), rtol=0, atol=0)


def test_a_replay_on_a_side_stream_matches_eager_and_reset_frees_the_graphs():
    """cuda_graph_stream (Transformer Engine's replay keyword): both directions replay on the
    given stream, ordered after the caller's work and before what follows it; reset() frees the
    graphs."""
    recipe = te.recipe.DelayedScaling(amax_history_len=8)
    graphed, eager, x = _captured_pair(enabled=True, recipe=recipe)
    side = torch.cuda.Stream()
    for step in range(3):
        new_x = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16) * (step + 1)
        dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        xg, xe = new_x.clone().requires_grad_(), new_x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            yg = graphed(xg, cuda_graph_stream=side)
        yg.backward(dy)
        with te.autocast(recipe=recipe):
            ye = eager(xe)
        ye.backward(dy)
        assert torch.equal(yg, ye) and torch.equal(xg.grad, xe.grad), step
    graphed.reset()
    with pytest.raises(RuntimeError, match="freed by reset"):
        graphed(x)


def test_a_calibrating_capture_matches_eager_calibration():
    """calibrating=True: the captured graphs compute in bf16 and record amaxes into the live
    histories; replays under te.autocast(enabled=False, calibrating=True) equal an eager twin's
    calibration steps bit for bit, histories and scales included."""
    recipe = te.recipe.DelayedScaling(amax_history_len=8)
    graphed, eager, x = _captured_pair(calibrating=True, recipe=recipe)
    for step in range(3):
        new_x = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16) * (step + 1)
        dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        xg, xe = new_x.clone().requires_grad_(), new_x.clone().requires_grad_()
        with te.autocast(enabled=False, calibrating=True, recipe=recipe):
            yg = graphed(xg)
        yg.backward(dy)
        with te.autocast(enabled=False, calibrating=True, recipe=recipe):
            ye = eager(xe)
        ye.backward(dy)
        assert torch.equal(yg, ye) and torch.equal(xg.grad, xe.grad), step
    _assert_same_scaling_state(graphed, eager)
    assert eager.quantization_state()["forward"]["input"]["amax_history"].abs().sum() > 0
