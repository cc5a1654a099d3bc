"""Run pytest over test files split into shares, one process per share, side by side on one GPU.

    python benchmarks/tools/sharded_pytest.py --jobs 4 --timeout 540 [--by-test] [--logs DIR] FILES... [-- ARGS...]

The GPU test suites are bound by the host (Triton compiles, small launches), not by the GPU, so
processes sharing one GPU finish together in about the time of the largest share. Shares are
balanced by file size; with --by-test the tests are collected first (one pytest --collect-only)
and dealt out one by one, so that one large file no longer sets the time of its share (each
share pays its own imports and compiles). Each share's full output goes to DIR/share-<i>.txt;
this prints one line per share (its files and pytest's summary line, or why it has none) and
exits non-zero when any share failed, was cut by the time limit or crashed, or when the
collection found no test or failed.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import List


def shares(files: List[str], jobs: int) -> List[List[str]]:
    """files split into at most `jobs` shares of about equal total size, largest files first."""
    parts: List[List[str]] = [[] for _ in range(max(1, min(jobs, len(files))))]
    sizes = [0] * len(parts)
    for f in sorted(files, key=lambda f: (-os.path.getsize(f), f)):
        k = sizes.index(min(sizes))
        parts[k].append(f)
        sizes[k] += os.path.getsize(f)
    return [sorted(p) for p in parts if p]


def id_shares(test_ids: List[str], jobs: int) -> List[List[str]]:
    """test ids dealt into at most `jobs` shares in turn: neighbours (the cases of one test, the
    tests of one file) land in different shares, so no share gets all of a slow file."""
    count = max(1, min(jobs, len(test_ids)))
    return [test_ids[k::count] for k in range(count) if test_ids[k::count]]


def collected_ids(output: str) -> List[str]:
    """The test ids in the output of `pytest --collect-only -q`: its lines naming a test."""
    return [line.strip() for line in output.splitlines() if "::" in line and not line.startswith((" ", "<"))]


def collect(files: List[str], pytest_args: List[str]) -> List[str]:
    """The ids of the tests pytest collects from `files` with `pytest_args` (-k, -m select).
    Verbosity flags are left out: the ids are the lines of exactly one -q (-qq prints counts per
    file, -v a tree)."""
    selecting = [a for a in pytest_args if not re.fullmatch(r"-[qv]+|--quiet|--verbose", a)]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *selecting, *files], capture_output=True, text=True)
    ids = collected_ids(done.stdout)
    if done.returncode not in (0, 5) or not ids:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"collecting the tests failed (pytest exit {done.returncode}, {len(ids)} tests):\n{tail}")
    return [absolute(test_id, files) for test_id in ids]


def absolute(test_id: str, files: List[str]) -> str:
    """`test_id` with its file as the absolute path of the given file it names: pytest names a
    test's file from its rootdir, which need not be the directory the shares run in."""
    name, sep, rest = test_id.partition("::")
    for f in files:
        path = os.path.abspath(f)
        if path == os.path.abspath(name) or path.endswith(os.sep + os.path.normpath(name)):
            return path + sep + rest
    raise RuntimeError(f"pytest collected {test_id!r}, which is in none of the files given")


def summary(log: str, rc: int, timeout: int) -> str:
    """pytest's closing summary line, or what stopped the share before it printed one."""
    if rc == 124:
        return f"TIMED OUT after {timeout} s: partial (raise --timeout)"
    lines = [line.strip("= \n") for line in open(log, errors="replace")]
    done = [line for line in lines if " in " in line and any(w in line for w in ("passed", "failed", "error", "skipped", "deselected"))]
    return done[-1] if done else f"no pytest summary (exit {rc}): see {log}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4, help="processes (shares), default 4")
    ap.add_argument("--timeout", type=int, default=540, help="seconds per share before it is stopped")
    ap.add_argument("--logs", default=None, help="folder for each share's output (default: a new temporary one)")
    ap.add_argument("--by-test", action="store_true", help="split the collected tests, not the files, into shares")
    ap.add_argument("files", nargs="+", help="test files; pytest's own arguments go after --")
    argv = sys.argv[1:] if argv is None else argv
    pytest_args: List[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, pytest_args = argv[:at], argv[at + 1:]
    # the shares run with -q already; another would hide pytest's summary line, which this reports
    pytest_args = [a for a in pytest_args if not re.fullmatch(r"-q+|--quiet", a)]
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.timeout < 1:
        ap.error(f"--jobs and --timeout must be at least 1, got {args.jobs} and {args.timeout}")
    missing = [f for f in args.files if not os.path.isfile(f)]
    if missing:
        ap.error(f"not a file: {', '.join(missing)} (pass test files, not folders: e.g. tests/modules/test_*.py)")
    logs = args.logs or tempfile.mkdtemp(prefix="sharded-pytest-")
    os.makedirs(logs, exist_ok=True)
    started, t0 = [], time.monotonic()
    if args.by_test:
        try:
            parts = id_shares(collect(args.files, pytest_args), args.jobs)
        except RuntimeError as err:
            print(err)
            return 1
    else:
        parts = shares(args.files, args.jobs)
    for i, part in enumerate(parts):
        log = os.path.join(logs, f"share-{i}.txt")
        with open(log, "w") as out:
            cmd = ["timeout", str(args.timeout), sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   *pytest_args, *part]
            # a wide terminal: pytest drops a failure's message from its summary line where the
            # line would pass the width, and test ids with parameters are long
            env = {**os.environ, "COLUMNS": os.environ.get("COLUMNS", "400")}
            started.append((part, log, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)))
    worst = 0
    for part, log, proc in started:
        rc = proc.wait()
        worst = max(worst, 0 if rc in (0, 5) else 1)  # 5: every test of the share deselected
        names = _named(part) if args.by_test else " ".join(os.path.basename(f) for f in part)
        print(f"## {names}\n{summary(log, rc, args.timeout)}  [share done at {time.monotonic() - t0:.0f} s]")
        if rc not in (0, 5, 124):
            failed = [line.rstrip() for line in open(log, errors="replace") if line.startswith(("FAILED", "ERROR"))]
            print("\n".join(failed[:40]))
    return worst


def _named(test_ids: List[str]) -> str:
    """A share of test ids, by how many it has from which files."""
    files: dict = {}
    for test_id in test_ids:
        name = os.path.basename(test_id.split("::")[0])
        files[name] = files.get(name, 0) + 1
    return ", ".join(f"{n} of {name}" for name, n in files.items())


if __name__ == "__main__":
    sys.exit(main())
