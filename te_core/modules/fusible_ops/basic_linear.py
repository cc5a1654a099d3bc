"""ops.BasicLinear: Transformer Engine's fusible linear operation without bias, y = x W^T, as
te-core's Linear(bias=False).

The operation is te-core's Linear under the operation's arguments, so its GEMMs (FP8 under
te.autocast), weight-gradient fusion (main_grad) and tensor parallelism are the module's. Megatron-LM
builds it on the meta device and then assigns a module's weight to it (`op.weight = linear.weight`):
the weight is read at each forward, so the operation trains the Parameter it was given."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ...quantization.tensor import QuantizedTensor
from .._common import check_bool, check_input
from ..linear import Linear
from .._quantizer_roles import op_quantizer_roles
from ._op import TORCH_LINEAR_INIT, FusibleOperation, check_dtype, check_extra_inputs
from ._parallel import resolve_tensor_parallel_group

_NAME = "ops.BasicLinear"
_MODES = (None, "column", "row")


class BasicLinear(FusibleOperation, Linear):
    """y = x W^T (torch.nn.Linear with bias=False); parameter `weight`, (out, in) features.

    tensor_parallel_mode "column" splits out_features over the ranks of tensor_parallel_group (the
    world group where none is given), "row" splits in_features and sums the outputs, as te-core's
    Linear(parallel_mode=...) does; over a group of one rank there is no parallelism, as in
    Transformer Engine. Unlike TE's, in_features and out_features are this rank's share (te-core's
    Linear's); local_in_features and local_out_features name them as TE does. accumulate_into_main_grad:
    the weight gradient is added into weight.main_grad (Linear's fuse_wgrad_accumulation). Not
    provided: userbuffers_options (communication overlap). An input of another dtype than the weight's
    is cast to it outside torch.autocast, as in TE."""

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype=None,
                 tensor_parallel_mode: Optional[str] = None, tensor_parallel_group=None,
                 sequence_parallel: bool = False, rng_state_tracker_function: Optional[Callable] = None,
                 accumulate_into_main_grad: bool = False, userbuffers_options: Optional[dict] = None):
        if userbuffers_options is not None:
            raise NotImplementedError(f"{_NAME}: userbuffers_options={userbuffers_options!r} (communication overlap "
                                      "through userbuffers) is not supported by te-core; pass None (Megatron-LM: "
                                      "turn tp_comm_overlap off)")
        if tensor_parallel_mode not in _MODES:
            raise ValueError(f"{_NAME}: tensor_parallel_mode must be None, 'column' or 'row', got "
                             f"{tensor_parallel_mode!r}")
        sequence_parallel = check_bool(sequence_parallel, name="sequence_parallel", module=_NAME)
        group, size = None, 1
        if tensor_parallel_mode is not None:
            group, size = resolve_tensor_parallel_group(tensor_parallel_group, _NAME)
        mode = tensor_parallel_mode if size > 1 else None
        super().__init__(in_features, out_features, bias=False, params_dtype=check_dtype(dtype, _NAME),
                         device=device, init_method=TORCH_LINEAR_INIT, parallel_mode=mode, tp_group=group,
                         sequence_parallel=sequence_parallel and size > 1,
                         get_rng_state_tracker=rng_state_tracker_function,
                         fuse_wgrad_accumulation=accumulate_into_main_grad)
        self.tensor_parallel_mode, self.tensor_parallel_group, self.tensor_parallel_size = mode, group, size

    def get_quantizer_roles(self, mode: str):
        """TE's operation form (not the module's fwd= / num_quantizers=): the roles of the quantizers
        this operation owns, forward [input, weight] and backward [grad_output] per GEMM."""
        return op_quantizer_roles(self, mode)

    @property
    def local_in_features(self) -> int:
        return self.in_features

    @property
    def local_out_features(self) -> int:
        return self.out_features

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        self._materialize_meta_parameters()
        weight = self.weight
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{_NAME}: its weight has shape {tuple(weight.shape)} but the operation was built for "
                             f"(out_features, in_features) = ({self.out_features}, {self.in_features}); assign a "
                             "weight of that shape or build the operation for the weight's")
        check_input(input, self.in_features, name="input", module=_NAME, last_dim_name="in_features",
                    device=weight.device)
        if (not torch.is_autocast_enabled(input.device.type) and not isinstance(input, QuantizedTensor)
                and input.dtype != weight.dtype):
            # As Transformer Engine's operation: outside torch.autocast it computes in the weight's dtype
            # (te.Linear refuses the mix); the cast is differentiable, so the input's gradient keeps its dtype.
            input = input.to(weight.dtype)  # noqa: A001 (TE's name)
        return super().forward(input)
