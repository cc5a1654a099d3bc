"""Delayed scaling: cast with earlier steps' scales, amax history, the update rule and its timing."""
from __future__ import annotations

import math

import pytest
import torch

from te_core._torch_fixes import SETS_TRACED_TENSOR_ATTRIBUTES
from te_core import ops
from te_core.modules import linear as linear_module
from te_core.modules.linear import Linear
from te_core.quantization import autocast, gemm_slots
from te_core.quantization.scaling import ScalingGroup, update_scales
from te_core.recipe import DelayedScaling, Format

from .conftest import randn

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
F32_MAX, F32_TINY = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny


def expected_update(history, scale, fmax, margin=0.0, algo="max"):
    """Transformer Engine's update kernel in float64 on copies: (new scale, new history).
    A column whose row 0 is 0 is left alone; "max" is fmaxf from 0 (NaN ignored, inf wins)."""
    h = history.double()
    stepped = h[0] != 0
    amax = torch.nan_to_num(h, nan=0.0, posinf=math.inf).amax(dim=0) if algo == "max" else h[0]
    amax = torch.where(stepped, amax, torch.zeros_like(amax))
    new = fmax * 2.0 ** -margin / amax
    keep = ~torch.isfinite(amax) | (amax <= 0)
    # inf -> float32 max; below float32's smallest normal number -> that number (finite 1 / scale)
    new = torch.where(keep, scale.double(), new).clamp(min=F32_TINY, max=F32_MAX).float()
    rolled = torch.roll(history, -1, 0).clone()
    rolled[0] = 0
    return new, torch.where(stepped, rolled, history)


def assert_scale(scale, fmax, amax):
    """scale == fmax / amax up to float32 rounding of the division."""
    amax = amax.detach() if isinstance(amax, torch.Tensor) else amax
    want = torch.tensor([fmax / float(amax)], dtype=torch.float32)
    torch.testing.assert_close(scale.reshape(1), want, rtol=1.3e-6, atol=0)


