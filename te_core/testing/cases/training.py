"""Cases for ops.loss (cross-entropy with its gradient), ops.optimizer (multi-tensor Adam,
in place) and ops.scaling (the delayed-scaling update, in place)."""
from __future__ import annotations

import torch

from ..inputs import case, randn, short, uniform


def _cross_entropy(n, v, dtype, reduction, smoothing=0.0, ignore_index=-100, n_ignored=0):
    name = f"{reduction}-{short(dtype)}-{n}x{v}" + (f"-smoothing{smoothing}" if smoothing else "")
    name += f"-ignore{ignore_index}x{n_ignored}" if n_ignored else ""

    @case("cross_entropy", name, grad_of=(0,))
    def make(gen):
        logits = randn(gen, n, v, dtype=dtype, std=3.0)
        target = torch.randint(0, v, (n,), generator=gen)
        target[torch.randperm(n, generator=gen)[:n_ignored]] = ignore_index
        kwargs = dict(ignore_index=ignore_index, label_smoothing=smoothing, reduction=reduction)
        return (logits, target), kwargs


_cross_entropy(16, 100, torch.float32, "mean")
_cross_entropy(13, 257, torch.bfloat16, "sum", n_ignored=4)
_cross_entropy(9, 50, torch.float32, "none", smoothing=0.1)
_cross_entropy(12, 33, torch.float16, "mean", smoothing=0.2, ignore_index=7, n_ignored=3)
_cross_entropy(8, 40, torch.float32, "mean", smoothing=0.1, n_ignored=2)


def _adam(name, param_dtype, state_dtype=torch.float32, **hyper):
    shapes = [(7,), (5, 13), (3, 4, 5)]

    @case("multi_tensor_adam", name)
    def make(gen):
        params = [randn(gen, *s, dtype=param_dtype) for s in shapes]
        grads = [randn(gen, *s, dtype=param_dtype, std=0.1) for s in shapes]
        exp_avgs = [randn(gen, *s, dtype=state_dtype, std=0.01) for s in shapes]
        exp_avg_sqs = [uniform(gen, *s, low=1e-5, high=1e-3, dtype=state_dtype) for s in shapes]
        kwargs = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=5)
        kwargs.update(hyper)
        return (params, grads, exp_avgs, exp_avg_sqs), kwargs


_adam("adamw-fp32", torch.float32)
_adam("adam-l2-fp32-first-step", torch.float32, adam_w_mode=False, weight_decay=0.1, step=1)
_adam("adamw-no-bias-correction-fp32", torch.float32, bias_correction=False, step=3)
_adam("adamw-bf16-params-fp32-states", torch.bfloat16, step=2)


def _scaling(name, margin, algo):
    @case("delayed_scaling_update", name)
    def make(gen):
        lengths_cols = [(4, 6), (1, 2), (6, 5)]
        histories = [uniform(gen, n, c, low=0.5, high=500.0) for n, c in lengths_cols]
        h = histories[0]
        h[:, 0] = 0.0  # amax 0: keep the old scale
        h[0, 1] = float("inf")  # inf amax: keep the old scale
        h[:, 2] = float("nan")  # NaN amax: keep the old scale
        h[:, 3] = 1e-40  # 448 / 1e-40 overflows: float32 max
        histories[2][0, 4] = 3e4  # the newest amax is the largest
        histories[2][3, 1] = float("nan")  # a NaN among finite amaxes: ignored by "max" (fmaxf)
        histories[2][0, 2] = 0.0  # nothing recorded this step: history and scale left as they are
        histories[2][2, 3] = float("nan")
        histories[2][0, 3] = float("nan")  # a NaN step: rolls, keeps the scale under "most_recent"
        scales = [uniform(gen, c, low=0.5, high=8.0) for _, c in lengths_cols]
        return (histories, scales, [448.0, 57344.0, 448.0]), dict(margin=margin, amax_compute_algo=algo)


_scaling("max-margin0", 0.0, "max")
_scaling("most-recent-margin1", 1.0, "most_recent")
_scaling("max-margin2.5", 2.5, "max")
