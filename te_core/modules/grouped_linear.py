"""te.GroupedLinear: num_gemms independent linear layers applied to consecutive row groups of
one input (the experts of a mixture-of-experts layer), in one autograd Function."""

from __future__ import annotations

import os
import warnings
from functools import partial
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..distributed import tensor_parallel
from ..quantization import gemm_slots
from ..quantization.gemm import dgrad_gemm, fprop_gemm, wgrad_operand
from ._base import QuantizedModule
from ._quantizer_roles import GemmQuantizerRoles
from ._delayed_wgrad import DelayedWgradMixin, new_batch, weight_grad_or_defer
from ._grad_proxy import grad_proxies
from ._wgrad import OVERWRITE, check_original_input, main_grad_mode, original_input_operand, weight_grad
from ._saved import restore_held, save_holding_quantized
from ._reset import resetting
from ._common import (
    check_callable,
    check_bools,
    check_fp8_gemms,
    check_input,
    check_m_splits,
    check_name,
    check_ub_name,
    check_positive,
    compute_dtype,
    default_init_method,
    hp_weight,
    no_torch_autocast,
    reject_unsupported,
    returned_bias,
)
from ._te_order import te_order


def _nothing() -> None:
    """An expert without tokens adds nothing into its weight's main_grad."""
    return None


def _zero_main_grad(weight: Tensor) -> None:
    """An expert without tokens on a first micro-batch: its main_grad is written, with zeros."""
    weight.main_grad.zero_()


def _whole_splits(m_splits, module: str):
    """A floating-point tensor m_splits as int64, as Transformer Engine casts any tensor (and a list
    holding floats as ints), where every count is whole (a fraction, which the cast would
    truncate, is an error); anything else as given."""
    if isinstance(m_splits, (list, tuple)) and any(isinstance(m, float) for m in m_splits):
        counts = list(m_splits)  # (a list of floats: TE makes an int64 tensor of it)
    elif not isinstance(m_splits, Tensor) or not m_splits.is_floating_point() or m_splits.dim() != 1:
        return m_splits
    else:
        counts = m_splits.tolist()
    fractional = [c for c in counts if not float(c).is_integer()]
    if fractional:
        raise ValueError(f"{module}: m_splits must hold whole row counts, got {fractional[0]} in {counts}; round "
                         "them (or pass an int64 tensor or a list of ints)")
    return m_splits.long() if isinstance(m_splits, Tensor) else [int(c) for c in counts]


def _split_grouped(state_dict, prefix: str, kind: str, num_gemms: int, member_shapes, error_msgs) -> None:
    """A grouped `kind` of Transformer Engine's single_grouped_weight / single_grouped_bias
    checkpoints (num_gemms tensors stacked, each of one of `member_shapes`) as kind0, kind1, ...,
    the first shape each, as Transformer Engine's per-GEMM module loads it; next to a full set of
    per-GEMM keys it is a redundant copy, dropped as there."""
    grouped_key, keys = prefix + kind, [f"{prefix}{kind}{i}" for i in range(num_gemms)]
    if grouped_key not in state_dict:
        return
    grouped = state_dict.pop(grouped_key)
    if all(key in state_dict for key in keys):
        return
    shapes = [(num_gemms, *shape) for shape in member_shapes]
    if not isinstance(grouped, Tensor) or tuple(grouped.shape) not in shapes:
        got = f"shape {tuple(grouped.shape)}" if isinstance(grouped, Tensor) else f"a {type(grouped).__name__}"
        error_msgs.append(f"{grouped_key}: Transformer Engine's grouped {kind} must be {' or '.join(map(str, shapes))} "
                          f"(num_gemms={num_gemms} of this module's {kind}0 shape {member_shapes[0]}, stacked), got "
                          f"{got}; load a checkpoint of a GroupedLinear of the same num_gemms, in_features and "
                          "out_features")
        return
    for key, member in zip(keys, grouped.unbind(0)):
        state_dict[key] = member.reshape(member_shapes[0])