def make_group(history, scale, recipe):
    group = ScalingGroup([f"t{i}" for i in range(history.shape[1])], torch.float8_e4m3fn, recipe, torch.device("cpu"))
    group.amax_history.copy_(history)
    group.scale.copy_(scale)
    return group


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_update_rule_matches_float64(gen, algo, margin):
    recipe = DelayedScaling(amax_history_len=5, amax_compute_algo=algo, margin=margin)
    history = randn(gen, 5, 8).abs() * 3
    # column 1: amax 0 everywhere; 2: NaN this step; 3: inf; 4: so small the scale overflows;
    # 5: NaN in an older row; 6: nothing recorded this step (row 0 is 0) over a non-zero history
    history[:, 1] = 0
    history[0, 2] = float("nan")
    history[0, 3] = float("inf")
    history[:, 4] = 0
    history[0, 4] = 1e-44
    history[2, 5] = float("nan")
    history[0, 6] = 0
    scale = randn(gen, 8).abs() + 0.5
    group = make_group(history, scale, recipe)
    update_scales([group])
    want_scale, want_history = expected_update(history, scale, E4M3_MAX, margin, algo)
    torch.testing.assert_close(group.scale, want_scale, rtol=1.3e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(group.amax_history, want_history, rtol=0, atol=0, equal_nan=True)
    assert group.scale[1] == scale[1] and group.scale[3] == scale[3] and group.scale[6] == scale[6]
    assert group.scale[4] == F32_MAX
    if algo == "max":  # a NaN never freezes the scale: the other entries of the window decide
        assert_scale(group.scale[2] * 2.0 ** margin, E4M3_MAX, history[1:, 2].max())
        assert_scale(group.scale[5] * 2.0 ** margin, E4M3_MAX, history[torch.arange(5) != 2, 5].max())
    else:
        assert group.scale[2] == scale[2]
    # rolled up by one row (TE: torch.roll(h, -1, 0)), then row 0 zeroed: this step's amax is last
    rolled = [c for c in range(8) if c != 6]
    torch.testing.assert_close(group.amax_history[-1, rolled], history[0, rolled], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(group.amax_history[1:-1, rolled], history[2:, rolled], rtol=0, atol=0, equal_nan=True)
    assert torch.all(group.amax_history[0, rolled] == 0)
    assert torch.equal(group.amax_history[:, 6], history[:, 6])  # nothing recorded: not rolled


@pytest.mark.parametrize("margin", [1, 3, 6])
def test_tiny_amax_keeps_its_margin_as_transformer_engines_update(gen, margin):
    """TE's fused update computes (fp8_max * 2^-margin) / amax: an amax so small that fp8_max /
    amax alone overflows float32 still gets a finite scale that maps it to fp8_max * 2^-margin
    (not float32 max, which would map it to fp8_max itself or beyond)."""
    low, high = E4M3_MAX * 2.0 ** -margin / F32_MAX, E4M3_MAX / F32_MAX  # the amaxes where the order matters
    amax = low + (high - low) * (0.05 + 0.9 * torch.rand(6, generator=gen, dtype=torch.float64))
    history = torch.zeros(3, 6)
    history[0] = amax.float()
    group = make_group(history, torch.rand(6, generator=gen) + 0.5, DelayedScaling(amax_history_len=3, margin=margin))
    update_scales([group])
    want = torch.full((6,), E4M3_MAX * 2.0 ** -margin) / history[0]  # float32, as TE's kernel
    assert torch.equal(group.scale, want) and (group.scale < F32_MAX).all()
    torch.testing.assert_close(group.scale.double() * history[0].double(),
                               torch.full((6,), E4M3_MAX * 2.0 ** -margin, dtype=torch.float64), rtol=1.3e-6, atol=0)


def test_scale_never_falls_below_float32s_smallest_normal(gen):
    """A huge amax under a large margin gives a scale below 2^-126 (a subnormal or 0, whose
    reciprocal is inf): the update writes 2^-126 instead, as it writes float32 max for an inf
    scale; the other columns follow the rule as always. A scaling_factor_compute_algo's positive
    subnormal scale is lifted the same way."""
    history = randn(gen, 4, 6).abs() + 0.5
    history[:, :3] *= 1e37  # 448 * 2^-20 / ~1e37 ≈ 4e-41 < 2^-126
    scale = randn(gen, 6).abs() + 0.5
    group = make_group(history, scale, DelayedScaling(amax_history_len=4, margin=20))
    update_scales([group])
    want, _ = expected_update(history, scale, E4M3_MAX, margin=20)
    assert torch.equal(group.scale[:3], torch.full((3,), F32_TINY))
    torch.testing.assert_close(group.scale, want, rtol=1.3e-6, atol=0)
    assert torch.isfinite(torch.reciprocal(group.scale)).all()

    def subnormal(amax, scale, fp8_max, recipe):
        return torch.rand(amax.shape, generator=gen) * F32_TINY  # in (0, 2^-126): subnormals

    group = make_group(randn(gen, 4, 3).abs() + 0.1, torch.ones(3),
                       DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=subnormal))
    update_scales([group])
    assert torch.equal(group.scale, torch.full((3,), F32_TINY))


def test_largest_margin_gives_finite_outputs_and_a_state_that_reloads(gen):
    """DelayedScaling at its largest margin: an input's scale (amax > 1.75) would be below 2^-126,
    in the first step (from the tensor's own amax) and after updates alike, and is 2^-126
    instead, so 1 / scale stays finite, outputs have no NaN, and the saved state loads into a
    fresh layer."""
    recipe = DelayedScaling(margin=134, amax_history_len=2)
    layer = Linear(32, 16)
    for step in range(2):
        x = randn(gen, 8, 32, scale=2.0 + step)
        with autocast(recipe=recipe):
            y = layer(x)
        assert torch.isfinite(y).all(), step
        state = layer.quantization_state()["forward"]
        assert state["input"]["scale"].item() == F32_TINY
        assert all(torch.isfinite(1 / state[name]["scale"]).all() for name in ("input", "weight"))
    twin = Linear(32, 16)
    twin.load_state_dict(layer.state_dict())
    assert twin.quantization_state()["forward"]["input"]["scale"].item() == F32_TINY


def test_callable_algorithms(gen):
    calls = []

    def second_largest(history):
        calls.append(history.shape)
        return history.sort(dim=0).values[-2]

    def halve(amax, scale, fp8_max, recipe):
        return fp8_max / amax / 2

    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=second_largest, scaling_factor_compute_algo=halve)
    history = randn(gen, 4, 3).abs() + 0.1
    group = make_group(history, torch.ones(3), recipe)
    update_scales([group])
    want = E4M3_MAX / history.sort(dim=0).values[-2] / 2
    torch.testing.assert_close(group.scale, want, rtol=1.3e-6, atol=0)
    assert calls == [torch.Size([4, 3])]
    assert torch.all(group.amax_history[0] == 0) and torch.equal(group.amax_history[-1], history[0])


