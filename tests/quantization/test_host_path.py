"""What the eager FP8 step takes once instead of per call, and when it must take it again:
a quantizer's per-GEMM accumulation choice and a state's GEMM alignment (re-derived when the
recipe changes), the delayed-scaling column views and scale_inv snapshot (re-taken when the
history or the scale changes), the FP8 format table."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import te_core as te
from te_core import ops
from te_core.backend.types import fp8_format_name, fp8_max
from te_core.quantization import fprop_gemm, gemm_slots, quantized_gemm
from te_core.quantization.scaling import ScalingGroup, update_scales
from te_core.recipe import DelayedScaling, Float8CurrentScaling, MMParams, MXFP8BlockScaling

from .conftest import randn

E4M3_MAX = 448.0


@pytest.fixture
def fast_flags(monkeypatch):
    """The fast_accumulation of every ops.gemm_fp8 call, in order."""
    seen = []
    real = ops.gemm_fp8

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fast_accumulation"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "gemm_fp8", spy)
    return seen


def _linear_step(module, x, recipe):
    with te.autocast(recipe=recipe):
        y = module(x)
    y.backward(torch.ones_like(y))
    return y


def test_recipe_change_rederives_each_gemms_accumulation(gen, fast_flags):
    """The same module under recipes of one class (its state is rebound, not rebuilt): each
    forward's fprop / dgrad / wgrad accumulate as the recipe of that forward says."""
    lin = te.Linear(64, 32, params_dtype=torch.float32)
    x = randn(gen, 16, 64).requires_grad_()
    default = Float8CurrentScaling()
    flipped = Float8CurrentScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=True),
                                   fp8_gemm_wgrad=MMParams(use_split_accumulator=False))
    for recipe, want in ((default, [True, False, False]), (flipped, [False, False, True]),
                         (default, [True, False, False])):
        fast_flags.clear()
        _linear_step(lin, x, recipe)
        assert fast_flags == want, type(recipe).__name__


def test_assigning_split_accumulator_rederives_the_table(gen, fast_flags):
    state = DelayedScaling().make_state(gemm_slots(), torch.device("cpu"))
    x = state.quantizer("input").quantize(randn(gen, 32, 64))
    w = state.quantizer("weight").quantize(randn(gen, 16, 64))
    fprop_gemm(x, w, out_dtype=torch.float32)
    state.quantizer("input").split_accumulator = lambda gemm: gemm != "dgrad"  # fprop now splits
    fprop_gemm(x, w, out_dtype=torch.float32)
    assert fast_flags == [True, False]
    assert state.quantizer("input").fast_accumulation == {"fprop": False, "dgrad": True, "wgrad": False}


def test_a_wrong_gemm_name_is_still_named(gen):
    state = Float8CurrentScaling().make_state(gemm_slots(), torch.device("cpu"))
    x = state.quantizer("input").quantize(randn(gen, 32, 64))
    w = state.quantizer("weight").quantize(randn(gen, 16, 64))
    with pytest.raises(ValueError, match="gemm must be one of fprop, dgrad, wgrad, got 'forward'"):
        quantized_gemm(x, w, out_dtype=torch.float32, gemm="forward")


def test_recipe_change_rederives_the_gemm_alignment(gen):
    """48 tokens are a multiple of 16 but not of 32 (MXFP8's alignment): the checks follow the
    recipe of each forward, both ways."""
    lin = te.Linear(64, 64, params_dtype=torch.float32)
    x = randn(gen, 48, 64).requires_grad_()
    want = x.detach().double() @ lin.weight.detach().double().T + lin.bias.detach().double()
    y = _linear_step(lin, x, Float8CurrentScaling())
    assert ((y.detach().double() - want).norm() / want.norm()) < 0.0675  # E4M3 relative bound
    with pytest.raises(ValueError, match=r"multiple of 32; got M=48, N=64, K=64 \(M=48 not\)"):
        _linear_step(lin, x, MXFP8BlockScaling())
    y = _linear_step(lin, x, Float8CurrentScaling())
    assert ((y.detach().double() - want).norm() / want.norm()) < 0.0675


