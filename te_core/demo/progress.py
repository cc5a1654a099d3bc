"""A text progress bar on stderr (no tqdm needed): redrawn in place on a terminal at most a few
times a second, a line every 10% otherwise (logs, CI). Shows speed and the time left."""

from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, Optional, TextIO

REDRAW_S = 0.25  # terminal redraws at most this often: drawing fetches the loss, which waits for the device


def format_duration(seconds: float) -> str:
    """A short clock: '42s', '3m07s', '2h05m'; '?' when unknown (negative, NaN or infinite)."""
    if not seconds >= 0 or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_seconds(step: int, total: int, elapsed: float) -> float:
    """Time left at the mean pace so far: elapsed / step per remaining step (inf before the first step)."""
    if step <= 0:
        return float("inf")
    return elapsed * (total - step) / step


class ProgressBar:
    def __init__(
        self,
        label: str,
        total: int,
        stream: Optional[TextIO] = None,
        enabled: bool = True,
        width: int = 20,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.label, self.total, self.width = label, max(total, 1), width
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interactive = getattr(self.stream, "isatty", lambda: False)()
        self.clock = clock
        self.start = clock()
        self._last_decile = -1
        self._last_draw = -float("inf")

    def due(self, step: int) -> bool:
        """Whether update(step) would draw: always at the last step; else on a terminal when
        REDRAW_S has passed since the last draw, off one when a new tenth of the run is reached."""
        if not self.enabled:
            return False
        if step >= self.total:
            return True
        if self.interactive:
            return self.clock() - self._last_draw >= REDRAW_S
        return 10 * step // self.total != self._last_decile

    def update(self, step: int, tokens_per_step: int = 0, **values: float) -> None:
        """Draw progress after `step` steps (1-based): steps/s (and tokens/s when tokens_per_step
        is given), values such as the loss, elapsed time and ETA."""
        if not self.due(step):
            return
        now = self.clock()
        self._last_decile, self._last_draw = 10 * step // self.total, now
        text = self.line(step, now - self.start, tokens_per_step, **values)
        self.stream.write(text if self.interactive else text + "\n")
        self.stream.flush()

    def line(self, step: int, elapsed: float, tokens_per_step: int = 0, **values: float) -> str:
        filled = self.width * step // self.total
        bar = "#" * filled + "." * (self.width - filled)
        rate = step / elapsed if elapsed > 0 else 0.0
        speed = f"{rate:.3g} steps/s" + (f" {rate * tokens_per_step:,.0f} tok/s" if tokens_per_step else "")
        shown = "".join(f" {k} {v:.4g}" if isinstance(v, float) else f" {k} {v}" for k, v in values.items())
        eta = format_duration(eta_seconds(step, self.total, elapsed))
        text = f"{self.label:>5} [{bar}] {step}/{self.total}{shown} | {speed} | {format_duration(elapsed)}, eta {eta}"
        if not self.interactive:
            return text
        # a line longer than the terminal wraps, and "\r" then redraws only its last part
        return "\r" + text[: shutil.get_terminal_size().columns - 1] + "\033[K"

    def close(self) -> None:
        if self.enabled and self.interactive:
            self.stream.write("\n")
            self.stream.flush()
