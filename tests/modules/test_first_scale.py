"""A fresh delayed-scaling state's first casts take their scales from their own tensors' amaxes
(QuantizationStep.first_scale): that first step is the current-scaling step, instead of casts
with scale 1 that flush small output gradients to zero. A loaded or calibrated state keeps its
scales; the ranks agree on a first scale as on any other (test_amax_reduction, test_scales)."""
from __future__ import annotations

import copy

import pytest
import torch

import te_core as te
import te_core.modules as tm
from te_core import recipe
from te_core.modules import linear as linear_module

E4M3_MAX, E5M2_MAX = 448.0, 57344.0

BUILD = {
    "Linear": lambda: tm.Linear(64, 32),
    "LayerNormLinear": lambda: tm.LayerNormLinear(64, 32),
    "LayerNormMLP": lambda: tm.LayerNormMLP(64, 128),
}


def _step(module, x, dy, rec):
    x = x.detach().clone().requires_grad_(True)
    with te.autocast(recipe=rec):
        y = module(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("name", list(BUILD))
def test_first_step_is_the_current_scaling_step(name):
    """Every cast of the first step (inputs, the fused norm and activation outputs, weights,
    output gradients) scales by its tensor's own amax: outputs and gradients equal a
    Float8CurrentScaling step's, and the scales it leaves are fp8_max over those amaxes."""
    torch.manual_seed(0)
    delayed = BUILD[name]()
    current = copy.deepcopy(delayed)
    x, dy = torch.randn(32, 64), torch.randn(32, delayed(torch.randn(32, 64)).shape[-1]) * 1e-6
    got = _step(delayed, x, dy, recipe.DelayedScaling())
    want = _step(current, x, dy, recipe.Float8CurrentScaling())
    for i, (g, w) in enumerate(zip(got, want)):
        # the same FP8 bytes and GEMMs; a bias gradient may sum its rows in another order (fp32)
        scale = w.abs().max()
        torch.testing.assert_close(g / scale, w / scale, rtol=1.3e-6, atol=1e-5,
                                   msg=lambda m: f"output/gradient {i}: {m}")
    assert all(g.abs().sum() > 0 for g in got), "a gradient was flushed to zero"
    state = delayed.quantization_state()
    for direction, fp8_max in (("forward", E4M3_MAX), ("backward", E5M2_MAX)):
        for slot, entry in state[direction].items():
            amax = entry["amax_history"][-1]
            assert amax > 0, f"{slot}: nothing recorded"
            torch.testing.assert_close(entry["scale"], fp8_max / amax.reshape(1), rtol=1.3e-6, atol=0,
                                       msg=lambda m: f"{slot}: {m}")


def test_small_gradients_survive_the_first_step():
    """Output gradients of 1e-7 (a loss averaged over many tokens): with a first scale of 1 they
    are below E5M2's smallest subnormal (2^-16) and the first step's input gradient would be
    zero; scaled by their own amax, it matches a float64 computation within E5M2's tolerance."""
    torch.manual_seed(1)
    layer = tm.Linear(64, 64, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    dy = torch.randn(16, 64) * 1e-7
    with te.autocast(recipe=recipe.DelayedScaling()):
        y = layer(x)
    y.backward(dy)
    want = dy.double() @ layer.weight.detach().double()
    scale = want.abs().max()
    torch.testing.assert_close(x.grad.double() / scale, want / scale, rtol=0.25, atol=0.125)
    assert (x.grad != 0).float().mean() > 0.9


def test_first_cast_scale_bit_exact(monkeypatch):
    """The first cast's scale is fp8_max / amax, the data x cast with it, bit for bit."""
    seen = []
    real = linear_module.fprop_gemm
    monkeypatch.setattr(linear_module, "fprop_gemm", lambda x, w, **kw: seen.append((x, w)) or real(x, w, **kw))
    layer = tm.Linear(32, 16)
    x = torch.randn(16, 32) * 3
    with te.autocast(recipe=recipe.DelayedScaling()):
        layer(x)
    x_q, w_q = seen[-1]
    for q, t in ((x_q, x), (w_q, layer.weight.detach())):
        scale = torch.full((1,), E4M3_MAX, device=t.device) / t.abs().max().reshape(1)
        assert torch.equal(q._scale_inv, torch.reciprocal(scale))
        want, _ = te.ops.quantize_fp8(t, scale, torch.float8_e4m3fn)
        assert torch.equal(q._data.view(torch.uint8), want.view(torch.uint8))


def test_margin_and_later_steps():
    """The first scale follows the recipe's margin; the second step casts with the update's
    scale (delayed scaling as usual), not its own amax."""
    layer = tm.Linear(32, 16)
    rec = recipe.DelayedScaling(margin=2, amax_history_len=4)
    x1, x2 = torch.randn(16, 32), torch.randn(16, 32) * 10
    with te.autocast(recipe=rec):
        layer(x1)
        first = layer.quantization_state()["forward"]["input"]["scale"].clone()
    torch.testing.assert_close(first, (E4M3_MAX / x1.abs().max() / 4).reshape(1), rtol=1.3e-6, atol=0)
    with te.autocast(recipe=rec):
        layer(x2)
        during = layer.quantization_state()["forward"]["input"]["scale"].clone()
    assert torch.equal(during, first)  # x2's larger amax waits for the update
    torch.testing.assert_close(layer.quantization_state()["forward"]["input"]["scale"],
                               (E4M3_MAX / x2.abs().max() / 4).reshape(1), rtol=1.3e-6, atol=0)


def test_loaded_state_keeps_its_scales():
    """A module whose state came from a checkpoint casts with the checkpoint's scales at once."""
    torch.manual_seed(2)
    trained = tm.Linear(32, 16)
    rec = recipe.DelayedScaling()
    with te.autocast(recipe=rec):
        trained(torch.randn(16, 32) * 100)
    loaded = tm.Linear(32, 16)
    loaded.load_state_dict(trained.state_dict())
    saved = trained.quantization_state()["forward"]["input"]["scale"].clone()
    with te.autocast(recipe=rec):
        loaded(torch.randn(16, 32))  # a much smaller amax: a fresh state would scale by it
        during = loaded.quantization_state()["forward"]["input"]["scale"].clone()
    assert torch.equal(during, saved)


def test_calibrated_state_keeps_its_scales():
    """autocast(calibrating=True) records amaxes and sets the scales; the FP8 step after it
    casts with those, not with its own tensors' amaxes."""
    layer = tm.Linear(32, 16)
    rec = recipe.DelayedScaling()
    calib = torch.randn(16, 32) * 50
    with te.autocast(enabled=False, calibrating=True, recipe=rec):
        layer(calib)
    calibrated = layer.quantization_state()["forward"]["input"]["scale"].clone()
    torch.testing.assert_close(calibrated, (E4M3_MAX / calib.abs().max()).reshape(1), rtol=1.3e-6, atol=0)
    with te.autocast(recipe=rec):
        layer(torch.randn(16, 32))
        during = layer.quantization_state()["forward"]["input"]["scale"].clone()
    assert torch.equal(during, calibrated)


def test_an_empty_first_batch_leaves_the_slots_fresh():
    """A first step without rows has no amax to scale by: its slots stay fresh, and the first
    step with rows scales by its own amaxes, as it would have without the empty step."""
    torch.manual_seed(0)
    plain = tm.Linear(64, 32)
    after_empty = copy.deepcopy(plain)
    x, dy = torch.randn(32, 64) * 1000, torch.randn(32, 32) * 1e-3
    _step(after_empty, torch.randn(0, 64), torch.randn(0, 32), recipe.DelayedScaling())
    got = _step(after_empty, x, dy, recipe.DelayedScaling())
    want = _step(plain, x, dy, recipe.DelayedScaling())
    for i, (g, w) in enumerate(zip(got, want)):  # (the empty step's parameter gradients are zeros)
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"output/gradient {i}: {m}")