@pytest.mark.parametrize("algo", [lambda history: history.max(dim=0).values, "max", "most_recent"],
                         ids=["callable", "max-with-callable-scale", "most_recent-with-callable-scale"])
def test_callables_update_as_transformer_engine_updates_them(gen, algo):
    """With a callable amax_compute_algo or scaling_factor_compute_algo, Transformer Engine runs
    its unfused update: every column's history rolls each step, also one whose tensor was all
    zeros (amax 0; its fused kernel for the string algorithms skips those), and the amax comes
    from the history as it is, NaN included (torch.max)."""
    sf = None if callable(algo) else (lambda amax, scale, fp8_max, recipe: fp8_max / amax)
    recipe = DelayedScaling(amax_history_len=3, amax_compute_algo=algo, scaling_factor_compute_algo=sf)
    group = make_group(torch.zeros(3, 2), torch.ones(2), recipe)
    expected_history = torch.zeros(3, 2)
    for amaxes in ([100.0, 5.0], [0.0, 6.0], [0.0, 0.0], [1.0, float("nan")]):
        group.amax_history[0] = torch.tensor(amaxes)
        expected_history[0] = torch.tensor(amaxes)
        old = group.scale.clone()
        if callable(algo) or algo == "max":
            amax = expected_history.max(dim=0).values
        else:
            amax = expected_history[0].clone()
        want = E4M3_MAX / amax
        want = torch.where(torch.isfinite(amax) & (amax > 0) & torch.isfinite(want), want, old)
        update_scales([group])
        expected_history = torch.roll(expected_history, -1, 0)
        expected_history[0] = 0.0
        torch.testing.assert_close(group.amax_history, expected_history, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(group.scale, want, rtol=1.3e-6, atol=0)


def _spy_fprop(monkeypatch):
    seen = []
    real = linear_module.fprop_gemm

    def spy(x, w, **kwargs):
        seen.append((x, w))
        return real(x, w, **kwargs)

    monkeypatch.setattr(linear_module, "fprop_gemm", spy)
    return seen


def test_each_step_casts_with_earlier_scale_and_records_amax(gen, monkeypatch):
    seen = _spy_fprop(monkeypatch)
    recipe = DelayedScaling(amax_history_len=3)
    layer = Linear(32, 16)
    scales_before = []
    amaxes = []
    for step in range(4):
        x = randn(gen, 16, 32, scale=1.0 + step)
        state = layer.quantization_state()
        scales_before.append(None if not state["forward"] else state["forward"]["input"]["scale"].clone())
        with autocast(recipe=recipe):
            layer(x)
            # inside the autocast, row 0 holds this step's amax, not yet rolled
            row0 = layer.quantization_state()["forward"]["input"]["amax_history"][0]
            assert row0 == x.abs().max()
        amaxes.append(x.abs().max())
        x_q = seen[-1][0]
        # the scale from earlier steps; a fresh state's first cast: its own amax's
        scale = scales_before[-1] if scales_before[-1] is not None else torch.full((1,), E4M3_MAX) / amaxes[0]
        assert x_q._scale_inv == torch.reciprocal(scale)
        want_data, _ = ops.quantize_fp8(x, scale, torch.float8_e4m3fn)
        assert torch.equal(x_q._data.view(torch.uint8), want_data.view(torch.uint8))  # bit exact
        state = layer.quantization_state()["forward"]["input"]
        window = torch.stack(amaxes[-3:]).max()
        assert_scale(state["scale"], E4M3_MAX, window)
        # history after the roll: most recent amax in the last row, row 0 zeroed
        assert state["amax_history"][-1] == amaxes[-1] and state["amax_history"][0] == 0
        assert state["amax_history"][1] == (amaxes[-2] if step >= 1 else 0)


def test_forward_update_at_outermost_exit_only(gen):
    layer = Linear(16, 16)
    first = randn(gen, 16, 16)
    with autocast(recipe=DelayedScaling(amax_history_len=2)):
        layer(first)
    before = layer.quantization_state()["forward"]["input"]["scale"].clone()
    x = randn(gen, 16, 16, scale=4.0)
    with autocast(recipe=DelayedScaling(amax_history_len=2)):
        with autocast(recipe=DelayedScaling(amax_history_len=2)):
            layer(x)
        inner_exit = layer.quantization_state()["forward"]["input"]["scale"].clone()
        with autocast(enabled=False):
            layer(x)  # high precision inside: still updates at the outermost exit
    assert inner_exit == before
    assert_scale(layer.quantization_state()["forward"]["input"]["scale"], E4M3_MAX, x.abs().max())


def test_backward_update_at_end_of_backward(gen):
    layer = Linear(16, 16)
    x = randn(gen, 16, 16).requires_grad_()
    dy = randn(gen, 16, 16, scale=3.0)
    recipe = DelayedScaling(amax_history_len=2)
    with autocast(recipe=recipe):
        layer(x).backward(dy / 8)  # a first step: its scale comes from that gradient's amax
    before = layer.quantization_state()["backward"]["grad_output"]["scale"].clone()
    assert_scale(before, E5M2_MAX, (dy / 8).abs().max())
    with autocast(recipe=recipe):
        y = layer(x)
    seen_during = []
    x.register_hook(lambda g: seen_during.append(
        {k: v.clone() for k, v in layer.quantization_state()["backward"]["grad_output"].items()}))
    y.backward(dy)
    during = seen_during[0]
    assert during["scale"] == before and during["amax_history"][0] == dy.abs().max()  # recorded, not yet updated
    after = layer.quantization_state()["backward"]["grad_output"]
    assert_scale(after["scale"], E5M2_MAX, dy.abs().max())  # HYBRID: gradients in E5M2
    assert after["amax_history"][0] == 0 and after["amax_history"][1] == dy.abs().max()


def test_weight_scale_only_updates_on_first_microbatch(gen):
    layer = Linear(16, 16)
    recipe = DelayedScaling(amax_history_len=4)
    x = randn(gen, 16, 16)
    with autocast(recipe=recipe):
        layer(x, is_first_microbatch=True)
    weight_after_first = {k: v.clone() for k, v in layer.quantization_state()["forward"]["weight"].items()}
    assert_scale(weight_after_first["scale"], E4M3_MAX, layer.weight.abs().max())
    for _ in range(2):
        with autocast(recipe=recipe):
            layer(randn(gen, 16, 16), is_first_microbatch=False)
    state = layer.quantization_state()["forward"]
    assert torch.equal(state["weight"]["amax_history"], weight_after_first["amax_history"])  # not rolled
    assert torch.equal(state["weight"]["scale"], weight_after_first["scale"])
    assert state["input"]["amax_history"][-3:].ne(0).all()  # inputs kept updating
    with autocast(recipe=recipe):
        layer(x, is_first_microbatch=None)
    assert not torch.equal(layer.quantization_state()["forward"]["weight"]["amax_history"],
                           weight_after_first["amax_history"])


def test_weight_cache_reused_while_not_first_microbatch(gen, monkeypatch):
    seen = _spy_fprop(monkeypatch)
    layer = Linear(16, 16)
    with autocast(recipe=DelayedScaling()):
        layer(randn(gen, 16, 16), is_first_microbatch=True)
        layer(randn(gen, 16, 16), is_first_microbatch=False)
        layer(randn(gen, 16, 16), is_first_microbatch=None)
    assert seen[1][1] is seen[0][1] and seen[2][1] is not seen[0][1]


def test_calibration_records_amax_computing_in_high_precision(gen):
    layer = Linear(16, 32)
    x = randn(gen, 8, 16, scale=2.0).requires_grad_()
    with autocast(enabled=False, calibrating=True, recipe=DelayedScaling(amax_history_len=2)):
        y = layer(x)
    y.backward(torch.ones_like(y))
    plain = torch.nn.functional.linear(x.detach(), layer.weight.detach(), layer.bias.detach())
    assert torch.allclose(y, plain, rtol=1.3e-6, atol=1e-5)  # not quantized (FP8 would be ~1e-2 off)
    state = layer.quantization_state()
    assert state["forward"]["input"]["amax_history"][1] == x.abs().max()
    assert_scale(state["forward"]["weight"]["scale"], E4M3_MAX, layer.weight.abs().max())
    assert_scale(state["backward"]["grad_output"]["scale"], E5M2_MAX, 1.0)


def test_quantization_state_layout(gen):
    layer = Linear(16, 16)
    assert layer.quantization_state() == {"forward": {}, "backward": {}}
    with autocast(recipe=DelayedScaling(amax_history_len=7)):
        layer(randn(gen, 16, 16))
    state = layer.quantization_state()
    assert set(state) == {"forward", "backward"}
    assert set(state["forward"]) == {"input", "weight"} and set(state["backward"]) == {"grad_output"}
    for roles in state.values():
        for entry in roles.values():
            assert set(entry) == {"scale", "amax_history"}
            assert entry["scale"].shape == (1,) and entry["amax_history"].shape == (7,)
            assert entry["scale"].dtype == torch.float32


def test_format_dtypes():
    assert Format.HYBRID.forward_dtype == torch.float8_e4m3fn and Format.HYBRID.backward_dtype == torch.float8_e5m2
    assert Format.E4M3.backward_dtype == torch.float8_e4m3fn
    assert math.isclose(E4M3_MAX, 448.0)


def test_quantized_tensors_keep_their_scale_snapshot(gen):
    """scale_inv is shared per step, but an update (or an in-place write to the scale) never
    changes the scale_inv of tensors quantized before it."""
    recipe = DelayedScaling(amax_history_len=2)
    state = recipe.make_state(gemm_slots(), torch.device("cpu"))
    q = state.quantizer("input")
    first = q.quantize(randn(gen, 16, 16, scale=9.0))
    update_scales([q.scaling_group])
    second = q.quantize(randn(gen, 16, 16))
    assert first._scale_inv == 1.0
    torch.testing.assert_close(second._scale_inv, torch.reciprocal(q.scale))
    q.scale.mul_(2)  # e.g. a state restore through the quantization_state() views
    third = q.quantize(randn(gen, 16, 16))
    torch.testing.assert_close(third._scale_inv, torch.reciprocal(q.scale))
    assert first._scale_inv == 1.0 and second._scale_inv == third._scale_inv * 2


def test_per_column_views_are_live_aligned_and_snapshotted():
    """scale_of/scale_inv_of hand out cached per-column views: scale views see updates, each
    scale_inv view sits at a 16-byte aligned address (GEMM libraries load scales as vectors) and
    keeps the value of its snapshot after the scale changes."""

    group = ScalingGroup(["a", "b", "c"], torch.float8_e4m3fn, DelayedScaling(amax_history_len=4),
                         torch.device("cpu"))
    group.scale.copy_(torch.tensor([2.0, 4.0, 8.0]))
    before = [group.scale_inv_of(i) for i in range(3)]
    assert all(v.data_ptr() % 16 == 0 for v in before)
    assert [v.item() for v in before] == [0.5, 0.25, 0.125]
    assert group.scale_of(1) is group.scale_of(1)  # made once
    group.scale.mul_(2.0)
    assert group.scale_of(2).item() == 16.0  # live
    assert [v.item() for v in before] == [0.5, 0.25, 0.125]  # earlier snapshot kept
    assert group.scale_inv_of(2).item() == 0.0625
    group.record(1, torch.tensor(3.0))
    group.record(1, torch.tensor(2.0))
    assert group.amax_history[0].tolist() == [0.0, 3.0, 0.0]
    after = [group.scale_inv_of(i) for i in range(3)]
    # one snapshot tensor (one kernel) holds every column's slot, 16 bytes apart
    assert len({v.untyped_storage().data_ptr() for v in after}) == 1
    assert [b.data_ptr() - a.data_ptr() for a, b in zip(after, after[1:])] == [16, 16]
    torch.testing.assert_close(group.scale_inv(), torch.tensor([0.25, 0.125, 0.0625]), rtol=0, atol=0)


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "compiled"])
def test_amax_slots_name_their_column_of_history_row_0(traced):
    """Each amax slot a cast is handed carries te_slot_column = c and is amax_history[0, c:c+1]
    (ops/cast.py): what lets a backend's compiled cast write the history itself for column 0.
    Compiled, the slots are made in the graph and carry it there."""
    if traced and not SETS_TRACED_TENSOR_ATTRIBUTES:
        pytest.skip("this torch's dynamo (2.7) cannot set an attribute on a traced tensor: traced slots carry none")
    group = ScalingGroup(["a", "b"], torch.float8_e4m3fn, DelayedScaling(amax_history_len=4), torch.device("cpu"))

    def columns_and_offsets():
        slots = group.column_views()[1]
        checks = [float(slot.te_slot_column == i and slot._base is group.amax_history) for i, slot in enumerate(slots)]
        for slot in slots:  # the slot is row 0's element of its column: writing it shows there
            slot.add_(1.0)
        return torch.tensor(checks)

    run = torch.compile(columns_and_offsets, fullgraph=True, backend="eager") if traced else columns_and_offsets
    assert run().tolist() == [1.0, 1.0]
    assert group.amax_history[0].tolist() == [1.0, 1.0] and group.amax_history[1:].abs().sum() == 0


