"""Checkpoints: extra state is tensors + plain values, restores bit for bit, resumes exactly."""
from __future__ import annotations

import io

import pytest
import torch

from te_core.modules.linear import Linear
from te_core.quantization import autocast
from te_core.quantization import extra_state as extra_state_bytes
from te_core.recipe import DelayedScaling, Float8CurrentScaling, Format

from .conftest import randn


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = Linear(32, 48)
        self.fc2 = Linear(48, 16)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def train(model, optimizer, batches, recipe):
    losses = []
    for x, target in batches:
        optimizer.zero_grad()
        with autocast(recipe=recipe):
            y = model(x)
        loss = torch.nn.functional.mse_loss(y, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def roundtrip(obj):
    """obj through torch.save / torch.load(weights_only=True), a state dict's extra state read
    into te-core's checkpoint dict (which set_extra_state also takes), for the tests to inspect
    and edit."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    if isinstance(loaded, dict) and isinstance(loaded.get("_extra_state"), torch.Tensor):
        loaded["_extra_state"] = extra_state_bytes.decode(loaded["_extra_state"], "test")
    return loaded


def make_batches(gen, n):
    return [(randn(gen, 16, 32, scale=1 + i), randn(gen, 16, 16)) for i in range(n)]


RECIPE = DelayedScaling(amax_history_len=4)


def test_state_dict_restores_scaling_state_bit_for_bit(gen):
    torch.manual_seed(0)
    model = TwoLayers()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), make_batches(gen, 3), RECIPE)
    loaded = roundtrip(model.state_dict())  # weights_only=True: no pickled objects
    torch.manual_seed(1)
    fresh = TwoLayers()
    fresh.load_state_dict(loaded)
    for name in ("fc1", "fc2"):
        want = getattr(model, name).quantization_state()
        got = getattr(fresh, name).quantization_state()
        for direction, roles in want.items():
            assert set(got[direction]) == set(roles)
            for role, entry in roles.items():
                for key, tensor in entry.items():
                    assert torch.equal(got[direction][role][key], tensor), (name, direction, role, key)
    assert want["forward"]["input"]["amax_history"].ne(0).any()


def test_resumed_training_matches_uninterrupted(gen):
    batches = make_batches(gen, 6)
    torch.manual_seed(0)
    model = TwoLayers()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, optimizer, batches[:3], RECIPE)
    checkpoint = roundtrip({"model": model.state_dict(), "optim": optimizer.state_dict()})
    uninterrupted = train(model, optimizer, batches[3:], RECIPE)

    torch.manual_seed(5)
    resumed_model = TwoLayers()
    resumed_optimizer = torch.optim.Adam(resumed_model.parameters(), lr=1e-2)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optim"])
    resumed = train(resumed_model, resumed_optimizer, batches[3:], DelayedScaling(amax_history_len=4))
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b)
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(model.fc2.quantization_state()["backward"]["grad_output"]["scale"],
                       resumed_model.fc2.quantization_state()["backward"]["grad_output"]["scale"])


def test_slots_not_cast_yet_stay_fresh_through_a_checkpoint(gen):
    """Saved after forward-only steps, the output-gradient slot has not cast yet: its first cast
    still scales by its own amax after a reload, as in the uninterrupted run (the resumed step is
    bit-identical), where with scale 1 a small gradient would flush to zero in E5M2. A checkpoint
    without that record (Transformer Engine's, older te-core ones) starts every slot from its
    saved scale."""
    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    layer = Linear(48, 32)
    with torch.no_grad(), autocast(recipe=recipe):  # evaluation only: nothing cast in the backward yet
        layer(randn(gen, 16, 48))
    saved = roundtrip(layer.state_dict())
    torch.manual_seed(1)
    resumed = Linear(48, 32)
    resumed.load_state_dict(saved)
    x, dy = randn(gen, 16, 48), randn(gen, 16, 32) * 1e-6
    grads = []
    for module in (layer, resumed):
        xi = x.clone().requires_grad_(True)
        with autocast(recipe=recipe):
            y = module(xi)
        y.backward(dy)
        grads.append((y, xi.grad, module.weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert torch.count_nonzero(grads[1][1]) > 0  # scaled by its own amax, not flushed to zero

    state = dict(saved["_extra_state"])
    assert state["fresh"] == {"forward": {"input": False, "weight": False}, "backward": {"grad_output": True}}
    del state["fresh"]  # as a checkpoint written before the record was
    older = Linear(48, 32)
    older.set_extra_state(state)
    assert not any(group.fresh for group in older._recipe_state.scaling_groups().values())


def _trained_layer(gen, recipe):
    layer = Linear(16, 16)
    with autocast(recipe=recipe):
        layer(randn(gen, 16, 16))
    return layer


def test_loading_other_history_length_fits_the_history(gen):
    """The history takes the module's length, the scales load as saved (test_history_length.py)."""
    source = _trained_layer(gen, DelayedScaling(amax_history_len=4))
    target = _trained_layer(gen, DelayedScaling(amax_history_len=8))
    target.load_state_dict(roundtrip(source.state_dict()))
    got = target.quantization_state()["forward"]["input"]
    want = source.quantization_state()["forward"]["input"]
    assert torch.equal(got["scale"], want["scale"]) and got["amax_history"].shape == (8,)
    assert torch.equal(got["amax_history"][-3:], want["amax_history"][1:]) and not got["amax_history"][1:5].any()


def test_checkpoint_then_other_recipe_warns_as_transformer_engine_does(gen):
    """A checkpoint's delayed state under another recipe kind: the recipe-change warning and a
    new state (as without a checkpoint, and as TE); under another format: a warning, the scales
    recomputed from the kept histories."""
    saved = roundtrip(_trained_layer(gen, DelayedScaling(amax_history_len=4)).state_dict())
    fresh = Linear(16, 16)
    fresh.load_state_dict(saved)  # no state yet: adopts the checkpoint's
    with pytest.warns(UserWarning, match=r"Recipe type changed from DelayedScaling to Float8CurrentScaling"):
        with autocast(recipe=Float8CurrentScaling()):
            fresh(randn(gen, 16, 16))
    other_format = Linear(16, 16)
    other_format.load_state_dict(saved)
    with pytest.warns(UserWarning, match=r"fp8_format=HYBRID.*fp8_format=E4M3.*scales of the grad_output tensors"):
        with autocast(recipe=DelayedScaling(amax_history_len=4, fp8_format=Format.E4M3)):
            other_format(randn(gen, 16, 16))


def test_checkpoint_without_scaling_state_loads_anywhere(gen):
    saved = roundtrip(Linear(16, 16).state_dict())
    assert saved["_extra_state"] is None
    target = _trained_layer(gen, Float8CurrentScaling())
    target.load_state_dict(saved)
    assert target.quantization_state() == {"forward": {}, "backward": {}}


def test_bad_extra_state_is_rejected():
    layer = Linear(16, 16)
    with pytest.raises(ValueError, match="unrecognised extra state"):
        layer.set_extra_state(torch.zeros(3))


def _corrupted(saved, slot, key, index, value):
    state = saved["_extra_state"]["quantization_state"]["forward"][slot][key]
    state.view(-1)[index] = value
    return saved


@pytest.mark.parametrize("slot, key, index, value, message", [
    ("input", "scale", 0, float("nan"), r"input.scale holds nan.*a scale must be finite and > 0"),
    ("weight", "scale", 0, 0.0, r"weight.scale holds 0.0"),
    ("input", "scale", 0, float("inf"), r"input.scale holds inf"),
    ("weight", "scale", 0, -2.0, r"weight.scale holds -2.0"),
    ("input", "amax_history", 1, -1.0, r"input.amax_history holds -1.0.*an amax is never negative"),
])
def test_corrupt_scaling_state_is_rejected_and_leaves_the_module_as_it_was(gen, slot, key, index, value, message):
    saved = _corrupted(roundtrip(_trained_layer(gen, RECIPE).state_dict()), slot, key, index, value)
    target = _trained_layer(gen, RECIPE)
    before = {k: v.clone() for k, v in target.state_dict().items() if isinstance(v, torch.Tensor)}
    state_before = [t.clone() for d in target.quantization_state().values() for e in d.values() for t in e.values()]
    with pytest.raises(ValueError, match=message + r".*Drop the module's '_extra_state' entry"):
        target.load_state_dict(saved)
    state_after = [t for d in target.quantization_state().values() for e in d.values() for t in e.values()]
    assert all(torch.equal(a, b) for a, b in zip(state_before, state_after))  # nothing half-loaded
    assert before.keys() <= target.state_dict().keys()


def test_nan_and_inf_in_a_saved_history_load(gen):
    """The update ignores NaN and keeps the scale for inf (TE's semantics): both are states a
    run can reach, so a checkpoint holding them loads and the next update stays finite."""
    saved = _corrupted(roundtrip(_trained_layer(gen, RECIPE).state_dict()), "input", "amax_history", 1, float("nan"))
    saved["_extra_state"]["quantization_state"]["forward"]["weight"]["amax_history"][2] = float("inf")
    target = Linear(16, 16)
    target.load_state_dict(saved)
    with autocast(recipe=RECIPE):
        target(randn(gen, 16, 16))
    scales = [entry["scale"] for entry in target.quantization_state()["forward"].values()]
    assert all(torch.isfinite(s).all() and (s > 0).all() for s in scales)


def test_unknown_format_name_in_a_checkpoint_is_a_clear_error(gen):
    saved = roundtrip(_trained_layer(gen, RECIPE).state_dict())
    saved["_extra_state"]["recipe"]["fp8_format"] = "E4M3FNUZ"
    with pytest.raises(ValueError, match=r"unknown fp8_format 'E4M3FNUZ'.*known: E4M3, E5M2, HYBRID"):
        Linear(16, 16).load_state_dict(saved)


def test_stateless_recipe_writes_no_state_and_loads_into_delayed(gen):
    saved = roundtrip(_trained_layer(gen, Float8CurrentScaling()).state_dict())
    assert saved["_extra_state"] is None
    target = Linear(16, 16)
    target.load_state_dict(saved)
    with autocast(recipe=DelayedScaling(amax_history_len=4)):
        target(randn(gen, 16, 16))
    assert target.quantization_state()["forward"]["input"]["amax_history"].shape == (4,)


def test_state_follows_the_module_device(gen):
    layer = _trained_layer(gen, RECIPE)
    before = {k: v.clone() for k, v in layer.quantization_state()["forward"]["input"].items()}
    layer.to("meta")  # any other device: the scaling state moves with the module at its next step
    step = layer.quantization_step()
    assert step.fp8 is False  # outside autocast nothing moves ...
    with autocast(recipe=RECIPE):
        layer.quantization_step()  # ... inside, the state follows the parameters
    moved = layer.quantization_state()["forward"]["input"]
    assert moved["scale"].device.type == "meta" and moved["amax_history"].shape == before["amax_history"].shape


def test_extra_state_of_another_module_type_is_refused(gen):
    """A Linear's slots loaded into a LayerNormMLP (and the reverse), or a stray slot, name the
    slots instead of loading some and dropping the rest unseen."""
    from te_core.modules.layernorm_mlp import LayerNormMLP

    linear_state = roundtrip(_trained_layer(gen, RECIPE).state_dict())["_extra_state"]
    with pytest.raises(ValueError, match=r"slot\(s\) 'input', 'weight' \(forward\) that this module does not have "
                                         r"\(it has fc1_input, fc1_weight, fc2_input, fc2_weight\).*another module type"):
        LayerNormMLP(16, 32).set_extra_state(linear_state)
    linear_state["quantization_state"]["backward"]["stray"] = {"scale": torch.ones(1), "amax_history": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"slot\(s\) 'stray' \(backward\) that this module does not have"):
        Linear(16, 16).set_extra_state(linear_state)


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.__setitem__("recipe", "DelayedScaling"), r"Linear: extra state entry 'recipe' is a str"),
    (lambda s: s.__setitem__("quantization_state", "x"), r"Linear: extra state entry 'quantization_state' is a str"),
    (lambda s: s["quantization_state"]["forward"]["input"].pop("amax_history"),
     r"state for slot 'input' \(forward\) lacks amax_history; the checkpoint is corrupt"),
    (lambda s: s["quantization_state"].__setitem__("backward", [1]), r"backward delayed-scaling state is a list"),
])
def test_malformed_extra_state_is_named(gen, edit, message):
    saved = roundtrip(_trained_layer(gen, RECIPE).state_dict())
    edit(saved["_extra_state"])
    with pytest.raises(ValueError, match=message):
        Linear(16, 16).load_state_dict(saved)


