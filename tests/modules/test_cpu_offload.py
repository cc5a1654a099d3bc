"""te.get_cpu_offload_context (Transformer Engine's activation offloading): a stack of te-core
layers trained inside the context gives the gradients of the same stack without it, bit for bit,
while the offloaded layers' saved tensors leave the device (their host copies are what the
backward reads) and the kept layers' stay. On the reference backend the CPU stands in for the
device (a runtime whose streams are no-ops and whose "device" tensors are CPU tensors); on an
accelerator backend the real streams, events and pinned buffers run, and the memory the device
holds after the forward drops by the offloaded activations."""
from __future__ import annotations

import contextlib
import copy
import warnings
import weakref

import pytest
import torch

import te_core as te
from te_core import cpu_offload, recipe
from te_core._offload_layer import MIN_NUMEL, Runtime

from ._compare import seeded

HIDDEN, TOKENS, LAYERS = 512, 512, 4  # TOKENS x HIDDEN = MIN_NUMEL: the block's activations are offloaded


class _NoStreams:
    """Streams and events that order nothing: on the CPU every copy has run when it returns."""

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_event(self, event):
            pass

        def wait_stream(self, stream):
            pass

    class Event:
        def record(self, stream=None):
            pass

    @staticmethod
    def current_stream(device=None):
        return _NoStreams.Stream()

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class CpuAsDevice(Runtime):
    """CPU tensors treated as device tensors; remembers each tensor it copied to the host."""

    def __init__(self):
        self.copied = []

    def offloads(self, t):
        return True

    def module(self, device):
        return _NoStreams

    def host_buffer(self, t):
        self.copied.append(weakref.ref(t))
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)


@pytest.fixture
def runtime(module_backend, monkeypatch):
    """The runtime the offload uses here: CpuAsDevice on the reference backend, else the real one."""
    if module_backend.device_type != "cpu":
        return None
    fake = CpuAsDevice()
    monkeypatch.setattr(cpu_offload, "_RUNTIME", fake)
    return fake


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = te.LayerNormLinear(HIDDEN, 2 * HIDDEN)
        self.fc2 = te.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _model():
    torch.manual_seed(0)
    return torch.nn.ModuleList(Block() for _ in range(LAYERS))


def _step(model, x, rec, context=None, sync=None, between=None):
    """Forward (each layer inside `context`, its output through `sync`), `between()` after the
    forward, then backward; the input's and parameters' gradients."""
    model.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(enabled=rec is not None, recipe=rec):
        h = x
        for layer in model:
            with context or contextlib.nullcontext():
                h = layer(h)
            h = sync(h) if sync else h
    if between is not None:
        between()
    h.float().pow(2).sum().backward()
    return [x.grad] + [p.grad.clone() for p in model.parameters()]


RECIPES = [None, recipe.DelayedScaling(), recipe.Float8CurrentScaling(), recipe.Float8BlockScaling()]
RECIPE_IDS = ["high-precision", "delayed", "current", "block"]


def _device_bytes():
    device = torch.get_default_device()
    return None if device.type == "cpu" else torch.get_device_module(device).memory_allocated(device)


@pytest.mark.parametrize("rec", RECIPES, ids=RECIPE_IDS)
def test_offloaded_layers_give_the_same_gradients_and_leave_the_device(rec, runtime):
    x = torch.randn(TOKENS, HIDDEN, generator=seeded(1))
    plain, offloaded = _model(), _model()
    offloaded.load_state_dict(plain.state_dict())
    for _ in range(2):  # (delayed scaling: the second step casts with updated scales)
        want = _step(plain, x, copy.deepcopy(rec))
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=LAYERS)
    synchronizer = context.offload_synchronizer
    seen = {}

    def after_forward():
        seen["host"] = [synchronizer.layer_states[i].host_bytes() for i in range(LAYERS)]
        seen["device"] = [len(synchronizer.layer_states[i].device_tensors()) for i in range(LAYERS)]
        seen["alive"] = [r() for r in runtime.copied] if runtime else []
        seen["bytes"] = _device_bytes()

    for _ in range(2):
        got = _step(offloaded, x, copy.deepcopy(rec), context, sync, after_forward)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # layers 0 and 1 were copied to the host and their device tensors released; 2 and 3 kept
    assert seen["host"][0] > 0 and seen["host"][1] > 0 and seen["host"][2:] == [0, 0]
    assert seen["device"][:2] == [0, 0]
    assert not any(t is not None and t.numel() >= MIN_NUMEL for t in seen["alive"][-10:]), \
        "a released activation is still alive"
    if seen["bytes"] is not None:  # on a device: its memory after the forward holds less
        _step(plain, x, copy.deepcopy(rec), between=lambda: seen.update(plain_bytes=_device_bytes()))
        assert seen["bytes"] < seen["plain_bytes"] - 2 * TOKENS * HIDDEN * 2
    # everything is let go after the backward
    assert all(not s.device_tensors() for s in synchronizer.layer_states.values())


