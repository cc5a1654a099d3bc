"""The demo's figure: both loss curves (per step, faint, and smoothed, bold) over the relative
gap of the smoothed curves, FP8 minus BF16, drawn with the built-in PNG writer."""

from __future__ import annotations

import math
from typing import List, Sequence

from .font import text_width
from .png import BLACK, GREY, Axes, Canvas, faded, nice_ticks

BF16_COLOR, FP8_COLOR = (31, 119, 180), (214, 39, 40)
GAP_COLOR = (90, 90, 90)


def ema(values: Sequence[float], alpha: float) -> List[float]:
    """Exponential moving average s[0] = v[0], s[i] = (1 - alpha) s[i-1] + alpha v[i], 0 < alpha <= 1.
    Non-finite values are skipped (the average carries over them) and give NaN only before the first finite one."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"EMA weight alpha must be in (0, 1], got {alpha}")
    out, state = [], math.nan
    for v in values:
        if math.isfinite(v):
            state = v if math.isnan(state) else (1.0 - alpha) * state + alpha * v
        out.append(state)
    return out


def ema_alpha(steps: int) -> float:
    """The EMA weight for a run of `steps` steps: a span of a twentieth of the run (alpha = 2 / (span + 1))."""
    span = max(1.0, steps / 20)
    return 2.0 / (span + 1.0)


def relative_gap(hp: Sequence[float], fp8: Sequence[float]) -> List[float]:
    """(fp8 - hp) / hp per step, in percent."""
    return [100.0 * (f - h) / h if h else math.nan for h, f in zip(hp, fp8)]


def _finite(values: Sequence[float]) -> List[float]:
    return [v for v in values if math.isfinite(v)] or [0.0]


def loss_figure(hp: Sequence[float], fp8: Sequence[float], recipe: str, width: int = 900, height: int = 640) -> bytes:
    """PNG bytes of the figure: loss panel on top (bf16 blue and drawn wider, so it shows where fp8
    lies on it), relative-gap panel below, one step axis."""
    if len(hp) != len(fp8) or len(hp) < 2:
        raise ValueError(f"need two runs of equal length >= 2, got {len(hp)} and {len(fp8)} steps")
    alpha = ema_alpha(len(hp))
    hp_s, fp8_s = ema(hp, alpha), ema(fp8, alpha)
    steps = list(range(1, len(hp) + 1))
    x_ticks = nice_ticks(1, len(hp), 6)
    x_range = (min(x_ticks[0], 1), max(x_ticks[-1], len(hp)))
    c = Canvas(width, height)
    left, right = 70, width - 20
    c.text(width // 2, 10, f"te-core demo: bf16 vs fp8 ({recipe})", scale=2, align="center")

    losses = _finite(list(hp) + list(fp8))
    y_ticks = nice_ticks(min(losses), max(losses), 6)
    top = Axes(c, (left, 60, right, round(height * 0.62)), x_range, (y_ticks[0], y_ticks[-1]))
    c.text(left, 44, f"training loss (nats per byte); faint: per step, bold: ema, span {2 / alpha - 1:.0f} steps")
    top.frame(y_ticks, x_ticks, x_labels=False)
    top.plot(steps, hp, faded(BF16_COLOR, 0.7))
    top.plot(steps, fp8, faded(FP8_COLOR, 0.7))
    top.plot(steps, hp_s, BF16_COLOR, thick=5)
    top.plot(steps, fp8_s, FP8_COLOR, thick=2)
    _legend(c, right - 10, 70, [("bf16", BF16_COLOR), (f"fp8 ({recipe})", FP8_COLOR)])

    gap = relative_gap(hp_s, fp8_s)
    finite_gap = _finite(gap)
    g_ticks = nice_ticks(min(min(finite_gap), 0.0), max(max(finite_gap), 0.0), 4)
    bottom_top = round(height * 0.62) + 44
    low = Axes(c, (left, bottom_top, right, height - 40), x_range, (g_ticks[0], g_ticks[-1]))
    c.text(left, bottom_top - 16, "gap: (fp8 - bf16) / bf16 of the ema curves")
    low.frame(g_ticks, x_ticks, y_suffix="%")
    low.plot([x_range[0], x_range[1]], [0.0, 0.0], BLACK)
    low.plot(steps, gap, GAP_COLOR, thick=2)
    c.text((left + right) // 2, height - 18, "step", align="center")
    return c.to_png()


def _legend(c: Canvas, right: int, top: int, entries) -> None:
    """Colour swatches with their names, right-aligned at `right`, on a white patch."""
    wide = max(text_width(name) for name, _ in entries) + 34
    x0, y0, x1, y1 = right - wide - 6, top - 6, right + 4, top + 16 * len(entries) + 2
    c.rect(x0, y0, x1, y1, (255, 255, 255))
    for a, b, e, f in ((x0, y0, x1, y0), (x0, y1, x1, y1), (x0, y0, x0, y1), (x1, y0, x1, y1)):
        c.line(a, b, e, f, GREY)
    for n, (name, color) in enumerate(entries):
        y = top + 16 * n
        c.line(right - wide, y + 3, right - wide + 24, y + 3, color, thick=3)
        c.text(right - wide + 30, y, name)