def test_extra_state_is_transformer_engines_uint8_tensor(gen):
    """Empty without scaling state, else te-core's dict in bytes that torch.load(weights_only=True)
    reads; the tensor itself round-trips through a state dict."""
    fresh = Linear(16, 16).get_extra_state()
    assert fresh.dtype == torch.uint8 and fresh.shape == (0,)
    layer = _trained_layer(gen, RECIPE)
    state = layer.get_extra_state()
    assert state.dtype == torch.uint8 and state.dim() == 1 and state.numel() > 0
    decoded = extra_state_bytes.decode(state, "Linear")
    assert torch.equal(decoded["quantization_state"]["forward"]["input"]["scale"],
                       layer.quantization_state()["forward"]["input"]["scale"])
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    target = Linear(16, 16)
    target.load_state_dict(torch.load(buffer, weights_only=True))
    for direction in ("forward", "backward"):
        for slot, entry in layer.quantization_state()[direction].items():
            for key, value in entry.items():
                assert torch.equal(target.quantization_state()[direction][slot][key], value)


def test_other_archive_as_extra_state_is_named():
    buffer = io.BytesIO()
    torch.save({"weights": torch.ones(2)}, buffer)
    archive = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"Linear: the extra state is a torch.save archive of dict, not te-core's"):
        Linear(16, 16).set_extra_state(archive)
    with pytest.raises(ValueError, match=r"Linear: the extra state could not be read"):
        Linear(16, 16).set_extra_state(archive[:40].clone())