def test_operand_alignment_is_checked_per_gemm(gen):
    state = MXFP8BlockScaling().make_state(gemm_slots(), torch.device("cpu"))
    x = state.quantizer("input").quantize(randn(gen, 48, 64))
    w = state.quantizer("weight").quantize(randn(gen, 32, 64))
    with pytest.raises(ValueError, match=r"FP8 GEMM: every dimension must be a multiple of 32; got M=48"):
        fprop_gemm(x, w, out_dtype=torch.float32)


def test_scale_written_behind_the_version_counter_is_seen_after_scale_changed(gen):
    """A backend kernel writes `scale` without bumping torch's version counter (here: through
    .data); scale_changed() (which update_scales runs) makes the next cast take a new scale_inv,
    while a tensor cast before keeps its own."""
    state = DelayedScaling().make_state(gemm_slots(), torch.device("cpu"))
    quantizer = state.quantizer("input")
    group = quantizer.scaling_group
    x = randn(gen, 32, 64)
    before = quantizer.quantize(x)
    group.scale.data.fill_(4.0)
    group.scale_changed()
    after = quantizer.quantize(x)
    assert before._scale_inv.item() == 1.0 and after._scale_inv.item() == 0.25
    assert torch.equal(after._data.view(torch.uint8), ops.quantize_fp8(x, torch.tensor([4.0]),
                                                                     torch.float8_e4m3fn)[0].view(torch.uint8))


def test_update_scales_invalidates_the_snapshot_of_every_group(gen, monkeypatch):
    state = DelayedScaling(amax_history_len=2).make_state(gemm_slots(), torch.device("cpu"))
    quantizers = [state.quantizer(name) for name in ("input", "weight", "grad_output")]
    xs = [randn(gen, 32, 64, scale=s) for s in (1.0, 3.0, 0.5)]
    for quantizer, x in zip(quantizers, xs):
        quantizer.quantize(x)  # records the amax, takes the first snapshot

    def kernel_update(histories, scales, fp8_maxes, *, margin, amax_compute_algo):
        for history, scale, fmax in zip(histories, scales, fp8_maxes):
            scale.data.copy_(fmax / history[0])  # as a kernel would: the version counter stays

    monkeypatch.setattr(ops, "delayed_scaling_update", kernel_update)
    update_scales(list(state.groups.values()))
    for quantizer, x in zip(quantizers, xs):
        fmax = fp8_max(quantizer.fp8_dtype)
        want = (x.abs().amax() / fmax).item()
        assert quantizer.quantize(x)._scale_inv.item() == pytest.approx(want, rel=1.3e-6)


