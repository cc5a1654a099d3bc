"""The demo figure: EMA smoothing, relative gap, and both curves visible in the PNG."""

import math
import random

import pytest

from te_core.demo.figure import BF16_COLOR, FP8_COLOR, GAP_COLOR, ema, ema_alpha, loss_figure, relative_gap
from te_core.demo.png import faded

from .pngdecode import count, decode


def test_ema_against_a_hand_computation():
    # s0 = 1; s1 = 0.5*1 + 0.5*3 = 2; s2 = 0.5*2 + 0.5*5 = 3.5; s3 = 0.5*3.5 + 0.5*(-1) = 1.25
    assert ema([1.0, 3.0, 5.0, -1.0], 0.5) == [1.0, 2.0, 3.5, 1.25]
    # alpha 0.25: s1 = 0.75*4 + 0.25*8 = 5
    assert ema([4.0, 8.0], 0.25) == [4.0, 5.0]
    assert ema([2.0, 7.0], 1.0) == [2.0, 7.0]  # alpha 1 is no smoothing


def test_ema_carries_over_non_finite_values():
    out = ema([math.nan, 2.0, math.inf, 4.0], 0.5)
    assert math.isnan(out[0]) and out[1:] == [2.0, 2.0, 3.0]


def test_ema_rejects_bad_weights():
    for alpha in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
            ema([1.0], alpha)


def test_ema_alpha_spans_a_twentieth_of_the_run():
    assert ema_alpha(20) == 1.0 and ema_alpha(5) == 1.0  # span 1: no smoothing for short runs
    assert ema_alpha(200) == pytest.approx(2 / 11)
    assert ema_alpha(250) == pytest.approx(2 / 13.5)


def test_relative_gap_in_percent():
    assert relative_gap([2.0, 4.0], [2.1, 3.9]) == pytest.approx([5.0, -2.5])


def _curves(n=120, seed=3):
    rng = random.Random(seed)
    hp = [2.0 + 3.5 * math.exp(-i / 20) + rng.gauss(0, 0.08) for i in range(n)]
    fp8 = [v + rng.gauss(0, 0.08) + 0.01 for v in hp]
    return hp, fp8


def test_figure_shows_both_smoothed_curves_the_raw_ones_and_the_gap():
    hp, fp8 = _curves()
    width, height, rows = decode(loss_figure(hp, fp8, "delayed", width=600, height=420))
    assert (width, height) == (600, 420)
    for color in (BF16_COLOR, FP8_COLOR, GAP_COLOR, faded(BF16_COLOR, 0.7), faded(FP8_COLOR, 0.7)):
        assert count(rows, color) > 50, color
    gap_rows = [y for y, row in enumerate(rows) if GAP_COLOR in row]
    curve_rows = [y for y, row in enumerate(rows[: int(height * 0.62)]) if FP8_COLOR in row]
    assert min(gap_rows) > max(curve_rows)  # the gap panel is below the loss panel


def test_bf16_stays_visible_when_the_runs_coincide():
    hp, _ = _curves()
    _, _, rows = decode(loss_figure(hp, list(hp), "current", width=600, height=420))
    # the bf16 line is drawn wider, under the fp8 one: its edges show on both sides
    assert count(rows, BF16_COLOR) > count(rows, FP8_COLOR) > 100


def test_figure_rejects_runs_of_different_length():
    with pytest.raises(ValueError, match="equal length"):
        loss_figure([3.0, 2.0, 1.0], [3.0, 2.0], "delayed")
