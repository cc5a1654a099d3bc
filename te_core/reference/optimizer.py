"""Reference multi-tensor Adam/AdamW step: the single-tensor torch.optim.Adam(W) update, in float32.

The operations and their order follow torch's `_single_tensor_adam` so float32 results agree
to the last bit or so; tensors of other dtypes are updated through float32 copies.
"""
from __future__ import annotations

from typing import List

from torch import Tensor

from .cast import check_float


def _check_lists(params, grads, exp_avgs, exp_avg_sqs, step: int) -> None:
    lists = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    lengths = {name: len(lst) for name, lst in lists.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"the tensor lists must have the same length, got {lengths}")
    for i in range(len(params)):
        for name, lst in lists.items():
            check_float(f"{name}[{i}]", lst[i])
            if lst[i].shape != params[i].shape:
                raise ValueError(
                    f"{name}[{i}] has shape {tuple(lst[i].shape)}; params[{i}] has {tuple(params[i].shape)}"
                )
    if step < 1:
        raise ValueError(f"step={step}: it counts this step, so it starts at 1")


def _adam_one(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode, bc1, bc2_sqrt) -> None:
    """Update float32 tensors p, m, v in place (g is not modified)."""
    if weight_decay != 0.0:
        if adam_w_mode:
            p.mul_(1.0 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bc1))


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
    _check_lists(params, grads, exp_avgs, exp_avg_sqs, step)
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2_sqrt = (1.0 - beta2**step) ** 0.5 if bias_correction else 1.0
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adam_w_mode=adam_w_mode)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32, m32, v32 = p.float(), m.float(), v.float()  # the tensors themselves when float32
        _adam_one(p32, g.float(), m32, v32, bc1=bc1, bc2_sqrt=bc2_sqrt, **hyper)
        for dst, src in ((p, p32), (m, m32), (v, v32)):
            if dst is not src:
                dst.copy_(src)
