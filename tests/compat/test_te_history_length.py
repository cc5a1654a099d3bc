"""Transformer Engine extra state whose amax_history_len differs from the te-core module's recipe
loads: TE's scales as saved, each history fitted to the recipe's length (this step's row, then
the most recent entries; TE itself keeps the oldest when it shortens), and training goes on."""
from __future__ import annotations

import warnings

import pytest
import torch

import te_core as te
from te_core.recipe import DelayedScaling, Format

from .test_te_checkpoints import _delayed_state, _te_extra_state, te_recipe  # noqa: F401  (fixture)

# te-core slot -> (TE's tensor suffix, column) for one GEMM: TE keeps input, weight, output
# forward and grad output, grad input backward
COLUMNS = {("forward", "input"): ("fwd", 0), ("forward", "weight"): ("fwd", 1), ("backward", "grad_output"): ("bwd", 0)}


def expected_fit(history: torch.Tensor, length: int) -> torch.Tensor:
    rows = history.tolist()
    newest = rows[1:][-(length - 1):] if length > 1 else []
    return torch.tensor([rows[0]] + [0.0] * (length - 1 - len(newest)) + newest)


def recipe_of(length: int) -> DelayedScaling:
    return DelayedScaling(margin=1, fp8_format=Format.E4M3, amax_history_len=length)  # _delayed_state's


def _load(layer, state):
    sd = {k: v for k, v in layer.state_dict().items() if k != "_extra_state"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read, not restarted with a warning
        layer.load_state_dict({**sd, "_extra_state": _te_extra_state(state)})


def _step(layer, x, recipe):
    with te.autocast(recipe=recipe):
        y = layer(x)
    y.square().sum().backward()


@pytest.mark.parametrize("saved_len, length", [(16, 4), (3, 10), (1024, 16)])
def test_te_state_of_another_length_loads_fitted(te_recipe, saved_len, length):
    state = _delayed_state(te_recipe, 1, history=saved_len, seed=int(torch.randint(0, 2**31, ())))
    layer = te.Linear(16, 16)
    _step(layer, torch.randn(4, 16), recipe_of(length))  # a state of the recipe's length exists
    _load(layer, state)
    got = layer.quantization_state()
    for (direction, slot), (suffix, column) in COLUMNS.items():
        assert torch.equal(got[direction][slot]["scale"], state[f"scale_{suffix}"][column:column + 1])
        assert torch.equal(got[direction][slot]["amax_history"],
                           expected_fit(state[f"amax_history_{suffix}"][:, column], length))


@pytest.mark.parametrize("saved_len, length", [(12, 5), (4, 9)])
def test_training_from_te_state_continues_at_the_recipe_length(te_recipe, saved_len, length):
    """A fresh module fits TE's history at its first forward; that step's input scale is
    448 / max(kept entries, this step's amax and TE's row 0) / 2 (margin 1), exactly."""
    state = _delayed_state(te_recipe, 1, history=saved_len, seed=int(torch.randint(0, 2**31, ())))
    layer, recipe = te.Linear(16, 16), recipe_of(length)
    _load(layer, state)
    x = torch.randn(4, 16) * (1 + 8 * torch.rand(()))
    _step(layer, x, recipe)
    fitted = expected_fit(state["amax_history_fwd"][:, 0], length)
    fitted[0] = torch.maximum(fitted[0], x.abs().max())  # the step's amax joins TE's row 0
    got = layer.quantization_state()["forward"]["input"]
    assert torch.equal(got["scale"], torch.div(torch.full((1,), 448.0), fitted.max()) / 2.0)
    rolled = torch.roll(fitted, -1)
    rolled[0] = 0.0
    assert torch.equal(got["amax_history"], rolled)
    for _ in range(3):
        _step(layer, torch.randn(4, 16), recipe)
    assert all(layer.quantization_state()[d][s]["amax_history"].shape == (length,) for d, s in COLUMNS)
