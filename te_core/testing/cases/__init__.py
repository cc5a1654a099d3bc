"""Every conformance case, one module per group of op families; importing registers them."""
from __future__ import annotations

from typing import Dict, List

from ..inputs import CASES, Case
from . import activation, attention, cast, empty, gemm, norm, training  # noqa: F401  (registers the cases)


def cases_by_op() -> Dict[str, List[Case]]:
    by_op: Dict[str, List[Case]] = {}
    for c in CASES:
        by_op.setdefault(c.op, []).append(c)
    return by_op


__all__ = ["CASES", "Case", "cases_by_op"]
