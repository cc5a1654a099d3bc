"""Contract: the delayed-scaling update of every amax history and scale of a step.

Each amax_histories[i] is a float32 (L, n_i) history whose row 0 holds this step's amaxes;
scales[i] is the float32 (n_i,) scale it drives; fp8_maxes[i] the largest value of its format.
Per column, as Transformer Engine: amax = max over the history ("max") or row 0
("most_recent"); new scale = fp8_max / amax / 2^margin; where amax is 0, inf or NaN the old
scale is kept; a scale that overflows to inf becomes float32 max. Then each history rolls up
by one row (row i takes row i + 1, the last row takes row 0) and row 0 is zeroed. All in place.
"""
from __future__ import annotations

from typing import List, Sequence

from torch import Tensor

from ._spec import contract_op


@contract_op("scaling")
def delayed_scaling_update(
    amax_histories: List[Tensor],
    scales: List[Tensor],
    fp8_maxes: Sequence[float],
    *,
    margin: float = 0.0,
    amax_compute_algo: str = "max",
) -> None:
    """In place, for all i at once (a backend may do it in one launch)."""
