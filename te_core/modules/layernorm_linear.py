"""te.LayerNormLinear: a norm fused with the linear layer that consumes it.

Forward: norm (FP8 output straight from the norm op where the recipe's quantizer allows),
quantized weight, fprop GEMM. The FP8 input and weight (with their column-wise copies) are
kept for the backward GEMMs; dgrad flows into the norm's backward.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..distributed import tensor_parallel
from ..distributed.norm_gather import shard_grad
from ..quantization import gemm_slots
from ..quantization.gemm import dgrad_gemm, fprop_gemm, wgrad_operand
from ._base import QuantizedModule
from ._quantizer_roles import GemmQuantizerRoles
from ._delayed_wgrad import DelayedWgradMixin, new_batch, weight_grad_or_defer
from ._grad_proxy import grad_proxies
from ._param_split import ParameterSplitMixin
from ._saved import restore_held, save_holding_quantized
from ._wgrad import OVERWRITE, main_grad_mode, weight_grad
from ._reset import resetting
from ._common import (
    check_callable,
    check_bool,
    check_bools,
    check_eps,
    check_fp8_gemms,
    check_input,
    check_name,
    check_ub_name,
    check_normalization,
    check_positive,
    check_split_sizes,
    compute_dtype,
    default_init_method,
    hp_weight,
    no_torch_autocast,
    check_symmetric_ar_type,
    reject_unsupported,
    returned_bias,
)
from ._norm import norm_bwd, norm_fwd
from ._te_order import te_order

SLOTS = gemm_slots()


def add_norm_parameters(module: QuantizedModule, size: int, normalization: str, eps: float,
                        zero_centered_gamma: bool, name: str) -> None:
    """The norm settings and parameters (layer_norm_weight, LayerNorm's layer_norm_bias) of a
    fused norm + GEMM module, registered before its GEMM weights."""
    module.normalization = check_normalization(normalization, name)
    module.eps = check_eps(eps, module=name)
    module.zero_centered_gamma = check_bool(zero_centered_gamma, name="zero_centered_gamma", module=name)
    factory = dict(device=module.device, dtype=module.params_dtype)
    module.layer_norm_weight = nn.Parameter(torch.empty(size, **factory))
    module.layer_norm_bias = nn.Parameter(torch.empty(size, **factory)) if normalization == "LayerNorm" else None


def reset_norm_parameters(module: QuantizedModule, params) -> None:
    """The norm's initial values, into `params` (_reset.resetting's)."""
    nn.init.constant_(params["layer_norm_weight"], 0.0 if module.zero_centered_gamma else 1.0)
    if "layer_norm_bias" in params:
        nn.init.zeros_(params["layer_norm_bias"])


def norm_settings(module: QuantizedModule) -> dict:
    return dict(eps=module.eps, normalization=module.normalization, zero_centered_gamma=module.zero_centered_gamma)


def fused_outputs(y, shape: torch.Size, out_features: int, bias: Optional[Tensor], ln_out: Optional[Tensor],
                  residual: Optional[Tensor] = None, *, return_bias: bool = False,
                  in_shape: Optional[torch.Size] = None, ln_shape: Optional[torch.Size] = None):
    """y shaped like the input of the GEMM, of shape `shape` (last dim out_features; a tuple of
    split views each shaped so), then, with return_bias, the bias left unapplied in y's dtype (None
    for a module without one, as Transformer Engine returns it), then the norm's output when it is
    returned (TE's order), then the residual when asked for: a tensor alone, else a tuple. The
    last two have the module input's shape `in_shape` (default `shape`; under sequence
    parallelism the GEMM's input is the gathered sequence, the norm's output this rank's shard),
    the norm's output `ln_shape` where given (gathered: tensor_parallel.gathered_norm_output)."""
    in_shape = shape if in_shape is None else in_shape
    ln_shape = in_shape if ln_shape is None else ln_shape
    lead = shape[:-1]
    if isinstance(y, tuple):
        result = (tuple(part.view(*lead, part.shape[-1]) for part in y),)
    else:
        result = (y.view(*lead, out_features),)
    if return_bias:
        result += (returned_bias(bias, (y[0] if isinstance(y, tuple) else y).dtype),)
    if ln_out is not None:
        result += (ln_out.view(ln_shape),)
    if residual is not None:
        result += (residual.view(in_shape),)
    return result[0] if len(result) == 1 else result


def returned_norm_output(ln_out: Tensor) -> Tensor:
    return ln_out.view_as(ln_out) if torch.compiler.is_compiling() else ln_out


def residual_view(x: Tensor, return_residual: bool) -> tuple:
    """The norm's input as one more output of a fused Function (a view, no copy): used as the
    block's residual, its gradient comes back into the same backward and is summed into dx
    by the norm's backward kernel (see norm_grads), not by autograd in a separate pass."""
    return (x.view_as(x),) if return_residual else ()


def fuse_residual(inp: Tensor, x: Tensor, return_residual: bool) -> bool:
    """Whether the Function returns the residual: only when x (what it normalizes) holds inp's
    values in inp's dtype; a cast input keeps the residual in the caller's precision (inp)."""
    return return_residual and x.dtype == inp.dtype


def unpack_outputs(out, inp: Tensor, *, return_ln_out: bool, return_residual: bool, residual_fused: bool):
    """A fused Function's outputs as (its GEMM outputs, a list; the norm output or None; the
    residual or None), the residual being inp itself where the Function did not return one."""
    out = list(out) if isinstance(out, tuple) else [out]
    residual = out.pop() if residual_fused else (inp if return_residual else None)
    ln_out = out.pop() if return_ln_out else None
    return out, ln_out, residual


def split_grads(ctx, grads, parts: int):
    """(output gradients, d_ln_out or None, d_residual or None) from a fused Function's grads."""
    rest = list(grads[parts:])
    d_res = rest.pop() if ctx.return_residual else None
    return grads[:parts], (rest[0] if rest else None), d_res


def needs_norm_grad(x: Tensor, ln_weight: Tensor, ln_bias: Optional[Tensor], grad: bool = True) -> bool:
    """Whether the backward must run dgrad into the norm: for dx, or for the norm's own parameters.
    grad: whether autograd records the call at all (the module's torch.is_grad_enabled(), which
    inside an autograd Function's forward always reads False): under no_grad or inference_mode
    no backward runs, whatever the parameters' requires_grad says."""
    return grad and any(t is not None and t.requires_grad for t in (x, ln_weight, ln_bias))


def norm_input_grad(ctx, dy_q, w_q, d_ln_out, dtype):
    """The gradient into the norm's output: dgrad of the GEMM that read it, plus any gradient
    of the returned norm output; None when nothing needs it."""
    if not ctx.needs_norm:
        return None
    # under sequence parallelism the norm's shard of the GEMM's gradient; the returned norm
    # output is that shard too (tensor_parallel.replicated_output)
    d_ln = shard_grad(ctx.step, dgrad_gemm(dy_q, w_q, out_dtype=dtype))
    return d_ln if d_ln_out is None else d_ln + d_ln_out


def norm_grads(ctx, d_ln, x, stats, ln_weight, d_residual=None):
    """The norm's backward: (dx, dweight, dbias), all None when nothing needs them; the
    residual's gradient, when the Function returned one, is added into dx."""
    if d_ln is None:
        return None, None, None
    return norm_bwd(d_ln, x, tuple(stats), ln_weight, ctx.norm["normalization"], ctx.norm["zero_centered_gamma"],
                    add=d_residual)


def normalized_operand(
    step,
    slot: str,
    x2d: Tensor,
    ln_weight: Tensor,
    ln_bias: Optional[Tensor],
    norm: dict,
    columnwise: bool,
    keep_hp: bool,
):
    """Norm of x2d as the GEMM operand of `slot`: (operand, what the wgrad reads of it, or None
    without `columnwise`; stats; the high-precision output when `keep_hp`, else None).

    The norm op writes FP8 directly when the slot's quantizer knows its scale up front and the
    high-precision output is not needed (`keep_hp`, or a high-precision wgrad: the step then
    offers no fused cast); otherwise the output is quantized afterwards."""
    fused = None if keep_hp else step.fused_cast_args(slot)
    if fused is not None:
        data, stats, amax = norm_fwd(x2d, ln_weight, ln_bias, **norm, **fused)
        y, operand = None, step.wrap_fused(slot, data, amax, nominal_dtype=x2d.dtype, columnwise=columnwise)
    else:
        y, stats, _ = norm_fwd(x2d, ln_weight, ln_bias, **norm)
        operand = step.operand(slot, y, columnwise=columnwise)
    return operand, (wgrad_operand(operand, y) if columnwise else None), stats, (y if keep_hp else None)


class _LayerNormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, step, norm, return_ln_out, split_sizes, return_residual,
                fuse_wgrad=False, wgrad_store=None, weight_proxy=None, grad=True):
        # weight_proxy: an FP8 primary weight's stand-in under torch.compile (_grad_proxy), given its gradient;
        # grad: whether autograd records this call (see needs_norm_grad)
        ln_out_q, ln_out_w, stats, ln_out = normalized_operand(
            step, "input", x, ln_weight, ln_bias, norm, columnwise=grad and weight.requires_grad, keep_hp=return_ln_out
        )
        w_hp = hp_weight(step, weight, x.dtype)
        norm_grad = needs_norm_grad(x, ln_weight, ln_bias, grad)
        w_q = step.weight_operand("weight", w_hp, columnwise=norm_grad)
        y = fprop_gemm(ln_out_q, w_q, out_dtype=x.dtype, bias=bias)
        # backward reads the column-wise copies only: ln_out for wgrad (or ln_out in high
        # precision, per the recipe), the weight for dgrad (or what a backward_override asks)
        save_holding_quantized(ctx, (x, ln_weight, ln_out_w, step.dgrad_weight(w_q, w_hp, x.dtype)
                                     if norm_grad else None, *stats))
        ctx.step, ctx.norm, ctx.weight_dtype = step, norm, weight.dtype
        ctx.fused_weight = weight if fuse_wgrad else None  # its main_grad takes the wgrad
        ctx.overwrite_main_grad = fuse_wgrad == OVERWRITE
        ctx.wgrad_store = wgrad_store  # delay_wgrad_compute=True: the wgrad is left for backward_dw
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.proxied = weight_proxy is not None
        ctx.needs = (x.requires_grad, weight.requires_grad)
        ctx.needs_norm = norm_grad
        ctx.parts = 1 if split_sizes is None else len(split_sizes)
        # split: the views' gradients arrive one by one and the gradient cast reads them in
        # place, where autograd would first concatenate them (q, k, v: 3 x 128 MiB at s2048 b8)
        ctx.return_residual = return_residual
        outs = (y,) if split_sizes is None else y.split(split_sizes, dim=-1)
        # traced, a view, not ln_out itself: under torch.compile (torch 2.11) an output that is
        # also saved for backward (the GEMM operand) got a zero gradient; eagerly ln_out itself,
        # which the caller may modify in place (a view made inside a Function may not be)
        outs += ((returned_norm_output(ln_out),) if return_ln_out else ()) + residual_view(x, return_residual)
        return outs[0] if len(outs) == 1 else outs

    @staticmethod
    def backward(ctx, *grads):
        x, ln_weight, ln_out_w, w_q, *stats = restore_held(ctx, "LayerNormLinear")
        step = ctx.step
        needs_dx, needs_dw = ctx.needs
        dys, d_ln_out, d_res = split_grads(ctx, grads, ctx.parts)
        # contiguous, as Linear's: the fused dbias of a strided gradient would be summed in another order
        dys = [g.to(x.dtype).contiguous() for g in dys]
        dy = dys[0] if ctx.parts == 1 else dys
        dy_q, dbias = step.grad_operand("grad_output", dy, columnwise=needs_dw, with_dbias=ctx.bias_dtype is not None)
        dw = weight_grad_or_defer(new_batch(ctx.wgrad_store), "weight", partial(
            weight_grad, wgrad_operand(dy_q, dy), ln_out_w, ctx.weight_dtype, ctx.fused_weight,
            "LayerNormLinear", ctx.overwrite_main_grad), ctx.fused_weight) if needs_dw else None
        d_ln = norm_input_grad(ctx, dy_q, w_q, d_ln_out, x.dtype)
        del dy_q  # freed before the norm backward allocates dx
        dx, d_ln_w, d_ln_b = norm_grads(ctx, d_ln, x, stats, ln_weight, d_res)
        step.backward_done()
        dbias = None if dbias is None else dbias.to(ctx.bias_dtype)
        return (dx if needs_dx else None, d_ln_w, d_ln_b, dw, dbias, None, None, None, None, None, None, None,
                dw if ctx.proxied else None, None)


