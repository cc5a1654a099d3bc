"""make_graphed_callables' capture order and Transformer Engine's capture options on the CPU:
the pipeline schedule (_order, _num_layers_per_chunk), shared input buffers
(_reuse_graph_input_output_buffers), retain_graph_in_backward and capture_time_hooks. The capture
is te-core's own (te_core._graph_capture) over a fake device whose graphs record nothing and
replay nothing, so a replay returns what its capture computed; the real capture, replayed in the
schedule's order against an eager twin, runs on the GPU (backends/cuda/tests/test_cuda_graphs.py)."""
import contextlib
import functools
import sys

import pytest
import torch

import te_core as te
from te_core import _graph_capture, graphs
from te_core._graph_order import default_schedule, pipeline_schedule, shared_samples

ORDER = [1, 2, 1, -2, 2, -1, -2, -1]  # two chunks, two microbatches, 1F1B-like


class FakeGraph:
    resets = 0

    def replay(self):
        pass

    def reset(self):
        FakeGraph.resets += 1


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append((self.name, "waits for", other.name))

    def wait_event(self, event):
        self.log.append((self.name, "waits for", event))


class FakeDevice:
    """torch.<device>'s graph functions, recording each capture."""
    captures = []

    @staticmethod
    @contextlib.contextmanager
    def graph(graph, pool=None):
        FakeDevice.captures.append(pool)
        yield

    @staticmethod
    def graph_pool_handle():
        return ("pool",)

    @staticmethod
    def synchronize():
        pass

    log = []
    main = FakeStream("main", log)

    @staticmethod
    def current_stream():
        return FakeDevice.main

    @staticmethod
    @contextlib.contextmanager
    def stream(stream):
        FakeDevice.log.append(("replay on", stream.name))
        yield


@pytest.fixture
def fake_device(monkeypatch):
    FakeDevice.captures = []
    calls = []

    def api(device):
        capture = functools.partial(_graph_capture.make_graphed, _graph_capture.DeviceGraphs(FakeDevice, FakeGraph))

        def recorded(callables, sample_args, **kwargs):
            calls.append((callables, sample_args, kwargs))
            return capture(callables, sample_args, **kwargs)

        return recorded

    monkeypatch.setattr(graphs, "_graph_api", api)
    return calls


def test_the_schedule_numbers_samples_and_orders_passes_as_transformer_engine():
    # chunk 1: layers 0 and 1; chunk 2: layer 2. Samples chunk by chunk, microbatch by microbatch.
    schedule = pipeline_schedule(ORDER, [2, 1], 3, 6)
    assert schedule.callable_of == (0, 1, 0, 1, 2, 2)
    f, b = "forward", "backward"
    assert schedule.steps == ((f, 0), (f, 1), (f, 4), (f, 2), (f, 3), (b, 4), (f, 5), (b, 1), (b, 0), (b, 5),
                              (b, 3), (b, 2))
    assert pipeline_schedule([1, -1, 1, -1], None, 2, 4).callable_of == (0, 1, 0, 1)  # layers inferred
    assert pipeline_schedule([1, -1, 1, -1], 2, 2, 4).steps == pipeline_schedule([1, -1, 1, -1], None, 2, 4).steps
    assert default_schedule(2).steps == ((f, 0), (f, 1), (b, 1), (b, 0))


