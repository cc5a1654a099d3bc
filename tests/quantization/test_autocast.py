"""Autocast state, FP8 availability per backend, emulated MXFP8, quantized_model_init."""
from __future__ import annotations

import io
import re
import types

import numpy as np
import pytest
import torch

from te_core import backend
from te_core.backend import BackendFallbackWarning, hookimpl, registry
from te_core.backend.types import API_VERSION, FP8_FORMATS, BackendInfo, Capabilities, OpImpl
from te_core.modules.linear import Linear
from te_core.quantization import (
    Float8Tensor,
    autocast,
    fp8_autocast,
    fp8_model_init,
    get_autocast_context,
    is_fp8_available,
    is_mxfp8_available,
    quantized_model_init,
)
from te_core.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, in_use

from .conftest import randn


def test_nesting_innermost_wins_and_restores():
    """Modules run with the recipe's copy in use (te_core.recipe.in_use); the context also keeps
    the object passed, which Transformer Engine's get_fp8_recipe returns."""
    outer, inner = DelayedScaling(), Float8CurrentScaling()
    assert get_autocast_context() is None
    with autocast(recipe=outer):
        assert get_autocast_context().recipe is in_use(outer) and get_autocast_context().given is outer
        with autocast(enabled=False, recipe=inner):
            ctx = get_autocast_context()
            assert ctx.recipe is in_use(inner) and ctx.given is inner and not ctx.enabled
        assert get_autocast_context().recipe is in_use(outer) and get_autocast_context().enabled
    assert get_autocast_context() is None


def test_default_recipe_is_delayed_scaling():
    with autocast():
        assert get_autocast_context().recipe == DelayedScaling()


def test_exception_leaves_no_state(gen):
    layer = Linear(16, 16)
    with pytest.raises(RuntimeError, match="boom"):
        with autocast(recipe=DelayedScaling()):
            layer(randn(gen, 16, 16))
            raise RuntimeError("boom")
    assert get_autocast_context() is None
    # no update from a failed step: the history never rolled (its last row is still empty)
    assert layer.quantization_state()["forward"]["input"]["amax_history"][-1] == 0.0


def test_fp8_autocast_alias(gen):
    recipe, group = DelayedScaling(amax_history_len=3), object()
    with pytest.warns(DeprecationWarning, match="use te_core.autocast"):
        context = fp8_autocast(fp8_recipe=recipe, fp8_group=group)
    with context:
        ctx = get_autocast_context()
        assert ctx.given is recipe and ctx.recipe == recipe and ctx.amax_reduction_group is group and ctx.enabled


def test_bad_recipe_type():
    with pytest.raises(TypeError, match="recipe must be a te_core.recipe recipe.*got str"):
        with autocast(recipe="delayed"):
            pass


@pytest.mark.parametrize("arg", ["enabled", "calibrating"])
@pytest.mark.parametrize("value", ["no", None, 2, 0.0])
def test_flags_refuse_values_read_by_truthiness(arg, value):
    # enabled="no" used to turn FP8 on
    with pytest.raises(TypeError, match=rf"autocast: {arg} must be True or False, got {re.escape(repr(value))}"):
        autocast(**{arg: value})
    with pytest.raises(TypeError, match=rf"quantized_model_init: enabled must be True or False, got "
                                        rf"{re.escape(repr(value))}"):
        with quantized_model_init(enabled=value):
            pass
    assert get_autocast_context() is None


@pytest.mark.parametrize("value, want", [(np.bool_(False), False), (0, False), (1, True), (np.bool_(True), True)])
def test_flags_take_numpy_bools_and_0_or_1(value, want):
    with autocast(enabled=value, calibrating=value):
        context = get_autocast_context()
        assert context.enabled is want and context.calibrating is want


def test_a_recipe_class_instead_of_an_instance_says_so():
    with pytest.raises(TypeError, match=r"autocast: recipe must be a recipe instance, got the class "
                                        r"Float8CurrentScaling; pass Float8CurrentScaling\(\) instead"):
        with autocast(recipe=Float8CurrentScaling):
            pass


def test_fp8_available_on_reference():
    assert is_fp8_available() is True  # a bool, as in Transformer Engine
    assert is_fp8_available(return_reason=True) == (True, "")


def _plugin(name, caps):
    from te_core.reference.plugin import implementations

    reference = implementations()

    @hookimpl
    def te_backend_info():
        return BackendInfo(name=name, device_type="cpu", api_version=API_VERSION)

    @hookimpl
    def te_backend_available():
        return True, "test backend"

    @hookimpl
    def te_backend_ops():
        return {"gemm_fp8": OpImpl(reference["gemm_fp8"])}

    @hookimpl
    def te_backend_capabilities(device):
        return caps

    return types.SimpleNamespace(te_backend_info=te_backend_info, te_backend_available=te_backend_available,
                                 te_backend_ops=te_backend_ops, te_backend_capabilities=te_backend_capabilities)


