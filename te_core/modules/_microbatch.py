"""One is_first_microbatch for every te_core module a forward runs, whatever each was passed.

make_graphed_callables(cache_quantized_params=True) captures a whole model, e.g. an nn.Sequential
whose forward takes no is_first_microbatch, once as a first microbatch (weights quantized into
the modules' weight caches) and once as a later one (the cached weights read back). While
`forced_first_microbatch(flag)` is active, QuantizedModule.quantization_step uses `flag` for every
module, as Transformer Engine's graphs apply their weight-caching flag to every module inside.

The setting is process-wide, not per thread: a checkpointed region that recomputes its forward
does so inside the backward, on autograd's own threads.
"""
from __future__ import annotations

from typing import Optional


class _Forced:
    value: Optional[bool] = None


_FORCED = _Forced()


class forced_first_microbatch:
    """Context manager: every quantization_step inside sees is_first_microbatch=`flag`
    (None: each module's own argument, the default)."""

    def __init__(self, flag: Optional[bool]):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"is_first_microbatch must be True, False or None, got {flag!r}")
        self.flag = flag

    def __enter__(self):
        self._outer = _FORCED.value
        if self.flag is not None:
            _FORCED.value = self.flag

    def __exit__(self, *exc):
        _FORCED.value = self._outer
        return False


def first_microbatch(given: Optional[bool]) -> Optional[bool]:
    """The is_first_microbatch a module's step uses: the forced one if any, else `given`."""
    forced = _FORCED.value
    return given if forced is None else forced


def forced_first_microbatch_active() -> bool:
    """Whether a forced_first_microbatch(flag) with a flag is active (make_graphed_callables'
    weight-caching variants, which pick their graph per call instead of reading a device flag)."""
    return _FORCED.value is not None
