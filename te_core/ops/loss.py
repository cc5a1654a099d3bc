"""Contract: cross-entropy over a vocabulary, differentiable.

logits (N, V) in any float dtype, target (N,) int64. Computed in float32 with the
log-sum-exp trick; `label_smoothing` mixes the one-hot target with the uniform distribution
as torch.nn.functional.cross_entropy does; targets equal to ignore_index contribute nothing
(and "mean" divides by the number of non-ignored targets). reduction "mean", "sum" or
"none" ((N,) float32). The gradient w.r.t. logits has the logits' dtype.

A target outside [0, V) that is not ignore_index is an error, never a finite wrong loss:
the reference raises ValueError (under torch.compile, where a graph cannot raise on values,
it makes the row NaN as below); a backend that cannot check without synchronizing with the
device makes that row's loss and gradient NaN instead (so "mean" and "sum" are NaN).
"""
from __future__ import annotations

from torch import Tensor

from ._spec import contract_op


@contract_op("loss")
def cross_entropy(
    logits: Tensor, target: Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean"
) -> Tensor:
    """Returns the loss (0-dim for mean/sum), float32."""
