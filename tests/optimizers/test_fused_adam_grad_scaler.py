"""FusedAdam under torch.amp.GradScaler: gradients unscaled within the update, a step with an
inf gradient skipped, against torch.optim.AdamW on float32 copies given the gradients
unscaled by hand."""
import contextlib
import warnings

import pytest
import torch

from te_core.optimizers import FusedAdam

FP32 = dict(rtol=1.3e-6, atol=1e-5)
SHAPES = [(7, 13), (31,), (3, 5, 2), ()]
SCALE = 2.0**10
# eps near the unscaled gradients' size: Adam's update is otherwise nearly the same for scaled ones
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.05)
# (parameter dtype, master_weights): float16 needs master weights to be stepped in float32
KINDS = [(torch.float16, True), (torch.bfloat16, True), (torch.float32, False)]
CAPTURABLE = pytest.mark.parametrize("capturable", [False, True])


def fresh(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


class Pair:
    """FusedAdam on `dtype` parameters under a GradScaler, and torch.optim.AdamW on float32
    copies stepped with the same gradients, unscaled by hand."""

    def __init__(self, dtype, master_weights, capturable, **scaler_kwargs):
        self.params = fresh(dtype)
        self.opt = FusedAdam(self.params, master_weights=master_weights, capturable=capturable, **HYPER)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, **scaler_kwargs)
        self.ref_params = [p.detach().to(torch.float32, copy=True).requires_grad_() for p in self.params]
        self.ref = torch.optim.AdamW(self.ref_params, foreach=False, **HYPER)
        self.generator = torch.Generator().manual_seed(1)

    def backward(self, inf=False, size=1 / 64):
        """Scaled gradients of a loss linear in the parameters, about `size` before scaling
        (one inf where `inf`)."""
        for p in self.params:
            p.grad = None
        coefficients = [torch.randn(p.shape, generator=self.generator) * size for p in self.params]
        if inf:
            coefficients[1][3] = float("inf")
        loss = sum((p.float() * c).sum() for p, c in zip(self.params, coefficients))
        self.scaler.scale(loss).backward()
        self.scaled = [p.grad.detach().clone() for p in self.params]  # (step leaves them unscaled)

    def reference_step(self, divide_by=SCALE):
        for p, scaled in zip(self.ref_params, self.scaled):
            p.grad = scaled.float() / divide_by
        self.ref.step()

    def stepped(self, p):
        """The float32 value FusedAdam steps: the master weight where kept."""
        return self.opt.state[p].get("master_param", p)

    def assert_matches_reference(self, **tolerance):
        for p, want in zip(self.params, self.ref_params):
            torch.testing.assert_close(self.stepped(p), want, **(tolerance or FP32))
            assert torch.equal(p, self.stepped(p).to(p.dtype))


def snapshot(pair):
    """Every value a step could change: parameters, states, step counts."""
    states = {i: {k: v.clone() for k, v in pair.opt.state[p].items()} for i, p in enumerate(pair.params)}
    steps = [g.get("step") for g in pair.opt.param_groups]
    return ([p.detach().clone() for p in pair.params], states,
            [s.clone() if torch.is_tensor(s) else s for s in steps])


def assert_same(before, after):
    (params_a, states_a, steps_a), (params_b, states_b, steps_b) = before, after
    for a, b in zip(params_a, params_b):
        assert torch.equal(a, b)
    assert states_a.keys() == states_b.keys()
    for i in states_a:
        assert states_a[i].keys() == states_b[i].keys()
        for name in states_a[i]:
            assert torch.equal(states_a[i][name], states_b[i][name]), (i, name)
    assert [s.item() if torch.is_tensor(s) else s for s in steps_a] == \
           [s.item() if torch.is_tensor(s) else s for s in steps_b]


