"""te_core.ops.multi_tensor_adam on torch's fused CUDA Adam/AdamW kernels (the ones behind
torch.optim.Adam(fused=True)), which match torch.optim's math by construction."""
from __future__ import annotations

from collections import defaultdict
from typing import Tuple

import torch


def multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                      adam_w_mode=True, bias_correction=True):
    if not params:
        return None
    kernel = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    groups = defaultdict(lambda: ([], [], [], []))
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        group = groups[(p.device, p.dtype)]
        for lst, t in zip(group, (p, g, m, v)):
            lst.append(t)
    for (device, _), (ps, gs, ms, vs) in groups.items():
        steps = [torch.tensor(float(step), dtype=torch.float32, device=device)] * len(ps)
        kernel(ps, gs, ms, vs, [], steps, lr=float(lr), beta1=float(beta1), beta2=float(beta2),
               weight_decay=float(weight_decay), eps=float(eps), amsgrad=False, maximize=False)
    return None


def supports_multi_tensor_adam(params, grads, exp_avgs, exp_avg_sqs, *, bias_correction=True, step=1,
                               **_) -> Tuple[bool, str]:
    if not bias_correction:
        return False, "torch's fused Adam always applies bias correction"
    if not hasattr(torch, "_fused_adamw_"):
        return False, "this torch has no fused Adam kernels"
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)) or step < 1:
        return False, "list lengths differ or step < 1 (the reference reports which)"
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if not p.is_cuda:
            return False, "params are not on a CUDA device"
        if not (p.dtype == g.dtype == m.dtype == v.dtype) or p.dtype not in (torch.float32, torch.bfloat16,
                                                                             torch.float16):
            return False, "fused Adam needs each param, grad and state in one float dtype"
        if not (p.shape == g.shape == m.shape == v.shape) or p.device != g.device:
            return False, "shapes or devices differ within a param's tensors"
    return True, ""
