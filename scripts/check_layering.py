#!/usr/bin/env python3
"""The layering rule: te_core/, the device-independent layer, holds no vendor code.

Vendor code lives in the backends; te_core reaches a device only through the selected backend
(its device module, its `device`, its capabilities) and runs ops only through the registry.

Usage: python scripts/check_layering.py [PATH ...]   (default: this repository's te_core/)
Prints every offending line as `path:line: text  [rule]`; exits 1 if there is one, else 0.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Iterator, List

RULES = (
    (re.compile(r"\btorch\.(cuda|musa)\b"), "a vendor device module: use get_backend().device_module"),
    (re.compile(r"^\s*(import|from)\s+torch_musa\b"), "a vendor library: import it in its backend"),
    (re.compile(r"^\s*(import|from)\s+(te_backend_\w+|te_triton|triton)\b"),
     "a backend's package: call ops through te_core.ops, the registry picks the backend"),
    (re.compile(r"[\"'](cuda|musa)(:[0-9]+)?[\"']"), "a vendor device string: use get_backend().device"),
)
DEFAULT = Path(__file__).resolve().parents[1] / "te_core"


def violations(path: Path) -> Iterator[str]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for pattern, rule in RULES:
            if pattern.search(line):
                yield f"{path}:{number}: {line.strip()}  [{rule}]"


def main(argv: List[str]) -> int:
    roots = [Path(arg) for arg in argv] or [DEFAULT]
    missing = [str(root) for root in roots if not root.exists()]
    if missing:
        print(f"check_layering: no such file or directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    files = sorted(p for root in roots for p in ([root] if root.is_file() else root.rglob("*.py")))
    found = [line for path in files for line in violations(path)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
