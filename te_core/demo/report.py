"""What the demo shows and keeps: the loss curves side by side, the gap, a PNG and a JSON."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Sequence

from .figure import ema, ema_alpha, loss_figure


def final_gap(hp: Sequence[float], fp8: Sequence[float], fraction: float = 0.1) -> Dict[str, float]:
    """Mean loss of the last `fraction` of the steps for both runs, and their difference."""
    n = max(1, int(len(hp) * fraction))
    hp_tail, fp8_tail = sum(hp[-n:]) / n, sum(fp8[-n:]) / n
    return dict(
        steps_averaged=n,
        bf16=hp_tail,
        fp8=fp8_tail,
        gap=fp8_tail - hp_tail,
        relative_gap=(fp8_tail - hp_tail) / hp_tail,
    )


def side_by_side(hp: Sequence[float], fp8: Sequence[float], rows: int = 10) -> str:
    """A table of both loss curves (EMA-smoothed as in the plot) at `rows` evenly spaced steps, with a bar per curve."""
    alpha = ema_alpha(len(hp))
    hs, fs = ema(hp, alpha), ema(fp8, alpha)
    lo, hi = min(hs + fs), max(hs + fs)
    span = (hi - lo) or 1.0

    def bar(v: float) -> str:
        return "#" * (1 + int(19 * (v - lo) / span))

    lines = [f"{'step':>6} | {'bf16 loss':>9} {'':20} | {'fp8 loss':>9} {'':20} | {'fp8-bf16':>8}"]
    rows = min(rows, len(hp))
    for r in range(rows):
        i = min(len(hp) - 1, round(r * (len(hp) - 1) / max(rows - 1, 1)))
        lines.append(
            f"{i + 1:>6} | {hs[i]:>9.4f} {bar(hs[i]):<20} | {fs[i]:>9.4f} {bar(fs[i]):<20} | {fs[i] - hs[i]:>+8.4f}"
        )
    return "\n".join(lines)


def write_json(path: str, record: dict) -> None:
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None  # JSON has no NaN
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    with open(path, "w") as f:
        json.dump(clean(record), f, indent=1)


def write_plot(path: str, hp: Sequence[float], fp8: Sequence[float], recipe: str) -> None:
    """PNG of both loss curves and their relative gap (te_core.demo.figure)."""
    data = loss_figure(hp, fp8, recipe)
    with open(path, "wb") as f:
        f.write(data)


def output_paths(out_dir: str) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    return dict(json=os.path.join(out_dir, "demo_run.json"), png=os.path.join(out_dir, "loss_curves.png"))


def speed(bf16_tokens_per_s: float, fp8_tokens_per_s: float, bf16_steady_tokens_per_s: float,
          fp8_steady_tokens_per_s: float) -> Dict[str, float]:
    """Both runs' tokens/s and the FP8 / BF16 ratio (above 1: FP8 is faster), over the whole runs
    and in the steady state (te_core.demo.train.SETTLE; NaN where a run has no steady steps)."""
    return dict(
        bf16_tokens_per_s=bf16_tokens_per_s,
        fp8_tokens_per_s=fp8_tokens_per_s,
        fp8_over_bf16=_ratio(fp8_tokens_per_s, bf16_tokens_per_s),
        bf16_steady_tokens_per_s=bf16_steady_tokens_per_s,
        fp8_steady_tokens_per_s=fp8_steady_tokens_per_s,
        fp8_over_bf16_steady=_ratio(fp8_steady_tokens_per_s, bf16_steady_tokens_per_s),
    )


def _ratio(fp8: float, bf16: float) -> float:
    return fp8 / bf16 if bf16 > 0 else float("nan")  # NaN > 0 is False: NaN stays NaN
