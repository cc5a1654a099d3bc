"""A text progress bar on stderr (no tqdm needed): redrawn in place on a terminal, a line
every 10% otherwise (logs, CI)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class ProgressBar:
    def __init__(self, label: str, total: int, stream: Optional[TextIO] = None, enabled: bool = True, width: int = 30):
        self.label, self.total, self.width = label, max(total, 1), width
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interactive = getattr(self.stream, "isatty", lambda: False)()
        self.start = time.perf_counter()
        self._last_decile = -1

    def update(self, step: int, **values: float) -> None:
        """Show progress after `step` steps (1-based) with values such as loss and tok/s."""
        if not self.enabled:
            return
        decile = 10 * step // self.total
        if not self.interactive and decile == self._last_decile and step != self.total:
            return
        self._last_decile = decile
        filled = self.width * step // self.total
        bar = "#" * filled + "." * (self.width - filled)
        shown = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        elapsed = time.perf_counter() - self.start
        line = f"{self.label:>5} [{bar}] {step}/{self.total} {shown} {elapsed:.0f}s"
        self.stream.write(("\r" + line) if self.interactive else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.interactive:
            self.stream.write("\n")
            self.stream.flush()
