"""`te-core certify NAME`: run the conformance kit against a backend and print its op coverage.

The kit is `python -m pytest --pyargs te_core.testing --te-backend NAME`; its outcomes are read
back from pytest's JUnit XML report, so the table below shows exactly what the kit decided.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Sequence

_OP_TEST = "test_op_matches_reference["
FALLBACK = "fallback to reference"


def kit_command(name: str, extra: Sequence[str] = ()) -> List[str]:
    return [sys.executable, "-m", "pytest", "--pyargs", "te_core.testing", "--te-backend", name,
            "-q", "-p", "no:cacheprovider", *extra]


def outcomes(report: Path) -> Dict[str, Dict[str, int]]:
    """op -> {"passed": n, "declined": n, "fallback": n, "failed": n} from a JUnit XML report."""
    counts: Dict[str, Dict[str, int]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test = case.get("name", "")
        if not test.startswith(_OP_TEST):
            continue
        op = test[len(_OP_TEST):].split("[", 1)[0]
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            kind = "failed"
        elif skipped is not None:
            kind = "fallback" if FALLBACK in (skipped.get("message") or "") else "declined"
        else:
            kind = "passed"
        row = counts.setdefault(op, {"passed": 0, "declined": 0, "fallback": 0, "failed": 0})
        row[kind] += 1
    return counts


def status(row: Dict[str, int]) -> str:
    if row["failed"]:
        return "FAILING"
    if row["passed"] or row["declined"]:
        return "native" + (" (some cases declined)" if row["declined"] else "")
    return "fallback (not declared)"


def table(name: str, counts: Dict[str, Dict[str, int]]) -> str:
    from ..ops import CONTRACT

    lines = [f"Coverage of backend {name!r} (cases: passed / declined / failed):", "",
             f"  {'op':<38} {'family':<11} {'cases':<11} status"]
    for op, contract_op in CONTRACT.items():
        row = counts.get(op)
        if row is None:
            lines.append(f"  {op:<38} {contract_op.family:<11} {'-':<11} not run")
            continue
        cases = f"{row['passed']}/{row['declined']}/{row['failed']}"
        lines.append(f"  {op:<38} {contract_op.family:<11} {cases:<11} {status(row)}")
    native = sum(1 for row in counts.values() if row["passed"] or row["declined"] or row["failed"])
    failing = sum(1 for row in counts.values() if row["failed"])
    fallback = len(counts) - native
    summary = f"  {len(CONTRACT)} ops: {native} native ({failing} failing), {fallback} fall back to the reference backend"
    not_run = len(set(CONTRACT) - set(counts))
    lines += ["", summary + (f", {not_run} not run" if not_run else "")]
    return "\n".join(lines)


def main(name: str, extra: Sequence[str] = ()) -> int:
    """Run the kit (its output streams through), then print the coverage table; pytest's exit code."""
    from ..backend import get_backend

    get_backend(name)  # a backend that is not installed or usable: one clear BackendError, no kit run
    with tempfile.TemporaryDirectory(prefix="te-core-certify-") as tmp:
        report = Path(tmp) / "kit.xml"
        command = kit_command(name, [*extra, f"--junitxml={report}"])
        print("$ python " + " ".join(command[1:7]), flush=True)
        code = subprocess.call(command)
        counts = outcomes(report) if report.exists() else {}
    print()
    print(table(name, counts))
    if code != 0:
        verdict = f"NOT certified: the kit exited with {code}"
    elif extra:
        verdict = f"the kit passed with {' '.join(extra)}, a partial run (certify runs it without extra arguments)"
    else:
        verdict = "certified: the kit passed"
    print(f"\nbackend {name!r}: {verdict}")
    return code
