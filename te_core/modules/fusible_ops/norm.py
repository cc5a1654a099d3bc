"""ops.LayerNorm and ops.RMSNorm: Transformer Engine's fusible normalizations, as te-core's
te.LayerNorm and te.RMSNorm modules under the operations' arguments.

Parameters `weight` (and LayerNorm's `bias`) as in TE; a module's norm parameters assigned to an
operation built on the meta device (Megatron-LM: `op.weight = linear.layer_norm_weight`) are read
at each forward, so the operation trains them."""
from __future__ import annotations

from typing import Sequence, Union

from torch import Tensor

from ..layernorm import LayerNorm as LayerNormModule
from ..layernorm import RMSNorm as RMSNormModule
from ._op import FusibleOperation, check_dtype, check_extra_inputs


class _NormOperation(FusibleOperation):
    """The operations' constructor and forward around te-core's norm module (the next base)."""

    def __init__(self, normalized_shape: Union[int, Sequence[int]], *, eps: float = 1e-5, device=None, dtype=None,
                 zero_centered_gamma: bool = False, sm_margin=0):
        super().__init__(normalized_shape, eps=eps, params_dtype=check_dtype(dtype, self._name),
                         zero_centered_gamma=zero_centered_gamma, device=device, sm_margin=sm_margin)

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        self._materialize_meta_parameters()
        for name, param in self._parameters.items():
            if param is not None and tuple(param.shape) != self.normalized_shape:
                raise ValueError(f"{self._name}: its {name} has shape {tuple(param.shape)} but the operation was "
                                 f"built for normalized_shape={self.normalized_shape}; assign a {name} of that shape "
                                 "or build the operation for it")
        return super().forward(input)


class LayerNorm(_NormOperation, LayerNormModule):
    """(x - mean) / sqrt(var + eps) * weight + bias over the trailing normalized_shape dimensions
    (weight + 1 with zero_centered_gamma). sm_margin is taken and has no effect (te-core's norms
    reserve no multiprocessors)."""


class RMSNorm(_NormOperation, RMSNormModule):
    """x / sqrt(mean(x^2) + eps) * weight over the trailing normalized_shape dimensions (weight + 1
    with zero_centered_gamma). sm_margin is taken and has no effect."""
