"""te.optimizers.FusedAdam: Adam / AdamW over the contract's multi-tensor Adam op.

Transformer Engine's arguments. `master_weights=True` keeps a float32 copy of each bf16/fp16
parameter in the optimizer state ("master_param"): the step updates the copy and writes it back
rounded, so small updates are not lost to the parameter's precision. `capturable=True` keeps the
step count and the learning rate as tensors on the parameters' device and steps with tensor
arithmetic only (no host synchronization), so the step can be captured in a device graph.
`exp_avg_dtype` / `exp_avg_sq_dtype` may be torch.bfloat16: the moments are kept in bf16 and
updated in float32 (the parameter update reads the float32 values, which are rounded once when
stored), as Transformer Engine's unscaled bf16 states. (A backend's fused Adam may take one
dtype per parameter's tensors only: te-backend-cuda's does, so bf16 moments beside float32
parameters or master weights run the reference update there, which warns once.) Transformer
Engine's scaled states (float16, FP8 as torch.uint8, a float16 master_weight_dtype), param
remainders and AMSGrad are not implemented and raise NotImplementedError.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch

from .. import ops
from ._grads import GradResetMixin, grad_of, run_closure
from ._state_dtypes import StateDtypesMixin

NAME = "FusedAdam"
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def _reject(name: str, value, default) -> None:
    if not (value is default or value == default):
        raise NotImplementedError(f"{NAME}: {name}={value!r} is not supported by te-core; leave it at {default!r}")


class FusedAdam(StateDtypesMixin, GradResetMixin, torch.optim.Optimizer):
    """Adam with decoupled weight decay (AdamW) by default, Adam with L2 with adam_w_mode=False."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, bias_correction: bool = True, adam_w_mode: bool = True,
                 capturable: bool = False, master_weights: bool = False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, use_decoupled_grad: bool = False,
                 store_param_remainders: bool = False, set_grad_none: Optional[bool] = None):
        if amsgrad:
            raise NotImplementedError(f"{NAME}: amsgrad=True is not supported (nor is it by Transformer Engine)")
        _reject("master_weight_dtype", master_weight_dtype, torch.float32)
        _reject("store_param_remainders", store_param_remainders, False)
        for name, value in (("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if value not in MOMENT_DTYPES:
                raise NotImplementedError(
                    f"{NAME}: {name}={value!r} is not supported by te-core (Transformer Engine's scaled float16 and "
                    "FP8 states are not implemented); use torch.float32 or torch.bfloat16")
        if capturable and exp_avg_dtype != exp_avg_sq_dtype:
            raise ValueError(f"{NAME}: capturable=True needs exp_avg_dtype and exp_avg_sq_dtype alike (both float32 or "
                             f"both bfloat16), as in Transformer Engine; got {exp_avg_dtype} and {exp_avg_sq_dtype}")
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise ValueError(f"{NAME}: lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"{NAME}: betas must be two values in [0, 1), got {betas}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode, self.capturable, self.master_weights = bool(adam_w_mode), capturable, master_weights
        self.use_decoupled_grad = use_decoupled_grad
        self.exp_avg_dtype, self.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
        self._init_set_grad_none(set_grad_none)

    def state_dtype(self, name: str):
        """The dtype state `name` is kept in (and reloaded in: StateDtypesMixin)."""
        return {"exp_avg": self.exp_avg_dtype, "exp_avg_sq": self.exp_avg_sq_dtype,
                "master_param": torch.float32}.get(name)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, the states in their own dtypes (StateDtypesMixin), and each group's step
        count and learning rate in this optimizer's form: float32 tensors on the parameters'
        device when capturable (a checkpoint loaded to the CPU would otherwise put host
        arithmetic into every step, which a captured graph does not replay), plain numbers
        otherwise (a capturable optimizer's checkpoint resumed without capturable=True)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for key in ("step", "lr"):
                value = group.get(key)
                if not torch.is_tensor(value):
                    continue
                if self.capturable:
                    group[key] = value.to(device=group["params"][0].device, dtype=torch.float32)
                else:
                    group[key] = int(value.item()) if key == "step" else value.item()

    def _state_of(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, dtype=self.exp_avg_dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.exp_avg_sq_dtype, memory_format=torch.preserve_format)
            if self.master_weights and p.dtype != torch.float32:
                state["master_param"] = p.detach().float()
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group in self.param_groups:
            live = [(p, g) for p in group["params"] if (g := grad_of(p, self.use_decoupled_grad, NAME)) is not None]
            if not live:
                continue
            if self.capturable:
                self._capturable_step(group, live)
            else:
                group["step"] = group.get("step", 0) + 1
                self._fused_step(group, live)
        return loss

    def _fused_step(self, group: dict, live) -> None:
        """One ops.multi_tensor_adam call per (device, dtype) of the stepped tensors."""
        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                     step=group["step"], adam_w_mode=self.adam_w_mode, bias_correction=group["bias_correction"])
        batches = defaultdict(lambda: ([], [], [], [], []))
        for p, g in live:
            state = self._state_of(p)
            target = state.get("master_param", p)
            lists = batches[(target.device, target.dtype, g.dtype)]
            for lst, t in zip(lists, (target, g, state["exp_avg"], state["exp_avg_sq"], p)):
                lst.append(t)
        for targets, grads, exp_avgs, exp_avg_sqs, owners in batches.values():
            ops.multi_tensor_adam(targets, grads, exp_avgs, exp_avg_sqs, **hyper)
            for target, p in zip(targets, owners):
                if target is not p:  # a master copy: the parameter gets its rounded value
                    p.copy_(target)

    def _capturable_step(self, group: dict, live) -> None:
        """The same update with lr and the step count as device tensors: no value leaves the device."""
        device = live[0][0].device
        if not torch.is_tensor(group.get("step")):
            group["step"] = torch.zeros((), dtype=torch.float32, device=device)
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        step, lr = group["step"], group["lr"]
        step.add_(1)
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            bc1, bc2_sqrt = 1 - beta1**step, (1 - beta2**step).sqrt()
        else:
            bc1 = bc2_sqrt = torch.ones((), device=device)
        for p, g in live:
            state = self._state_of(p)
            target = state.get("master_param", p)
            m_kept, v_kept = state["exp_avg"], state["exp_avg_sq"]
            p32, g32, m, v = target.float(), g.float(), m_kept.float(), v_kept.float()
            if group["weight_decay"] != 0.0:
                if self.adam_w_mode:
                    p32.mul_(1 - lr * group["weight_decay"])
                else:
                    g32 = g32.add(p32, alpha=group["weight_decay"])
            m.lerp_(g32, 1 - beta1)
            v.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            p32.sub_(m / (v.sqrt() / bc2_sqrt + group["eps"]) * (lr / bc1))
            for kept, value in ((m_kept, m), (v_kept, v)):
                if kept is not value:  # bf16 moments: rounded once, after the update read them
                    kept.copy_(value)
            if target is not p32:  # a low-precision parameter stepped through a float32 copy
                target.copy_(p32)
            if p is not target:  # a master copy: the parameter gets its rounded value
                p.copy_(target)
