"""A checkpoint whose delayed-scaling amax history has another length than the module's recipe
loads: the scales as saved, the history fitted to the recipe's length (this step's row, then the
most recent entries, zeros in front where the checkpoint has fewer), and training goes on with
the recipe's length. Loading into a module that has run already fits at once; into a fresh one
at its first forward (as Transformer Engine resizes at its next forward)."""
from __future__ import annotations

import pytest
import torch

from te_core.modules.linear import Linear
from te_core.quantization import autocast
from te_core.quantization.scaling import fit_history
from te_core.recipe import DelayedScaling, Format

SLOTS = (("forward", "input"), ("forward", "weight"), ("backward", "grad_output"))


def recipe_of(length: int) -> DelayedScaling:
    return DelayedScaling(fp8_format=Format.E4M3, amax_history_len=length)


def expected_fit(history: torch.Tensor, length: int) -> torch.Tensor:
    """Row 0, zeros, then the newest length - 1 entries (rows 1.. run oldest to newest)."""
    rows = history.tolist()
    newest = rows[1:][-(length - 1):] if length > 1 else []
    return torch.tensor([rows[0]] + [0.0] * (length - 1 - len(newest)) + newest)


def saved_state(length: int) -> dict:
    """te-core's extra state of a Linear, random; the oldest entries are the largest, so keeping
    the wrong end of the history would show in the scales too. Row 0 is empty, as between steps."""
    def entry():
        history = torch.rand(length) * 4 + 0.1 + torch.linspace(8, 0, length)
        history[0] = 0.0
        return {"scale": torch.rand(1) + 0.5, "amax_history": history}

    state = {"forward": {"input": entry(), "weight": entry()}, "backward": {"grad_output": entry()}}
    return {"recipe": recipe_of(length).to_config(), "quantization_state": state}


def load(layer: Linear, extra: dict) -> None:
    layer.load_state_dict({**{k: v for k, v in layer.state_dict().items() if k != "_extra_state"},
                           "_extra_state": extra})


def step(layer: Linear, x: torch.Tensor, recipe) -> None:
    with autocast(recipe=recipe):
        y = layer(x)
    y.square().sum().backward()


LENGTHS = [(8, 3), (3, 8), (5, 1), (1, 4), (6, 6)]  # (saved, module's recipe)


@pytest.mark.parametrize("saved_len, length", LENGTHS)
def test_load_into_a_module_that_has_run_fits_the_history_and_keeps_the_scales(saved_len, length):
    layer = Linear(32, 24)
    step(layer, torch.randn(8, 32), recipe_of(length))
    extra = saved_state(saved_len)
    load(layer, extra)
    got = layer.quantization_state()
    for direction, slot in SLOTS:
        saved = extra["quantization_state"][direction][slot]
        assert torch.equal(got[direction][slot]["scale"], saved["scale"])
        assert torch.equal(got[direction][slot]["amax_history"], expected_fit(saved["amax_history"], length))


@pytest.mark.parametrize("saved_len, length", LENGTHS)
def test_training_continues_with_the_recipe_length(saved_len, length):
    """A fresh module keeps the checkpoint's length until its first forward (as TE); that step
    fits it, then updates from the fitted history: the new input scale is 448 / max(this step's
    amax, the kept entries), exactly, and both load paths agree bit for bit."""
    extra, recipe = saved_state(saved_len), recipe_of(length)
    weight = torch.randn(24, 32)
    fresh, ran = Linear(32, 24), Linear(32, 24)
    step(ran, torch.randn(8, 32), recipe)
    for layer in (fresh, ran):
        load(layer, extra)
        with torch.no_grad():
            layer.weight.copy_(weight)
    assert fresh.quantization_state()["forward"]["input"]["amax_history"].shape == (saved_len,)
    x = torch.randn(8, 32) * (1 + 3 * torch.rand(()))
    for layer in (fresh, ran):
        step(layer, x, recipe)
    fitted = expected_fit(extra["quantization_state"]["forward"]["input"]["amax_history"], length)
    fitted[0] = x.abs().max()
    state = fresh.quantization_state()["forward"]["input"]
    assert torch.equal(state["scale"], torch.div(torch.full((1,), 448.0), fitted.max()))
    rolled = torch.roll(fitted, -1)
    rolled[0] = 0.0
    assert torch.equal(state["amax_history"], rolled)
    for direction, slot in SLOTS:
        for key in ("scale", "amax_history"):
            assert torch.equal(fresh.quantization_state()[direction][slot][key],
                               ran.quantization_state()[direction][slot][key]), (direction, slot, key)
    for _ in range(length + 1):  # runs on, the history staying at the recipe's length
        step(fresh, torch.randn(8, 32), recipe)
    assert all(fresh.quantization_state()[d][s]["amax_history"].shape == (length,) for d, s in SLOTS)


def test_a_trained_checkpoint_round_trips_into_another_length():
    src = Linear(32, 24)
    for i in range(7):
        step(src, torch.randn(8, 32) * (i + 1), recipe_of(6))
    dst = Linear(32, 24)
    step(dst, torch.randn(8, 32), recipe_of(4))
    dst.load_state_dict(src.state_dict())
    for direction, slot in SLOTS:
        saved = src.quantization_state()[direction][slot]
        got = dst.quantization_state()[direction][slot]
        assert torch.equal(got["scale"], saved["scale"])
        assert torch.equal(got["amax_history"], expected_fit(saved["amax_history"], 4))


def test_fit_history_keeps_columns_apart():
    history = torch.rand(7, 3)
    fitted = fit_history(history, 4)
    for column in range(3):
        assert torch.equal(fitted[:, column], expected_fit(history[:, column], 4))
    assert torch.equal(fit_history(history, 7), history)


def test_a_format_mismatch_keeps_the_histories_and_rescales():
    """A checkpoint of another fp8_format: its histories are kept (fitted to this length), and
    the scales of the tensors whose format differs are recomputed from them, with a warning."""
    layer = Linear(32, 24)
    step(layer, torch.randn(8, 32), DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4))
    with pytest.warns(UserWarning, match=r"made with DelayedScaling\(fp8_format=E4M3\) and now serves "
                                         r"DelayedScaling\(fp8_format=HYBRID\)"):
        load(layer, saved_state(5))
    grad = layer.quantization_state()["backward"]["grad_output"]
    amax = grad["amax_history"].max()
    torch.testing.assert_close(grad["scale"], torch.finfo(torch.float8_e5m2).max / amax.reshape(1), rtol=1.3e-6,
                               atol=0)


@pytest.mark.parametrize("history, shape", [(torch.zeros(0), "(0,)"), (torch.rand(3, 1), "(3, 1)")])
def test_a_history_of_no_length_or_the_wrong_rank_is_corrupt(history, shape):
    layer = Linear(32, 24)
    before = {k: v.clone() for k, v in layer.quantization_state()["forward"].get("input", {}).items()}
    extra = saved_state(4)
    extra["quantization_state"]["forward"]["weight"]["amax_history"] = history
    with pytest.raises(ValueError, match=f"weight.amax_history has shape {shape.replace('(', '[(]').replace(')', '[)]')}"
                                         ", expected [(]length,[)] with length >= 1"):
        load(layer, extra)
    assert layer.quantization_state()["forward"].get("input", {}).keys() == before.keys()
