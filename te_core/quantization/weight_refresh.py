"""A device flag that decides, inside graphs captured by their caller, whether a module's FP8
weight is quantized afresh or kept from an earlier microbatch.

Code that captures whole layers itself, once, and replays that one graph for every microbatch
(Megatron-LM's own CUDA graphs) cannot pick a graph per is_first_microbatch as
te_core.make_graphed_callables does (it captures two). Transformer Engine's answer, which such
code drives, is one persistent (1,) float32 flag: a captured graph always casts the weight and
keeps the result in the weight cache unless the flag holds 1, so the caller sets it to 0 on a
step's first microbatch and to 1 on the others, between replays, with no recapture.

While the caller's capture is marked (set_caller_capture: TE's set_capture_start / set_capture_end)
and a flag is set, a weight cast does that with device-side selects: the cache (buffers made once, at
fixed addresses) takes the new cast where the flag is 0 and keeps its bytes where it is 1, and so
does the weight's amax slot, so a skipped cast records nothing, as in Transformer Engine.
te_core.make_graphed_callables' own weight caching forces is_first_microbatch instead and is left
alone.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .tensor import QuantizedTensor


class _Flag:
    tensor: Optional[Tensor] = None
    caller_capturing = False  # process-wide: autograd runs backward passes on threads of its own


_FLAG = _Flag()


def set_skip_weight_refresh(skip: bool, device) -> Tensor:
    """Fill the flag with `skip` (made on `device` at the first call, then kept at its address,
    which captured graphs read); returns it."""
    if not isinstance(skip, bool):
        raise TypeError(f"set_skip_fp8_weight_update_tensor: skip must be True or False, got {skip!r}")
    if _FLAG.tensor is None:
        _FLAG.tensor = torch.zeros(1, dtype=torch.float32, device=device)
    _FLAG.tensor.fill_(float(skip))
    return _FLAG.tensor


def skip_weight_refresh_flag() -> Optional[Tensor]:
    """The flag, or None before any set_skip_weight_refresh."""
    return _FLAG.tensor


def set_caller_capture(active: bool) -> None:
    """Mark the start (True) or end (False) of graphs captured by their caller, which then read
    the flag; te_core.make_graphed_callables' captures never do."""
    _FLAG.caller_capturing = bool(active)


def refresh_gate() -> Optional[Tensor]:
    """The flag while it decides weight casts (set, inside a caller's capture), else None."""
    flag = _FLAG.tensor
    return flag if flag is not None and _FLAG.caller_capturing else None


def gated_weight(quantize, quantizer, cache: dict, slot: str, flag: Tensor) -> QuantizedTensor:
    """The weight for this cast: `quantize()` (the cast, recording its amax) selected into the
    persistent `cache[slot]` where `flag` is 0, the cached bytes (and the amax slot as it was)
    where it is 1. The cache entry is made once (its first contents are the first cast's, as a
    caller sets the flag to 0 before a step's first replay)."""
    group = quantizer.scaling_group
    amax_slot = None if group is None else group.amax_slot(quantizer.column)
    amax_before = None if amax_slot is None else amax_slot.clone()
    fresh = quantize()
    skip = flag != 0
    kept = cache.get(slot)
    if not _same_layout(kept, fresh):
        kept = fresh._same_kind()
        for name, value in fresh._payload().items():
            setattr(kept, name, None if value is None else torch.empty_like(value))
        cache[slot] = kept
    with torch.no_grad():
        for name, value in fresh._payload().items():
            if value is not None:
                buffer = getattr(kept, name)
                buffer.copy_(torch.where(skip, buffer, value))
        if amax_slot is not None:
            amax_slot.copy_(torch.where(skip, amax_before, amax_slot))
    return kept


def _same_layout(kept: Optional[QuantizedTensor], fresh: QuantizedTensor) -> bool:
    """Whether `kept` can take `fresh`'s bytes in place: same kind, same payload tensors."""
    if kept is None or type(kept) is not type(fresh) or kept.shape != fresh.shape:
        return False
    mine, theirs = kept._payload(), fresh._payload()
    return mine.keys() == theirs.keys() and all(
        (a is None) == (b is None) and (a is None or (a.shape, a.dtype) == (b.shape, b.dtype))
        for a, b in ((mine[k], theirs[k]) for k in mine))