def _slot(i: int, role: str) -> str:
    return f"gemm{i}_{role}"


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, step, num_gemms, fuse_wgrad, wgrad_store, proxied, keep_original, grad, buffers,
                *params):
        # (backward_override="dequantized" reads the forward's FP8 inputs instead, as Transformer Engine)
        keep_original = keep_original and step.backward_override != "dequantized"
        # grad: whether autograd records this call (the module's torch.is_grad_enabled(); inside
        # this forward it always reads False, while requires_grad stays True under no_grad and
        # inference_mode, where no backward runs and no column-wise copy or saved operand is needed)
        dx_needed = grad and x.requires_grad
        # params: the weights, the biases, then the stand-ins (_grad_proxy) of the FP8 primary
        # weights numbered in `proxied` under torch.compile, which are given those weights' gradients
        weights, biases = params[:num_gemms], params[num_gemms:len(params) - len(proxied)]
        outs, saved = [], []
        for i, xi in enumerate(torch.split(x, m_splits)):
            w = weights[i]
            if xi.shape[0] == 0:  # an expert that received no tokens this step
                outs.append(xi.new_empty(0, w.shape[0]))
                saved += [None, None]  # (the backward reads nothing of an expert without tokens)
                continue
            dw_needed = grad and w.requires_grad
            original = keep_original and dw_needed  # save_original_input: the backward casts xi
            if original:
                check_original_input(step, _slot(i, "input"), "GroupedLinear")
            x_q = step.operand(_slot(i, "input"), xi, columnwise=dw_needed and not original)
            w_hp = hp_weight(step, w, x.dtype)
            w_q = step.weight_operand(_slot(i, "weight"), w_hp, columnwise=dx_needed)
            outs.append(fprop_gemm(x_q, w_q, out_dtype=x.dtype, bias=biases[i] if biases else None))
            # wgrad reads x's column-wise copy (or x in high precision, per the recipe), dgrad the weight's
            saved += [xi if original else wgrad_operand(x_q, xi) if dw_needed else None,
                      step.dgrad_weight(w_q, w_hp, x.dtype) if dx_needed else None]
        save_holding_quantized(ctx, saved)
        ctx.keep_original = keep_original
        ctx.step, ctx.m_splits, ctx.num_gemms = step, m_splits, num_gemms
        ctx.weight_meta = [(w.shape, w.dtype) for w in weights]
        ctx.fused_weights = weights if fuse_wgrad else (None,) * num_gemms  # their main_grad takes the wgrad
        ctx.overwrite_main_grad = fuse_wgrad == OVERWRITE
        ctx.wgrad_store = wgrad_store  # delay_wgrad_compute=True: the wgrads are left for backward_dw
        ctx.bias_dtypes = [b.dtype for b in biases]
        ctx.x_dtype, ctx.needs_dx = x.dtype, dx_needed
        ctx.proxied = proxied
        out, ctx.dgrad_out = buffers  # (the caller's buffers: the output aliases out, as in Transformer Engine)
        return torch.cat(outs, dim=0) if out is None else torch.cat(outs, dim=0, out=out)

    @staticmethod
    def backward(ctx, dy):
        saved, step = restore_held(ctx, "GroupedLinear"), ctx.step
        dxs, dws, dbs = [], [], []
        batch = new_batch(ctx.wgrad_store)
        for i, dyi in enumerate(torch.split(dy.to(ctx.x_dtype), ctx.m_splits)):
            x_w, w_q = saved[2 * i], saved[2 * i + 1]
            shape, w_dtype = ctx.weight_meta[i]
            if dyi.shape[0] == 0:
                dxs.append(dyi.new_zeros(0, shape[1]))
                # no tokens: a zero gradient, or nothing to add into main_grad
                fused = ctx.fused_weights[i]
                if fused is None:
                    zero = partial(torch.zeros, shape, dtype=w_dtype, device=dy.device)
                else:  # (written on a first micro-batch: zeros, as an empty GEMM writes them)
                    zero = partial(_zero_main_grad, fused) if ctx.overwrite_main_grad else _nothing
                dws.append(weight_grad_or_defer(batch, f"weight{i}", zero, fused))
                dbs.append(torch.zeros(shape[0], dtype=w_dtype, device=dy.device) if ctx.bias_dtypes else None)
                continue
            dyi = dyi.contiguous()
            dy_q, db = step.grad_operand(_slot(i, "grad_output"), dyi, columnwise=x_w is not None,
                                         with_dbias=bool(ctx.bias_dtypes))
            if ctx.needs_dx:
                dxs.append(dgrad_gemm(dy_q, w_q, out_dtype=ctx.x_dtype))
            if ctx.keep_original and x_w is not None:
                x_w = original_input_operand(step, _slot(i, "input"), x_w, ctx.x_dtype, now=ctx.wgrad_store is None)
            dws.append(None if x_w is None else weight_grad_or_defer(batch, f"weight{i}", partial(
                weight_grad, wgrad_operand(dy_q, dyi), x_w, w_dtype, ctx.fused_weights[i], "GroupedLinear",
                ctx.overwrite_main_grad),
                ctx.fused_weights[i]))
            dbs.append(None if db is None else db.to(ctx.bias_dtypes[i]))
        step.backward_done()
        dx = None if not ctx.needs_dx else torch.cat(dxs, dim=0, **({} if ctx.dgrad_out is None else
                                                                     {"out": ctx.dgrad_out}))
        return (dx, None, None, None, None, None, None, None, None, None, *dws, *(dbs if ctx.bias_dtypes else ()),
                *(dws[i] for i in ctx.proxied))


