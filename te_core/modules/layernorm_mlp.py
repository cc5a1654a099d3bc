"""te.LayerNormMLP: norm -> fc1 -> activation -> fc2 in one autograd Function.

Each GEMM operand is quantized once in forward (with the column-wise copy its wgrad needs)
and kept; the norm and the activation write FP8 directly where the quantizer knows its scale
up front. The backward runs fc2's dgrad/wgrad, the activation backward, fc1's dgrad/wgrad,
and the norm backward, with the bias gradients fused into the gradient casts.
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Union

import torch
from torch import Tensor, nn

from .. import ops
from ..distributed import tensor_parallel
from ..quantization import gemm_slots
from ..quantization.gemm import dgrad_gemm, fprop_gemm, wgrad_operand
from . import _saved
from ._activation import activation_op, split_activation
from ._base import QuantizedModule
from ._quantizer_roles import GemmQuantizerRoles
from .checkpoint import checkpoint as recompute
from ._delayed_wgrad import DelayedWgradMixin, new_batch, weight_grad_or_defer
from ._grad_proxy import grad_proxies
from ._wgrad import OVERWRITE, main_grad_mode, weight_grad
from ._reset import resetting
from ._common import (
    check_callable,
    check_bool,
    check_bools,
    check_fp8_gemms,
    check_input,
    check_name,
    check_positive,
    check_warmup_sizes,
    compute_dtype,
    default_init_method,
    hp_weight,
    is_gated,
    no_torch_autocast,
    check_symmetric_ar_type,
    reject_unsupported,
)
from .layernorm_linear import (
    add_norm_parameters,
    fuse_residual,
    fused_outputs,
    needs_norm_grad,
    norm_grads,
    norm_input_grad,
    norm_settings,
    normalized_operand,
    reset_norm_parameters,
    residual_view,
    returned_norm_output,
    split_grads,
    unpack_outputs,
)
from ._te_order import te_order

SLOTS = gemm_slots("fc1_") + gemm_slots("fc2_")


def activated_operand(step, slot: str, h: Tensor, act, columnwise: bool):
    """act(h) as the GEMM operand of `slot`, FP8 straight from the activation op where possible:
    (operand, what the wgrad reads of it). `act`: an activation_op value (the kind, with its
    parameters if it has any)."""
    kind, params = split_activation(act)
    fused = step.fused_cast_args(slot)
    if fused is not None:
        data, amax = ops.activation_fwd(h, kind, **fused, **params)
        a_q, a = step.wrap_fused(slot, data, amax, nominal_dtype=h.dtype, columnwise=columnwise), None
    else:
        a, _ = ops.activation_fwd(h, kind, **params)
        a_q = step.operand(slot, a, columnwise=columnwise)
    return a_q, (wgrad_operand(a_q, a) if columnwise else None)


def activation_grad_operand(step, slot: str, d_act_and_h: list, act, *, columnwise: bool, with_dbias):
    """d(act)/dh applied to d_act as the gradient operand of `slot`: (operand, fc1's bias gradient,
    what fc1's wgrad reads of it). `d_act_and_h`: [d_act, h], which this function empties, so
    that it holds their last references.

    One fused op (activation backward + dbias + FP8 cast) where the quantizer knows its scale up
    front; otherwise the activation backward, then the recipe's gradient cast, which runs after
    d_act and h are freed: its FP8 outputs then replace them instead of adding to the
    high-precision d_h on top of them (the peak of a current- or block-scaled layer step)."""
    d_act, h = d_act_and_h
    d_act_and_h.clear()
    kind, params = split_activation(act)
    fused = step.fused_cast_args(slot)
    if fused is None:
        d_h = ops.activation_bwd(d_act, h, kind, **params)
        del d_act, h
        dh_q, dbias = step.grad_operand(slot, d_h, columnwise=columnwise, with_dbias=bool(with_dbias))
        return dh_q, dbias, (wgrad_operand(dh_q, d_h) if columnwise else None)
    data, data_t, dbias, amax = ops.activation_bwd_dbias_cast_transpose(
        d_act, h, kind, fused["fp8_scale"], fused["fp8_dtype"], amax_out=fused.get("amax_out"), **params
    )
    dh_q = step.wrap_fused(slot, data, amax, nominal_dtype=h.dtype, columnwise=columnwise, data_t=data_t)
    return dh_q, (dbias if with_dbias else None), (wgrad_operand(dh_q, None) if columnwise else None)


class _LayerNormMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, step, norm, activation, return_ln_out,
        return_residual, fuse_wgrad=(0, 0), wgrad_store=None, fc1_weight_proxy=None, fc2_weight_proxy=None, grad=True,
    ):
        # *_proxy: FP8 primary weights' stand-ins under torch.compile (_grad_proxy), given their gradients;
        # grad: whether autograd records this call (see needs_norm_grad)
        ln_out_q, ln_out_w, stats, ln_out = normalized_operand(
            step, "fc1_input", x, ln_weight, ln_bias, norm, columnwise=grad and fc1_weight.requires_grad,
            keep_hp=return_ln_out
        )
        fc1_w_hp, fc2_w_hp = hp_weight(step, fc1_weight, x.dtype), hp_weight(step, fc2_weight, x.dtype)
        norm_grad = needs_norm_grad(x, ln_weight, ln_bias, grad)
        fc1_w_q = step.weight_operand("fc1_weight", fc1_w_hp, columnwise=norm_grad)
        h = fprop_gemm(ln_out_q, fc1_w_q, out_dtype=x.dtype, bias=fc1_bias)
        act_q, act_wgrad = activated_operand(step, "fc2_input", h, activation,
                                             columnwise=grad and fc2_weight.requires_grad)
        fc2_w_q = step.weight_operand("fc2_weight", fc2_w_hp, columnwise=grad)
        y = fprop_gemm(act_q, fc2_w_q, out_dtype=x.dtype, bias=fc2_bias)
        # backward reads the column-wise copies only (wgrad: ln_out, act, or both in high precision
        # per the recipe; dgrad: the weights) and frees each intermediate once used (_saved): at
        # its end only the gradients are alive
        _saved.save(ctx, (x, ln_weight, *stats), (
            ln_out_w,
            step.dgrad_weight(fc1_w_q, fc1_w_hp, x.dtype) if norm_grad else None, h,
            act_wgrad, step.dgrad_weight(fc2_w_q, fc2_w_hp, x.dtype) if grad else None,
        ))
        ctx.step, ctx.norm, ctx.activation = step, norm, activation
        ctx.bias_dtypes = (None if fc1_bias is None else fc1_bias.dtype, None if fc2_bias is None else fc2_bias.dtype)
        ctx.weight_dtypes = (fc1_weight.dtype, fc2_weight.dtype)
        # fuse_wgrad: main_grad_mode of fc1's and of fc2's weight (each may carry overwrite_main_grad)
        ctx.fused_weights = tuple(w if mode else None for w, mode in zip((fc1_weight, fc2_weight), fuse_wgrad))
        ctx.overwrite_main_grad = tuple(mode == OVERWRITE for mode in fuse_wgrad)
        ctx.wgrad_store = wgrad_store  # delay_wgrad_compute=True: the wgrads are left for backward_dw
        ctx.needs = (x.requires_grad, fc1_weight.requires_grad, fc2_weight.requires_grad)
        ctx.needs_norm = norm_grad
        ctx.return_residual = return_residual
        ctx.proxied = (fc1_weight_proxy is not None, fc2_weight_proxy is not None)
        # traced, a view, not ln_out itself: under torch.compile (torch 2.11) an output that is
        # also saved for backward (the GEMM operand) got a zero gradient; eagerly ln_out itself,
        # which the caller may modify in place (a view made inside a Function may not be)
        outs = (y,) + ((returned_norm_output(ln_out),) if return_ln_out else ()) + residual_view(x, return_residual)
        return outs[0] if len(outs) == 1 else outs

    @staticmethod
    def backward(ctx, *grads):
        (dy,), d_ln_out, d_res = split_grads(ctx, grads, 1)
        (x, ln_weight, *stats), held = _saved.restore(ctx, "LayerNormMLP")
        ln_out_w, fc1_w_q, h, act_w, fc2_w_q = held
        del held  # from here on the locals below are the only references: each `del` frees memory
        step = ctx.step
        needs_dx, needs_dw1, needs_dw2 = ctx.needs
        dy = dy.to(x.dtype).contiguous()  # as Linear's: a strided gradient's dbias would be summed in another order
        dy_q, d_fc2_b = step.grad_operand(
            "fc2_grad_output", dy, columnwise=needs_dw2, with_dbias=ctx.bias_dtypes[1] is not None
        )
        dy_w = wgrad_operand(dy_q, dy) if needs_dw2 else None
        del dy
        fc1_fused, fc2_fused = ctx.fused_weights
        batch = new_batch(ctx.wgrad_store)
        d_fc2_w = weight_grad_or_defer(batch, "fc2_weight", partial(
            weight_grad, dy_w, act_w, ctx.weight_dtypes[1], fc2_fused, "LayerNormMLP", ctx.overwrite_main_grad[1]),
            fc2_fused) if needs_dw2 else None
        del act_w, dy_w
        d_act = dgrad_gemm(dy_q, fc2_w_q, out_dtype=x.dtype)
        del dy_q, fc2_w_q
        d_act_and_h = [d_act, h]
        del d_act, h  # activation_grad_operand frees them as soon as it has read them
        dh_q, d_fc1_b, dh_w = activation_grad_operand(
            step, "fc1_grad_output", d_act_and_h, ctx.activation, columnwise=needs_dw1, with_dbias=ctx.bias_dtypes[0]
        )
        d_fc1_w = weight_grad_or_defer(batch, "fc1_weight", partial(
            weight_grad, dh_w, ln_out_w, ctx.weight_dtypes[0], fc1_fused, "LayerNormMLP", ctx.overwrite_main_grad[0]),
            fc1_fused) if needs_dw1 else None
        del ln_out_w, dh_w
        d_ln = norm_input_grad(ctx, dh_q, fc1_w_q, d_ln_out, x.dtype)
        del dh_q, fc1_w_q
        dx, d_ln_w, d_ln_b = norm_grads(ctx, d_ln, x, stats, ln_weight, d_res)
        step.backward_done()
        d_fc1_b, d_fc2_b = (None if d is None else d.to(t) for d, t in zip((d_fc1_b, d_fc2_b), ctx.bias_dtypes))
        return (dx if needs_dx else None, d_ln_w, d_ln_b, d_fc1_w, d_fc1_b, d_fc2_w, d_fc2_b,
                None, None, None, None, None, None, None,
                d_fc1_w if ctx.proxied[0] else None, d_fc2_w if ctx.proxied[1] else None, None)


class LayerNormMLP(DelayedWgradMixin, tensor_parallel.TensorParallelMixin, GemmQuantizerRoles, QuantizedModule):
    """y = fc2(act(fc1(norm(x)))). Parameters layer_norm_weight, layer_norm_bias (LayerNorm
    only), fc1_weight (ffn_hidden_size, or 2 * ffn_hidden_size for gated activations, x
    hidden_size), fc1_bias, fc2_weight (hidden_size x ffn_hidden_size), fc2_bias.

    With tp_size > 1, fc1 is column-parallel and fc2 row-parallel, as in Transformer Engine:
    each rank holds size_per_partition = ffn_hidden_size / tp_size of the FFN features (for a
    gated activation, its block of each half of fc1), and fc2_bias whole, added after the sum."""

    _routes_fp8_weight_grads = True
    _chained_gemms = True  # fc1 feeds fc2 (get_quantizer_roles)

    @te_order("hidden_size", "ffn_hidden_size", "eps", "sequence_parallel", "return_bias", "get_rng_state_tracker",
              "tp_group", "tp_size", "init_method", "bias", "normalization", "activation", "activation_params",
              "output_layer_init_method", "fuse_wgrad_accumulation", "params_dtype", "return_layernorm_output",
              "return_layernorm_output_gathered", "seq_length", "micro_batch_size", "set_parallel_mode",
              "zero_centered_gamma", "device", "ub_overlap_ag", "name", "ub_overlap_rs", "ub_overlap_rs_dgrad",
              "ub_bulk_dgrad", "ub_bulk_wgrad", "delay_wgrad_compute", "symmetric_ar_type", "checkpoint")
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        return_bias: bool = False,
        get_rng_state_tracker=None,
        tp_group=None,
        tp_size: int = 1,
        init_method=None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        output_layer_init_method=None,
        fuse_wgrad_accumulation: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        zero_centered_gamma: bool = False,
        device: Union[None, str, torch.device] = None,
        delay_wgrad_compute: bool = False,
        **kwargs,
    ):
        name = "LayerNormMLP"
        set_parallel_mode = kwargs.pop("set_parallel_mode", False)
        act = activation_op(activation, kwargs.pop("activation_params", None), name)
        checkpoint = kwargs.pop("checkpoint", False)
        gathered = check_bool(kwargs.pop("return_layernorm_output_gathered", False),
                              name="return_layernorm_output_gathered", module=name)
        label = check_name(kwargs.pop("name", None), name)
        check_warmup_sizes(name, kwargs.pop("seq_length", None), kwargs.pop("micro_batch_size", None))
        symmetric_ar_type = check_symmetric_ar_type(kwargs.pop("symmetric_ar_type", None), name)
        reject_unsupported(name, **kwargs)
        sequence_parallel, return_bias, bias, fuse_wgrad_accumulation, return_layernorm_output, checkpoint, \
            delay_wgrad_compute, set_parallel_mode = check_bools(
                name, sequence_parallel=sequence_parallel, return_bias=return_bias, bias=bias,
                fuse_wgrad_accumulation=fuse_wgrad_accumulation, return_layernorm_output=return_layernorm_output,
                checkpoint=checkpoint, delay_wgrad_compute=delay_wgrad_compute, set_parallel_mode=set_parallel_mode)
        if checkpoint and delay_wgrad_compute:
            raise NotImplementedError(f"{name}: checkpoint=True with delay_wgrad_compute=True is not supported: "
                                      "the recompute would run inside backward(), after which backward_dw() expects "
                                      "the kept operands; use one of the two")
        super().__init__(SLOTS, device=device, params_dtype=params_dtype)
        self.symmetric_ar_type = symmetric_ar_type  # (runs as torch.distributed's all-reduce: check_symmetric_ar_type)
        self.name = label
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        tensor_parallel.init_tensor_parallel(
            self, name, tp_group=tp_group, tp_size=tp_size, parallel_mode=None,
            sequence_parallel=sequence_parallel, get_rng_state_tracker=get_rng_state_tracker,
            rng_tracker_name=None)
        if self.tp_size > 1 and set_parallel_mode is not True:
            raise ValueError(f"{name}: tp_size={self.tp_size} needs set_parallel_mode=True (fc1 column-parallel, fc2 "
                             "row-parallel, as in Transformer Engine); without it TE splits the FFN weights but leaves "
                             "the output a partial sum of the ranks'")
        self.set_parallel_mode = set_parallel_mode
        self.hidden_size = check_positive(hidden_size, name="hidden_size", module=name)
        self.ffn_hidden_size = check_positive(ffn_hidden_size, name="ffn_hidden_size", module=name)
        self.size_per_partition = tensor_parallel.split_size(ffn_hidden_size, self.tp_size, what="ffn_hidden_size",
                                                             module=name)
        self.activation, self._activation_op = activation, act
        add_norm_parameters(self, hidden_size, normalization, eps, zero_centered_gamma, name)
        self.return_bias, self.return_layernorm_output, self.use_bias = return_bias, return_layernorm_output, bias
        self.return_layernorm_output_gathered = gathered  # (tensor_parallel.gathered_norm_output)
        factory = dict(device=self.device, dtype=self.params_dtype)
        fc1_out = 2 * self.size_per_partition if is_gated(activation) else self.size_per_partition
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, **factory))
        self.fc1_bias = nn.Parameter(torch.empty(fc1_out, **factory)) if bias else None
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, self.size_per_partition, **factory))
        self.fc2_bias = nn.Parameter(torch.empty(hidden_size, **factory)) if bias else None
        tensor_parallel.mark_sequence_parallel(self, [self.layer_norm_weight, self.layer_norm_bias, self.fc2_bias])
        init_method, output_layer_init_method = (
            check_callable(m, name=n, module="LayerNormMLP")
            for m, n in ((init_method, "init_method"), (output_layer_init_method, "output_layer_init_method")))
        self.init_method = default_init_method() if init_method is None else init_method
        self.output_layer_init_method = (default_init_method() if output_layer_init_method is None
                                         else output_layer_init_method)
        self.note_primary_weights(fc1_weight="fc1_weight", fc2_weight="fc2_weight")
        self._initialize(materialize=False)
        # Transformer Engine's tensor-parallel attributes: fc1 splits its outputs, fc2 its inputs
        tensor_parallel.model_parallel_attributes(self.fc1_weight, 0)
        tensor_parallel.model_parallel_attributes(self.fc2_weight, 1)
        if self.fc1_bias is not None:
            tensor_parallel.model_parallel_attributes(self.fc1_bias, 0)
        self.init_delayed_wgrad(delay_wgrad_compute, name)
        # Transformer Engine's selective recompute: keep only the input for the backward and run
        # the forward again there (te_core.checkpoint: FP8-exact, delayed scales of that forward)
        self.checkpoint = checkpoint

    def _initialize(self, *, materialize: bool = True) -> None:
        with resetting(self, materialize=materialize) as params:
            reset_norm_parameters(self, params)
            for name in ("fc1_bias", "fc2_bias"):
                if name in params:
                    nn.init.zeros_(params[name])
            tensor_parallel.init_weight(self, self.init_method, params["fc1_weight"])
            tensor_parallel.init_weight(self, self.output_layer_init_method, params["fc2_weight"])

    def forward(self, inp: Tensor, is_first_microbatch: Optional[bool] = None, *, return_residual: bool = False):
        """`return_residual` (te-core): also return `inp` itself (last), to be the block's
        residual: its gradient is then summed into the input's inside the norm's backward.
        With checkpoint=True the backward recomputes the whole forward (fc2 included, which
        Transformer Engine skips) instead of keeping its activations."""
        return_residual = check_bool(return_residual, name="return_residual", module="LayerNormMLP.forward")
        if self.checkpoint and torch.is_grad_enabled():
            return recompute(self._forward, inp, is_first_microbatch, return_residual=return_residual)
        return self._forward(inp, is_first_microbatch, return_residual=return_residual)

    def _forward(self, inp: Tensor, is_first_microbatch: Optional[bool], *, return_residual: bool):
        check_input(inp, self.hidden_size, module="LayerNormMLP", device=self.fc1_weight.device)
        dtype = compute_dtype(inp, self)
        step = self.quantization_step(is_first_microbatch)
        # cast first: a gather under tensor parallelism moves the compute dtype's bytes
        x, step, fc1_shape = tensor_parallel.norm_input(self, inp.to(dtype), step, "fc1_input")
        # contiguous rows, as LayerNormLinear's: the norm's result must not depend on the layout
        x = x.reshape(-1, self.hidden_size).contiguous()
        m = fc1_shape.numel() // self.hidden_size
        check_fp8_gemms(
            step,
            "LayerNormMLP",
            (m, self.fc1_weight.shape[0], self.hidden_size),
            (m, self.hidden_size, self.size_per_partition),
        )
        # with tp_size > 1 fc2_bias is added once, after the sum of the ranks' partial outputs
        fc2_bias = None if self.return_bias or self.tp_size > 1 else self.fc2_bias
        norm = norm_settings(self)
        # under tensor parallelism the residual's gradient must not join the input's before the sum
        residual_fused = fuse_residual(inp, x, return_residual) and self.tp_size == 1
        with no_torch_autocast(inp.device.type):
            out = _LayerNormMLPFunction.apply(
                x,
                tensor_parallel.replicated_parameter(self, self.layer_norm_weight),
                tensor_parallel.replicated_parameter(self, self.layer_norm_bias),
                self.fc1_weight,
                self.fc1_bias,
                self.fc2_weight,
                fc2_bias,
                step,
                norm,
                self._activation_op,
                self.return_layernorm_output,
                residual_fused,
                tuple(main_grad_mode(self.fuse_wgrad_accumulation, is_first_microbatch, w)
                      for w in (self.fc1_weight, self.fc2_weight)),
                self.delayed_wgrad_store(),
                *grad_proxies(self, ("fc1_weight", "fc2_weight")),
                torch.is_grad_enabled(),
            )
        out, ln_out, residual = unpack_outputs(out, inp, return_ln_out=self.return_layernorm_output,
                                               return_residual=return_residual, residual_fused=residual_fused)
        ln_out, ln_shape = tensor_parallel.gathered_norm_output(
            self, tensor_parallel.replicated_output(self, ln_out), inp.shape)
        if self.tp_size > 1:
            out[0] = tensor_parallel.row_parallel_output(self, out[0], None if self.return_bias else self.fc2_bias)
        return fused_outputs(out[0], inp.shape, self.hidden_size, self.fc2_bias, ln_out, residual,
                             return_bias=self.return_bias, ln_shape=ln_shape)