def test_single_column_snapshot_is_the_reciprocal_itself():
    """A one-column group's scale_inv needs no slot layout: the view handed to casts is the
    snapshot tensor itself, recomputed only when the scale changed."""
    group = ScalingGroup(["x"], torch.float8_e4m3fn, DelayedScaling(), torch.device("cpu"))
    group.scale.fill_(8.0)
    view = group.scale_inv_of(0)
    assert view is group.scale_inv() and view.shape == (1,) and view.item() == 0.125
    assert group.scale_inv_of(0) is view  # no change to the scale, no new snapshot
    group.scale_changed()
    assert group.scale_inv_of(0) is not view


@pytest.mark.parametrize("algo, returned", [
    (lambda h: h, r"a tensor of shape \(4, 3\)"),  # the whole history, not one amax per column
    (lambda h: h.max(), r"a tensor of shape \(\)"),
    (lambda h: float(h.max()), r"returned float"),
])
def test_callable_amax_algo_with_a_wrong_result_is_a_clear_error(gen, algo, returned):
    group = make_group(randn(gen, 4, 3).abs() + 0.1, torch.ones(3), DelayedScaling(amax_history_len=4,
                                                                                   amax_compute_algo=algo))
    with pytest.raises(ValueError, match=r"amax_compute_algo must return a tensor with one value per scaled tensor "
                                         r"of the group \(shape \(3,\)\) .*" + returned):
        update_scales([group])


def test_callable_scale_that_is_not_finite_keeps_the_old_scale(gen):
    def bad(amax, scale, fp8_max, recipe):
        return torch.tensor([float("nan"), 0.0, 5.0])

    group = make_group(randn(gen, 4, 3).abs() + 0.1, torch.tensor([2.0, 3.0, 4.0]),
                       DelayedScaling(amax_history_len=4, scaling_factor_compute_algo=bad))
    update_scales([group])
    assert group.scale.tolist() == [2.0, 3.0, 5.0]
