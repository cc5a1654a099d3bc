"""Linear: y = x @ weight.T + bias, in FP8 under te_core.autocast (Transformer Engine's te.Linear).

The module checks arguments and picks the quantization step; the autograd Function writes one
code path for every recipe (and for high precision): quantize operands, fprop GEMM, keep the
column-wise copies for the backward GEMMs, then dgrad, wgrad and the fused dbias.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..distributed import tensor_parallel
from ..quantization.gemm import dgrad_gemm, fprop_gemm, wgrad_operand
from ..quantization.roles import gemm_slots
from ._base import QuantizedModule
from ._quantizer_roles import GemmQuantizerRoles
from ._delayed_wgrad import DelayedWgradMixin, WeightGradStore, new_batch, weight_grad_or_defer
from ._grad_proxy import grad_proxies
from ._param_split import ParameterSplitMixin
from ._saved import restore_held, save_holding_quantized
from ._wgrad import OVERWRITE, check_original_input, main_grad_mode, original_input_operand, weight_grad
from ._reset import resetting
from ._common import (
    check_callable,
    check_bools,
    check_input,
    check_name,
    check_ub_name,
    check_positive,
    check_split_sizes,
    compute_dtype,
    default_init_method,
    no_torch_autocast,
    check_symmetric_ar_type,
    reject_unsupported,
    returned_bias,
)
from ._te_order import te_order

_default_init = default_init_method()


class _Options(NamedTuple):
    compute_dtype: torch.dtype
    fuse_wgrad_accumulation: int  # _wgrad.main_grad_mode: 0, or how the wgrad goes into main_grad
    grad_enabled: bool  # read outside the Function: inside forward, grad mode is always off
    wgrad_store: Optional[WeightGradStore] = None  # delay_wgrad_compute=True: wgrad left for backward_dw
    save_original_input: bool = False  # keep the input as given; the backward casts it for the wgrad


def _fprop(inp: Tensor, weight: Tensor, bias: Optional[Tensor], step, options: _Options,
           need_dgrad: bool = False, need_wgrad: bool = False):
    """(y as a 2-D tensor, what the wgrad reads of x or None, what the dgrad reads of the weight
    or None): the forward GEMM with its quantized operands."""
    out_features, in_features = weight.shape
    dtype = options.compute_dtype
    # contiguous rows: a GEMM may pick another kernel (and summation order) for a strided operand
    x2d = (inp if inp.dim() == 2 else inp.reshape(-1, in_features)).contiguous()
    step.check_gemm_dims(x2d.shape[0], out_features, in_features)
    x_op = step.operand("input", x2d if step.fp8 else x2d.to(dtype), columnwise=need_wgrad)
    w_hp = weight if step.fp8 else weight.to(dtype)
    w_op = step.weight_operand("weight", w_hp, columnwise=need_dgrad)
    x_wgrad = wgrad_operand(x_op, x2d, dtype) if need_wgrad else None
    w_dgrad = step.dgrad_weight(w_op, w_hp, dtype) if need_dgrad else None
    return fprop_gemm(x_op, w_op, out_dtype=dtype, bias=bias), x_wgrad, w_dgrad


def _output(y: Tensor, inp: Tensor) -> Tensor:
    return y if inp.dim() == 2 else y.reshape(*inp.shape[:-1], y.shape[-1])


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp: Tensor, weight: Tensor, bias: Optional[Tensor], step, options: _Options, split_sizes=None,
                weight_proxy: Optional[Tensor] = None):
        # weight_proxy: an FP8 primary weight's stand-in under torch.compile (_grad_proxy), given its gradient
        need_dgrad = options.grad_enabled and inp.requires_grad
        need_wgrad = options.grad_enabled and weight.requires_grad
        # (backward_override="dequantized" reads the forward's FP8 input instead, as Transformer Engine)
        original = need_wgrad and options.save_original_input and step.backward_override != "dequantized"
        if original:
            check_original_input(step, "input", "Linear")
        y, x_wgrad, w_dgrad = _fprop(inp, weight, bias, step, options, need_dgrad, need_wgrad and not original)
        if original:  # the input as given (a view of it): the backward casts it for the wgrad
            x_wgrad = inp if inp.dim() == 2 else inp.reshape(-1, inp.shape[-1])
        # Backward reads only column-wise copies: x's for wgrad (or x in high precision, per the
        # recipe), the weight's for dgrad (a cached weight keeps both layouts in the module's
        # cache; saving the twin costs nothing extra); or, under a backward_override, what the
        # step says (step.dgrad_weight).
        save_holding_quantized(ctx, (x_wgrad, w_dgrad))
        ctx.original = original
        ctx.step, ctx.options, ctx.weight = step, options, weight
        ctx.inp_shape, ctx.inp_dtype = inp.shape, inp.dtype
        ctx.need_dgrad, ctx.need_wgrad = need_dgrad, need_wgrad
        ctx.bias_dtype = None if bias is None or not bias.requires_grad else bias.dtype
        ctx.split = split_sizes is not None
        ctx.proxied = weight_proxy is not None
        # the 2-D result itself, which Linear.forward views in the input's shape: an output that is
        # a view made inside a Function cannot be modified in place (a model's `y *= scale`)
        return y if split_sizes is None else _split_output(y, inp, split_sizes)

    @staticmethod
    def backward(ctx, *dys: Tensor):
        x_wgrad, w_op = restore_held(ctx, "Linear")
        step, weight = ctx.step, ctx.weight
        # split outputs: their gradients go to the cast as column blocks, not concatenated (LayerNormLinear)
        parts = [(dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])).contiguous() for dy in dys]
        dy = parts if ctx.split else parts[0]
        dy_op, dbias = step.grad_operand("grad_output", dy, columnwise=ctx.need_wgrad,
                                         with_dbias=ctx.bias_dtype is not None)
        dx = dw = None
        if ctx.need_dgrad:
            dx = dgrad_gemm(dy_op, w_op, out_dtype=ctx.inp_dtype)
            dx = dx if dx.shape == ctx.inp_shape else dx.reshape(ctx.inp_shape)
        if ctx.need_wgrad:
            fused = weight if ctx.options.fuse_wgrad_accumulation else None
            store = ctx.options.wgrad_store
            # now: the GEMM runs at once, reading dy_op's column-wise copy in place; else it is left
            # for backward_dw, keeping only what it reads
            now = store is None
            if ctx.original:  # save_original_input: the input's wgrad operand, cast now
                # (contiguous here, not in the forward: a strided input is copied only while it is cast)
                x_wgrad = original_input_operand(step, "input", x_wgrad.contiguous(), ctx.options.compute_dtype,
                                                 now=now)
            dw = weight_grad_or_defer(new_batch(store), "weight", partial(
                weight_grad, wgrad_operand(dy_op, dy, now=now), x_wgrad, weight.dtype, fused, "Linear",
                ctx.options.fuse_wgrad_accumulation == OVERWRITE), fused)
        step.backward_done()
        if dbias is not None:
            dbias = dbias.to(ctx.bias_dtype)
        return dx, dw, dbias, None, None, None, (dw if ctx.proxied else None)


def _split_output(y: Tensor, inp: Tensor, split_sizes) -> tuple:
    return tuple(_output(part, inp) for part in y.split(split_sizes, dim=-1))


class Linear(ParameterSplitMixin, DelayedWgradMixin, tensor_parallel.TensorParallelMixin, GemmQuantizerRoles,
             QuantizedModule):
    """Applies y = x @ weight.T + bias. Runs in FP8 per the recipe under te_core.autocast,
    in high precision (ops.gemm) otherwise.

    FP8 GEMMs need the tokens (product of the leading input dims), in_features and
    out_features to be multiples of 16 (32 with MXFP8): otherwise a ValueError names the shape.
    With fuse_wgrad_accumulation=True the weight gradient is added into `weight.main_grad`
    (which you allocate) and weight.grad stays None. With delay_wgrad_compute=True the backward
    leaves the weight gradient to `module.backward_dw()` (see te_core/modules/_delayed_wgrad.py).
    With save_original_input=True the backward keeps the input as given, not its FP8 column-wise
    copy, and casts it for the wgrad GEMM then: less memory where the input is kept anyway (by
    another module), the same gradients. Not with DelayedScaling (a ValueError), whose scale
    changes between the forward and the backward.

    Tensor parallelism (Transformer Engine's arguments, see te_core.distributed.tensor_parallel):
    parallel_mode="column" splits out_features over the tp_size ranks of tp_group, "row" splits
    in_features and sums the outputs; in_features / out_features then hold this rank's share.
    """

    _routes_fp8_weight_grads = True

    @te_order("in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation", "tp_group", "tp_size",
              "get_rng_state_tracker", "rng_tracker_name", "init_method", "bias", "return_bias", "params_dtype",
              "parallel_mode", "parameters_split", "device", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad",
              "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type",
              "save_original_input", "name")
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        params_dtype: Optional[torch.dtype] = None,
        device: Union[None, str, torch.device] = None,
        return_bias: bool = False,
        init_method: Optional[Callable[[Tensor], None]] = None,
        parallel_mode: Optional[str] = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        name: Optional[str] = None,
        sequence_parallel: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name: Optional[str] = None,
        save_original_input: bool = False,
        **unsupported,
    ):
        parameters_split = unsupported.pop("parameters_split", None)
        symmetric_ar_type = check_symmetric_ar_type(unsupported.pop("symmetric_ar_type", None), "Linear")
        ub_name = check_ub_name(unsupported.pop("ub_name", None), "Linear")
        reject_unsupported("Linear", **unsupported)
        bias, return_bias, fuse_wgrad_accumulation, sequence_parallel, save_original_input = check_bools(
            "Linear", bias=bias, return_bias=return_bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            sequence_parallel=sequence_parallel, save_original_input=save_original_input)
        in_features = check_positive(in_features, name="in_features", module="Linear")
        out_features = check_positive(out_features, name="out_features", module="Linear")
        super().__init__(gemm_slots(), device=device, params_dtype=params_dtype)
        self.ub_name = ub_name
        self.symmetric_ar_type = symmetric_ar_type  # (runs as torch.distributed's all-reduce: check_symmetric_ar_type)
        tensor_parallel.init_tensor_parallel(
            self, "Linear", tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel, get_rng_state_tracker=get_rng_state_tracker,
            rng_tracker_name=rng_tracker_name)
        self.in_features, self.out_features = tensor_parallel.local_features(self, in_features, out_features, "Linear")
        self.return_bias, self.use_bias = return_bias, bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input  # read at each forward: may be set later (Megatron-LM does)
        self.name = check_name(name, "Linear")
        init_method = check_callable(init_method, name="init_method", module="Linear")
        self._create_parameters(_default_init if init_method is None else init_method)
        self.apply_parameters_split(parameters_split, "Linear")
        tensor_parallel.mark_model_parallel(self)
        self.init_delayed_wgrad(delay_wgrad_compute, "Linear")
        if parallel_mode == "row":
            tensor_parallel.mark_sequence_parallel(self, [self.bias])

    def _create_parameters(self, init_method) -> None:
        factory = dict(device=self.device, dtype=self.params_dtype)
        self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, **factory))
        bias = nn.Parameter(torch.empty(self.out_features, **factory)) if self.use_bias else None
        self.register_parameter("bias", bias)
        self.init_method = init_method
        self.note_primary_weights(weight="weight")
        self._initialize(init_method, materialize=False)

    def forward(self, inp: Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False, *, split_sizes: Optional[Sequence[int]] = None, **unsupported):
        """`split_sizes` (te-core): the output as a tuple of views split along its last dimension,
        as torch.split would; the backward takes their gradients without concatenating them."""
        if fp8_output or fp8_grad or unsupported:  # FP8 tensors between modules are not implemented
            reject_unsupported("Linear.forward", fp8_output=fp8_output, fp8_grad=fp8_grad, **unsupported)
        # read once: under parameters_split each read concatenates the parts
        weight, bias = self.weight, self.bias
        reduce_output = self.parallel_mode == "row" and self.tp_size > 1  # then the bias goes after the sum
        if reduce_output and isinstance(inp, torch.Tensor) and inp.dim() and inp.shape[-1] != self.in_features:
            raise ValueError(f"Linear: inp has shape {tuple(inp.shape)}; a row-parallel Linear takes this rank's "
                             f"share of the input features, in_features / tp_size = {self.in_features * self.tp_size} "
                             f"/ {self.tp_size} = {self.in_features}: split the input along its last dimension")
        check_input(inp, self.in_features, module="Linear", last_dim_name="in_features", device=weight.device)
        if split_sizes is not None:
            if reduce_output:
                raise NotImplementedError("Linear: split_sizes with parallel_mode='row' and tp_size > 1 is not "
                                          "supported; split the summed output yourself")
            split_sizes = check_split_sizes(split_sizes, self.out_features, "Linear")
        keep_original = self._keeps_original_input()  # (refused before any all-gather where it cannot apply)
        step = self.quantization_step(is_first_microbatch)
        if self.parallel_mode == "column":  # under sequence parallelism, FP8 all-gather where the recipe allows
            inp = tensor_parallel.column_parallel_input(self, inp, step)
        options = _Options(compute_dtype(inp, self),
                           main_grad_mode(self.fuse_wgrad_accumulation, is_first_microbatch, weight),
                           torch.is_grad_enabled(), self.delayed_wgrad_store(), keep_original)
        fused_bias = None if self.return_bias or reduce_output else bias
        with no_torch_autocast(inp.device.type):  # operands are cast here, not by torch.autocast
            if options.grad_enabled and (inp.requires_grad or weight.requires_grad
                                         or (fused_bias is not None and fused_bias.requires_grad)):
                out = _LinearFunction.apply(inp, weight, fused_bias, step, options, split_sizes,
                                            grad_proxies(self, ("weight",))[0])
                out = _output(out, inp) if split_sizes is None else out
            else:  # nothing to differentiate: skip the autograd Function's bookkeeping (inference)
                y = _fprop(inp, weight, fused_bias, step, options)[0]
                out = _output(y, inp) if split_sizes is None else _split_output(y, inp, split_sizes)
        if reduce_output:
            out = tensor_parallel.row_parallel_output(self, out, None if self.return_bias else bias)
        if self.return_bias:
            return out, returned_bias(bias, options.compute_dtype)
        return out

    def _keeps_original_input(self) -> bool:
        if not getattr(self, "save_original_input", False):
            return False
        if self.sequence_parallel and self.parallel_mode == "column":
            raise NotImplementedError(
                "Linear: save_original_input=True with sequence_parallel=True and parallel_mode='column' is not "
                "supported (the GEMM's input is all-gathered, so the original is only this rank's shard); set "
                "save_original_input=False")
        return True

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.use_bias}"

    def reset_parameters(self, defer_init: bool = False, *, init_method: Optional[Callable[[Tensor], None]] = None
                         ) -> None:
        """Initialize the parameters as construction does (init_method: the constructor's unless
        given), materializing those on the meta device on te-core's device, and quantizing an
        FP8 primary weight (quantized_model_init) again; see te_core/modules/_reset.py.
        `defer_init=True` (Transformer Engine's) does nothing."""
        if callable(defer_init):  # te-core's earlier form, reset_parameters(init_method)
            init_method, defer_init = defer_init, False
        if not defer_init:
            self._initialize(init_method or getattr(self, "init_method", _default_init))

    def _initialize(self, init_method, *, materialize: bool = True) -> None:
        with resetting(self, materialize=materialize) as params:
            weight, bias = self.whole_of(params, "weight"), self.whole_of(params, "bias")
            tensor_parallel.init_weight(self, init_method, weight)
            if bias is not None:
                bias.zero_()
            self.store_split(params, weight=weight, bias=bias)  # parameters_split: into the named parts
