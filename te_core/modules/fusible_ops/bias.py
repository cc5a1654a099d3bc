"""ops.Bias: Transformer Engine's fusible bias, y = x + b, b along the input's last dimension.

An addition in torch (autograd sums the gradient over the rows), as TE's unfused operation: a
bias fused into a GEMM is te-core's Linear's (bias=True), not a sequence of operations."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .._common import check_bool, check_input, check_positive, resolve_device, resolve_params_dtype
from .._reset import DeferredInit, resetting
from ._op import EmptyExtraState, FusibleOperation, check_dtype, check_extra_inputs
from ._parallel import resolve_tensor_parallel_group

_NAME = "ops.Bias"


class Bias(EmptyExtraState, FusibleOperation, DeferredInit, nn.Module):
    """y = x + bias, parameter `bias` of `size` values (zeros at first). tensor_parallel: the input
    and the bias are split along the last dimension over tensor_parallel_group (the world group
    where none is given), so this rank holds local_size = size / ranks of them."""

    def __init__(self, size: int, *, device=None, dtype=None, tensor_parallel: bool = False,
                 tensor_parallel_group=None):
        super().__init__()
        size = check_positive(size, name="size", module=_NAME)
        group, ranks = (None, 1)
        if check_bool(tensor_parallel, name="tensor_parallel", module=_NAME):
            group, ranks = resolve_tensor_parallel_group(tensor_parallel_group, _NAME)
        if size % ranks:
            raise ValueError(f"{_NAME}: size={size} is not divisible by the {ranks} ranks of tensor_parallel_group; "
                             "each rank holds size / ranks of the bias")
        self.tensor_parallel, self.tensor_parallel_group, self.tensor_parallel_size = ranks > 1, group, ranks
        self.local_size = size // ranks
        factory = dict(device=resolve_device(device), dtype=resolve_params_dtype(check_dtype(dtype, _NAME)))
        self.bias = nn.Parameter(torch.empty(self.local_size, **factory))
        self._initialize(materialize=False)

    def _initialize(self, *, materialize: bool = True) -> None:
        with resetting(self, materialize=materialize) as params:
            params["bias"].zero_()

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        self._materialize_meta_parameters()
        bias = self.bias
        if tuple(bias.shape) != (self.local_size,):
            raise ValueError(f"{_NAME}: its bias has shape {tuple(bias.shape)} but the operation was built for "
                             f"{self.local_size} values; assign a bias of that many or build the operation for it")
        check_input(input, self.local_size, name="input", module=_NAME, last_dim_name="the bias's size",
                    device=bias.device)
        return input + bias

    def extra_repr(self) -> str:
        return f"size={self.local_size * self.tensor_parallel_size}"
