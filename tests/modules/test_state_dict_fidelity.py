"""State dicts of quantized modules keep torch's and Transformer Engine's contracts: keep_vars=True
hands out the parameters themselves, assign=True keeps FP8 primary weights FP8, and a delayed-scaling
checkpoint runs under another recipe as a module that switched recipes in memory does."""
from __future__ import annotations

import io
import warnings

import pytest
import torch

import te_core as te
from te_core.quantization import extra_state as extra_state_bytes
from te_core.quantization.tensor import QuantizedTensor
from te_core.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling
from te_core.reference.scaling import history_amax, scale_from_amax

PRIMARY_RECIPES = [Float8CurrentScaling, DelayedScaling, MXFP8BlockScaling]
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def _roundtrip(sd):
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _fp8_linear(recipe, seed=0, **kwargs):
    torch.manual_seed(seed)
    with te.quantized_model_init(recipe=recipe):
        return te.Linear(64, 64, **kwargs)


def _assert_same_state(module, other):
    got, want = module.quantization_state(), other.quantization_state()
    for direction, slots in want.items():
        assert set(got[direction]) == set(slots)
        for slot, entry in slots.items():
            for key, value in entry.items():
                assert torch.equal(got[direction][slot][key], value), (direction, slot, key)


def _forward(module, x, recipe):
    with torch.no_grad(), te.autocast(recipe=recipe):
        return module(x)


# ------------------------------------------------------------------ keep_vars


@pytest.mark.parametrize("make_recipe", PRIMARY_RECIPES)
def test_keep_vars_returns_the_fp8_parameters_themselves(make_recipe):
    module = _fp8_linear(make_recipe())
    kept = module.state_dict(keep_vars=True)
    assert kept["weight"] is module.weight and kept["bias"] is module.bias
    assert isinstance(kept["weight"], QuantizedTensor) and kept["weight"].requires_grad
    plain = module.state_dict()["weight"]  # without keep_vars: still the checkpoint-safe plain tensor
    assert type(plain) is torch.Tensor and not plain.requires_grad
    assert torch.equal(plain, module.weight.dequantize())


def test_keep_vars_maps_parameters_by_identity_in_a_model():
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        model = torch.nn.Sequential(te.Linear(64, 64), te.LayerNormLinear(64, 64))
    kept = model.state_dict(keep_vars=True)
    by_identity = {id(p) for p in model.parameters()}
    assert all(id(kept[name]) in by_identity for name, _ in model.named_parameters())


# ------------------------------------------------------------------ assign=True


@pytest.mark.parametrize("make_recipe", PRIMARY_RECIPES)
@pytest.mark.parametrize("device", ["same", "meta"])
def test_assign_keeps_fp8_primary_weights_quantized(make_recipe, device):
    recipe = make_recipe()
    source = _fp8_linear(recipe, seed=0)
    sd = _roundtrip(source.state_dict())
    copied = _fp8_linear(recipe, seed=1)
    copied.load_state_dict(sd)
    kwargs = {"device": "meta"} if device == "meta" else {}
    assigned = _fp8_linear(recipe, seed=2, **kwargs)
    assigned.load_state_dict(sd, assign=True)

    weight = assigned.weight
    assert isinstance(weight, torch.nn.Parameter) and isinstance(weight, QuantizedTensor)
    assert type(weight) is type(copied.weight) and weight.requires_grad
    assert weight.device == source.weight.device
    assert torch.equal(weight.dequantize(), copied.weight.dequantize())
    _assert_same_state(assigned, source)
    x = torch.randn(32, 64)
    out = _forward(assigned, x, recipe)
    assert torch.equal(out, _forward(copied, x, recipe))
    assert torch.equal(out, _forward(source, x, recipe))


@pytest.mark.parametrize("make_recipe", PRIMARY_RECIPES)
def test_an_assigned_fp8_weight_trains(make_recipe):
    recipe = make_recipe()
    sd = _roundtrip(_fp8_linear(recipe, seed=0).state_dict())
    copied, assigned = _fp8_linear(recipe, seed=1), _fp8_linear(recipe, seed=2)
    copied.load_state_dict(sd)
    assigned.load_state_dict(sd, assign=True)
    x = torch.randn(32, 64)
    for module in (copied, assigned):
        with te.autocast(recipe=recipe):
            module(x).square().sum().backward()
    assert isinstance(assigned.weight, QuantizedTensor) and assigned.weight.grad is not None
    assert torch.equal(assigned.weight.grad, copied.weight.grad)


