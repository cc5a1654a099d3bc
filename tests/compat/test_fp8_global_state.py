"""FP8GlobalStateManager's calls beyond the queries: reset() (nothing to do outside te-core's
contexts, an error inside one), with_high_precision_init_val, fp8_graph_capturing, and the
calls that drive TE's global buffers, refused with what te-core does instead."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.compat.transformer_engine import FP8GlobalStateManager as Manager
from te_core.quantization.scaling import graph_capture
from te_core.recipe import DelayedScaling


def _train_step(layer, x, recipe):
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.square().sum().backward()


def test_reset_between_steps_changes_nothing():
    """Scales, histories and the next step's result are those of a run without reset()."""
    recipe = DelayedScaling(amax_history_len=5)
    torch.manual_seed(0)
    a, b = te.Linear(32, 48), te.Linear(32, 48)
    b.load_state_dict(a.state_dict())
    xs = [torch.randn(8, 32) * (1 + i) for i in range(3)]
    for i, x in enumerate(xs):
        _train_step(a, x, recipe)
        _train_step(b, x, recipe)
        Manager.reset()
        assert not Manager.is_fp8_enabled() and isinstance(Manager.get_fp8_recipe(), DelayedScaling)
    for direction, slots in a.quantization_state().items():
        for slot, entry in slots.items():
            for key, value in entry.items():
                assert torch.equal(value, b.quantization_state()[direction][slot][key]), (direction, slot, key)
    assert a.quantization_state()["forward"]["input"]["scale"].item() != 1.0  # scales were updated
    x = torch.randn(8, 32)
    with te.autocast(recipe=recipe):
        assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("context, name", [
    (lambda: te.autocast(recipe=DelayedScaling()), "te.autocast"),
    (lambda: te.autocast(enabled=False, calibrating=True), "te.autocast"),
    (lambda: te.quantized_model_init(recipe=DelayedScaling()), "te.quantized_model_init"),
])
def test_reset_inside_a_context_is_an_error(context, name):
    with context():
        with pytest.raises(RuntimeError, match=f"FP8GlobalStateManager.reset\\(\\) inside {name}: te-core keeps FP8 "
                                               "settings in the entered context"):
            Manager.reset()
    Manager.reset()  # after the block: fine


def test_with_high_precision_init_val_follows_quantized_model_init():
    assert Manager.with_high_precision_init_val() is False
    with te.quantized_model_init(recipe=DelayedScaling(), preserve_high_precision_init_val=True):
        assert Manager.with_high_precision_init_val() is True
        with te.quantized_model_init(enabled=False, preserve_high_precision_init_val=True):
            assert Manager.with_high_precision_init_val() is False
    with te.quantized_model_init(recipe=DelayedScaling()):
        assert Manager.with_high_precision_init_val() is False


def test_fp8_graph_capturing_follows_te_core_capture():
    assert Manager.fp8_graph_capturing() is False
    with graph_capture():
        assert Manager.fp8_graph_capturing() is True
    assert Manager.fp8_graph_capturing() is False


def test_forward_reduce_and_update_is_refused_with_the_replacement():
    """(The calls Megatron-LM's own CUDA graphs make, the skip flag and the backward update:
    test_megatron_local_cuda_graphs.py.)"""
    assert Manager.get_skip_fp8_weight_update_tensor() is None
    with pytest.raises(NotImplementedError, match="te-core updates delayed scales itself, at the exit of the "
                                                  "outermost te.autocast"):
        Manager.reduce_and_update_fp8_tensors(forward=True)