@pytest.mark.parametrize("order, layers, n_modules, n_samples, error, match", [
    ([-1, 1], None, 1, 1, ValueError, "backward pass 1 of chunk 1 before its forward pass"),
    ([1, 2, -1, -2, 1], None, 2, 2, ValueError, "forward and .* backward pass.* of chunk"),
    ([1, -1, 0], None, 1, 1, ValueError, "non-zero chunk numbers"),
    ([True, -1], None, 1, 1, ValueError, "non-zero chunk numbers"),
    ([], None, 1, 1, TypeError, "non-empty list"),
    ([1, -1], [1, 1], 1, 1, ValueError, "a list of 1 positive ints"),
    ([1, -1], 2, 1, 2, ValueError, "makes 2 layers, but 1 modules"),
    ([1, -1, 1, -1], 1, 1, 3, ValueError, "3 sample_args given; 1 layers over 2 microbatches need 2"),
    ([1, -1, 1, -1], None, 1, 3, ValueError, "do not split into 1 model chunk"),
    ([1, -1, -0.5], 1, 1, 1, ValueError, "-0.5 is neither a chunk number nor -k-0.5"),
    ([1, -1, 1.5], 1, 1, 1, ValueError, "1.5 is neither a chunk number"),
])
def test_a_bad_schedule_is_refused_by_name(order, layers, n_modules, n_samples, error, match):
    with pytest.raises(error, match=match):
        pipeline_schedule(order, layers, n_modules, n_samples)


def test_inputs_are_shared_only_between_passes_that_never_overlap():
    alternating = pipeline_schedule([1, -1, 1, -1, 1, -1], 1, 1, 3)
    assert shared_samples(alternating, ["k", "k", "k"]) == [0, 0, 0]
    assert shared_samples(alternating, ["k", "other", "k"]) == [0, 1, 0]
    overlapping = pipeline_schedule([1, 1, -1, -1], 1, 1, 2)
    assert shared_samples(overlapping, ["k", "k"]) == [0, 1]


def _layers():
    torch.manual_seed(0)
    return te.Linear(16, 16, params_dtype=torch.float32), te.Linear(16, 8, params_dtype=torch.float32)


def _samples():
    torch.manual_seed(1)
    # per (chunk, microbatch): chunk 1's layer takes 16 features, chunk 2's too
    return [(torch.randn(4, 16, requires_grad=True),) for _ in range(4)]


