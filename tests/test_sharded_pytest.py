"""benchmarks/tools/sharded_pytest.py: the GPU test parts' runner splits files into balanced shares,
reports each share's pytest summary and fails when a share fails."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "tools"))
import sharded_pytest  # noqa: E402


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_shares_balance_by_size_and_keep_every_file(tmp_path):
    files = [_write(tmp_path / f"test_{i}.py", "#" * size) for i, size in enumerate([900, 500, 400, 300, 100])]
    parts = sharded_pytest.shares(files, 2)
    assert sorted(f for p in parts for f in p) == sorted(files)  # nothing lost, nothing twice
    totals = sorted(sum(os.path.getsize(f) for f in p) for p in parts)
    assert totals == [1000, 1200]  # largest first into the lighter share
    assert len(sharded_pytest.shares(files[:1], 4)) == 1  # never an empty share


def test_a_failing_share_fails_the_run_and_names_its_failures(tmp_path, capsys):
    good = _write(tmp_path / "test_good.py", "def test_a():\n    assert 1 + 1 == 2\n")
    bad = _write(tmp_path / "test_bad.py", "def test_b():\n    assert 2 + 2 == 5\n")
    rc = sharded_pytest.main(["--jobs", "2", "--logs", str(tmp_path / "logs"), good, bad, "--", "-rf"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "1 passed" in out and "1 failed" in out
    assert "FAILED" in out and "test_b" in out
    assert sharded_pytest.main(["--jobs", "2", "--logs", str(tmp_path / "logs2"), good]) == 0


def test_folders_and_bad_counts_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        sharded_pytest.main([str(tmp_path)])  # a folder, not a file
    with pytest.raises(SystemExit):
        sharded_pytest.main(["--jobs", "0", __file__])


def test_a_share_cut_by_its_limit_says_so(tmp_path):
    log = _write(tmp_path / "share-0.txt", "....\n")
    assert "TIMED OUT after 9 s" in sharded_pytest.summary(log, 124, 9)
    assert "no pytest summary (exit 3)" in sharded_pytest.summary(log, 3, 9)