class _CountReciprocals(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "reciprocal" in func.__name__:
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _snapshot_setup(gen, wide_columns):
    state = DelayedScaling(amax_history_len=2).make_state(gemm_slots(), torch.device("cpu"))
    quantizers = [state.quantizer(name) for name in ("input", "weight", "grad_output")]
    xs = [randn(gen, 32, 64, scale=s) for s in (1.0, 3.0, 0.5)]
    before = [q.quantize(x) for q, x in zip(quantizers, xs)]
    wides = []
    for n in wide_columns:
        wide = ScalingGroup([f"c{i}" for i in range(n)], torch.float8_e4m3fn, DelayedScaling(amax_history_len=2),
                            torch.device("cpu"))
        for i in range(n):
            wide.record(i, randn(gen, 1).abs().reshape(()) * 4 + 0.5)
        wides.append(wide)
    return state, quantizers, xs, before, wides


def _check_snapshots(quantizers, xs, before, after, wides):
    for q, x, old, new in zip(quantizers, xs, before, after):
        assert old._scale_inv.item() == 1.0  # kept
        assert torch.equal(new._scale_inv, torch.reciprocal(q.scale))
        assert new._scale_inv.item() == pytest.approx(x.abs().amax().item() / fp8_max(q.fp8_dtype), rel=1.3e-6)
    for wide in wides:
        views = [wide.scale_inv_of(i) for i in range(len(wide.names))]
        assert all(v.shape == (1,) and v.data_ptr() % 16 == 0 for v in views)
        assert torch.equal(torch.cat(views), torch.reciprocal(wide.scale))
        assert torch.equal(wide.scale_inv(), torch.reciprocal(wide.scale)) and wide.scale_inv() is wide.scale_inv()


def test_update_takes_the_snapshots_of_one_column_groups_in_one_launch(gen):
    """After an update of one-column groups only, their scale_inv snapshots come from one foreach
    reciprocal (not one reciprocal per group at its first cast), equal to 1 / scale bit for bit;
    tensors cast before keep theirs."""
    state, quantizers, xs, before, wides = _snapshot_setup(gen, ())
    with _CountReciprocals() as counted:
        update_scales(list(state.groups.values()))
        after = [q.quantize(x) for q, x in zip(quantizers, xs)]
    assert counted.ops == ["_foreach_reciprocal"], counted.ops
    _check_snapshots(quantizers, xs, before, after, wides)


@pytest.mark.parametrize("wide_columns", [(2,), (2, 3)])
def test_update_with_groups_of_several_columns_takes_every_snapshot_in_one_reciprocal(gen, wide_columns):
    """With groups of several columns among them (a LayerNormMLP's), an update takes every
    group's snapshot with one reciprocal into 16-byte slots (none at the groups' first casts):
    each column's view aligned and equal to 1 / scale bit for bit, the whole vector on request."""
    state, quantizers, xs, before, wides = _snapshot_setup(gen, wide_columns)
    with _CountReciprocals() as counted:
        update_scales([*state.groups.values(), *wides])
        after = [q.quantize(x) for q, x in zip(quantizers, xs)]
        views = [wide.scale_inv_of(i) for wide in wides for i in range(len(wide.names))]
    assert counted.ops == ["reciprocal"], counted.ops
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one tensor holds every slot
    _check_snapshots(quantizers, xs, before, after, wides)


def test_aligned_snapshots_of_groups_on_two_devices_stay_on_each_device(gen):
    """Groups of one update on different devices (pipeline stages under one autocast) take
    their snapshots per device: each view on its group's device, none joined across them."""
    recipe = DelayedScaling(amax_history_len=2)
    groups = [ScalingGroup(["a", "b"], torch.float8_e4m3fn, recipe, torch.device(d)) for d in ("cpu", "meta")]
    groups.append(ScalingGroup(["c"], torch.float8_e4m3fn, recipe, torch.device("cpu")))
    for g in groups:
        for i in range(len(g.names)):
            g.record(i, torch.tensor(4.0, device=g.scale.device))
    update_scales(groups)
    for g in groups:
        views = [g.scale_inv_of(i) for i in range(len(g.names))]
        assert all(v.device == g.scale.device and v.shape == (1,) for v in views)
        if g.scale.device.type == "cpu":
            assert torch.equal(torch.cat(views), torch.reciprocal(g.scale))


def test_history_resized_by_a_recipe_change_receives_the_next_amax(gen):
    """A DelayedScaling recipe with another amax_history_len rebinds the module's state to a new
    history: the next casts must max their amax into it (not into a view of the old one)."""
    lin = te.Linear(64, 32, params_dtype=torch.float32)
    small, large = randn(gen, 16, 64, scale=0.1), randn(gen, 16, 64, scale=50.0)
    _linear_step(lin, small.requires_grad_(), DelayedScaling(amax_history_len=4))
    _linear_step(lin, large.requires_grad_(), DelayedScaling(amax_history_len=8))
    entry = lin.quantization_state()["forward"]["input"]
    assert entry["amax_history"].shape == (8,)
    assert entry["scale"].item() == pytest.approx(E4M3_MAX / large.detach().abs().amax().item(), rel=1.3e-6)


def test_fp8_format_table():
    assert (fp8_max(torch.float8_e4m3fn), fp8_max(torch.float8_e5m2)) == (448.0, 57344.0)
    assert (fp8_format_name(torch.float8_e4m3fn), fp8_format_name(torch.float8_e5m2)) == ("E4M3", "E5M2")
    for lookup in (fp8_max, fp8_format_name):
        with pytest.raises(ValueError, match="torch.bfloat16 is not an FP8 dtype te-core knows; use one of "
                                             "torch.float8_e4m3fn, torch.float8_e5m2"):
            lookup(torch.bfloat16)