def test_extra_state_bytes_depend_on_the_state_alone(gen):
    """The same scaling state encodes to the same bytes wherever its tensors sit in memory (torch's
    tensor pickle names storages by address): torch's distributed checkpoint loads the entry in
    place only into a tensor of the same size."""
    source = _trained_layer(gen, RECIPE)
    first = source.get_extra_state()
    twin = Linear(16, 16)
    ballast = [torch.empty(n) for n in (1, 3000, 70000)]  # other allocations: other addresses
    twin.load_state_dict(source.state_dict())
    assert torch.equal(twin.get_extra_state(), first)
    target = Linear(16, 16)
    from te_core.modules import init_quantization_state

    init_quantization_state(target, RECIPE)
    assert target.get_extra_state().numel() == first.numel()
    del ballast


def test_torch_dcp_restores_scaling_state_into_an_initialized_model(gen, tmp_path):
    """torch.distributed.checkpoint loads a tensor in place into the destination's tensor of the
    same size: a model whose scaling state te.init_quantization_state made (or one that has run
    a step of the recipe) takes the saved state exactly; a fresh model's empty extra state is
    refused by DCP with a size mismatch, as Transformer Engine's is."""
    import warnings

    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from te_core.modules import init_quantization_state

    source = _trained_layer(gen, RECIPE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note that no process group is initialized
        save(get_model_state_dict(source), checkpoint_id=str(tmp_path))
        target = Linear(16, 16)
        init_quantization_state(target, RECIPE)
        state = get_model_state_dict(target)
        load(state, checkpoint_id=str(tmp_path))
        set_model_state_dict(target, state)
        with pytest.raises(CheckpointException, match=r"(?s)Size mismatch.*\[0\]\) for _extra_state"):
            load(get_model_state_dict(Linear(16, 16)), checkpoint_id=str(tmp_path))
    for direction, slots in source.quantization_state().items():
        for slot, entry in slots.items():
            for key, value in entry.items():
                assert torch.equal(target.quantization_state()[direction][slot][key], value), (direction, slot, key)
