"""A user's checkpoint paths with the pickled extra state (TE's module layout), for every stateful
module kind a TE user trains under DelayedScaling: torch.save / torch.load(weights_only=True),
safetensors, deepcopy and pickle of the module, and a state dict in te-core's earlier torch.save
form. Each restored model must hold the source's scales, amax histories and fresh flags bit for
bit and take the same next training step (output, gradients, updated scales)."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import te_core as te
from te_core.quantization.state import extra_state
from te_core.recipe import DelayedScaling, Format

RECIPE = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
SPLITS = [4, 0, 8]  # GroupedLinear: the second GEMM gets no rows, so its slots stay fresh


def _build(kind: str) -> torch.nn.Module:
    if kind == "Linear":
        return te.Linear(32, 48)
    if kind == "LayerNormMLP":
        return te.LayerNormMLP(32, 64)
    if kind == "GroupedLinear":
        return te.GroupedLinear(len(SPLITS), 32, 48)
    return te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)


def _step(model, kind: str, generator: torch.Generator, scale: float = 1.0) -> dict:
    shape = {"GroupedLinear": (sum(SPLITS), 32), "TransformerLayer": (4, 2, 32)}.get(kind, (8, 32))
    x = (torch.randn(shape, generator=generator) * scale).requires_grad_()
    with te.autocast(recipe=RECIPE):
        y = model(x, SPLITS) if kind == "GroupedLinear" else model(x)
    y.backward(torch.randn(y.shape, generator=generator))
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"y": y.detach(), "dx": x.grad, **grads}


def _stateful(model):
    return {name: m for name, m in model.named_modules() if getattr(m, "_recipe_state", None) is not None}


def _scaling_state(model) -> dict:
    return {name: (m._recipe_state.quantization_state(), m._recipe_state.fresh_slots())
            for name, m in _stateful(model).items()}


def _assert_same(actual, expected, where=""):
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}/{key}")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where}: {actual} != {expected}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _trained(kind: str):
    torch.manual_seed(11)
    model = _build(kind)
    generator = torch.Generator().manual_seed(3)
    for step in range(3):  # growing inputs: scales and histories differ from step to step
        _step(model, kind, generator, scale=1.0 + step)
    states = _scaling_state(model)
    assert states and any(not all(f for d in fresh.values() for f in d.values()) for _, fresh in states.values())
    return model


def _assert_resumes_as(restored, source, kind: str):
    """Same scaling state now, and the same next step (outputs, gradients, updated state)."""
    _assert_same(_scaling_state(restored), _scaling_state(source), "restored")
    expected_source = copy.deepcopy(source)
    step = _step(restored, kind, torch.Generator().manual_seed(7), scale=2.5)
    _assert_same(step, _step(expected_source, kind, torch.Generator().manual_seed(7), scale=2.5), "next step")
    _assert_same(_scaling_state(restored), _scaling_state(expected_source), "after the next step")


def _into_fresh(kind: str, state_dict: dict):
    torch.manual_seed(99)  # other initial weights than the source's: the state dict must set them
    model = _build(kind)
    model.load_state_dict(state_dict)
    return model


KINDS = ["Linear", "LayerNormMLP", "GroupedLinear", "TransformerLayer"]


@pytest.mark.parametrize("kind", KINDS)
def test_torch_save_then_weights_only_load(kind):
    source = _trained(kind)
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)
    buffer.seek(0)
    _assert_resumes_as(_into_fresh(kind, torch.load(buffer, weights_only=True)), source, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_under_another_default_device(kind):
    """state_dict() inside a `with torch.device(...)` block (model-building code often is): the
    extra state's placeholder columns must not follow that default device while the scales stay
    on the module's (on a GPU this raised for scales on the GPU and for the block's device alike)."""
    source = _trained(kind)
    with torch.device("meta"):
        state = source.state_dict()
    _assert_resumes_as(_into_fresh(kind, state), source, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_safetensors_round_trip(kind):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    source = _trained(kind)
    loaded = safetensors_torch.load(safetensors_torch.save(source.state_dict()))
    _assert_resumes_as(_into_fresh(kind, loaded), source, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save module"])
def test_copied_module(kind, how):
    source = _trained(kind)
    if how == "deepcopy":
        restored = copy.deepcopy(source)
    elif how == "pickle":
        restored = pickle.loads(pickle.dumps(source))
    else:
        buffer = io.BytesIO()
        torch.save(source, buffer)
        buffer.seek(0)
        restored = torch.load(buffer, weights_only=False)
    _assert_resumes_as(restored, source, kind)


def _earlier_form(module) -> torch.Tensor:
    """te-core's extra state before the pickled layout: torch.save's archive of its checkpoint dict."""
    buffer = io.BytesIO()
    torch.save({"te_core_extra_state": 1, **extra_state(module._recipe_state)}, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


@pytest.mark.parametrize("kind", KINDS)
def test_earlier_torch_save_form_loads(kind):
    source = _trained(kind)
    state_dict = source.state_dict()
    for name in _stateful(source):
        key = f"{name}._extra_state" if name else "_extra_state"
        assert bytes(state_dict[key][:1].tolist()) == b"\x80"  # the new form: a pickle
        state_dict[key] = _earlier_form(source.get_submodule(name))
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    restored = _into_fresh(kind, torch.load(buffer, weights_only=True))
    resaved = restored.state_dict()  # (before the next step changes it)
    _assert_resumes_as(restored, source, kind)
    # saved again, it is in the new form with the same values
    assert all(bytes(value[:1].tolist()) == b"\x80" for key, value in resaved.items()
               if key.endswith("_extra_state") and value.numel())
    _assert_resumes_as(_into_fresh(kind, resaved), source, kind)