def test_transformer_layers_offload_their_attention_tensors_too(runtime):
    """Attention saves rearranged views of its projections (a transposed key, say): each is copied as
    its whole base and rebuilt, so nothing stays on the device with a warning."""
    torch.manual_seed(0)
    plain = torch.nn.ModuleList(te.TransformerLayer(HIDDEN, 2 * HIDDEN, 8, hidden_dropout=0.0, attention_dropout=0.0)
                                for _ in range(3))
    offloaded = copy.deepcopy(plain)
    x = torch.randn(TOKENS // 2, 2, HIDDEN, generator=seeded(6))
    want = _step(plain, x, recipe.DelayedScaling())
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3)
    layer0, seen = context.offload_synchronizer.layer_states[0], []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _step(offloaded, x, recipe.DelayedScaling(), context, sync,
                    lambda: seen.append((layer0.host_bytes(), layer0.device_tensors())))
    assert seen[0][0] > 0 and seen[0][1] == []
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_permuted_and_sliced_tensors_are_copied_by_their_storage(runtime):
    """A permuted result (no view: its own storage in another order) is copied with its strides;
    q, k and v sliced from one projection share one copy of it; the backward reads them back."""
    w = torch.randn(HIDDEN, 3 * HIDDEN, generator=seeded(7))
    rows = 2 * TOKENS  # (the projection's shape then differs from w's)
    x = torch.randn(rows, HIDDEN, generator=seeded(8))

    def layer(inp):
        permuted = inp.t() * 2.0  # strides (1, HIDDEN): fills its storage, transposed
        q, k, v = (inp @ w).chunk(3, dim=-1)  # three non-contiguous views of one (rows, 3 HIDDEN) tensor
        return (permuted * permuted).t() + q * k * v

    def run(context=None, sync=None, between=None):
        xi = x.clone().requires_grad_(True)
        with context or contextlib.nullcontext():
            y = layer(xi)
        y = sync(y) if sync else y
        if between:
            between()
        y.pow(2).sum().backward()
        return xi.grad

    context, sync, controller = te.get_cpu_offload_context(enabled=True, model_layers=1, manual_synchronization=True)
    state, seen = controller.layer_states[0], []

    def offload_and_reload():
        seen.append([(tuple(t.shape), t.stride()) for t in state._saved])
        controller.start_offload_layer(0)
        controller.release_activation_forward_gpu_memory(0)
        controller.start_reload_layer(0)  # the backward reads the copies, rebuilt with their strides

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(context, sync, offload_and_reload)
    assert torch.equal(got, run())
    assert ((HIDDEN, rows), (1, HIDDEN)) in seen[0]  # the permuted tensor, as it is laid out
    assert seen[0].count(((rows, 3 * HIDDEN), (3 * HIDDEN, 1))) == 1  # q, k and v: their projection, once


def test_manual_synchronization_offloads_every_layer(runtime):
    x = torch.randn(TOKENS, HIDDEN, generator=seeded(2))
    plain, offloaded = _model(), _model()
    offloaded.load_state_dict(plain.state_dict())
    want = _step(plain, x, recipe.DelayedScaling())
    context, sync, controller = te.get_cpu_offload_context(enabled=True, model_layers=LAYERS,
                                                           manual_synchronization=True)
    assert isinstance(controller, te.ManualOffloadSynchronizer)
    model = offloaded
    model.zero_grad()
    xi = x.detach().clone().requires_grad_(True)
    with te.autocast(recipe=recipe.DelayedScaling()):
        h = xi
        for i, layer in enumerate(model):
            with context:
                h = layer(h)
            h = sync(h)
            controller.start_offload_layer(i)
    for i in range(LAYERS):
        controller.release_activation_forward_gpu_memory(i)
    assert all(not controller.layer_states[i].device_tensors() for i in range(LAYERS))
    assert controller.get_offloaded_total_size_mb() > 0
    for i in reversed(range(LAYERS)):
        controller.start_reload_layer(i)
    h.float().pow(2).sum().backward()
    for g, w in zip([xi.grad] + [p.grad for p in model.parameters()], want):
        assert torch.equal(g, w)


