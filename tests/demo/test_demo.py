"""The demo end to end with a tiny setting, and its pieces (data, PNG writer, report)."""

import json
import math
import struct
import zlib

import pytest
import torch

from te_core.demo import main
from te_core.demo.data import BatchSampler, load_corpus, stdlib_sources, stdlib_dir
from te_core.demo.png import plot_curves
from te_core.demo.report import final_gap, side_by_side, smoothed


def test_demo_tiny_run_writes_sensible_json_and_png(tmp_path, capsys):
    rc = main(["--size", "tiny", "--steps", "24", "--recipe", "current", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    record = json.loads((tmp_path / "demo_run.json").read_text())
    assert record["backend"] == "reference" and record["recipe"] == "current"
    bf16, fp8 = record["runs"]["bf16"]["losses"], record["runs"]["fp8"]["losses"]
    assert len(bf16) == len(fp8) == 24
    assert abs(bf16[0] - math.log(256)) < 0.5  # starts near a uniform guess over bytes
    assert sum(bf16[-4:]) / 4 < bf16[0] - 1.0 and sum(fp8[-4:]) / 4 < fp8[0] - 1.0  # both learn
    assert bf16 != fp8  # the FP8 run really quantized
    assert abs(record["final_gap"]["gap"]) < 0.25
    assert record["runs"]["fp8"]["tokens_per_s"] > 0
    png = (tmp_path / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "bf16 loss" in out and "fp8 loss" in out and "tokens/s" in out


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--recipe", "fp4"])
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
    assert main(["--steps", "1"]) == 2
    assert "--steps must be at least 2" in capsys.readouterr().err
    assert main(["--backend", "no-such-backend", "--steps", "2"]) == 2
    assert "--backend no-such-backend" in capsys.readouterr().err


def test_corpus_is_stdlib_source_and_batches_are_reproducible():
    files = stdlib_sources(stdlib_dir())
    assert any(f.endswith("os.py") for f in files)
    tokens, n_files = load_corpus(200_000)
    assert tokens.dtype == torch.uint8 and tokens.numel() == 200_000 and n_files >= 1
    a = BatchSampler(tokens, 3, 16, seed=5).next(torch.device("cpu"))
    b = BatchSampler(tokens, 3, 16, seed=5).next(torch.device("cpu"))
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])


def test_png_writer_produces_a_valid_image_with_the_curves():
    data, colors = plot_curves({"a": [3.0, 2.0, 1.5], "b": [3.1, 2.2, 1.4]}, width=120, height=80)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (120, 80)
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41 : 41 + idat_len])
    assert len(raw) == height * (1 + 3 * width)
    assert bytes(colors[0]) in raw and bytes(colors[1]) in raw  # both curves were drawn


def test_report_helpers():
    assert smoothed([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    gap = final_gap([4.0] * 9 + [2.0], [4.0] * 9 + [2.5])
    assert gap["steps_averaged"] == 1 and gap["gap"] == pytest.approx(0.5)
    table = side_by_side([5.0, 4.0, 3.0], [5.0, 4.1, 3.2], rows=3)
    assert table.count("\n") == 3 and "+0.2000" in table
