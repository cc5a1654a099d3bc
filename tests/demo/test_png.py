"""The dependency-free plot pieces: bitmap font, canvas, ticks, PNG encoding."""

import pytest

from te_core.demo.font import ADVANCE, GLYPHS, text_pixels, text_width
from te_core.demo.png import BLACK, WHITE, Axes, Canvas, faded, nice_ticks, tick_label

from .pngdecode import count, decode


def test_png_round_trips_pixels():
    c = Canvas(7, 5)
    c.set(0, 0, (1, 2, 3))
    c.set(6, 4, (250, 0, 9))
    c.set(7, 0, BLACK)  # outside: clipped, not an error
    w, h, rows = decode(c.to_png())
    assert (w, h) == (7, 5)
    assert rows[0][0] == (1, 2, 3) and rows[4][6] == (250, 0, 9)
    assert count(rows, WHITE) == 7 * 5 - 2


def test_text_draws_the_glyph_bits():
    c = Canvas(20, 10)
    c.text(2, 1, "1")
    for row, bits in enumerate(GLYPHS["1"]):
        for col in range(5):
            expected = BLACK if bits & (1 << (4 - col)) else WHITE
            assert c.get(2 + col, 1 + row) == expected, (row, col)
    assert text_width("ab") == 2 * ADVANCE - 1 and text_width("ab", scale=2) == 2 * (2 * ADVANCE - 1)
    assert len(list(text_pixels("A"))) == len(list(text_pixels("a")))  # upper case drawn as lower


def test_text_alignment_and_unknown_glyphs():
    for align, left in (("left", 10), ("center", 10 - text_width("8") // 2), ("right", 10 - text_width("8"))):
        c = Canvas(30, 10)
        c.text(10, 0, "8", align=align)
        xs = [x for y in range(10) for x in range(30) if c.get(x, y) == BLACK]
        assert min(xs) == left, align
    with pytest.raises(ValueError, match="no glyph for '#'"):
        Canvas(30, 10).text(0, 0, "a#b")
    with pytest.raises(ValueError, match="align must be"):
        Canvas(30, 10).text(0, 0, "a", align="middle")


def test_nice_ticks_are_round_and_cover_the_range():
    assert nice_ticks(1.8, 5.7, 6) == [1, 2, 3, 4, 5, 6]
    assert nice_ticks(1, 250, 6) == [0, 50, 100, 150, 200, 250]
    assert nice_ticks(-0.8, 1.7, 4) == [-1, 0, 1, 2]
    assert nice_ticks(0.0, 0.9, 5) == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert nice_ticks(3.0, 3.0) == pytest.approx([2.5, 2.75, 3.0, 3.25, 3.5])  # a flat range gets a unit span
    with pytest.raises(ValueError, match="finite with lo <= hi"):
        nice_ticks(2.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        nice_ticks(0.0, float("nan"))


def test_tick_labels_use_the_decimals_of_the_step():
    assert tick_label(100.0, 50.0) == "100"
    assert tick_label(2.5, 2.5) == "2.5"
    assert tick_label(0.25, 0.25) == "0.25"
    assert tick_label(0.5, 0.5, "%") == "0.5%"
    assert tick_label(-0.0, 1.0, "%") == "0%"


def test_axes_map_data_to_the_box_and_plot_inside_it():
    c = Canvas(100, 60)
    ax = Axes(c, (10, 5, 90, 55), (0.0, 4.0), (1.0, 2.0))
    assert ax.px(0.0, 1.0) == (10, 55) and ax.px(4.0, 2.0) == (90, 5) and ax.px(2.0, 1.5) == (50, 30)
    ax.plot([0, 2, 4], [1.0, float("nan"), 2.0], (255, 0, 0))
    assert c.get(10, 55) == (255, 0, 0) and c.get(90, 5) == (255, 0, 0) and c.get(50, 30) == (255, 0, 0)
    assert faded((0, 100, 255), 0.5) == (128, 178, 255)
