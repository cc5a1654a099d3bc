"""ops.GroupedLinear: Transformer Engine's fusible grouped linear operation, as te.GroupedLinear.

TE's operation and its module compute the same thing (rows split_sizes[0], split_sizes[1], ... of
the input through weight0, weight1, ...) with other constructor and forward arguments; this class
is te-core's GroupedLinear under the operation's arguments, parameter order and forward, so its
quantization (te.autocast, its extra state) is the module's. The operation's own scale_bias (each
row's bias times that row's scale, a second extra input) is added after the module's GEMMs."""
from __future__ import annotations

import numbers
from typing import List, Optional

import torch
from torch import Tensor

from .._common import check_bools, check_input
from ..grouped_linear import GroupedLinear as GroupedLinearModule
from .._quantizer_roles import op_quantizer_roles
from ._op import TORCH_LINEAR_INIT, FusibleOperation, check_dtype, check_extra_inputs

_NAME = "ops.GroupedLinear"
_BUFFER_KWARGS = ("output", "grad_input")  # TE's op_kwargs: caller-provided buffers


def split_sizes_list(split_sizes, num_groups: int, rows: int) -> List[int]:
    """The split sizes (a 1-D integer tensor, as TE takes them, or a list of ints) as `num_groups`
    non-negative ints summing to the input's `rows`."""
    if isinstance(split_sizes, Tensor):
        if split_sizes.dim() != 1 or split_sizes.is_floating_point() or split_sizes.is_complex() \
                or split_sizes.dtype == torch.bool:
            raise TypeError(f"{_NAME}: split_sizes must be a 1-D integer tensor of num_groups={num_groups} row counts, "
                            f"got a {split_sizes.dim()}-D {split_sizes.dtype} tensor")
        sizes = split_sizes.tolist()
    elif isinstance(split_sizes, (list, tuple)) and all(
            isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in split_sizes):
        sizes = [int(s) for s in split_sizes]
    else:
        raise TypeError(f"{_NAME}: split_sizes must be a 1-D integer tensor (or a list of ints) of "
                        f"num_groups={num_groups} row counts, got {split_sizes!r}")
    if len(sizes) != num_groups:
        raise ValueError(f"{_NAME}: expected {num_groups} split sizes (one per group, num_groups={num_groups}), got "
                         f"{len(sizes)}: {sizes}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{_NAME}: split sizes must be non-negative row counts, got {sizes}")
    if sum(sizes) != rows:
        raise ValueError(f"{_NAME}: split sizes {sizes} sum to {sum(sizes)} but the input has {rows} rows (its "
                         "elements / in_features); they must add up to its rows")
    return sizes


def bias_scales(scales, rows: int, device: torch.device) -> Tensor:
    """The scale_bias extra input (one scale per input row, as the routing probabilities of a
    mixture of experts) as a 1-D tensor of `rows` values."""
    if not isinstance(scales, Tensor) or not scales.is_floating_point():
        got = f"a {scales.dtype} tensor" if isinstance(scales, Tensor) else repr(scales)
        raise TypeError(f"{_NAME}: with scale_bias=True the second extra input must be a floating-point tensor of "
                        f"one bias scale per input row ({rows}), got {got}")
    if scales.numel() != rows:
        raise ValueError(f"{_NAME}: with scale_bias=True the second extra input holds one bias scale per input row: "
                         f"expected {rows} values (shape ({rows},)), got shape {tuple(scales.shape)}")
    if scales.device != device:
        raise ValueError(f"{_NAME}: the bias scales are on {scales.device} but the input is on {device}; move them "
                         "to the input's device")
    return scales.reshape(-1)


def add_scaled_bias(y: Tensor, biases: List[Tensor], scales: Tensor, sizes: List[int]) -> Tensor:
    """y + bias_g * scale_r for each row r of group g, summed in float32 and rounded to y's dtype, as
    Transformer Engine's split-quantize path adds it to the GEMMs' output (its grouped GEMM on
    Hopper adds it before rounding that output); autograd gives each bias the scale-weighted sum of
    its rows' output gradients and each scale its row's output gradient dotted with its bias."""
    rows = y.reshape(-1, y.shape[-1])
    scaled = torch.cat([b.to(y.dtype).float() * s.float().unsqueeze(-1) for b, s in zip(biases, scales.split(sizes))])
    return (rows.float() + scaled).to(y.dtype).view(y.shape)


