"""benchmarks/tools/sharded_pytest.py: the GPU test parts' runner splits files into balanced shares,
reports each share's pytest summary and fails when a share fails."""
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "tools"))
import sharded_pytest  # noqa: E402


@pytest.fixture(autouse=True)
def plain_pytest(monkeypatch):
    """The runs these tests start load no installed pytest plugins: te-core's own (which imports
    torch) would cost each of them seconds, and the runner's behaviour does not depend on it."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


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
    bad = _write(tmp_path / "test_bad.py", "import pytest\n\n@pytest.mark.parametrize('case', ['x' * 60])\n"
                 "def test_b(case):\n    assert 2 + 2 == 5, 'the sum is off'\n")
    rc = sharded_pytest.main(["--jobs", "2", "--logs", str(tmp_path / "logs"), good, bad, "--", "-rf"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "1 passed" in out and "1 failed" in out
    assert "FAILED" in out and "test_b" in out
    assert "the sum is off" in out  # the message, beside a long test id
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


def test_by_test_deals_the_cases_out_in_turn():
    ids = [f"t.py::test_a[{i}]" for i in range(5)] + ["u.py::test_b"]
    parts = sharded_pytest.id_shares(ids, 4)
    assert parts == [["t.py::test_a[0]", "t.py::test_a[4]"], ["t.py::test_a[1]", "u.py::test_b"],
                     ["t.py::test_a[2]"], ["t.py::test_a[3]"]]
    assert sharded_pytest.id_shares(ids[:2], 4) == [["t.py::test_a[0]"], ["t.py::test_a[1]"]]  # no empty share


def test_collected_ids_are_the_lines_naming_tests():
    out = ("backends/x/test_a.py::test_one[1-2]\nbackends/x/test_a.py::test_two\n\n"
           "  <Function test_three>\n3 tests collected in 0.01s\n")
    assert sharded_pytest.collected_ids(out) == ["backends/x/test_a.py::test_one[1-2]",
                                                 "backends/x/test_a.py::test_two"]


def test_by_test_runs_every_test_once_across_shares(tmp_path, capsys):
    many = _write(tmp_path / "test_many.py", "import pytest\n\n@pytest.mark.parametrize('i', range(6))\n"
                  "def test_i(i):\n    assert i != 4\n")
    one = _write(tmp_path / "test_one.py", "def test_ok():\n    assert True\n")
    rc = sharded_pytest.main(["--jobs", "3", "--by-test", "--logs", str(tmp_path / "logs"), many, one, "--", "-rf"])
    out = capsys.readouterr().out
    assert rc == 1  # test_i[4] fails
    logs = [(tmp_path / "logs" / f"share-{k}.txt").read_text() for k in range(3)]
    assert sum(int(log.split(" passed")[0].split()[-1]) for log in logs if " passed" in log) == 6
    assert "test_i[4]" in out and "## 2 of test_many.py, 1 of test_one.py" in out
    assert sharded_pytest.main(["--jobs", "3", "--by-test", "--logs", str(tmp_path / "l2"), one]) == 0


@pytest.mark.parametrize("verbosity", ["-q", "-v", "-vv"])
def test_by_test_collects_the_same_whatever_verbosity_is_asked_for(tmp_path, capsys, verbosity):
    many = _write(tmp_path / "test_many.py", "import pytest\n\n@pytest.mark.parametrize('i', range(4))\n"
                  "def test_i(i):\n    assert i >= 0\n")
    rc = sharded_pytest.main(["--jobs", "2", "--by-test", "--logs", str(tmp_path / "logs"), many, "--", verbosity])
    assert rc == 0, capsys.readouterr().out
    logs = [(tmp_path / "logs" / f"share-{k}.txt").read_text() for k in range(2)]
    assert sum(int(re.search(r"(\d+) passed", log).group(1)) for log in logs) == 4, logs


def test_by_test_with_nothing_collected_fails_and_says_so(tmp_path, capsys):
    empty = _write(tmp_path / "test_empty.py", "x = 1\n")
    assert sharded_pytest.main(["--by-test", "--logs", str(tmp_path / "logs"), empty]) == 1
    assert "collecting the tests failed" in capsys.readouterr().out


def test_collected_ids_name_the_given_files_absolutely(tmp_path):
    f = _write(tmp_path / "test_a.py", "")
    assert sharded_pytest.absolute("test_a.py::test_x[1]", [f]) == os.path.abspath(f) + "::test_x[1]"
    assert sharded_pytest.absolute(f"{os.path.basename(tmp_path)}/test_a.py::t", [f]) == os.path.abspath(f) + "::t"
    with pytest.raises(RuntimeError, match="in none of the files given"):
        sharded_pytest.absolute("other/test_b.py::t", [f])
