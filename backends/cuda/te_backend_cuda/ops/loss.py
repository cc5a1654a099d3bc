"""Cross-entropy over a vocabulary, forward and backward, on te_triton's chunked loss kernels.

A target outside [0, V) (not ignore_index) makes its row's loss and gradient NaN, as the
contract allows: raising would need a host synchronization on every call."""
from __future__ import annotations

from te_triton import loss

from .. import configs
from .checks import FLOAT_DTYPES, OK


def cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    return loss.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                              reduction=reduction, cfg=configs.for_tensor(logits).loss)


def cross_entropy_ok(logits, target, **_):
    if logits.dim() != 2 or target.dim() != 1 or target.dtype.is_floating_point or target.device != logits.device:
        return False, "logits must be 2-D and target 1-D integer on the same device"
    if not logits.is_cuda or logits.dtype not in FLOAT_DTYPES or not logits.is_contiguous():
        return False, "logits must be contiguous float32/bfloat16/float16 on a CUDA device"
    return OK