class _EntryPoint:
    def __init__(self, name, plugin):
        self.name, self._plugin = name, plugin
        self.dist = types.SimpleNamespace(metadata={"Name": f"te-backend-{name}"}, version="1.0")

    def load(self):
        return self._plugin


@pytest.fixture
def fake_backend(monkeypatch):
    def install(name, caps):
        monkeypatch.setattr(registry, "_entry_points", lambda: [_EntryPoint(name, _plugin(name, caps))])
        registry.REGISTRY.reset()
        backend.set_backend(name)

    yield install
    monkeypatch.undo()
    registry.REGISTRY.reset()


def test_autocast_refuses_without_fp8(fake_backend):
    fake_backend("nofp8", Capabilities(fp8_formats={}, device_name="Old GPU", arch="arch_1"))
    ok, reason = is_fp8_available(return_reason=True)
    assert not ok and "E4M3" in reason
    assert is_fp8_available() is False
    with pytest.raises(RuntimeError, match="FP8 is not available on the selected backend: .*E4M3"):
        with autocast():
            pass
    with autocast(enabled=False, calibrating=True):  # calibration needs no FP8 hardware
        pass


def test_mxfp8_emulated_where_the_backend_lacks_it(gen, fake_backend):
    formats = {n: m for n, m in FP8_FORMATS.values()}
    fake_backend("nomx", Capabilities(fp8_formats=formats, scaling_modes=frozenset({"tensorwise"}),
                                      device_name="Fake GPU", arch="fake_9"))
    ok, reason = is_mxfp8_available(return_reason=True)
    assert not ok and "mxfp8" in reason
    assert is_mxfp8_available() is False
    torch.manual_seed(0)
    layer = Linear(64, 32)
    x = randn(gen, 32, 64)
    with pytest.warns(BackendFallbackWarning) as record:
        with autocast(recipe=MXFP8BlockScaling()):
            y = layer(x)
    messages = [str(w.message) for w in record]
    assert any(re.search(r"gemm_fp8.*falls back.*nomx.*'mxfp8' not supported", m) for m in messages), messages
    want = x.double() @ layer.weight.double().T + layer.bias.double()
    assert (y - want).norm() / want.norm() < 0.07


def test_quantized_model_init_keeps_weights_in_fp8(gen):
    torch.manual_seed(0)
    with quantized_model_init(recipe=Float8CurrentScaling()):
        layer = Linear(32, 16)
    assert isinstance(layer.weight, Float8Tensor)
    assert layer.weight.requires_grad
    hp_weight = layer.weight.dequantize().clone()
    x = randn(gen, 16, 32)
    with autocast(recipe=Float8CurrentScaling()):
        y = layer(x)
    y.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (16, 32)
    torch.optim.SGD(layer.parameters(), lr=0.5, foreach=False).step()
    assert isinstance(layer.weight, Float8Tensor)
    torch.testing.assert_close(layer.weight.dequantize(), hp_weight - 0.5 * layer.weight.grad, rtol=0.125, atol=0.0675)
    y_hp = layer(x)  # without autocast: the FP8 weight is dequantized
    torch.testing.assert_close(y_hp, x @ layer.weight.dequantize().T + layer.bias)
    # checkpoints hold the dequantized weight (loads with weights_only=True) and load back into FP8
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert type(saved["weight"]) is torch.Tensor
    with quantized_model_init(recipe=Float8CurrentScaling()):
        other = Linear(32, 16)
    other.load_state_dict(saved)
    assert isinstance(other.weight, Float8Tensor)
    torch.testing.assert_close(other.weight.dequantize(), layer.weight.dequantize(), rtol=0.125, atol=0.0675)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam])
def test_foreach_optimizers_update_fp8_weights_as_looping_ones(gen, optimizer):
    """A foreach step (one op over every parameter: torch's default on GPUs) requantizes FP8
    primary weights as a looping step does, bit for bit."""
    x = randn(gen, 16, 32)
    weights = {}
    for foreach in (False, True):
        torch.manual_seed(0)
        with quantized_model_init(recipe=Float8CurrentScaling()):
            model = torch.nn.Sequential(Linear(32, 16), Linear(16, 16))
        opt = optimizer(model.parameters(), lr=0.1, foreach=foreach)
        for _ in range(2):
            with autocast(recipe=Float8CurrentScaling()):
                y = model(x)
            y.square().sum().backward()
            opt.step()
            opt.zero_grad()
        assert all(isinstance(m.weight, Float8Tensor) for m in model)
        weights[foreach] = [(m.weight._data.view(torch.uint8).clone(), m.weight._scale_inv.clone()) for m in model]
    for (data, scale_inv), (data_f, scale_inv_f) in zip(weights[False], weights[True]):
        assert torch.equal(data, data_f) and torch.equal(scale_inv, scale_inv_f)


