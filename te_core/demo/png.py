"""A loss-curve PNG without plotting libraries: lines rasterized into an RGB canvas and
written with zlib. Used when matplotlib is not installed."""

from __future__ import annotations

import struct
import zlib
from typing import Dict, List, Sequence, Tuple

Color = Tuple[int, int, int]
WHITE, GREY, BLACK = (255, 255, 255), (200, 200, 200), (0, 0, 0)
PALETTE = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]


class Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(WHITE) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: float, y0: float, x1: float, y1: float, color: Color, thick: int = 1) -> None:
        steps = int(max(abs(x1 - x0), abs(y1 - y0), 1))
        for i in range(steps + 1):
            t = i / steps
            x, y = round(x0 + (x1 - x0) * t), round(y0 + (y1 - y0) * t)
            for dx in range(thick):
                for dy in range(thick):
                    self.set(x + dx, y + dy, color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(y0, y1):
            for x in range(x0, x1):
                self.set(x, y, color)

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


def plot_curves(curves: Dict[str, Sequence[float]], width: int = 800, height: int = 450) -> Tuple[bytes, List[Color]]:
    """PNG bytes of the curves (one color each, in PALETTE order) on shared axes with a grid;
    returns the colors used so a caption can name them."""
    canvas = Canvas(width, height)
    left, right, top, bottom = 50, width - 20, 20, height - 40
    values = [v for ys in curves.values() for v in ys if v == v]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    longest = max((len(ys) for ys in curves.values()), default=2)
    for k in range(6):  # horizontal grid lines
        y = top + (bottom - top) * k // 5
        canvas.line(left, y, right, y, GREY)
    canvas.line(left, top, left, bottom, BLACK)
    canvas.line(left, bottom, right, bottom, BLACK)

    def px(i: int, v: float) -> Tuple[float, float]:
        return left + (right - left) * i / max(longest - 1, 1), bottom - (bottom - top) * (v - lo) / (hi - lo)

    colors = []
    for n, ys in enumerate(curves.values()):
        color = PALETTE[n % len(PALETTE)]
        colors.append(color)
        points = [px(i, v) for i, v in enumerate(ys) if v == v]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            canvas.line(x0, y0, x1, y1, color, thick=2)
        canvas.rect(right - 120, top + 10 + 16 * n, right - 100, top + 20 + 16 * n, color)  # legend swatch
    return canvas.to_png(), colors