@pytest.fixture
def no_host_reads(monkeypatch):
    """A context in which reading a tensor's value back to the host raises."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("a capturable step read a value back to the host")

    class Guard:
        def __enter__(self):
            for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
                monkeypatch.setattr(torch.Tensor, name, refuse)

        def __exit__(self, *exc):
            monkeypatch.undo()
    return Guard()


def test_fused_adam_takes_part_in_grad_scaler_unscaling():
    opt = FusedAdam(fresh(torch.float32))
    assert opt._step_supports_amp_scaling
    with pytest.raises(TypeError, match="unexpected keyword arguments"):
        opt.step(grad_scalar=None)


@CAPTURABLE
@pytest.mark.parametrize("dtype, master_weights", KINDS)
def test_scaled_gradients_step_as_adamw_on_unscaled_float32_ones(dtype, master_weights, capturable):
    pair = Pair(dtype, master_weights, capturable)
    for _ in range(4):
        pair.backward()
        scaled = [p.grad.clone() for p in pair.params]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "Attempting to unscale FP16 gradients", no FutureWarning
            pair.scaler.step(pair.opt)
        pair.scaler.update()
        # left unscaled, as GradScaler's own unscale_ leaves them (TE's tests compare them so)
        assert all(torch.equal(p.grad, g.mul_(1 / SCALE)) for p, g in zip(pair.params, scaled))
        pair.reference_step()
    assert pair.scaler.get_scale() == SCALE
    pair.assert_matches_reference()
    assert not hasattr(pair.opt, "grad_scale") and not hasattr(pair.opt, "found_inf")


@CAPTURABLE
@pytest.mark.parametrize("dtype, master_weights", KINDS)
def test_a_step_with_an_inf_gradient_changes_nothing(dtype, master_weights, capturable, no_host_reads):
    pair = Pair(dtype, master_weights, capturable)
    pair.backward()
    pair.scaler.step(pair.opt)
    pair.scaler.update()
    pair.reference_step()
    before = snapshot(pair)
    pair.backward(inf=True)
    with no_host_reads if capturable else contextlib.nullcontext():
        pair.scaler.step(pair.opt)
    assert_same(before, snapshot(pair))
    pair.scaler.update()
    assert pair.scaler.get_scale() == SCALE / 2
    pair.backward()  # the next step goes on as if the skipped one had not been
    pair.scaler.step(pair.opt)
    pair.reference_step(divide_by=SCALE / 2)
    pair.assert_matches_reference()
    steps = [g["step"] for g in pair.opt.param_groups]
    assert [float(s) for s in steps] == [2.0]


@CAPTURABLE
def test_float16_gradients_below_float16s_normal_range_unscaled_keep_their_precision(capturable):
    """Gradients scaled into float16's normal range would, divided in float16, fall back
    below it (to fewer significant bits, or zero) as the unscaled float32 ones do not. (The
    parameters start at zero, so that the small updates are compared to float32's precision.)"""
    pair = Pair(torch.float16, True, capturable)
    with torch.no_grad():
        for p in pair.params + pair.ref_params:
            p.zero_()
    for _ in range(2):
        pair.backward(size=2e-6)
        assert all(p.grad.abs().min() > 0 for p in pair.params)
        pair.scaler.step(pair.opt)
        pair.scaler.update()
        pair.reference_step()
    pair.assert_matches_reference(rtol=1e-4, atol=1e-12)


@CAPTURABLE
def test_a_skipped_first_step_leaves_the_parameters_and_the_step_count(capturable):
    pair = Pair(torch.float16, True, capturable)
    before = [p.detach().clone() for p in pair.params]
    pair.backward(inf=True)
    pair.scaler.step(pair.opt)
    pair.scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, pair.params))
    assert float(pair.opt.param_groups[0].get("step", 0)) == 0
    pair.backward()  # the first step taken has step 1's bias correction
    pair.scaler.step(pair.opt)
    pair.reference_step(divide_by=SCALE / 2)
    pair.assert_matches_reference()


@CAPTURABLE
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unscale_before_step_is_not_unscaled_again(dtype, capturable):
    """scaler.unscale_ (as before clipping) divides the gradients in place; step then gets
    grad_scale None. (GradScaler's unscale_ refuses float16 gradients itself.)"""
    pair = Pair(dtype, dtype != torch.float32, capturable)
    for _ in range(3):
        pair.backward()
        pair.scaler.unscale_(pair.opt)
        pair.scaler.step(pair.opt)
        pair.scaler.update()
        pair.reference_step()
    pair.assert_matches_reference()
    pair.backward(inf=True)
    before = snapshot(pair)
    pair.scaler.unscale_(pair.opt)
    pair.scaler.step(pair.opt)
    assert_same(before, snapshot(pair))


@CAPTURABLE
def test_grad_scaler_given_to_step_by_hand_as_in_transformer_engine(capturable):
    pair = Pair(torch.bfloat16, True, capturable)
    for inf, unscale_first in ((False, False), (True, False), (False, False), (False, True)):
        pair.backward(inf=inf)
        scale = pair.scaler.get_scale()
        if unscale_first:
            pair.scaler.unscale_(pair.opt)
        pair.opt.step(grad_scaler=pair.scaler)
        pair.scaler.update()
        if not inf:
            pair.reference_step(divide_by=scale)
    assert pair.scaler.get_scale() == SCALE / 2
    pair.assert_matches_reference()
