"""Multi-tensor Adam/AdamW through torch's fused kernels (torch._fused_adamw_ / _fused_adam_),
which torch_musa implements for MUSA (csrc/aten/ops/FusedAdam.cpp; `fused=True` optimizers).

They follow torch.optim exactly: the step count is read from float32 step tensors (torch.optim
increments them before the call, so they hold this step), bias correction is always applied,
math is float32 for 16-bit tensors, and each launch takes tensors of one device and dtype.
"""
from __future__ import annotations

from collections import defaultdict
from typing import List

import torch
from torch import Tensor

from .gemm import HIGH_PRECISION, Verdict


def _groups(params, grads, exp_avgs, exp_avg_sqs):
    grouped = defaultdict(lambda: ([], [], [], []))
    for group in zip(params, grads, exp_avgs, exp_avg_sqs):
        lists = grouped[(group[0].device, group[0].dtype)]
        for target, tensor in zip(lists, group):
            target.append(tensor)
    return grouped


def multi_tensor_adam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
) -> None:
    kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    for (device, _), (p, g, m, v) in _groups(params, grads, exp_avgs, exp_avg_sqs).items():
        steps = [torch.tensor(float(step), dtype=torch.float32, device=device)] * len(p)
        kernel(
            p, g, m, v, [], steps,
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
        )


def multi_tensor_adam_supports(params, grads, exp_avgs, exp_avg_sqs, *, bias_correction=True, **_) -> Verdict:
    if not bias_correction:
        return False, "bias_correction=False: torch's fused Adam always applies bias correction"
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)):
        return False, "params, grads, exp_avgs and exp_avg_sqs must have the same length"
    for i, group in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if group[0].dtype not in HIGH_PRECISION:
            return False, f"params[{i}] is {group[0].dtype}; fused Adam takes float32, float16 or bfloat16"
        if any(t.dtype != group[0].dtype or t.device != group[0].device for t in group[1:]):
            return False, (
                f"tensor {i}: fused Adam needs param, grad and both states of one dtype and device, got "
                + ", ".join(str(t.dtype) for t in group)
            )
    return True, ""
