"""ops.L2Normalization: Transformer Engine's parameter-free y = x / sqrt(sum(x^2) + eps) over the
last dimension (its attention's query-key normalization), as te-core's MultiheadAttention computes
its qk_norm_type="L2Normalization": in float32, rounded once to the input's dtype."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .._common import check_eps, check_warmup_sizes
from ..multihead_attention import L2Normalization as L2NormalizationModule
from ._op import check_extra_inputs
from .operation import BasicOperation

_NAME = "ops.L2Normalization"


class L2Normalization(BasicOperation):
    """x / sqrt(sum(x^2) + eps) over the last dimension. seq_length and micro_batch_size size
    Transformer Engine's warm-up of its TorchScript kernels and change no result: taken and
    checked, with no effect."""

    def __init__(self, *, eps: float = 1e-6, seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None):
        super().__init__()
        check_warmup_sizes(_NAME, seq_length, micro_batch_size)
        self.eps = check_eps(eps, module=_NAME)
        self._norm = L2NormalizationModule(self.eps)

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        if not isinstance(input, Tensor) or not input.is_floating_point() or input.dim() == 0:
            got = f"a {input.dim()}-dimensional {input.dtype} tensor" if isinstance(input, Tensor) else \
                type(input).__name__
            raise TypeError(f"{_NAME}: input must be a floating-point tensor with at least one dimension (the last is "
                            f"normalized), got {got}")
        self._norm.eps = self.eps
        return self._norm(input)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
