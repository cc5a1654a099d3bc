"""Zero tokens: every module runs forward and backward on an empty batch, under every recipe,
with empty outputs, zero parameter gradients and, as in Transformer Engine, the scaling state of
the empty tensors untouched (an amax of 0 records nothing, so no history rolls)."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

from .conftest import randn

RECIPES = {
    "high-precision": None,
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
}

MODULES = {
    "Linear": (lambda: te.Linear(32, 32), (0, 32)),
    "LayerNormLinear": (lambda: te.LayerNormLinear(32, 32), (0, 32)),
    "LayerNormMLP": (lambda: te.LayerNormMLP(32, 64), (0, 32)),
    "LayerNorm": (lambda: te.LayerNorm(32), (0, 32)),
    "RMSNorm": (lambda: te.RMSNorm(32), (0, 32)),
    "GroupedLinear": (lambda: te.GroupedLinear(2, 32, 32), (0, 32)),
    "MultiheadAttention": (lambda: te.MultiheadAttention(32, 2), (0, 2, 32)),
    "TransformerLayer": (lambda: te.TransformerLayer(32, 64, 2), (0, 2, 32)),
}


def _forward(module, x, recipe, name):
    args = (x, [0, 0]) if name == "GroupedLinear" else (x,)
    if recipe is None:
        return module(*args)
    with te.autocast(recipe=recipe):
        return module(*args)


def _scaling_state(module):
    return {direction: {slot: {k: v.clone() for k, v in entry.items()} for slot, entry in slots.items()}
            for direction, slots in module.quantization_state().items()}


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("name", list(MODULES))
def test_empty_batch_forward_and_backward(gen, name, recipe_name):
    make, shape = MODULES[name]
    module, recipe = make(), RECIPES[recipe_name]
    x = torch.zeros(shape).requires_grad_()
    y = _forward(module, x, recipe, name)
    assert y.shape == (*shape[:-1], 32) and y.numel() == 0
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    for pname, param in module.named_parameters():
        assert param.grad is None or torch.count_nonzero(param.grad) == 0, f"{pname}: a gradient from no tokens"


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_empty_batch_leaves_the_activation_scaling_state_untouched(gen, name):
    """Inputs and gradients of an empty batch record amax 0; their histories and scales stay as
    they were (weights, which are not empty, update as on any step)."""
    make, shape = MODULES[name]
    module, recipe = make(), DelayedScaling(amax_history_len=4)
    full = (16, *shape[1:])
    for step in range(2):
        x = randn(gen, *full, scale=1.0 + step).requires_grad_()
        with te.autocast(recipe=recipe):
            y = module(x)
        y.sum().backward()
    before = _scaling_state(module)
    x = torch.zeros(shape).requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x)
    y.sum().backward()
    after = _scaling_state(module)
    checked = 0
    for direction, slots in before.items():
        for slot, entry in slots.items():
            if "weight" in slot:
                continue
            for key, value in entry.items():
                assert torch.equal(after[direction][slot][key], value), f"{direction} {slot} {key} changed"
                checked += 1
    assert checked >= 4
