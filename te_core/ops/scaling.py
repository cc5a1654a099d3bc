"""Contract: the delayed-scaling update of every amax history and scale of a step.

Each amax_histories[i] is a float32 (L, n_i) history whose row 0 holds this step's amaxes;
scales[i] is the float32 (n_i,) scale it drives; fp8_maxes[i] the largest value of its format.
Per column, as Transformer Engine's update kernel:
- a column whose row 0 is 0 recorded nothing this step (an empty or all-zero tensor, an unused
  slot): its scale and history are left as they are. Every other column (NaN in row 0 counts)
  is updated as follows.
- amax = the max over the history ("max"), taken like C's fmaxf from 0: a NaN entry is ignored,
  so one NaN step never freezes a scale for the window, while an inf entry wins; or row 0 as it
  is ("most_recent").
- new scale = (fp8_max * 2^-margin) / amax, in float32 and in that order (2^-margin rounded to
  float32, times fp8_max, then the quotient), where amax is finite and > 0; otherwise (0, inf,
  NaN) the old scale is kept. Then a scale that is inf (a tiny amax) becomes float32 max, and one
  below float32's smallest normal number (a huge amax under a large margin) becomes 2^-126, so
  that 1 / scale stays finite.
- the history rolls up by one row (row i takes row i + 1, the last row takes row 0) and row 0
  is zeroed.
All in place.
"""
from __future__ import annotations

from typing import List, Sequence

from torch import Tensor

from ._spec import contract_op


@contract_op("scaling", mutates=("amax_histories", "scales"))
def delayed_scaling_update(
    amax_histories: List[Tensor],
    scales: List[Tensor],
    fp8_maxes: Sequence[float],
    *,
    margin: float = 0.0,
    amax_compute_algo: str = "max",
) -> None:
    """In place, for all i at once (a backend may do it in one launch)."""