class GroupedLinear(FusibleOperation, GroupedLinearModule):
    """y_i = x_i W_i^T + b_i for the row groups x_i of the input given by the extra input
    split_sizes; parameters weight0, weight1, ..., then bias0, bias1, ... as in Transformer
    Engine. scale_bias=True (with a bias): y_i = x_i W_i^T + s_i b_i, s (one scale per input row)
    a second extra input, as Transformer Engine's; with bias=False it is ignored, as there."""

    num_extra_inputs = 1

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True,
                 device=None, dtype: Optional[torch.dtype] = None, rng_state_tracker_function=None,
                 accumulate_into_main_grad: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, delay_wgrad_compute: bool = False, scale_bias: bool = False):
        (scale_bias,) = check_bools(_NAME, scale_bias=scale_bias)
        super().__init__(num_gemms=num_groups, in_features=in_features, out_features=out_features, bias=bias,
                         init_method=TORCH_LINEAR_INIT, params_dtype=check_dtype(dtype, _NAME), device=device,
                         fuse_wgrad_accumulation=accumulate_into_main_grad, delay_wgrad_compute=delay_wgrad_compute,
                         get_rng_state_tracker=rng_state_tracker_function,
                         single_grouped_weight=single_grouped_weight, single_grouped_bias=single_grouped_bias)
        self.num_groups = self.num_gemms
        self._scale_bias = scale_bias and self.use_bias
        if self._scale_bias:  # (an instance's count: Sequential hands it the scales after the split sizes)
            self.num_extra_inputs = 2
        # TE's order (parameters(), state_dict()): every weight, then every bias
        order = [f"weight{i}" for i in range(num_groups)] + [f"bias{i}" for i in range(num_groups)]
        params = dict(self._parameters)
        self._parameters.clear()
        self._parameters.update((k, params[k]) for k in order + [k for k in params if k not in order])

    def _owned_slots(self) -> tuple:
        # TE's operation asks a CustomRecipe factory with module_type "linear" (its module: "grouped_linear")
        return tuple(slot._replace(module_type="linear") for slot in super()._owned_slots())

    def get_quantizer_roles(self, mode: str):
        """TE's operation form (not the module's fwd= / num_quantizers=): the roles of the quantizers
        this operation owns, forward [input, weight] and backward [grad_output] per GEMM."""
        return op_quantizer_roles(self, mode)

    @property
    def has_bias(self) -> bool:
        return self.use_bias

    def reset_parameters(self, defer_init: bool = False) -> None:
        """Initializes every weight{i} (and bias{i}) as construction does. One taken out of the
        registered parameters and set back as a plain attribute (a model that keeps its experts'
        weights stacked in one parameter of its own and gives the operation views of it, as
        Transformer Engine's Mixtral tutorial does) is registered again on new storage, as
        Transformer Engine's operation registers each weight it initializes: the model's stacked
        tensor is never written through its views."""
        if not defer_init:
            self._register_detached_parameters()
        super().reset_parameters(defer_init)

    def _register_detached_parameters(self) -> None:
        shapes = {f"weight{i}": (self.out_features, self.in_features) for i in range(self.num_groups)}
        if self.use_bias:
            shapes.update({f"bias{i}": (self.out_features,) for i in range(self.num_groups)})
        for name, shape in shapes.items():
            if name in self._parameters:
                continue
            held = self.__dict__.get(name)
            if not isinstance(held, Tensor) or tuple(held.shape) != shape:
                got = f"shape {tuple(held.shape)}" if isinstance(held, Tensor) else type(held).__name__
                raise RuntimeError(f"{_NAME}: reset_parameters() found no parameter {name} (it was removed from the "
                                   f"operation's parameters) and, as its stand-in attribute, {got}; set a tensor of "
                                   f"shape {shape} as {name} (or register the parameter again) first")
            del self.__dict__[name]
            self.register_parameter(name, torch.nn.Parameter(torch.empty(shape, dtype=held.dtype, device=held.device)))

    def forward(self, input: Tensor, *extra_inputs, **op_kwargs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(_NAME, self.num_extra_inputs, extra_inputs, "the split sizes: rows of the input per group"
                           + ("; then, with scale_bias=True, one bias scale per input row" if self._scale_bias else ""))
        unknown = sorted(set(op_kwargs) - set(_BUFFER_KWARGS))
        if unknown:
            raise TypeError(f"{_NAME}: unexpected keyword arguments {unknown} (it takes output and grad_input)")
        given = sorted(k for k, v in op_kwargs.items() if v is not None)
        if given:
            raise NotImplementedError(f"{_NAME}: caller-provided buffers ({', '.join(given)}) are not supported by "
                                      "te-core; call without them (the output and the input's gradient are new "
                                      "tensors)")
        self._materialize_meta_parameters()
        check_input(input, self.in_features, name="input", module=_NAME, device=self.weight0.device)
        rows = input.numel() // self.in_features
        sizes = split_sizes_list(extra_inputs[0], self.num_groups, rows)
        if not self._scale_bias:
            return super().forward(input, sizes)
        scales = bias_scales(extra_inputs[1], rows, input.device)
        return add_scaled_bias(super().forward(input, sizes), self._params("bias"), scales, sizes)

    def _gemm_biases(self) -> List[Tensor]:
        # with scale_bias the GEMMs add no bias: forward adds it scaled afterwards
        return [] if self._scale_bias else super()._gemm_biases()