def test_assign_keeps_requires_grad_false():
    recipe = Float8CurrentScaling()
    sd = _fp8_linear(recipe).state_dict()
    frozen = _fp8_linear(recipe, seed=1)
    frozen.weight.requires_grad_(False)
    frozen.load_state_dict(sd, assign=True)
    assert isinstance(frozen.weight, QuantizedTensor) and not frozen.weight.requires_grad


def test_assign_takes_a_quantized_value_of_the_same_kind_as_is():
    recipe = Float8CurrentScaling()
    source = _fp8_linear(recipe)
    target = _fp8_linear(recipe, seed=1)
    target.load_state_dict(source.state_dict(keep_vars=True), assign=True)
    assert target.weight is source.weight


# ------------------------------------------------------------------ checkpoints under another recipe


def _trained(recipe=None, seed=0):
    """A Linear after one training step under `recipe` (DelayedScaling by default), and its checkpoint."""
    torch.manual_seed(seed)
    module = te.Linear(64, 64)
    with te.autocast(recipe=recipe or DelayedScaling(amax_history_len=8)):
        module(torch.randn(32, 64) * 3).sum().backward()
    return module, _roundtrip(module.state_dict())


def _loaded(sd):
    module = te.Linear(64, 64)
    module.load_state_dict(sd)
    return module


def _recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught]


@pytest.mark.parametrize("other", [Float8CurrentScaling, MXFP8BlockScaling])
def test_a_loaded_delayed_state_gives_way_to_another_recipe_kind(other):
    source, sd = _trained()
    target = _loaded(sd)
    x = torch.randn(32, 64)
    out, caught = _recorded(lambda: _forward(target, x, other()))
    assert any(m.startswith(f"Recipe type changed from DelayedScaling to {other.__name__}") for m in caught)
    assert target.quantization_state() == {"forward": {}, "backward": {}}
    # the module that made the checkpoint, switched in memory the same way
    expected, caught = _recorded(lambda: _forward(source, x, other()))
    assert any(m.startswith("Recipe type changed") for m in caught)
    assert torch.equal(out, expected)


def test_a_module_of_another_recipe_loads_a_delayed_checkpoint():
    source, sd = _trained()
    x = torch.randn(32, 64)
    target = te.Linear(64, 64)
    _forward(target, x, MXFP8BlockScaling())
    target.load_state_dict(sd)  # no error: the checkpoint's state is taken
    out, caught = _recorded(lambda: _forward(target, x, MXFP8BlockScaling()))
    assert any(m.startswith("Recipe type changed from DelayedScaling to MXFP8BlockScaling") for m in caught)
    expected, _ = _recorded(lambda: _forward(source, x, MXFP8BlockScaling()))
    assert torch.equal(out, expected)


def test_a_module_of_another_recipe_resumes_the_delayed_checkpoint():
    source, sd = _trained()
    target = te.Linear(64, 64)
    _forward(target, torch.randn(32, 64), Float8CurrentScaling())
    target.load_state_dict(sd)
    x = torch.randn(32, 64)
    recipe = DelayedScaling(amax_history_len=8)
    out, caught = _recorded(lambda: _forward(target, x, recipe))
    assert not caught
    assert torch.equal(out, _forward(source, x, recipe))


def _rescaled(saved_state, algo="max"):
    """The E4M3 scale the update computes from a saved E5M2 grad_output history (margin 0)."""
    history = saved_state["backward"]["grad_output"]["amax_history"]
    if algo == "most_recent":
        amax = history[0] if history[0] != 0 else history[-1]
    else:
        amax = history_amax(history.reshape(-1, 1), "max")
    old = saved_state["backward"]["grad_output"]["scale"]
    return scale_from_amax(amax.reshape(1), old, E4M3_MAX, 0.0)