def test_a_layer_read_before_its_reload_is_an_error(runtime):
    x = torch.randn(TOKENS, HIDDEN, generator=seeded(3), requires_grad=True)
    context, sync, controller = te.get_cpu_offload_context(enabled=True, model_layers=1, manual_synchronization=True)
    with context:
        h = _model()[0](x)
    h = sync(h)
    controller.start_offload_layer(0)
    controller.release_activation_forward_gpu_memory(0)
    with pytest.raises(RuntimeError, match="start_reload_layer"):
        h.sum().backward()
    with pytest.raises(ValueError, match="layer 5 does not exist"):
        controller.start_reload_layer(5)


def test_retained_host_buffers_are_reused_and_marked_tensors_stay(runtime):
    model = _model()
    x = torch.randn(TOKENS, HIDDEN, generator=seeded(4))
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=LAYERS,
                                               retain_pinned_cpu_buffers=True)
    state = context.offload_synchronizer.layer_states[0]
    _step(model, x, None, context, sync)
    first = [t.data_ptr() for t in state._host]
    _step(model, x, None, context, sync)
    assert first and [t.data_ptr() for t in state._host] == first
    # a tensor marked by mark_not_offload is saved as it is
    big = torch.randn(TOKENS, HIDDEN, generator=seeded(5), requires_grad=True)
    te.mark_not_offload(big)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3)
    with context:
        y = big * big  # saves `big` twice for its backward
    y = sync(y)
    layer0 = context.offload_synchronizer.layer_states[0]
    assert layer0.device_tensors() == []


def test_quantized_inputs_are_copied_by_their_data_and_weights_stay(runtime):
    """An FP8 input is copied data tensor by data tensor and comes back as an FP8 tensor with the
    same bytes; an FP8 weight copy (role weight, as Transformer Engine marks it) stays on the device."""
    from te_core.quantization.quantizers import Float8CurrentScalingQuantizer
    from te_core.quantization.roles import Role

    value = torch.randn(TOKENS, HIDDEN, generator=seeded(9))
    activation = Float8CurrentScalingQuantizer(Role.INPUT, torch.float8_e4m3fn).quantize(value, columnwise=True)
    weight = Float8CurrentScalingQuantizer(Role.WEIGHT, torch.float8_e4m3fn).quantize(value, columnwise=True)
    synchronizer = te.ManualOffloadSynchronizer(1)
    synchronizer.fwd_step()
    handles = [synchronizer.push_tensor(activation), synchronizer.push_tensor(weight)]
    assert handles[1] is weight
    state = synchronizer.layer_states[0]
    assert len(state.device_tensors()) == 2  # the activation's row-wise and column-wise FP8 data
    synchronizer.start_offload_layer(0)
    synchronizer.release_activation_forward_gpu_memory(0)
    synchronizer.start_reload_layer(0)
    synchronizer.bwd_step(0)
    back = synchronizer.pop_tensor(handles[0])
    assert type(back) is type(activation) and back._data.data_ptr() != activation._data.data_ptr()
    for name in ("_data", "_transpose"):
        assert torch.equal(getattr(back, name).view(torch.uint8), getattr(activation, name).view(torch.uint8))
    assert torch.equal(back.dequantize(), activation.dequantize())


def test_disabled_context_does_nothing_and_bad_arguments_say_what_to_change():
    context, sync = te.get_cpu_offload_context(enabled=False)
    assert isinstance(context, contextlib.nullcontext) and sync(3) == 3
    context, _ = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3, double_buffering=True)
    assert context.offload_synchronizer.offloaded == {0}  # double_buffering changes nothing (as in TE 2.x)
    assert len(te.get_cpu_offload_context(enabled=False, manual_synchronization=True)) == 3
    with pytest.raises(ValueError, match="neither offload_activations nor offload_weights"):
        te.get_cpu_offload_context(enabled=True, offload_activations=False)
    with pytest.raises(ValueError, match="offload at most 3 layers"):
        te.get_cpu_offload_context(enabled=True, num_layers=4, model_layers=4)
    with pytest.raises(ValueError, match="only be given with manual_synchronization"):
        te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=4, offload_stream=object())
    with pytest.raises(ValueError, match="model_layers must be a positive int"):
        te.get_cpu_offload_context(enabled=True, model_layers=0)
    with pytest.warns(DeprecationWarning, match="offload_weights is deprecated"):
        te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3, offload_weights=True)
    with pytest.warns(UserWarning, match="no layer to overlap"):
        te.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=3)
    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3)
    with pytest.raises(RuntimeError, match="before any layer ran"):
        sync(torch.ones(2, requires_grad=True) * 2)
    with context:
        with pytest.raises(RuntimeError, match="entered again"):
            context.__enter__()
        with pytest.raises(RuntimeError, match="inside the context"):
            sync(torch.ones(2))
    with pytest.raises(ValueError, match="made by autograd"):
        sync(torch.ones(2))
