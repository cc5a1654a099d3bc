"""Plots without plotting libraries: an RGB canvas with lines, text and axes, written as a PNG
with zlib. te-core keeps its dependencies to torch, pluggy and numpy, so the demo draws its own."""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import List, Sequence, Tuple

from .font import GLYPH_HEIGHT, text_pixels, text_width

Color = Tuple[int, int, int]
WHITE, GREY, BLACK = (255, 255, 255), (215, 215, 215), (0, 0, 0)


def faded(color: Color, amount: float) -> Color:
    """`color` mixed with white: amount 0 keeps it, 1 gives white."""
    return tuple(round(c + (255 - c) * amount) for c in color)  # type: ignore[return-value]


class Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(WHITE) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        i = 3 * (y * self.width + x)
        return tuple(self.pixels[i : i + 3])  # type: ignore[return-value]

    def line(self, x0: float, y0: float, x1: float, y1: float, color: Color, thick: int = 1) -> None:
        """A straight line `thick` pixels wide, centred on the segment."""
        steps = int(max(abs(x1 - x0), abs(y1 - y0), 1))
        half = (thick - 1) // 2
        for i in range(steps + 1):
            t = i / steps
            x, y = round(x0 + (x1 - x0) * t) - half, round(y0 + (y1 - y0) * t) - half
            for dx in range(thick):
                for dy in range(thick):
                    self.set(x + dx, y + dy, color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(y0, y1):
            for x in range(x0, x1):
                self.set(x, y, color)

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 1, align: str = "left") -> None:
        """`text` with its top at y; x is its left edge, centre or right edge by `align`."""
        if align not in ("left", "center", "right"):
            raise ValueError(f"align must be 'left', 'center' or 'right', not {align!r}")
        width = text_width(text, scale)
        x0 = x - {"left": 0, "center": width // 2, "right": width}[align]
        for dx, dy in text_pixels(text, scale):
            self.set(x0 + dx, y + dy, color)

    def to_png(self) -> bytes:
        rows = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width]) for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")
        )


def nice_ticks(lo: float, hi: float, count: int = 5) -> List[float]:
    """About `count` round values (steps of 1, 2, 2.5 or 5 times a power of ten) covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        raise ValueError(f"tick range must be finite with lo <= hi, got [{lo}, {hi}]")
    if hi == lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = (hi - lo) / max(count - 1, 1)
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw * (1 - 1e-9))
    first = math.floor(lo / step + 1e-9) * step
    ticks = []
    k = 0
    while not ticks or ticks[-1] < hi - 1e-9 * step:
        ticks.append(round(first + k * step, 12))
        k += 1
    return ticks


def tick_label(value: float, step: float, suffix: str = "") -> str:
    """`value` with as many decimals as the tick step needs."""
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if abs(step / 10.0**-decimals - round(step / 10.0**-decimals)) > 1e-6:
        decimals += 1  # steps like 2.5 or 0.25 need one more digit
    text = f"{value:.{decimals}f}"
    return ("0" if float(text) == 0 else text) + suffix


@dataclass
class Axes:
    """A plot panel: a pixel box and the data ranges its edges stand for."""

    canvas: Canvas
    box: Tuple[int, int, int, int]  # left, top, right, bottom in pixels
    x_range: Tuple[float, float]
    y_range: Tuple[float, float]

    def px(self, x: float, y: float) -> Tuple[float, float]:
        left, top, right, bottom = self.box
        (x0, x1), (y0, y1) = self.x_range, self.y_range
        px = left + (right - left) * (x - x0) / ((x1 - x0) or 1.0)
        return px, bottom - (bottom - top) * (y - y0) / ((y1 - y0) or 1.0)

    def frame(
        self, y_ticks: Sequence[float], x_ticks: Sequence[float], y_suffix: str = "", x_labels: bool = True
    ) -> None:
        """Grid lines and labels at the ticks, then the left and bottom axes."""
        left, top, right, bottom = self.box
        c = self.canvas
        y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
        for v in y_ticks:
            _, y = self.px(self.x_range[0], v)
            c.line(left, y, right, y, GREY)
            c.text(left - 6, round(y) - (GLYPH_HEIGHT - 1) // 2, tick_label(v, y_step, y_suffix), align="right")
        x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0
        for v in x_ticks:
            x, _ = self.px(v, self.y_range[0])
            c.line(x, top, x, bottom, GREY)
            if x_labels:
                c.text(round(x), bottom + 6, tick_label(v, x_step), align="center")
        c.line(left, top, left, bottom, BLACK)
        c.line(left, bottom, right, bottom, BLACK)

    def plot(self, xs: Sequence[float], ys: Sequence[float], color: Color, thick: int = 1) -> None:
        """A polyline through the finite points."""
        points = [self.px(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            self.canvas.line(x0, y0, x1, y1, color, thick=thick)
