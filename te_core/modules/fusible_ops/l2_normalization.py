"""ops.L2Normalization: Transformer Engine's parameter-free y = x / sqrt(sum(x^2) + eps) over the
last dimension, its attention's query-key normalization: MultiheadAttention's q_norm and k_norm
with qk_norm_type="L2Normalization" are one instance of it, as in TE."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._common import check_eps, check_warmup_sizes
from ._op import check_extra_inputs
from .operation import BasicOperation

_NAME = "ops.L2Normalization"


class L2Normalization(BasicOperation):
    """x / sqrt(sum(x^2) + eps) over the last dimension, computed in float32 (its gradient too) and
    rounded once to the input's dtype. It holds no quantization state and quantizes nothing, under
    te.autocast too: TE's has no quantizers. seq_length and micro_batch_size size Transformer
    Engine's warm-up of its TorchScript kernels and change no result: taken and checked, with no effect."""

    def __init__(self, *, eps: float = 1e-6, seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None):
        super().__init__()
        check_warmup_sizes(_NAME, seq_length, micro_batch_size)
        self.eps = check_eps(eps, module=_NAME)

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        if not isinstance(input, Tensor) or not input.is_floating_point() or input.dim() == 0:
            got = f"a {input.dim()}-dimensional {input.dtype} tensor" if isinstance(input, Tensor) else \
                type(input).__name__
            raise TypeError(f"{_NAME}: input must be a floating-point tensor with at least one dimension (the last is "
                            f"normalized), got {got}")
        x32 = input.float()
        return (x32 * torch.rsqrt(x32.square().sum(dim=-1, keepdim=True) + self.eps)).to(input.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