def _caller_buffer(buffer: Optional[Tensor], what: str, rows: int, cols: int, dtype: torch.dtype,
                   device: torch.device) -> Optional[Tensor]:
    """forward's out= / dgrad_out=: a buffer the GEMMs write into, which must be what they would
    allocate (Transformer Engine's rule)."""
    if buffer is None:
        return None
    where = f"GroupedLinear.forward: {what}="
    if not isinstance(buffer, Tensor):
        raise TypeError(f"{where} must be a tensor or None, got {type(buffer).__name__}")
    if tuple(buffer.shape) != (rows, cols) or buffer.dtype != dtype or buffer.device != device:
        raise ValueError(f"{where} must be a ({rows}, {cols}) {dtype} tensor on {device} (the input's rows by "
                         f"{'out' if what == 'out' else 'in'}_features, in the compute dtype), got "
                         f"{tuple(buffer.shape)} {buffer.dtype} on {buffer.device}")
    if not buffer.is_contiguous():
        raise ValueError(f"{where} must be contiguous; allocate it with torch.empty({rows}, {cols})")
    if buffer.requires_grad:
        raise ValueError(f"{where} must not require grad; pass buffer.detach() when you reuse a buffer across "
                         "steps (autograd marks the returned output)")
    return buffer


def _grouped_tensor_flag(value, name: str) -> bool:
    """Transformer Engine's use_grouped_tensor picks its fused grouped GEMM over per-expert
    parameters; the results are the same, and te-core runs its own grouped path either way."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"{name}: use_grouped_tensor must be a bool or None, got {type(value).__name__}")
    return value


def _single_param_flags(weight: bool, bias: bool, name: str) -> Tuple[bool, bool]:
    """Transformer Engine's single_grouped_weight / single_grouped_bias are experimental and gated
    on NVTE_GROUPED_LINEAR_SINGLE_PARAM: without it TE warns and keeps per-expert parameters, as
    here; with it te-core, which has no single grouped parameters, refuses."""
    weight, bias = check_bools(name, single_grouped_weight=weight, single_grouped_bias=bias)
    if not (weight or bias):
        return False, False
    if int(os.environ.get("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "0") or "0") > 0:
        raise NotImplementedError(f"{name}: single_grouped_weight / single_grouped_bias with "
                                  "NVTE_GROUPED_LINEAR_SINGLE_PARAM set are not supported by te-core (one parameter "
                                  "per expert: weight0, weight1, ...); unset the variable or pass False")
    warnings.warn(f"{name} was constructed with single_grouped_weight={weight} and single_grouped_bias={bias}, but "
                  "NVTE_GROUPED_LINEAR_SINGLE_PARAM is not set: per-expert parameters are used (as Transformer "
                  "Engine falls back)", UserWarning, stacklevel=4)
    return False, False


class GroupedLinear(DelayedWgradMixin, tensor_parallel.TensorParallelMixin, GemmQuantizerRoles, QuantizedModule):
    """Rows m_splits[0], m_splits[1], ... of the input go through weight0, weight1, ...;
    parameters weight{i} (out_features, in_features) and bias{i}, as in Transformer Engine.
    save_original_input=True: as te.Linear's (the backward casts the kept input rows).

    Tensor parallelism as in Transformer Engine (expert tensor parallelism): parallel_mode
    "column" keeps out_features / tp_size of each weight's rows, "row" in_features / tp_size of
    its columns, and the module communicates nothing: the caller gathers and reduces around it
    (Megatron-LM's expert layers do). No bias with tp_size > 1 (as there: the bias would go
    after a reduction the module does not run)."""

    _routes_fp8_weight_grads = True

    @te_order("num_gemms", "in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation", "tp_group",
              "tp_size", "get_rng_state_tracker", "rng_tracker_name", "init_method", "bias", "return_bias",
              "params_dtype", "parallel_mode", "device", "ub_overlap_rs", "ub_overlap_ag", "ub_name",
              "delay_wgrad_compute", "save_original_input", "single_grouped_weight", "single_grouped_bias", "name",
              "use_grouped_tensor")
    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        init_method=None,
        params_dtype: Optional[torch.dtype] = None,
        device: Union[None, str, torch.device] = None,
        return_bias: bool = False,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        parallel_mode: Optional[str] = None,
        sequence_parallel: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name: Optional[str] = None,
        **kwargs,
    ):
        name = "GroupedLinear"
        label = check_name(kwargs.pop("name", None), name)
        ub_name = check_ub_name(kwargs.pop("ub_name", None), name)
        use_grouped_tensor = _grouped_tensor_flag(kwargs.pop("use_grouped_tensor", None), name)
        single_flags = _single_param_flags(kwargs.pop("single_grouped_weight", False),
                                           kwargs.pop("single_grouped_bias", False), name)
        reject_unsupported(name, **kwargs)
        bias, return_bias, fuse_wgrad_accumulation, save_original_input, sequence_parallel = check_bools(
            name, bias=bias, return_bias=return_bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            save_original_input=save_original_input, sequence_parallel=sequence_parallel)
        num_gemms = check_positive(num_gemms, name="num_gemms", module=name)
        in_features = check_positive(in_features, name="in_features", module=name)
        out_features = check_positive(out_features, name="out_features", module=name)
        slots = tuple(s for i in range(num_gemms) for s in gemm_slots(f"gemm{i}_"))
        super().__init__(slots, device=device, params_dtype=params_dtype)
        self.ub_name = ub_name
        tensor_parallel.init_tensor_parallel(
            self, name, tp_group=tp_group, tp_size=tp_size, parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel, get_rng_state_tracker=get_rng_state_tracker,
            rng_tracker_name=rng_tracker_name)
        if self.tp_size > 1 and bias:
            raise ValueError(f"{name}: no bias with tp_size > 1 (as in Transformer Engine: the module runs no "
                             "tensor-parallel communication, so a bias would go before the caller's reduction); "
                             "build it with bias=False and add the bias after that reduction")
        in_features, out_features = tensor_parallel.local_features(self, in_features, out_features, name)
        self.name = label
        self.num_gemms, self.fuse_wgrad_accumulation = num_gemms, fuse_wgrad_accumulation
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        init_method = check_callable(init_method, name="init_method", module="GroupedLinear")
        self.init_method = default_init_method() if init_method is None else init_method
        factory = dict(device=self.device, dtype=self.params_dtype)
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(out_features, in_features, **factory)))
            self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(out_features, **factory)) if bias else None)
        self.note_primary_weights(**{f"weight{i}": f"gemm{i}_weight" for i in range(num_gemms)})
        self._initialize(materialize=False)
        tensor_parallel.mark_model_parallel(self)  # Transformer Engine's tensor-parallel attributes
        self.init_delayed_wgrad(delay_wgrad_compute, name)
        self.save_original_input = save_original_input  # read at each forward: may be set later (Megatron-LM does)
        self.use_grouped_tensor = use_grouped_tensor
        self.single_grouped_weight, self.single_grouped_bias = single_flags

    def _initialize(self, *, materialize: bool = True) -> None:
        with resetting(self, materialize=materialize) as params:
            for i in range(self.num_gemms):
                tensor_parallel.init_weight(self, self.init_method, params[f"weight{i}"])
                if f"bias{i}" in params:
                    params[f"bias{i}"].zero_()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Also Transformer Engine's single-grouped-parameter checkpoints: `weight` [num_gemms,
        out_features, in_features] and `bias` [num_gemms, out_features] load as weight{i} / bias{i}."""
        shape = tuple(self.weight0.shape)
        _split_grouped(state_dict, prefix, "weight", self.num_gemms, [shape], error_msgs)
        if self.use_bias:  # (TE's grouped bias may keep a middle dimension of 1)
            _split_grouped(state_dict, prefix, "bias", self.num_gemms, [shape[:1], (1, shape[0])], error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def backward_dw(self) -> None:
        """DelayedWgradMixin's, except that with nothing pending it returns, as Transformer
        Engine's GroupedLinear does (its Linear-like modules raise)."""
        if self.need_backward_dw() and len(self.wgrad_store) == 0:
            return
        super().backward_dw()

    def _params(self, prefix: str) -> List[Tensor]:
        return [getattr(self, f"{prefix}{i}") for i in range(self.num_gemms)]

    def _gemm_biases(self) -> List[Tensor]:
        """The biases the GEMMs add: none when the module returns them (return_bias) or, in the
        fusible operation with scale_bias, adds them scaled per row after the GEMMs."""
        return self._params("bias") if self.use_bias and not self.return_bias else []

    def forward(self, inp: Tensor, m_splits: Sequence[int], is_first_microbatch: Optional[bool] = None,
                out: Optional[Tensor] = None, dgrad_out: Optional[Tensor] = None):
        name = "GroupedLinear"
        check_input(inp, self.in_features, module=name, device=self.weight0.device)
        rows = inp.numel() // self.in_features
        m_splits = check_m_splits(_whole_splits(m_splits, name), self.num_gemms, rows, name)
        dtype = compute_dtype(inp, self)
        buffers = (_caller_buffer(out, "out", rows, self.out_features, dtype, inp.device),
                   _caller_buffer(dgrad_out, "dgrad_out", rows, self.in_features, dtype, inp.device))
        # contiguous rows: a GEMM may pick another kernel (and summation order) for a strided operand
        x = inp.reshape(-1, self.in_features).to(dtype).contiguous()
        step = self.quantization_step(is_first_microbatch)
        check_fp8_gemms(step, name, *((m, self.out_features, self.in_features) for m in m_splits))  # (0 is aligned)
        biases = self._gemm_biases()
        proxied, proxies = (), ()
        if torch.compiler.is_compiling():  # FP8 primary weights' gradient stand-ins (_grad_proxy); none eagerly
            named = grad_proxies(self, tuple(f"weight{i}" for i in range(self.num_gemms)))
            proxied = tuple(i for i, proxy in enumerate(named) if proxy is not None)
            proxies = tuple(named[i] for i in proxied)
        # weight0's overwrite_main_grad (Megatron-FSDP's flag) decides for every GEMM, as weights[0]'s does in TE
        with no_torch_autocast(inp.device.type):
            y = _GroupedLinearFunction.apply(x, m_splits, step, self.num_gemms,
                                             main_grad_mode(self.fuse_wgrad_accumulation, is_first_microbatch,
                                                            self.weight0),
                                             self.delayed_wgrad_store(), proxied,
                                             bool(getattr(self, "save_original_input", False)),
                                             torch.is_grad_enabled(), buffers, *self._params("weight"), *biases,
                                             *proxies)
        y = y.view(*inp.shape[:-1], self.out_features)
        if self.return_bias:
            return y, [returned_bias(b, dtype) for b in self._params("bias")] if self.use_bias else None
        return y
