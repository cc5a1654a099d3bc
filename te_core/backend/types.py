"""Plain data a backend hands to the registry: who it is, what its device can do, its ops."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Tuple

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


_FORMAT_NAMES = {dtype: f[0] for dtype, f in FP8_FORMATS.items()}
_FORMAT_MAXES = {dtype: f[1] for dtype, f in FP8_FORMATS.items()}


# Every cast of every backend asks these (several times per op, on a host-bound path): one dict
# lookup each, and plain functions, which torch.compile traces in every supported torch.
def fp8_format_name(dtype: torch.dtype) -> str:
    name = _FORMAT_NAMES.get(dtype)
    return _unknown_fp8(dtype) if name is None else name


def fp8_max(dtype: torch.dtype) -> float:
    value = _FORMAT_MAXES.get(dtype)
    return _unknown_fp8(dtype) if value is None else value


def _unknown_fp8(dtype):
    allowed = ", ".join(str(d) for d in FP8_FORMATS)
    raise ValueError(f"{dtype} is not an FP8 dtype te-core knows; use one of {allowed}")


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, without calling .to() when it already is. Ops return their results through
    this: under torch.compile (torch 2.11) an autograd.Function output made by a no-op .to() got
    zero gradients."""
    return t if t.dtype == dtype else t.to(dtype)


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_version(value: Any, length: int) -> bool:
    """A tuple of `length` ints >= 0 (bool excluded: True is no version number)."""
    return (isinstance(value, tuple) and len(value) == length
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


@dataclass(frozen=True)
class BackendInfo:
    """Who a backend is. `vendor_versions` maps library name -> version string (or None)."""

    name: str
    device_type: str
    api_version: str = API_VERSION
    description: str = ""
    vendor_versions: Mapping[str, Optional[str]] = field(default_factory=dict)

    def problems(self) -> List[str]:
        """What is malformed, checked when the plugin loads (empty when nothing is)."""
        found = [f"{attr} must be a non-empty string, got {getattr(self, attr)!r}"
                 for attr in ("name", "device_type", "api_version")
                 if not (_is_text(getattr(self, attr)) and getattr(self, attr).strip())]
        if not _is_text(self.description):
            found.append(f"description must be a string, got {self.description!r}")
        if not isinstance(self.vendor_versions, Mapping):
            found.append(f"vendor_versions must be a mapping, got {type(self.vendor_versions).__name__}")
        else:
            found += [f"vendor_versions[{k!r}] must be a version string or None, got {v!r}"
                      for k, v in self.vendor_versions.items() if not _is_text(k) or not (v is None or _is_text(v))]
        return found


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do on one device; enforced by the dispatcher before each call.

    fp8_formats: format name ("E4M3", "E5M2") -> largest finite value.
    scaling_modes: the FP8 GEMM scaling modes (see SCALING_MODES) the device runs natively.
    arch: the device architecture as the vendor names it (e.g. "sm_90"), "" when not applicable.
    notes: anything a user should know (e.g. why a mode is missing), shown by `te-core info`.
    compute_capability: the device's (major, minor) as its vendor numbers it (the numbers `arch`
        spells), or () for a device that has none (a CPU): Transformer Engine's
        get_device_compute_capability() answers with it.
    library_versions: library name -> (major, minor, patch) of the vendor libraries the
        backend's kernels run through on this device, as the running process loaded them (e.g.
        {"cudnn": (9, 1, 0)}); Transformer Engine's get_cudnn_version() reads "cudnn".
    """

    fp8_formats: Mapping[str, float] = field(default_factory=dict)
    scaling_modes: frozenset = frozenset()
    arch: str = ""
    device_name: str = ""
    distributed_backend: str = ""  # torch.distributed backend name for this device ("gloo", ...)
    notes: Tuple[str, ...] = ()
    compute_capability: Tuple[int, ...] = ()
    library_versions: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)

    def problems(self) -> List[str]:
        """What is malformed or contradicts te-core's formats, checked before the dispatcher
        trusts these capabilities (empty when nothing is)."""
        found = []
        known = {name: fmax for name, fmax in FP8_FORMATS.values()}
        if not isinstance(self.fp8_formats, Mapping):
            found.append(f"fp8_formats must be a mapping of format name to max value, got {self.fp8_formats!r}")
        else:
            for name, fmax in self.fp8_formats.items():
                if name not in known:
                    found.append(f"fp8_formats names {name!r}; te-core's FP8 formats are {', '.join(known)}")
                elif fmax != known[name]:
                    found.append(f"fp8_formats gives {name} the max {fmax!r}; te-core's {name} has max {known[name]:g}")
        modes = self.scaling_modes
        if not isinstance(modes, (set, frozenset)) or not all(_is_text(m) for m in modes):
            found.append(f"scaling_modes must be a frozenset of mode names, got {modes!r}")
        elif set(modes) - set(SCALING_MODES):
            found.append(f"scaling_modes names {sorted(set(modes) - set(SCALING_MODES))}; "
                         f"te-core's modes are {', '.join(SCALING_MODES)}")
        found += [f"{attr} must be a string, got {getattr(self, attr)!r}"
                  for attr in ("arch", "device_name", "distributed_backend") if not _is_text(getattr(self, attr))]
        if not isinstance(self.notes, (tuple, list)) or not all(_is_text(n) for n in self.notes):
            found.append(f"notes must be a tuple of strings, got {self.notes!r}")
        if self.compute_capability != () and not _is_version(self.compute_capability, 2):
            found.append(f"compute_capability must be a (major, minor) tuple of ints >= 0, or () for a device "
                         f"without one, got {self.compute_capability!r}")
        if not isinstance(self.library_versions, Mapping):
            found.append(f"library_versions must be a mapping of library name to version tuple, "
                         f"got {self.library_versions!r}")
        else:
            found += [f"library_versions[{k!r}] must be a (major, minor, patch) tuple of ints >= 0, got {v!r}"
                      for k, v in self.library_versions.items() if not (_is_text(k) and _is_version(v, 3))]
        return found

    def check_fp8(self, dtype: torch.dtype) -> Optional[str]:
        """None when `dtype` is supported, else the reason it is not."""
        fmt = FP8_FORMATS.get(dtype)  # (no default: str(dtype) would be built on every call)
        if fmt is not None and fmt[0] in self.fp8_formats:  # every cast and FP8 GEMM asks: no second call
            return None
        return self.check_fp8_name(fmt[0] if fmt is not None else str(dtype))

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
    traced: optional; the same op written in plain torch operations, which torch.compile traces
        into the graph in place of the opaque op, so that its compiler fuses it with its
        neighbours and launches it without the op's Python. Called while tracing with the
        contract signature; returns NotImplemented for a call it does not take (the opaque op,
        with `supports` and the fallback rules, is recorded then). Its results must equal `fn`'s
        to the contract's tolerance.
    """

    fn: Callable[..., Any]
    supports: Optional[Supports] = None
    traced: Optional[Callable[..., Any]] = None