def _switched_checkpoint(sd, scale, **fields):
    """`sd` as if saved under DelayedScaling(fp8_format=E4M3), its grad_output scale `scale`."""
    sd = dict(sd)
    state = extra_state_bytes.decode(sd["_extra_state"], "test")
    state["recipe"] = dict(state["recipe"], fp8_format="E4M3", **fields)
    state["quantization_state"]["backward"]["grad_output"]["scale"] = scale.clone()
    sd["_extra_state"] = extra_state_bytes.encode(state)
    return sd


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_a_loaded_delayed_state_under_another_format_rescales_from_its_history(algo):
    hybrid = DelayedScaling(amax_history_len=8, amax_compute_algo=algo)
    source, sd = _trained(hybrid)
    saved = source.quantization_state()
    e4m3 = DelayedScaling(amax_history_len=8, amax_compute_algo=algo, fp8_format=Format.E4M3)
    target = _loaded(sd)
    x = torch.randn(32, 64)

    def step(module):
        x.grad = None
        with te.autocast(recipe=e4m3):
            y = module(x.requires_grad_())
        # (torch.randn: randn_like takes a generator from torch 2.10 on)
        dy = torch.randn(y.shape, generator=torch.Generator(y.device).manual_seed(3), dtype=y.dtype, device=y.device)
        y.backward(dy * 1e-3)
        return y.detach(), x.grad.clone(), module.weight.grad.clone()

    target.weight.grad = None
    got, caught = _recorded(lambda: step(target))
    assert any("fp8_format=HYBRID" in m and "fp8_format=E4M3" in m for m in caught)
    # reference: the checkpoint as if written under E4M3 with the recomputed gradient scale
    reference = _loaded(_switched_checkpoint(sd, _rescaled(saved, algo), amax_compute_algo=algo))
    reference.weight.grad = None
    expected, caught = _recorded(lambda: step(reference))
    assert not caught
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    _assert_same_state(target, reference)  # both updated the same state from the same start


def test_the_recomputed_scale_is_the_updates_for_the_new_format():
    source, sd = _trained()
    saved = source.quantization_state()
    target = _loaded(sd)
    _recorded(lambda: _forward(target, torch.randn(32, 64), DelayedScaling(amax_history_len=8, fp8_format=Format.E4M3)))
    grad_output = target.quantization_state()["backward"]["grad_output"]
    assert torch.equal(grad_output["scale"], _rescaled(saved))
    assert torch.equal(grad_output["amax_history"], saved["backward"]["grad_output"]["amax_history"])
    assert not torch.equal(grad_output["scale"], saved["backward"]["grad_output"]["scale"])


def test_a_module_in_another_format_loads_a_delayed_checkpoint_rescaled():
    source, sd = _trained()
    saved = source.quantization_state()
    e4m3 = DelayedScaling(amax_history_len=8, fp8_format=Format.E4M3)
    target = te.Linear(64, 64)
    _forward(target, torch.randn(32, 64), e4m3)
    _, caught = _recorded(lambda: target.load_state_dict(sd))
    assert any("fp8_format=HYBRID" in m and "fp8_format=E4M3" in m for m in caught)
    state = target.quantization_state()
    assert torch.equal(state["forward"]["input"]["scale"], saved["forward"]["input"]["scale"])
    assert torch.equal(state["backward"]["grad_output"]["scale"], _rescaled(saved))
    assert torch.equal(state["backward"]["grad_output"]["amax_history"],
                       saved["backward"]["grad_output"]["amax_history"])
    x = torch.randn(32, 64)
    reference = _loaded(_switched_checkpoint(sd, _rescaled(saved)))
    assert torch.equal(_forward(target, x, e4m3), _forward(reference, x, e4m3))


def test_a_column_without_history_starts_fresh_in_the_new_format():
    # amax_history_len=1: the update zeroes the only row, so the checkpoint holds no amax to rescale by
    source, sd = _trained(DelayedScaling(amax_history_len=1))
    target = _loaded(sd)
    e4m3 = DelayedScaling(amax_history_len=1, fp8_format=Format.E4M3)
    x = torch.randn(32, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with te.autocast(recipe=e4m3):
            y = target(x)
    dy = torch.randn_like(y) * 1e-3
    y.backward(dy)
    # the gradient's first cast took its scale from its own amax, as a fresh state's does
    fresh = te.Linear(64, 64)
    fresh.load_state_dict({k: v for k, v in sd.items() if k != "_extra_state"}, strict=False)
    x2 = x.detach().clone().requires_grad_()
    with te.autocast(recipe=e4m3):
        y2 = fresh(x2)
    y2.backward(dy)
    assert torch.equal(x.grad, x2.grad)
