"""te.optimizers.FusedAdam: Adam / AdamW over the contract's multi-tensor Adam op.

Transformer Engine's arguments. `master_weights=True` keeps a float32 copy of each bf16/fp16
parameter, and of each FP8 one (a QuantizedTensor, e.g. from te.quantized_model_init, whatever
its nominal dtype), in the optimizer state ("master_param"): the step updates the copy and writes
it back rounded (quantized), so small updates are not lost to the parameter's precision.
`capturable=True` keeps the step count and the learning rate as tensors on the parameters'
device and steps with tensor arithmetic only (no host synchronization), so the step can be
captured in a device graph.
`exp_avg_dtype` / `exp_avg_sq_dtype` may be torch.bfloat16: the moments are kept in bf16 and
updated in float32 (the parameter update reads the float32 values, which are rounded once when
stored), as Transformer Engine's unscaled bf16 states. (A backend's fused Adam may take one
dtype per parameter's tensors only: te-backend-cuda's does, so bf16 moments beside float32
parameters or master weights run the reference update there, which warns once.) As in
Transformer Engine, the moments may also be torch.float16 or torch.uint8 (FP8) and the master
weights torch.float16 (`master_weight_dtype`): scaled states, updated through float32 copies;
and `store_param_remainders=True` keeps a bf16 parameter's float32 master weight as the
parameter plus 16 bits (_scaled_states). `get_unscaled_state` / `set_scaled_state` read and
write any state in float32, and `state_dict()` is in Transformer Engine's form, each state in
float32 (_adam_checkpoint), so that a checkpoint of either loads into the other.
Under torch.amp.GradScaler the update divides the gradients by its scale and a step with an
inf gradient changes nothing (_amp_scaling), capturable or not. AMSGrad raises
NotImplementedError, as in Transformer Engine.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch

from .. import ops
from ..quantization.quantizers import Float8Quantizer
from ..quantization.tensor import QuantizedTensor
from . import _adam_checkpoint
from . import _scaled_states as compact
from ._amp_scaling import AmpScaling
from ._checks import check_group, check_loadable, check_param_dtype, listed_params, scalar
from ._grads import GradResetMixin, grad_of, run_closure
from ._state_dtypes import StateDtypesMixin
from ._torch_adam import fused_adam_form

NAME = "FusedAdam"
MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
MASTER_DTYPES = (torch.float32, torch.float16)
STATES = ("exp_avg", "exp_avg_sq", "master_param")
RANGES = {"lr": (0.0, None, False), "eps": (0.0, None, False), "weight_decay": (0.0, None, False)}
# (supported parameter dtypes, what to do instead): as Transformer Engine's "FusedAdam only support model
# weights in fp32, fp16, bf16 and fp8" (an FP8 parameter's dtype is its nominal one)
PARAM_DTYPES = ((torch.float32, torch.float16, torch.bfloat16),
                "as in Transformer Engine (and FP8 ones of those nominal dtypes); convert the model (e.g. "
                "model.float()) or step float64 parameters with torch.optim.AdamW")


class FusedAdamConfigError(ValueError, RuntimeError):
    """An unsupported state dtype or capturable combination. Transformer Engine raises
    RuntimeError for these, so code written for it (`except RuntimeError`) catches this too."""


class FusedAdam(StateDtypesMixin, GradResetMixin, torch.optim.Optimizer):
    """Adam with decoupled weight decay (AdamW) by default, Adam with L2 with adam_w_mode=False."""

    # torch.amp.GradScaler hands step() its scale and found-inf flag rather than unscaling the
    # gradients in place (_amp_scaling); Transformer Engine's capturable FusedAdam does so too.
    _step_supports_amp_scaling = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, bias_correction: bool = True, adam_w_mode: bool = True,
                 capturable: bool = False, master_weights: bool = False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, set_grad_none: Optional[bool] = None):
        if amsgrad:
            raise NotImplementedError(f"{NAME}: amsgrad=True is not supported (nor is it by Transformer Engine)")
        checked = [("exp_avg_dtype", exp_avg_dtype, MOMENT_DTYPES),
                   ("exp_avg_sq_dtype", exp_avg_sq_dtype, MOMENT_DTYPES)]
        if master_weights:  # (Transformer Engine ignores master_weight_dtype without master weights)
            checked.append(("master_weight_dtype", master_weight_dtype, MASTER_DTYPES))
        for name, value, allowed in checked:
            if value not in allowed:
                fp8 = " (torch.uint8: FP8)" if torch.uint8 in allowed else ""
                raise FusedAdamConfigError(f"{NAME}: {name} must be one of {', '.join(map(str, allowed))}{fp8}, "
                                           f"as in Transformer Engine; got {value!r}")
        if capturable and exp_avg_dtype != exp_avg_sq_dtype or capturable and exp_avg_dtype in compact.SCALED:
            raise FusedAdamConfigError(f"{NAME}: capturable=True needs exp_avg_dtype and exp_avg_sq_dtype alike "
                                       f"and unscaled (both float32 or both bfloat16), as in Transformer Engine; "
                                       f"got {exp_avg_dtype} and {exp_avg_sq_dtype}")
        # (as in Transformer Engine: remainders only stand in for float32 master weights)
        store_param_remainders = bool(store_param_remainders and master_weights
                                      and master_weight_dtype == torch.float32)
        if capturable and (master_weights and master_weight_dtype != torch.float32 or store_param_remainders):
            raise FusedAdamConfigError(f"{NAME}: capturable=True keeps float32 master weights (no float16 "
                                       "master_weight_dtype, no store_param_remainders), as in Transformer Engine")
        check_group(NAME, dict(params=[], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), RANGES)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode, self.capturable, self.master_weights = bool(adam_w_mode), capturable, master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self.master_weight_dtype, self.store_param_remainders = master_weight_dtype, store_param_remainders
        # (an ignored master_weight_dtype must not decide how a loaded checkpoint's master weights are kept)
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype if master_weights else torch.float32}
        self._scales = {}  # param -> {state name: its float32 scale}, for the scaled states
        self._init_set_grad_none(set_grad_none)
        for group in self.param_groups:
            self._capturable_lr(group)

    def _capturable_lr(self, group: dict) -> None:
        """A capturable group's lr as a float32 tensor on its parameters' device from the start,
        as Transformer Engine makes it in its constructor: a checkpoint of the optimizer (one
        saved after a step holds a tensor) then loads into a fresh one, through torch's
        distributed checkpoint too, whose plan follows the fresh optimizer's types."""
        if getattr(self, "capturable", False) and not torch.is_tensor(group.get("lr")):
            device = group["params"][0].device if group["params"] else self._step_device([])
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with the group's hyperparameters and parameters checked first (_checks)."""
        param_group = listed_params(param_group)
        check_group(NAME, {**self.defaults, **param_group}, RANGES, len(self.param_groups), PARAM_DTYPES)
        super().add_param_group(param_group)
        self._capturable_lr(self.param_groups[-1])

    def state_dtype(self, name: str):
        """The dtype state `name` is kept in (and reloaded in: StateDtypesMixin); None for the
        scaled states, which load_state_dict sets itself, as it does remainders. (With
        store_param_remainders an fp16 or FP8 parameter keeps a float32 master weight, which
        torch's load alone would cast to the parameter's dtype.)"""
        dtype = self.name_to_dtype_map.get(name)
        return None if dtype in compact.SCALED else dtype

    def _remainders(self, p) -> bool:
        # an FP8 parameter's bits are no bf16 upper half for the remainders to complete
        return self.store_param_remainders and p.dtype == torch.bfloat16 and not _quantized(p)

    def _needs_master(self, p) -> bool:
        """Whether `p` steps through a master weight: any parameter whose values are not float32
        ones. That includes an FP8 parameter of nominal dtype float32, whose small updates would
        be lost rounding each step into FP8 (Transformer Engine gives every QuantizedTensor one)."""
        return self.master_weights and (p.dtype != torch.float32 or _quantized(p))

    def initialize_state(self, param, store_param_remainders: bool = False) -> None:
        """The states of `param` as its first step makes them: zero moments; the master weight
        from the parameter (dequantized from an FP8 one; zero remainders where
        `store_param_remainders`), as in Transformer Engine."""
        for name in ("exp_avg", "exp_avg_sq"):
            self.set_scaled_state(param, name, torch.zeros_like(param, dtype=torch.float32))
        if self._needs_master(param):
            self._init_master(param, store_param_remainders and param.dtype == torch.bfloat16
                              and not _quantized(param))

    def _init_master(self, param, remainders: bool) -> None:
        if remainders:
            self.state[param]["master_param"] = torch.zeros_like(param, dtype=torch.int16)
        else:
            self.set_scaled_state(param, "master_param", _float32_value(param))

    def get_unscaled_state(self, param, state_name: str, skip_unscale: bool = False) -> torch.Tensor:
        """State `state_name` of `param` in float32 (Transformer Engine's): a scaled state times
        its scale, a bf16 one converted (kept bf16 with skip_unscale), the int16 remainders of
        store_param_remainders as they are."""
        value = self.state[param][state_name]
        dtype = self.name_to_dtype_map[state_name]
        if dtype in compact.SCALED:
            return compact.unscaled(value, self._scales[param][state_name])
        if value.dtype == torch.int16 or (skip_unscale and value.dtype == torch.bfloat16):
            return value
        return value.float()

    def set_scaled_state(self, param, state_name: str, unscaled_state: torch.Tensor) -> None:
        """Set state `state_name` of `param` from its float32 value, scaled into its dtype where
        that is float16 or FP8 (int16 remainders are taken as they are). The value of a sharded
        (FSDP2 DTensor) parameter's state may be this rank's shard, as Transformer Engine takes it
        (it copies the value into the state's local tensor): seeding master weights from
        `get_high_precision_init_val()` of the local FP8 shard passes one."""
        unscaled_state = _state_value(param, state_name, unscaled_state)
        state = self.state[param]
        dtype = self.name_to_dtype_map[state_name]
        if state_name == "master_param" and self._remainders(param):
            if unscaled_state.dtype != torch.int16:
                raise ValueError(f"{NAME}: with store_param_remainders the master weight of a bf16 parameter is its "
                                 f"int16 remainder, got {unscaled_state.dtype}")
            state[state_name] = unscaled_state.to(param.device).clone()
            return
        value = unscaled_state.to(device=param.device)
        if dtype not in compact.SCALED:
            state[state_name] = value.to(dtype, copy=True)
            return
        kept = state.get(state_name)
        if kept is None or kept.dtype != compact.storage_dtype(dtype) or kept.shape != param.shape:
            state[state_name] = torch.empty_like(param, dtype=compact.storage_dtype(dtype))
        scale = self._scales.setdefault(param, {}).setdefault(
            state_name, torch.ones(1, dtype=torch.float32, device=param.device))
        compact.rescaled(value.float(), dtype, state[state_name], scale)

    def state_dict(self) -> dict:
        """torch's state dict in Transformer Engine's form (_adam_checkpoint): every state in
        float32 (scaled states unscaled, their scales chosen again on load; bf16 moments
        converted), remainders as int16, and with master_weights a master weight for every
        parameter that has states."""
        return _adam_checkpoint.te_form(self, super().state_dict())

    def _saved_master(self, param) -> torch.Tensor:
        """The master weight a checkpoint holds for a parameter that keeps none: its float32
        value, as Transformer Engine saves for a float32 parameter (zero remainders where the
        first step would make them). A copy, never the parameter: torch's distributed checkpoint
        loads into the tensors of a state dict, and would write the saved value into the model."""
        if self._remainders(param):
            return torch.zeros_like(param, dtype=torch.int16)
        return _float32_value(param) if _quantized(param) else param.detach().to(torch.float32, copy=True)

    def _load_state(self, param, name: str, value) -> None:
        if self.name_to_dtype_map.get(name) in compact.SCALED or name == "master_param" and self._remainders(param):
            self.set_scaled_state(param, name, value if value.dtype == torch.int16 else value.float())
        else:
            super()._load_state(param, name, value)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, the states in their own dtypes (StateDtypesMixin), and each group's step
        count and learning rate in this optimizer's form (_adam_checkpoint.restore_group_types).
        A state dict of another optimizer or of other parameters, or with a state this optimizer
        cannot keep as saved (_adam_checkpoint.check_states), is refused before anything loads;
        torch.optim.Adam's and AdamW's load with their step counts (_torch_adam). A master weight
        the step does not use is dropped (_drop_unused_masters)."""
        state_dict = fused_adam_form(self, state_dict)
        check_loadable(self, state_dict, allowed=STATES, required=STATES[:2], shaped=STATES)
        _adam_checkpoint.check_states(self, state_dict)
        super().load_state_dict(state_dict)
        self._drop_unused_masters()
        _adam_checkpoint.restore_group_types(self)

    def _drop_unused_masters(self) -> None:
        """Drop the loaded master weights of parameters that step without one: float32 ones (not
        FP8), or any without master_weights. Transformer Engine's FusedAdam(master_weights=True)
        keeps and saves a master weight for every parameter but steps a float32 one in place, so
        its checkpoints hold that parameter's initial value there; stepping it would put the
        parameter back to where training began."""
        for group in self.param_groups:
            for p in group["params"]:
                if "master_param" in self.state.get(p, {}) and not self._needs_master(p):
                    del self.state[p]["master_param"]
                    self._scales.get(p, {}).pop("master_param", None)

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            self.initialize_state(p, self._remainders(p))
        elif "master_param" not in state and self._needs_master(p):
            # loaded from a checkpoint without one (saved with master_weights=False, or before FP8
            # parameters of nominal dtype float32 had one): the parameter's value is all there is
            self._init_master(p, self._remainders(p))
        return state

    def _working(self, p, state):
        """(update target, exp_avg, exp_avg_sq) the update steps: the states themselves, or
        float32 copies of scaled states and of a master weight kept as remainders."""
        moments = [self.get_unscaled_state(p, name) if self.name_to_dtype_map[name] in compact.SCALED else state[name]
                   for name in ("exp_avg", "exp_avg_sq")]
        master = state.get("master_param")
        if master is None:
            return (p, *moments)
        if master.dtype == torch.int16:
            return (compact.join(p.detach(), master), *moments)
        return (self.get_unscaled_state(p, "master_param") if master.dtype != torch.float32 else master, *moments)

    def _store(self, p, state, target, exp_avg, exp_avg_sq) -> None:
        """Write the stepped working tensors back into the states and the parameter."""
        for name, value in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if value is not state[name]:
                self.set_scaled_state(p, name, value)
        if target is p:
            return
        master = state["master_param"]
        if master.dtype == torch.int16:  # the parameter is the master's upper half, rounded
            high, low = compact.split(target)
            compact.local(p).copy_(high)
            compact.local(master).copy_(low)
            return
        if target is not master:
            self.set_scaled_state(p, "master_param", target)
        p.copy_(target)  # the parameter gets the master's value, rounded

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """One step; under torch.amp.GradScaler the gradients are divided by its scale within
        the update and a step with an inf or NaN gradient changes nothing, the step count
        included (_amp_scaling). Transformer Engine's `grad_scaler=` keyword is taken, but
        not declared, so that GradScaler.step sets the attributes torch keeps rather than
        passing itself with a FutureWarning each step."""
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(f"{NAME}.step() got unexpected keyword arguments {sorted(kwargs)}")
        loss = run_closure(closure)
        scaling = AmpScaling.of(self, grad_scaler)
        # Every group counts the step, one without gradients (or without parameters: a group can
        # be empty on one data-parallel rank and not on another) too, as Transformer Engine's:
        # "step" is checkpointed per group, and a group that stopped counting would resume with a
        # stale bias correction.
        lives = [[(p, g) for p in group["params"] if (g := grad_of(p, self.use_decoupled_grad, NAME)) is not None]
                 for group in self.param_groups]
        for live in lives:  # (a model converted after the optimizer was made, e.g. by model.double())
            for p, _ in live:
                check_param_dtype(NAME, p, *PARAM_DTYPES)
                if not self.master_weights:
                    _check_updatable_in_place(p)
        # an inf step is skipped here, read on the host; a capturable step decides on the device
        if self.capturable or not scaling.skips_on_host():
            for group, live in zip(self.param_groups, lives):
                self._init_idle(group, live)
                if self.capturable:
                    self._capturable_step(group, live, scaling)
                else:
                    group["step"] = group.get("step", 0) + 1
                    if live:
                        self._fused_step(group, live, scaling)
        scaling.leave_unscaled(g for live in lives for _, g in live)
        return loss

    def _init_idle(self, group: dict, live) -> None:
        """States for the group's parameters without a gradient too, as Transformer Engine makes
        them at each step: a checkpoint then holds every stepped group's parameters
        (its structure does not depend on which ones had a gradient) and a parameter whose
        gradient comes later starts from zero moments and its master weight of now. Nothing to
        do (no pass over the parameters) where every one of them has a gradient: the step makes
        their states."""
        if len(live) == len(group["params"]):
            return
        for p in group["params"]:
            if not self.state.get(p) and p.dtype in PARAM_DTYPES[0]:
                self._state_of(p)

    def _step_device(self, live) -> torch.device:
        """Where a capturable group's step count lives: its stepped tensors' device, else that of
        any parameter of the optimizer (an empty group has none of its own)."""
        if live:
            return live[0][0].device
        return next((p.device for group in self.param_groups for p in group["params"]), torch.device("cpu"))

    def _fused_step(self, group: dict, live, scaling: AmpScaling) -> None:
        """One ops.multi_tensor_adam call per (device, dtype) of the stepped tensors, each with
        its batch's gradients unscaled (new tensors, made batch by batch) where GradScaler's."""
        beta1, beta2 = map(scalar, group["betas"])  # (a one-element tensor hyperparameter as a 0-dim one)
        lr, eps, weight_decay = (scalar(group[key]) for key in ("lr", "eps", "weight_decay"))
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     step=group["step"], adam_w_mode=self.adam_w_mode, bias_correction=group["bias_correction"])
        batches = defaultdict(lambda: ([], [], [], [], []))
        for p, g in live:
            target, exp_avg, exp_avg_sq = self._working(p, self._state_of(p))
            lists = batches[(target.device, target.dtype, g.dtype)]
            for lst, t in zip(lists, (target, g, exp_avg, exp_avg_sq, p)):
                lst.append(t)
        for targets, grads, exp_avgs, exp_avg_sqs, owners in batches.values():
            grads = [scaling.unscaled(g) for g in grads]
            ops.multi_tensor_adam(targets, grads, exp_avgs, exp_avg_sqs, **hyper)
            for target, m, v, p in zip(targets, exp_avgs, exp_avg_sqs, owners):
                self._store(p, self.state[p], target, m, v)

    def _capturable_step(self, group: dict, live, scaling: AmpScaling) -> None:
        """The same update with lr and the step count as device tensors: no value leaves the
        device. With GradScaler's found_inf the update is computed on copies and the kept
        values selected back (torch.where), the step count advanced by 0."""
        device = self._step_device(live)
        # (a step count or lr set as a number, e.g. by hand, is kept; the count is an int32 tensor
        # of shape [1], the lr a float32 one, as Transformer Engine's)
        if not torch.is_tensor(group.get("step")):
            group["step"] = torch.tensor([round(group.get("step", 0))], dtype=torch.int32, device=device)
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        _, skip = scaling.on(group["step"].device)
        group["step"].add_(1 if skip is None else (~skip).to(group["step"].dtype))
        if not live:
            return
        # (0-dim views: a shape-[1] count, as Transformer Engine's checkpoints hold, or a shape-[1]
        # lr would not broadcast into a 0-dim parameter)
        step, lr, eps, weight_decay = (scalar(group[key]) for key in ("step", "lr", "eps", "weight_decay"))
        step = step.to(torch.float32)  # (exact below 2**24 steps; the bias correction is float32 math)
        beta1, beta2 = map(scalar, group["betas"])
        if group["bias_correction"]:
            bc1, bc2_sqrt = 1 - beta1**step, (1 - beta2**step).sqrt()
        else:
            bc1 = bc2_sqrt = torch.ones((), device=device)
        for p, g in live:
            state = self._state_of(p)
            target = state.get("master_param", p)
            m_kept, v_kept = state["exp_avg"], state["exp_avg_sq"]
            inv_scale, skip = scaling.on(p.device)
            # (float32 tensors are their own .float(): copies where the kept values may be reselected)
            p32, m, v = (t.to(torch.float32, copy=skip is not None) for t in (target, m_kept, v_kept))
            g32 = g.float() if inv_scale is None else g.float() * inv_scale
            if weight_decay != 0.0:
                if self.adam_w_mode:
                    p32.mul_(1 - lr * weight_decay)
                else:
                    g32 = g32.add(p32, alpha=weight_decay)
            m.lerp_(g32, 1 - beta1)
            v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            p32.sub_(m / (v.sqrt() / bc2_sqrt + eps) * (lr / bc1))
            if skip is not None:
                p32, m, v = (torch.where(skip, kept, new) for kept, new in ((target, p32), (m_kept, m), (v_kept, v)))
            for kept, value in ((m_kept, m), (v_kept, v)):
                if kept is not value:  # bf16 moments: rounded once, after the update read them
                    kept.copy_(value)
            if target is not p32:  # a low-precision parameter stepped through a float32 copy
                target.copy_(p32)
            if p is not target:  # a master copy: the parameter gets its rounded value
                p.copy_(target)


def _quantized(p) -> bool:
    return isinstance(compact.local(p), QuantizedTensor)


def _check_updatable_in_place(p) -> None:
    """Without master weights the update lands in the parameter itself. A delayed-scaling FP8
    weight takes it (rounded to FP8 with its scale each step, as Transformer Engine's FP8 Adam
    kernel does); any other quantized weight refuses, as in Transformer Engine: its next cast
    picks a new scale for the updated values, and updates far below one FP8 step would be lost."""
    local = compact.local(p)
    if not isinstance(local, QuantizedTensor):  # (every plain parameter, at every step: nothing more to read)
        return
    quantizer = getattr(local, "_quantizer", None)
    quantizer = getattr(quantizer, "inner", quantizer)  # (an FSDP2 shard's: te_core.distributed.fsdp.ShardQuantizer)
    if not isinstance(quantizer, Float8Quantizer):
        raise RuntimeError(f"{NAME} without master_weights does not support {type(local).__name__} parameters of "
                           f"{type(quantizer).__name__}. Use master_weights=True (a float32 "
                           "copy of each weight takes the updates, and the FP8 weight is cast from it).")


def _state_value(param, state_name: str, value) -> torch.Tensor:
    """`value` laid out as `param` (a shard of a sharded parameter as a DTensor), or a ValueError
    naming the shapes: a state of another shape would only fail later, inside the step's update."""
    sharded = hasattr(param, "_local_tensor") and not hasattr(value, "_local_tensor")
    want = compact.local(param).shape if sharded else param.shape
    if not torch.is_tensor(value) or value.shape != want:
        got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
        shard = " (this rank's shard of the sharded parameter, or a DTensor of its full shape)" if sharded else ""
        raise ValueError(f"{NAME}.set_scaled_state: {state_name} must have shape {tuple(want)}{shard}, as the "
                         f"parameter it belongs to; got {got}")
    return compact.sharded_like(param, value)


def _float32_value(param) -> torch.Tensor:
    """A new float32 tensor holding `param`'s value (of a sharded parameter: sharded alike). An
    FP8 parameter is dequantized explicitly: .float() of one whose nominal dtype is already
    float32 would return it unchanged, still quantized."""
    shard = compact.local(param)
    if not isinstance(shard, QuantizedTensor):
        return param.detach().float()
    return compact.sharded_like(param, shard.dequantize(dtype=torch.float32))