class LayerNormLinear(ParameterSplitMixin, DelayedWgradMixin, tensor_parallel.TensorParallelMixin, GemmQuantizerRoles,
                      QuantizedModule):
    """y = norm(x) @ weight.T + bias. Parameters layer_norm_weight, layer_norm_bias (LayerNorm
    only), weight (out_features, in_features), bias.

    parallel_mode="column" with tp_size > 1 splits out_features over the ranks of tp_group
    (out_features then holds this rank's share); the norm runs on the whole input, replicated
    or, under sequence_parallel, gathered along the sequence first."""

    _routes_fp8_weight_grads = True

    @te_order("in_features", "out_features", "eps", "sequence_parallel", "fuse_wgrad_accumulation", "tp_group",
              "tp_size", "get_rng_state_tracker", "init_method", "bias", "normalization", "return_bias", "params_dtype",
              "parallel_mode", "return_layernorm_output", "return_layernorm_output_gathered", "parameters_split",
              "zero_centered_gamma", "device", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_wgrad",
              "ub_bulk_dgrad", "ub_name", "delay_wgrad_compute", "symmetric_ar_type", "name")
    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        init_method=None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        return_layernorm_output: bool = False,
        zero_centered_gamma: bool = False,
        device: Union[None, str, torch.device] = None,
        delay_wgrad_compute: bool = False,
        **kwargs,
    ):
        name = "LayerNormLinear"
        parameters_split = kwargs.pop("parameters_split", None)
        gathered = check_bool(kwargs.pop("return_layernorm_output_gathered", False),
                              name="return_layernorm_output_gathered", module=name)
        label = check_name(kwargs.pop("name", None), name)
        symmetric_ar_type = check_symmetric_ar_type(kwargs.pop("symmetric_ar_type", None), name)
        ub_name = check_ub_name(kwargs.pop("ub_name", None), name)
        reject_unsupported(name, **kwargs)
        sequence_parallel, fuse_wgrad_accumulation, bias, return_bias, return_layernorm_output = check_bools(
            name, sequence_parallel=sequence_parallel, fuse_wgrad_accumulation=fuse_wgrad_accumulation, bias=bias,
            return_bias=return_bias, return_layernorm_output=return_layernorm_output)
        super().__init__(SLOTS, device=device, params_dtype=params_dtype)
        self.ub_name = ub_name
        self.symmetric_ar_type = symmetric_ar_type  # (runs as torch.distributed's all-reduce: check_symmetric_ar_type)
        self.name = label
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        tensor_parallel.init_tensor_parallel(
            self, name, tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel, get_rng_state_tracker=get_rng_state_tracker,
            rng_tracker_name=None)
        if parallel_mode == "row" and self.tp_size > 1:
            raise NotImplementedError(f"{name}: parallel_mode='row' with tp_size > 1 is not supported (the norm "
                                      "would see only this rank's features); use LayerNorm and a row-parallel Linear")
        self.in_features = check_positive(in_features, name="in_features", module=name)
        self.out_features = check_positive(out_features, name="out_features", module=name)
        if parallel_mode == "column":
            self.out_features = tensor_parallel.split_size(out_features, self.tp_size, what="out_features", module=name)
        out_features = self.out_features
        add_norm_parameters(self, in_features, normalization, eps, zero_centered_gamma, name)
        tensor_parallel.mark_sequence_parallel(self, [self.layer_norm_weight, self.layer_norm_bias])
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output
        self.return_layernorm_output_gathered = gathered  # (tensor_parallel.gathered_norm_output)
        self.use_bias = bias
        factory = dict(device=self.device, dtype=self.params_dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        init_method = check_callable(init_method, name="init_method", module="LayerNormLinear")
        self.init_method = default_init_method() if init_method is None else init_method
        self.note_primary_weights(weight="weight")
        self._initialize(materialize=False)
        self.apply_parameters_split(parameters_split, name)
        tensor_parallel.mark_model_parallel(self)
        self.init_delayed_wgrad(delay_wgrad_compute, name)

    def _initialize(self, *, materialize: bool = True) -> None:
        with resetting(self, materialize=materialize) as params:
            reset_norm_parameters(self, params)
            weight, bias = self.whole_of(params, "weight"), self.whole_of(params, "bias")
            tensor_parallel.init_weight(self, self.init_method, weight)
            if bias is not None:
                nn.init.zeros_(bias)
            self.store_split(params, weight=weight, bias=bias)  # parameters_split: into the named parts

    def forward(self, inp: Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False, *, split_sizes: Optional[Sequence[int]] = None, return_residual: bool = False,
                **unsupported):
        """te-core extensions: `split_sizes` returns the output as a tuple of views split along
        its last dimension, as torch.split would; the backward then takes their gradients
        without concatenating them (a fused QKV projection feeding attention).
        `return_residual` also returns `inp` itself (last), to be the block's residual: its
        gradient is then summed into the input's inside the norm's backward."""
        if fp8_output or fp8_grad or unsupported:  # FP8 tensors between modules are not implemented
            reject_unsupported("LayerNormLinear.forward", fp8_output=fp8_output, fp8_grad=fp8_grad, **unsupported)
        # read once: under parameters_split each read concatenates the parts
        weight, bias = self.weight, self.bias
        check_input(inp, self.in_features, module="LayerNormLinear", device=weight.device)
        if split_sizes is not None:
            split_sizes = check_split_sizes(split_sizes, self.out_features, "LayerNormLinear")
        return_residual = check_bool(return_residual, name="return_residual", module="LayerNormLinear.forward")
        if self.sequence_parallel and return_residual:
            raise NotImplementedError("LayerNormLinear: return_residual=True with sequence_parallel=True is not "
                                      "supported yet; keep the residual from the module's input yourself")
        dtype = compute_dtype(inp, self)
        step = self.quantization_step(is_first_microbatch)
        norm_inp, gemm_shape = inp, inp.shape
        if self.parallel_mode == "column":  # cast first: a gather moves the compute dtype's bytes
            norm_inp, step, gemm_shape = tensor_parallel.norm_input(self, inp.to(dtype), step, "input")
        # contiguous rows: the norm of a strided input (a permuted view) would otherwise be
        # summed in another order, and its result would depend on the input's memory layout
        x = norm_inp.reshape(-1, self.in_features).to(dtype).contiguous()
        check_fp8_gemms(step, "LayerNormLinear", (gemm_shape.numel() // self.in_features, self.out_features,
                                                  self.in_features))
        fused_bias = None if self.return_bias else bias
        norm = norm_settings(self)
        # under tensor parallelism the residual's gradient must not join the input's before the sum
        residual_fused = fuse_residual(inp, x, return_residual) and self.tp_size == 1
        with no_torch_autocast(inp.device.type):
            out = _LayerNormLinearFunction.apply(
                x,
                tensor_parallel.replicated_parameter(self, self.layer_norm_weight),
                tensor_parallel.replicated_parameter(self, self.layer_norm_bias),
                weight,
                fused_bias,
                step,
                norm,
                self.return_layernorm_output,
                split_sizes,
                residual_fused,
                main_grad_mode(self.fuse_wgrad_accumulation, is_first_microbatch, weight),
                self.delayed_wgrad_store(),
                grad_proxies(self, ("weight",))[0],
                torch.is_grad_enabled(),
            )
        out, ln_out, residual = unpack_outputs(out, inp, return_ln_out=self.return_layernorm_output,
                                               return_residual=return_residual, residual_fused=residual_fused)
        ln_out, ln_shape = tensor_parallel.gathered_norm_output(
            self, tensor_parallel.replicated_output(self, ln_out), inp.shape)
        y = out[0] if split_sizes is None else tuple(out)
        return fused_outputs(y, gemm_shape, self.out_features, bias, ln_out, residual, return_bias=self.return_bias,
                             in_shape=inp.shape, ln_shape=ln_shape)
