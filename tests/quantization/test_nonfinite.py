"""Non-finite amaxes in every position of the delayed-scaling pipeline, with Transformer Engine's
outcome as the expected value: a NaN is ignored (C's fmaxf), an inf keeps the scale while it is in
the window, and no non-finite value ever reaches a scale."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from te_core.modules.linear import Linear
from te_core.quantization import autocast
from te_core.quantization.scaling import ScalingGroup, reduce_amaxes
from te_core.recipe import DelayedScaling

from .conftest import randn

E4M3_MAX = 448.0
NAN, INF = float("nan"), float("inf")


def _input_state(layer):
    return layer.quantization_state()["forward"]["input"]


def _step(layer, x, recipe):
    with autocast(recipe=recipe):
        layer(x)
    return _input_state(layer)["scale"].item()


def test_record_ignores_nan_and_keeps_inf():
    group = ScalingGroup(["a", "b", "c"], torch.float8_e4m3fn, DelayedScaling(amax_history_len=4),
                         torch.device("cpu"))
    for column, amaxes in enumerate([(2.0, NAN, 3.0), (NAN, 5.0), (1.0, INF, 7.0)]):
        for amax in amaxes:
            group.record(column, torch.tensor(amax))
    assert group.amax_history[0].tolist() == [3.0, 5.0, INF]


def test_one_nan_step_does_not_freeze_the_scale(gen):
    """A step whose input holds a NaN contributes no amax; the next step's scale follows the other
    steps of the window (torch's max would keep the NaN, freezing the scale for the window)."""
    recipe = DelayedScaling(amax_history_len=16)
    layer = Linear(32, 16)
    x1, x3 = randn(gen, 16, 32), randn(gen, 16, 32, scale=50.0)
    _step(layer, x1, recipe)
    x2 = randn(gen, 16, 32, scale=2.0)
    x2[3, 5] = NAN
    _step(layer, x2, recipe)
    scale = _step(layer, x3, recipe)
    want = torch.div(torch.tensor(E4M3_MAX), torch.maximum(x1.abs().max(), x3.abs().max()))
    assert scale == pytest.approx(want.item(), rel=1.3e-6)
    history = _input_state(layer)["amax_history"]
    assert history[-2].isnan() and history.isnan().sum() == 1  # kept in the window, ignored by the max


def test_inf_step_keeps_the_scale_for_the_window(gen):
    """As Transformer Engine: an inf amax is the window's max, so the scale stays as it was until
    the inf leaves the history, then follows the finite amaxes again."""
    length = 3
    recipe = DelayedScaling(amax_history_len=length)
    layer = Linear(32, 16)
    first = _step(layer, randn(gen, 16, 32), recipe)
    x = randn(gen, 16, 32)
    x[0, 0] = INF
    assert _step(layer, x, recipe) == first
    later = [randn(gen, 16, 32, scale=3.0 + i) for i in range(length)]
    scales = [_step(layer, xi, recipe) for xi in later]
    assert scales[: length - 2] == [first] * (length - 2)  # the inf is still in the window
    window = torch.stack([xi.abs().max() for xi in later[-length:]]).max()
    assert scales[-1] == pytest.approx(E4M3_MAX / window.item(), rel=1.3e-6)
    assert all(torch.isfinite(torch.tensor(scales)))


def test_most_recent_nan_keeps_the_scale(gen):
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    layer = Linear(32, 16)
    first = _step(layer, randn(gen, 16, 32), recipe)
    x = randn(gen, 16, 32, scale=5.0)
    x[1, 1] = NAN
    assert _step(layer, x, recipe) == first
    x3 = randn(gen, 16, 32, scale=9.0)
    assert _step(layer, x3, recipe) == pytest.approx(E4M3_MAX / x3.abs().max().item(), rel=1.3e-6)


@pytest.fixture
def two_ranks(monkeypatch):
    """run(fn0, fn1): both "ranks" at once on two threads, joined by a fake all_reduce whose MAX
    is `a if a > b else b` taken in rank order, as some collective libraries do: a NaN on one side
    decides the result by which rank holds it. Returns (fn0(), fn1())."""
    barrier, sent, rank_of = threading.Barrier(2, timeout=30), {}, {}

    def all_reduce(tensor, op=None, group=None, async_op=False):
        assert op == dist.ReduceOp.MAX
        sent[rank_of[threading.get_ident()]] = tensor.clone()
        barrier.wait()
        tensor.copy_(torch.where(sent[0] > sent[1], sent[0], sent[1]))
        barrier.wait()

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)

    def run(*fns):
        results, errors = [None, None], []

        def body(rank):
            rank_of[threading.get_ident()] = rank
            try:
                results[rank] = fns[rank]()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    return run


def _reduced_row(row):
    def fn():
        group = ScalingGroup(["a", "b", "c", "d"], torch.float8_e4m3fn, DelayedScaling(), torch.device("cpu"))
        group.amax_history[0] = torch.tensor(row)
        reduce_amaxes([(group, "world")])
        return group.amax_history[0]
    return fn


def test_reduction_is_fmax_across_ranks(two_ranks):
    """One rank's NaN never hides the other ranks' amaxes, whichever rank holds it; NaN only
    where every rank had NaN; both ranks agree."""
    got = two_ranks(_reduced_row([NAN, 2.0, NAN, INF]), _reduced_row([3.0, NAN, NAN, 1.0]))
    for row in got:
        assert row[:2].tolist() == [3.0, 2.0] and row[2].isnan() and row[3] == INF


def test_reduced_nan_never_reaches_the_scale(gen, two_ranks):
    recipe = DelayedScaling(amax_history_len=4)
    x = randn(gen, 16, 32, scale=4.0)
    bad = x.clone()
    bad[2, 2] = NAN

    def rank(inp):
        def fn():
            torch.manual_seed(0)
            layer = Linear(32, 16)
            with autocast(recipe=recipe, amax_reduction_group="world"):
                layer(inp)
            return _input_state(layer)["scale"].item()
        return fn

    scales = two_ranks(rank(x), rank(bad))
    assert scales[0] == scales[1] == pytest.approx(E4M3_MAX / x.abs().max().item(), rel=1.3e-6)