def test_fp8_model_init_alias():
    with pytest.warns(DeprecationWarning):
        context = fp8_model_init(recipe=DelayedScaling())
    with context:
        layer = Linear(16, 16)
    assert isinstance(layer.weight, Float8Tensor)
    # the initial scale comes from the weight's own amax: its largest element lands on E4M3's max
    assert layer.weight._data.float().abs().max() == 448.0
    assert torch.equal(torch.reciprocal(layer.quantization_state()["forward"]["weight"]["scale"]),
                       layer.weight._scale_inv)


def _input_entry(layer):
    entry = layer.quantization_state()["forward"]["input"]
    return entry["scale"].clone(), entry["amax_history"].clone()


def test_nested_delayed_recipe_keeps_the_module_history(gen):
    """As Transformer Engine: a module keeps its amax history and scales across DelayedScaling
    recipes (an inner autocast with another margin or algorithm does not reset them); the update
    at the outermost exit follows the recipe the module ran under last."""
    layer = Linear(32, 16)
    outer, inner = DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, margin=1)
    xs = [randn(gen, 16, 32, scale=1.0 + i) for i in range(3)]
    for x in xs[:2]:
        with autocast(recipe=outer):
            layer(x)
    scale_before, history_before = _input_entry(layer)
    with autocast(recipe=outer):
        with autocast(recipe=inner):
            layer(xs[2])
    scale, history = _input_entry(layer)
    assert torch.equal(history[1:-1], history_before[2:])  # rolled on, not reset
    assert history[-1] == xs[2].abs().max()
    window = torch.stack([x.abs().max() for x in xs]).max()
    assert scale.item() == pytest.approx(448.0 / window.item() / 2, rel=1.3e-6)  # inner's margin=1
    with autocast(recipe=outer):
        layer(xs[0])
    assert _input_entry(layer)[1][-2] == xs[2].abs().max()  # back to the outer recipe: still kept


def test_assigned_margin_applies_from_the_next_autocast(gen):
    """A field assigned to the recipe a module runs with (Transformer Engine's recipes take
    assignments) reaches the module at the next te.autocast, as a new recipe of the same kind
    would: the amax history carries over and the next update uses the new margin. Assigned inside
    a step, it leaves that step's update alone (the step runs the copy in use at its start)."""
    layer = Linear(32, 16)
    rcp = DelayedScaling(amax_history_len=4)
    xs = [randn(gen, 16, 32, scale=1.0 + i) for i in range(3)]
    for x in xs[:2]:
        with autocast(recipe=rcp):
            layer(x)
    _, history_before = _input_entry(layer)
    rcp.margin = 1
    with autocast(recipe=rcp):
        layer(xs[2])
        rcp.margin = 2  # from the next autocast on
    scale, history = _input_entry(layer)
    assert torch.equal(history[1:-1], history_before[2:]) and history[-1] == xs[2].abs().max()
    window = torch.stack([x.abs().max() for x in xs]).max()
    assert scale.item() == pytest.approx(448.0 / window.item() / 2, rel=1.3e-6)
    with autocast(recipe=rcp):
        layer(xs[0])
    assert _input_entry(layer)[0].item() == pytest.approx(448.0 / window.item() / 4, rel=1.3e-6)


@pytest.mark.parametrize("length", [2, 7])
def test_other_history_length_keeps_the_most_recent_entries(gen, length):
    layer = Linear(32, 16)
    xs = [randn(gen, 16, 32, scale=1.0 + i) for i in range(4)]
    for x in xs:
        with autocast(recipe=DelayedScaling(amax_history_len=4)):
            layer(x)
    _, before = _input_entry(layer)
    with autocast(recipe=DelayedScaling(amax_history_len=length)):
        pass  # nothing runs: the state adapts on the module's next forward
    y = randn(gen, 16, 32)
    with autocast(recipe=DelayedScaling(amax_history_len=length)):
        layer(y)
    _, history = _input_entry(layer)
    amaxes = [x.abs().max() for x in xs] + [y.abs().max()]
    assert history.shape == (length,) and history[0] == 0
    kept = min(length - 1, 4)
    assert history[-kept:].tolist() == [a.item() for a in amaxes[-kept:]]
    assert torch.all(history[1 : length - kept] == 0)


def test_other_recipe_class_starts_afresh_as_transformer_engine(gen):
    layer = Linear(32, 16)
    with autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(randn(gen, 16, 32))
    with autocast(recipe=Float8CurrentScaling()):
        layer(randn(gen, 16, 32))
    assert layer.quantization_state() == {"forward": {}, "backward": {}}
    with autocast(recipe=DelayedScaling(amax_history_len=4)):
        layer(randn(gen, 16, 32))
    assert torch.count_nonzero(_input_entry(layer)[1]) == 1
