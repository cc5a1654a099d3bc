"""A new value copied into an FP8 primary weight (te.quantized_model_init) under DelayedScaling.

Before any scale update (pretrained weights copied into a freshly built model), the value takes
its scale from its own amax, as the init value did: the init value's scale would saturate larger
values. After an update, delayed scaling as usual: the current scale, the new amax recorded for
the next update. Reference backend, CPU.
"""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.recipe import DelayedScaling

E4M3 = dict(rtol=0.125, atol=0.0675)
FP8_MAX = 448.0


def _model(module: str):
    with te.quantized_model_init(enabled=True, recipe=DelayedScaling()):
        if module == "Linear":
            return te.Linear(64, 48, params_dtype=torch.float32)
        return te.LayerNormMLP(64, 96, params_dtype=torch.float32)


def _weights(model):
    return [p for p in model.parameters() if isinstance(p, te.QuantizedTensor)]


def _column(weight):
    quantizer = weight._quantizer
    return quantizer.scaling_group, quantizer.column


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_copy_before_training_takes_the_values_own_scale(module):
    """Values ~40x the init's, copied in before any update, come back within E4M3's tolerance
    (the init scale saturated them at the init's amax), bit for bit as load_state_dict casts them;
    the forward under autocast matches the same model loaded through load_state_dict."""
    torch.manual_seed(0)
    copied, loaded = _model(module), _model(module)
    new = {name: torch.randn(p.shape) * 1.5 for name, p in copied.named_parameters() if isinstance(p, te.QuantizedTensor)}
    with torch.no_grad():
        for name, value in new.items():
            copied.get_parameter(name).copy_(value)
    state = loaded.state_dict()
    state.update(new)
    loaded.load_state_dict(state)
    for name, value in new.items():
        weight = copied.get_parameter(name)
        torch.testing.assert_close(weight.dequantize(), value, **E4M3)
        assert torch.equal(weight._data, loaded.get_parameter(name)._data)
    x = torch.randn(16, 64)
    with te.autocast(recipe=DelayedScaling()):
        torch.testing.assert_close(copied(x), loaded(x), rtol=0, atol=0)


def test_copy_before_training_replaces_the_init_amax_in_the_history():
    """Smaller values copied in before training: the first update scales the weight by their amax,
    not by the init value's larger one still in the history."""
    torch.manual_seed(1)
    model = _model("Linear")
    (weight,) = _weights(model)
    value = torch.randn(weight.shape) * 1e-3
    with torch.no_grad():
        weight.copy_(value)
    with te.autocast(recipe=DelayedScaling()):
        model(torch.randn(16, 64))
    group, column = _column(weight)
    expected = FP8_MAX / value.abs().amax()
    torch.testing.assert_close(group.scale[column], expected, rtol=1.3e-6, atol=0)


def test_copy_after_an_update_is_delayed_scaling():
    """Once an update ran, a copy casts with the current scale, which the copy leaves as it is, and
    records the value's amax for the next update (Transformer Engine's delayed scaling)."""
    torch.manual_seed(2)
    model = _model("Linear")
    (weight,) = _weights(model)
    with te.autocast(recipe=DelayedScaling()):
        model(torch.randn(16, 64))
    group, column = _column(weight)
    scale = group.scale[column].clone()
    value = torch.randn(weight.shape) * 0.01
    with torch.no_grad():
        weight.copy_(value)
    assert torch.equal(group.scale[column], scale)
    torch.testing.assert_close(group.amax_history[0, column], value.abs().amax(), rtol=0, atol=0)
    torch.testing.assert_close(weight.dequantize(), value, **E4M3)


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_resume_before_any_update_writes_the_weights_as_the_uninterrupted_run(module):
    """FP8 primary weights trained with high-precision compute (te.autocast off, Transformer
    Engine's checkpointing test): no scale update ever runs, so each optimizer step's write takes
    its own amax's scale. A model loaded from a checkpoint keeps doing so (the flag is in its extra
    state): its weights after further steps equal the uninterrupted run's, FP8 bytes and scales
    (the restored scale was kept instead, saturating values the steps grew past it)."""
    import io

    def step(model, optim, x, dy):
        optim.zero_grad()
        model(x).backward(dy)
        optim.step()

    torch.manual_seed(0)
    saved = _model(module)
    optim = torch.optim.SGD(saved.parameters(), lr=0.05)
    for _ in range(2):
        step(saved, optim, torch.randn(32, 64), torch.randn(32, 48 if module == "Linear" else 64))
    buffer = io.BytesIO()
    torch.save({"model": saved.state_dict(), "optim": optim.state_dict()}, buffer)
    loaded = _model(module)
    checkpoint = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    loaded.load_state_dict(checkpoint["model"])
    optim_loaded = torch.optim.SGD(loaded.parameters(), lr=0.05)
    optim_loaded.load_state_dict(checkpoint["optim"])
    for _ in range(3):
        x, dy = torch.randn(32, 64), torch.randn(32, 48 if module == "Linear" else 64)
        reference = [w.dequantize().double() for w in _weights(saved)]
        step(saved, optim, x, dy)
        step(loaded, optim_loaded, x, dy)
        for a, b, before in zip(_weights(saved), _weights(loaded), reference):
            assert torch.equal(a._data.view(torch.uint8), b._data.view(torch.uint8))
            assert torch.equal(a._scale_inv, b._scale_inv)
            # and the step's write is the update's value within E4M3 (nothing saturated)
            expected = before - 0.05 * a.grad.double()
            torch.testing.assert_close(b.dequantize().double(), expected, **E4M3)
