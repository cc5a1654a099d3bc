"""The delayed-scaling update (amax histories -> new scales) in one te_triton launch, replayed
as a captured CUDA graph once the same set of histories comes back (update_graph)."""
from __future__ import annotations

import torch
from te_triton import scaling

from .. import configs, persistent, update_graph
from .checks import OK
from .launch import guard


def delayed_scaling_update(amax_histories, scales, fp8_maxes, *, margin=0.0, amax_compute_algo="max"):
    if not amax_histories:
        return None
    first = amax_histories[0]
    key = (scaling.plan_key(amax_histories, scales, fp8_maxes), float(margin), amax_compute_algo, first.get_device())
    # The plan's device tables outlive this call: they come from outside any CUDA-graph pool.
    place = persistent.placer(first.device)
    with guard(first):
        update_graph.run(key, lambda: scaling.plan(amax_histories, scales, fp8_maxes, first.device, place, margin),
                         lambda: scaling.delayed_scaling_update(amax_histories, scales, fp8_maxes, margin=margin,
                                                                amax_compute_algo=amax_compute_algo,
                                                                cfg=configs.for_tensor(first).scaling, place=place))
    return None


def scaling_ok(amax_histories, scales, fp8_maxes, *, margin=0.0, amax_compute_algo="max"):
    if callable(amax_compute_algo):
        return False, "a callable amax_compute_algo runs on the reference path"
    if amax_compute_algo not in ("max", "most_recent"):
        return False, f"amax_compute_algo {amax_compute_algo!r} has no kernel"
    if len(amax_histories) != len(scales):
        return False, "histories and scales do not pair up (the reference names the problem)"
    if scaling.planned(amax_histories, scales, fp8_maxes):  # checked when the kernel first ran on them
        return OK
    devices = {t.device for t in list(amax_histories) + list(scales)}
    if len(devices) > 1 or any(d.type != "cuda" for d in devices):
        return False, "histories and scales must all be on one CUDA device"
    for h, s in zip(amax_histories, scales):
        if h.dim() != 2 or h.dtype != torch.float32 or not h.is_contiguous() or not s.is_contiguous():
            return False, "histories must be contiguous float32 (L, n) tensors with contiguous scales"
    return OK
