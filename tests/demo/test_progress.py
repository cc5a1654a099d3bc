"""Progress bar: speed, elapsed time and ETA, drawn at the right moments."""

import io
import os
import math

import pytest

from te_core.demo.progress import REDRAW_S, ProgressBar, eta_seconds, format_duration


def test_format_duration():
    assert format_duration(0) == "0s"
    assert format_duration(42.4) == "42s"
    assert format_duration(59.6) == "1m00s"
    assert format_duration(187) == "3m07s"
    assert format_duration(7500) == "2h05m"
    for unknown in (math.nan, math.inf, -1.0):
        assert format_duration(unknown) == "?"


def test_eta_at_the_mean_pace():
    assert eta_seconds(5, 20, 10.0) == pytest.approx(30.0)
    assert eta_seconds(20, 20, 10.0) == 0.0
    assert eta_seconds(0, 20, 1.0) == math.inf


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_log_output_draws_a_line_per_tenth_with_speed_and_eta():
    clock, out = FakeClock(), io.StringIO()
    bar = ProgressBar("fp8", 20, stream=out, clock=clock)
    for step in range(1, 21):
        clock.now += 0.5
        bar.update(step, tokens_per_step=100, loss=2.5)
    lines = out.getvalue().splitlines()
    # steps 1, 2, 4, ..., 20: one line each time a new tenth of the run starts
    assert len(lines) == 11
    assert lines[5].startswith("  fp8 [##########..........] 10/20 loss 2.5 |")
    assert lines[5].endswith("| 2 steps/s 200 tok/s | 5s, eta 5s")
    assert lines[-1].endswith("| 10s, eta 0s")


def test_terminal_redraws_in_place_at_most_every_redraw_interval():
    clock, out = FakeClock(), Tty()
    bar = ProgressBar("bf16", 100, stream=out, clock=clock)
    drawn = []
    for step in range(1, 101):
        clock.now += REDRAW_S / 4
        if bar.due(step):
            drawn.append(step)
        bar.update(step, loss=1.0)
    bar.close()
    assert drawn[0] == 1 and drawn[-1] == 100
    assert all(b - a >= 4 for a, b in zip(drawn, drawn[1:-1]))  # one draw per REDRAW_S at most
    text = out.getvalue()
    assert text.count("\r") == len(drawn) and text.endswith("\n") and "eta" in text


def test_disabled_bar_writes_nothing():
    out = io.StringIO()
    bar = ProgressBar("bf16", 3, stream=out, enabled=False)
    bar.update(3, loss=1.0)
    bar.close()
    assert out.getvalue() == "" and not bar.due(3)


def test_terminal_lines_fit_the_terminal_width(monkeypatch):
    monkeypatch.setattr("shutil.get_terminal_size", lambda *a, **k: os.terminal_size((40, 24)))
    out = Tty()
    ProgressBar("bf16", 10, stream=out).update(10, tokens_per_step=4096, loss=2.0)
    drawn = out.getvalue().split("\r")[1].replace("\033[K", "")
    assert len(drawn) == 39 and drawn.startswith(" bf16 [####################] 10/10")
