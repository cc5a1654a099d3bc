"""ops.Linear: Transformer Engine's fusible y = x W^T + b, a FusedOperation of basic operations:

    no tensor parallelism, "column"   BasicLinear (which gathers a sequence-parallel input), Bias
    "row"                             BasicLinear over this rank's input features, Bias,
                                      AllReduce (ReduceScatter under sequence parallelism)

so its GEMMs run as te-core's Linear's (FP8 under te.autocast). As in TE, in_features and
out_features are the whole layer's, and under "row" each rank adds a whole bias of its own before
the sum over the ranks (the layer's bias is the ranks' biases summed).

Its parameters `weight` and `bias` are the basic operations' (assigning one assigns theirs), and
state dicts hold them under the basic operations' keys only (basic_ops.0.weight, basic_ops.1.bias),
as Transformer Engine's checkpoints do."""
from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor, nn

from .._common import check_bool, check_divisible, check_positive
from .basic_linear import _MODES, BasicLinear
from .bias import Bias
from .communication import AllReduce, ReduceScatter
from .operation import FusedOperation
from ._parallel import resolve_tensor_parallel_group

_NAME = "ops.Linear"


class Linear(FusedOperation):
    """y = x W^T + b (torch.nn.Linear); `weight` (out_features, in_features) and, with bias=True,
    `bias` (out_features), split over the ranks of tensor_parallel_group under tensor_parallel_mode
    (the world group where none is given; none over a group of one rank). accumulate_into_main_grad:
    the weight gradient goes into weight.main_grad, as BasicLinear's does."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, device=None, dtype=None,
                 tensor_parallel_mode: Optional[str] = None, tensor_parallel_group=None,
                 sequence_parallel: bool = False, rng_state_tracker_function: Optional[Callable] = None,
                 accumulate_into_main_grad: bool = False):
        in_features = check_positive(in_features, name="in_features", module=_NAME)
        out_features = check_positive(out_features, name="out_features", module=_NAME)
        has_bias = check_bool(bias, name="bias", module=_NAME)
        sequence_parallel = check_bool(sequence_parallel, name="sequence_parallel", module=_NAME)
        if tensor_parallel_mode not in _MODES:
            raise ValueError(f"{_NAME}: tensor_parallel_mode must be None, 'column' or 'row', got "
                             f"{tensor_parallel_mode!r}")
        group, ranks = (None, 1)
        if tensor_parallel_mode is not None:
            group, ranks = resolve_tensor_parallel_group(tensor_parallel_group, _NAME)
        mode = tensor_parallel_mode if ranks > 1 else None
        sequence_parallel = sequence_parallel and mode is not None
        factory = dict(device=device, dtype=dtype)
        common = dict(factory, rng_state_tracker_function=rng_state_tracker_function,
                      accumulate_into_main_grad=accumulate_into_main_grad)
        if mode == "row":
            local_in = check_divisible(in_features, ranks, what="in_features", by="the ranks of tensor_parallel_group",
                                       module=_NAME)
            ops = [BasicLinear(local_in, out_features, **common)]
            if has_bias:  # a whole bias on each rank, summed by the reduction (Transformer Engine's layout)
                ops.append(Bias(out_features * ranks, tensor_parallel=True, tensor_parallel_group=group, **factory))
            ops.append(ReduceScatter(group) if sequence_parallel else AllReduce(group))
        else:
            ops = [BasicLinear(in_features, out_features, tensor_parallel_mode=mode, tensor_parallel_group=group,
                               sequence_parallel=sequence_parallel, **common)]
            if has_bias:
                ops.append(Bias(out_features, tensor_parallel=mode is not None, tensor_parallel_group=group, **factory))
        super().__init__(ops)
        self.in_features, self.out_features = in_features, out_features
        self.tensor_parallel_mode, self.tensor_parallel_group, self.tensor_parallel_size = mode, group, ranks
        self.sequence_parallel = sequence_parallel
        self._bias_idx = 1 if has_bias else None
        self._take_parameters()

    def _take_parameters(self) -> None:
        """Register the basic operations' weight and bias as this operation's, after anything that
        replaced them there (meta parameters materialized, reset_parameters)."""
        self._parameters["weight"] = self.basic_ops[0].weight
        self._parameters["bias"] = None if self._bias_idx is None else self.basic_ops[self._bias_idx].bias

    def register_parameter(self, name: str, param: Optional[nn.Parameter]) -> None:
        """Also the basic operation's parameter: `op.weight = p` (Megatron-LM's assignment of a
        module's weight to an operation built on meta) trains p."""
        if name == "bias" and self._bias_idx is None and param is not None:
            raise ValueError(f"{_NAME}: was built with bias=False, so it has no bias to assign; build it with "
                             "bias=True")
        super().register_parameter(name, param)
        if name == "weight":
            self.basic_ops[0].weight = param
        elif name == "bias" and self._bias_idx is not None:
            self.basic_ops[self._bias_idx].bias = param

    def _apply(self, fn, recurse: bool = True):
        # A conversion that makes new tensors (to_empty off the meta device) would give this
        # operation's references copies of their own, which the GEMM never reads: convert only
        # the basic operations' parameters, then refer to them again
        self._parameters["weight"] = self._parameters["bias"] = None
        try:
            return super()._apply(fn, recurse)
        finally:
            self._take_parameters()

    def reset_parameters(self) -> None:
        for op in self.basic_ops:
            if hasattr(op, "reset_parameters"):
                op.reset_parameters()
        self._take_parameters()

    def forward(self, input: Tensor, *extra_inputs: Tensor, basic_op_kwargs=None):  # noqa: A002 (TE's name)
        for op in self.basic_ops:
            op._materialize_meta_parameters()
        self._take_parameters()
        return super().forward(input, *extra_inputs, basic_op_kwargs=basic_op_kwargs)

    def _save_to_state_dict(self, destination, prefix: str, keep_vars: bool) -> None:
        """Nothing of its own: its basic operations save the parameters under their keys."""

    def _load_from_state_dict(self, state_dict, prefix: str, *args, **kwargs) -> None:
        # Transformer Engine's checkpoints hold the basic operations' keys only: loading takes
        # `weight` / `bias` from there (the basic operations then load the same values)
        for name, key in (("weight", "basic_ops.0.weight"), ("bias", f"basic_ops.{self._bias_idx}.bias")):
            if prefix + name not in state_dict and prefix + key in state_dict:
                state_dict[prefix + name] = state_dict[prefix + key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self._bias_idx is not None}, "
                f"tensor_parallel_mode={self.tensor_parallel_mode}")
