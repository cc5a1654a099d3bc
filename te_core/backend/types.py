"""Plain data a backend hands to the registry: who it is, what its device can do, its ops."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Tuple

import torch

API_VERSION = "1.0"
"""Version of the backend contract. A backend whose major version differs is rejected."""

# FP8 formats by torch dtype: the name used in capabilities and the largest finite value.
FP8_FORMATS: Mapping[torch.dtype, Tuple[str, float]] = {
    torch.float8_e4m3fn: ("E4M3", 448.0),
    torch.float8_e5m2: ("E5M2", 57344.0),
}

# Scaling modes an FP8 GEMM can be asked for (the `scaling` argument of ops.gemm_fp8).
TENSORWISE = "tensorwise"  # one float32 scale_inv per operand
ROWWISE = "rowwise"  # a: (M, 1), b: (N, 1) float32 scale_inv
BLOCK_1x128_128x128 = "block_1x128_128x128"  # a: 1x128 blocks, b: 128x128 blocks (fprop, dgrad)
BLOCK_1x128_1x128 = "block_1x128_1x128"  # both operands 1x128 blocks (wgrad)
MXFP8 = "mxfp8"  # both operands 1x32 blocks, E8M0 (uint8) scales
SCALING_MODES = (TENSORWISE, ROWWISE, BLOCK_1x128_128x128, BLOCK_1x128_1x128, MXFP8)


def fp8_format_name(dtype: torch.dtype) -> str:
    if dtype not in FP8_FORMATS:
        allowed = ", ".join(str(d) for d in FP8_FORMATS)
        raise ValueError(f"{dtype} is not an FP8 dtype te-core knows; use one of {allowed}")
    return FP8_FORMATS[dtype][0]


def fp8_max(dtype: torch.dtype) -> float:
    fp8_format_name(dtype)
    return FP8_FORMATS[dtype][1]


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, without calling .to() when it already is. Ops return their results through
    this: under torch.compile (torch 2.11) an autograd.Function output made by a no-op .to() got
    zero gradients."""
    return t if t.dtype == dtype else t.to(dtype)


@dataclass(frozen=True)
class BackendInfo:
    """Who a backend is. `vendor_versions` maps library name -> version string (or None)."""

    name: str
    device_type: str
    api_version: str = API_VERSION
    description: str = ""
    vendor_versions: Mapping[str, Optional[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do on one device; enforced by the dispatcher before each call.

    fp8_formats: format name ("E4M3", "E5M2") -> largest finite value.
    scaling_modes: the FP8 GEMM scaling modes (see SCALING_MODES) the device runs natively.
    arch: the device architecture as the vendor names it (e.g. "sm_90"), "" when not applicable.
    notes: anything a user should know (e.g. why a mode is missing), shown by `te-core info`.
    """

    fp8_formats: Mapping[str, float] = field(default_factory=dict)
    scaling_modes: frozenset = frozenset()
    arch: str = ""
    device_name: str = ""
    distributed_backend: str = ""  # torch.distributed backend name for this device ("gloo", ...)
    notes: Tuple[str, ...] = ()

    def check_fp8(self, dtype: torch.dtype) -> Optional[str]:
        """None when `dtype` is supported, else the reason it is not."""
        return self.check_fp8_name(FP8_FORMATS.get(dtype, (str(dtype), 0.0))[0])

    def check_fp8_name(self, name: str) -> Optional[str]:
        if name in self.fp8_formats:
            return None
        have = ", ".join(sorted(self.fp8_formats)) or "none"
        return f"FP8 format {name} not supported on {self.device_name or 'this device'} {self.arch} (has: {have})"

    def check_scaling(self, mode: str) -> Optional[str]:
        if mode in self.scaling_modes:
            return None
        have = ", ".join(sorted(self.scaling_modes)) or "none"
        return f"FP8 scaling mode {mode!r} not supported on {self.device_name or 'this device'} {self.arch} (has: {have})"


Supports = Callable[..., Tuple[bool, str]]


@dataclass(frozen=True)
class OpImpl:
    """One backend's implementation of one contract op.

    fn: called with exactly the contract signature.
    supports: optional; called with the same arguments before `fn`; returns (True, "") to run,
        or (False, reason) to decline, in which case the reference implementation runs (with one
        warning per op and reason). It must be cheap and must not raise for valid contract input.
    """

    fn: Callable[..., Any]
    supports: Optional[Supports] = None
