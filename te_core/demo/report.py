"""What the demo shows and keeps: the loss curves side by side, the gap, a PNG and a JSON."""

from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Sequence

from .png import plot_curves


def smoothed(values: Sequence[float], window: int) -> List[float]:
    """Trailing moving average (window >= 1)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


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
    """A table of both (smoothed) loss curves at `rows` evenly spaced steps, with a bar per curve."""
    window = max(1, len(hp) // 20)
    hs, fs = smoothed(hp, window), smoothed(fp8, window)
    lo, hi = min(hs + fs), max(hs + fs)
    span = (hi - lo) or 1.0

    def bar(v: float) -> str:
        return "#" * (1 + int(20 * (v - lo) / span))

    lines = [f"{'step':>6} | {'bf16 loss':>9} {'':20} | {'fp8 loss':>9} {'':20} | {'fp8-bf16':>8}"]
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


def write_plot(path: str, hp: Sequence[float], fp8: Sequence[float], recipe: str) -> str:
    """PNG of both loss curves; matplotlib when installed, the built-in rasterizer otherwise.
    Returns which one drew it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        data, _ = plot_curves({"bf16": hp, f"fp8 ({recipe})": fp8})
        with open(path, "wb") as f:
            f.write(data)
        return "builtin (blue: bf16, red: fp8)"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(range(1, len(hp) + 1), hp, label="bf16", linewidth=1)
    ax.plot(range(1, len(fp8) + 1), fp8, label=f"fp8 ({recipe})", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title("te-core demo: GPT on Python stdlib source")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


def output_paths(out_dir: str) -> Dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    return dict(json=os.path.join(out_dir, "demo_run.json"), png=os.path.join(out_dir, "loss_curves.png"))