def test_a_pipeline_capture_follows_the_order_and_returns_one_callable_per_sample(fake_device):
    first, second = _layers()
    samples = _samples()
    seen = []

    def record(point, index):
        return {point: {"record": lambda module: seen.append((point, index, module))}}

    hooks = [{**record("forward_pre_hooks", 0), **record("backward_hooks", 0)},
             {**record("forward_pre_hooks", 1), **record("backward_hooks", 1)}]
    graphed = te.make_graphed_callables((first, second), tuple(samples), num_warmup_iters=1, _order=ORDER,
                                        capture_time_hooks=hooks)
    assert len(graphed) == 4 and all(callable(g) for g in graphed)
    assert "forward" not in vars(first) and "forward" not in vars(second)  # the modules are left as they were
    # the schedule's passes, warm-up then capture, each with its module; hooks run outside any capture
    modules = (first, second)
    steps = [(kind, s // 2) for kind, s in pipeline_schedule(ORDER, 1, 2, 4).steps]
    expected = [("forward_pre_hooks" if kind == "forward" else "backward_hooks", m, modules[m]) for kind, m in steps]
    assert [(p, i) for p, i, _ in seen] == [(p, i) for p, i, _ in expected] * 2
    assert all(a is b for (_, _, a), (_, _, b) in zip(seen, expected * 2))
    assert FakeDevice.captures == [("pool",)] * 8  # 4 forward and 4 backward graphs, one pool
    (_, _, kwargs), = fake_device
    assert kwargs["steps"] and "retain_graph" not in kwargs
    # a replay hands back what its capture computed: each sample's own layer on that sample
    for index, (sample, layer) in enumerate(zip(samples, (first, first, second, second))):
        torch.testing.assert_close(graphed[index](sample[0]), layer(sample[0]), rtol=1.3e-6, atol=1e-5)


def test_the_backward_capture_retains_its_graph_where_asked(fake_device, monkeypatch):
    asked = []
    grad = torch.autograd.grad

    def spy(*args, **kwargs):
        if sys._getframe(1).f_code.co_filename == _graph_capture.__file__:  # the capture's own call
            asked.append(kwargs.get("retain_graph"))
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    for retain in (True, False):
        asked.clear()
        lin = _layers()[0]
        te.make_graphed_callables(lin, (torch.randn(4, 16, requires_grad=True),), num_warmup_iters=0,
                                  retain_graph_in_backward=retain)
        assert asked == [retain], asked


def test_reused_buffers_share_the_inputs_of_passes_that_never_overlap(fake_device):
    lin = _layers()[0]
    samples = [(torch.randn(4, 16, requires_grad=True),) for _ in range(3)]
    graphed = te.make_graphed_callables((lin,), tuple(samples), num_warmup_iters=0, _order=[1, -1, 1, -1, 1, -1],
                                        _reuse_graph_input_output_buffers=True)
    (_, inputs, kwargs), = fake_device
    assert inputs[1][0] is inputs[0][0] and inputs[2][0] is inputs[0][0] and kwargs["share_grad_outputs"]
    x = torch.randn(4, 16, requires_grad=True)
    graphed[2](x)  # a replay copies its input into the shared buffer
    assert torch.equal(samples[0][0], x)


def test_a_capture_time_hook_returning_a_value_is_an_error(fake_device):
    lin = _layers()[0]
    with pytest.raises(RuntimeError, match="capture_time_hooks forward_hooks 'bad' returned a value"):
        te.make_graphed_callables(lin, (torch.randn(4, 16, requires_grad=True),), num_warmup_iters=0,
                                  capture_time_hooks=[{"forward_hooks": {"bad": lambda module: 1}}])


def test_deferred_weight_gradients_get_a_graph_that_backward_dw_replays(fake_device):
    """A module built with delay_wgrad_compute=True: warm-up runs (and drops) its deferred work
    after each backward, capture records the weight-gradient work as a graph of its own right after the
    backward's, and the captured module's backward_dw replays it once per backward, adds the
    gradients into .grad and runs the module's wgrad hooks."""
    torch.manual_seed(0)
    lin = te.Linear(16, 8, params_dtype=torch.float32, delay_wgrad_compute=True)
    hooked = []
    lin.register_wgrad_accumulation_and_reduce_hooks(lambda: hooked.append(1))
    x = torch.randn(4, 16, requires_grad=True)
    graphed = te.make_graphed_callables(lin, (x,), num_warmup_iters=2)
    assert len(lin.wgrad_store) == 0 and lin.weight.grad is None and not hooked  # warm-up work done and dropped
    assert FakeDevice.captures == [("pool",)] * 3  # forward, backward, weight gradients
    (_, _, kwargs), = fake_device
    assert callable(kwargs["wgrad"])
    graphed(x).sum().backward()
    assert lin.weight.grad is None  # deferred
    graphed.backward_dw()
    first = lin.weight.grad.clone()
    assert len(hooked) == 1
    graphed(x).sum().backward()
    graphed.backward_dw()  # (the fake replays nothing: the same captured gradient again)
    # (the capture ran on uninitialized output gradients, as real captures do: NaN among them is fine)
    torch.testing.assert_close(lin.weight.grad, 2 * first, equal_nan=True)
    with pytest.raises(RuntimeError, match="no weight gradient is pending"):
        graphed.backward_dw()


def test_a_pipeline_of_deferring_layers_needs_its_weight_gradient_entries():
    with pytest.raises(ValueError, match=r"chunk 1 has layers built with delay_wgrad_compute=True, whose weight "
                                         r"gradients need an _order entry -1.5"):
        pipeline_schedule([1, -1], 1, 1, 1, [True])
    with pytest.raises(ValueError, match="weight-gradient pass .* 1 of chunk 1 before its backward pass"):
        pipeline_schedule([1, -1.5, -1], 1, 1, 1, [True])
    schedule = pipeline_schedule([1, 2, -2, -2.5, -1, -1.5], 1, 2, 2, [True, True])
    assert schedule.steps == (("forward", 0), ("forward", 1), ("backward", 1), ("wgrad", 1), ("backward", 0),
                              ("wgrad", 0))


def test_a_replay_runs_on_the_stream_it_is_given_and_reset_frees_the_graphs(fake_device):
    """Transformer Engine's cuda_graph_stream / cuda_graph_event: the replay (each direction) runs
    on the given stream after the caller's work, and the caller's stream then waits for the event
    or the stream; reset() frees every graph of the callable, which then refuses to run."""
    FakeDevice.log.clear()
    lin = _layers()[0]
    x = torch.randn(4, 16, requires_grad=True)
    graphed = te.make_graphed_callables(lin, (x,), num_warmup_iters=0)
    side = FakeStream("side", FakeDevice.log)
    graphed(x, cuda_graph_stream=side).sum().backward()
    assert FakeDevice.log == [("side", "waits for", "main"), ("replay on", "side"), ("main", "waits for", "side")] * 2
    FakeDevice.log.clear()
    graphed(x, cuda_graph_stream=side, cuda_graph_event="event")
    assert FakeDevice.log == [("side", "waits for", "main"), ("replay on", "side"), ("main", "waits for", "event")]
    FakeDevice.log.clear()
    graphed(x, cuda_graph_stream=FakeDevice.main)  # the current stream: a plain replay
    assert FakeDevice.log == []
    with pytest.raises(ValueError, match="cuda_graph_event is what the caller's stream waits for"):
        graphed(x, cuda_graph_event="event")
    with pytest.raises(TypeError, match="cuda_graph_stream must be a device stream"):
        graphed(x, cuda_graph_stream="side")
    FakeGraph.resets = 0
    graphed.reset()
    assert FakeGraph.resets == 2  # its forward and backward graphs
    with pytest.raises(RuntimeError, match="its graphs were freed by reset"):
        graphed(x)


def test_a_callable_without_a_backward_graph_resets_its_forward_graph_only(fake_device):
    lin = _layers()[0].requires_grad_(False)  # frozen, and an input without grad: nothing to differentiate
    graphed = te.make_graphed_callables(lin, (torch.randn(4, 16),), num_warmup_iters=0)
    assert FakeDevice.captures == [("pool",)]  # the forward only
    FakeGraph.resets = 0
    graphed.reset()
    assert FakeGraph.resets == 1


def test_a_pipeline_capture_with_weight_caching_and_keywords(fake_device):
    """_order with cache_quantized_params=True captures each sample twice (first and later
    microbatch, back to back in the schedule), and sample_kwargs take one dict per sample."""
    torch.manual_seed(0)  # (FP8 GEMMs: every dimension a multiple of 16)
    first, second = (te.Linear(16, 16, params_dtype=torch.float32) for _ in range(2))
    samples = [(torch.randn(16, 16, requires_grad=True),) for _ in range(4)]
    recipe = te.recipe.DelayedScaling()
    graphed = te.make_graphed_callables((first, second), tuple(samples), num_warmup_iters=0, _order=ORDER,
                                        enabled=True, recipe=recipe, cache_quantized_params=True,
                                        sample_kwargs=tuple({} for _ in samples))
    (variants, inputs, kwargs), = fake_device
    assert len(variants) == 8 and len(FakeDevice.captures) == 16
    # each sample's two variants: forwards first-then-later, backwards later-then-first
    want = []
    for kind, s in pipeline_schedule(ORDER, 1, 2, 4).steps:
        pair = [2 * s, 2 * s + 1]
        want += [(kind, v) for v in (pair if kind == "forward" else pair[::-1])]
    assert list(kwargs["steps"]) == want
    with te.autocast(recipe=recipe):
        with pytest.raises(ValueError, match="is_first_microbatch=True"):
            graphed[0](samples[0][0])
        graphed[0](samples[0][0], is_first_microbatch=True)
    with pytest.raises(ValueError, match="4 modules but 3 sample_kwargs|sample_kwargs"):
        te.make_graphed_callables((first, second), tuple(samples), num_warmup_iters=0, _order=ORDER,
                                  sample_kwargs=tuple({} for _ in range(3)))
