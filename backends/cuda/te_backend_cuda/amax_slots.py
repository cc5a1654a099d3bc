"""Fresh amax accumulators that need no memset launch each.

A cast that is not given an `amax_out` maxes its amax into a new zeroed float32. Zeroing it
with torch.zeros is a fill kernel per cast, whose launch costs GPU time and, on a path that
is often host-bound, a torch op's host time. Instead, one fill zeroes CHUNK slots, and
each cast takes the next unused one, 16-byte aligned like a buffer of its own. A slot is handed
out once and never reused, so nothing a caller keeps can be overwritten; a chunk is freed once
every slot of it is gone.

Chunks are kept per (device, stream): the fill is ordered before the kernels of its own stream
only. Inside a CUDA graph capture no slot is handed out: a replayed kernel would max into the
same slot again, so the caller zeroes a buffer inside the capture instead.

A current-scaling cast takes a wider slot (CURRENT_SLOTS): its amax, scale and scale_inv, so
that the scale pair needs no allocation either.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, Hashable, List, Optional

import torch

from . import persistent

CHUNK = 1024
MAX_STREAMS = 64  # chunks kept at once; torch hands out streams from a small pool, so few recur
_FLOATS_PER_SLOT = 4  # 16 bytes
CURRENT_FLOATS = 3 * _FLOATS_PER_SLOT  # amax, scale, scale_inv: 16 bytes each


def amax_slots(chunk: torch.Tensor, n: int) -> list:
    """n slots of 16 bytes: a 0-dim float32 each. One per 16 bytes: Triton specializes a kernel
    on whether each pointer is 16-byte aligned, so slots 4 bytes apart would compile a second
    variant of every cast in the middle of training."""
    return list(chunk[::_FLOATS_PER_SLOT].unbind(0))


def current_slots(chunk: torch.Tensor, n: int) -> list:
    """n slots of 48 bytes: (amax 0-dim at byte 0, scale (1,) at byte 16, scale_inv (1,) at byte 32),
    each 16-byte aligned: as the buffers a cast allocates for itself inside a CUDA-graph capture
    (where no slot is handed out). A pointer aligned one way here and the other way there makes
    Triton compile a second variant of the cast inside the capture, which a capture can refuse;
    the FP8 GEMMs need an aligned scale_inv too (cuBLASLt)."""
    rows = chunk.view(n, CURRENT_FLOATS)
    return list(zip(rows[:, 0].unbind(0), rows[:, 4:5].unbind(0), rows[:, 8:9].unbind(0)))


class ZeroedSlots:
    """take(device) -> a fresh slot on `device` (by default a 0-dim float32 zero; `split` says
    how a zeroed chunk is cut into `chunk` slots of `floats` floats each), or None where none
    may be handed out.

    `stream_key(device)` names the stream the caller's kernels go to; `capturing()` says whether
    that stream is being captured. Both are the CUDA runtime's unless a test fakes them."""

    def __init__(self, stream_key: Callable[[torch.device], Hashable], capturing: Callable[[], bool],
                 chunk: int = CHUNK, zeros: Optional[Callable[[int, torch.device], torch.Tensor]] = None,
                 floats: int = _FLOATS_PER_SLOT, split: Callable[[torch.Tensor, int], list] = amax_slots):
        self._stream_key = stream_key
        self._capturing = capturing
        self._zeros = zeros or (lambda numel, device: torch.zeros(numel, dtype=torch.float32, device=device))
        self._chunk = chunk
        self._floats = floats
        self._split = split
        self._free: Dict[Hashable, List[torch.Tensor]] = {}
        self._lock = threading.Lock()  # autograd runs backward casts on its own thread

    def take(self, device: torch.device) -> Optional[torch.Tensor]:
        if self._capturing():
            return None
        key = self._stream_key(device)
        with self._lock:
            free = self._free.get(key)
            if not free:
                # Reversed: slots go out in address order. Cut outside inference mode: a view made
                # in it could not be written in place later, in training (an FP8 weight's
                # scale_inv is refreshed in place when the optimizer requantizes it).
                with torch.inference_mode(False):
                    free = self._split(self._zeros(self._chunk * self._floats, device), self._chunk)[::-1]
                if len(self._free) >= MAX_STREAMS:  # slots already out keep their chunk alive
                    self._free.clear()
                self._free[key] = free
            return free.pop()

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


def _cuda_stream_key(device: torch.device) -> Hashable:
    """(device index, the raw handle of its current stream), without the torch.cuda.Stream object
    that torch.cuda.current_stream builds on every call."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, _raw_stream(index)


# (a CPU-only build of torch lacks the runtime's call; its stream objects say the same)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)

# Chunks come from outside any CUDA-graph pool: a chunk made while torch.compile warms up a
# graph would otherwise be a pool tensor outliving the graph's outputs (persistent.py).
SLOTS = ZeroedSlots(_cuda_stream_key, lambda: torch.cuda.is_current_stream_capturing(), zeros=persistent.zeros)
CURRENT_SLOTS = ZeroedSlots(_cuda_stream_key, lambda: torch.cuda.is_current_stream_capturing(), zeros=persistent.zeros,
                            floats=CURRENT_FLOATS, split=current_slots)


def fresh(amax_out: Optional[torch.Tensor], x: torch.Tensor) -> Optional[torch.Tensor]:
    """amax_out if the caller gave one, else a pooled zero on x's device (None under capture:
    the kernels then zero a buffer of their own)."""
    return amax_out if amax_out is not None else SLOTS.take(x.device)


NO_SLOTS = (None, None, None)


def fresh_current(x: torch.Tensor):
    """(amax, scale, scale_inv) slots for a current-scaling cast of x (Nones under capture: the
    kernels then allocate their own)."""
    return CURRENT_SLOTS.take(x.device) or NO_SLOTS
