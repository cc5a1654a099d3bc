"""Comparing a backend's results with the reference's: structure, dtype, device, values.

Tolerances are Transformer Engine's, chosen by the dtype of the compared tensor. FP8 data is
compared bit for bit where the case makes it deterministic (a pure cast at a fixed scale),
else as values with the FP8 format's tolerance (one FP8 step). Every check raises an
AssertionError that names the output (`where`), what differs and by how much.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ..backend.types import FP8_FORMATS


@dataclass(frozen=True)
class Tol:
    rtol: float
    atol: float

    def loosest(self, other: Optional["Tol"]) -> "Tol":
        if other is None:
            return self
        return Tol(max(self.rtol, other.rtol), max(self.atol, other.atol))


TOLERANCES = {
    torch.float64: Tol(1e-12, 1e-12),
    torch.float32: Tol(1.3e-6, 1e-5),
    torch.bfloat16: Tol(1.6e-2, 1e-5),
    torch.float16: Tol(1e-3, 1e-5),
}
"""High-precision tolerances by dtype (Transformer Engine's)."""

FP8_TOLERANCES = {
    torch.float8_e4m3fn: Tol(0.125, 0.0675),
    torch.float8_e5m2: Tol(0.25, 0.125),
}
"""For FP8 data that is not a pure cast, and for values dequantized after FP8 GEMMs."""


def fp8_tolerance(*dtypes: torch.dtype) -> Tol:
    """The loosest FP8 tolerance among `dtypes` (a mixed E4M3 x E5M2 GEMM gets E5M2's)."""
    tol = None
    for dtype in dtypes:
        if dtype in FP8_TOLERANCES:
            tol = FP8_TOLERANCES[dtype].loosest(tol)
    if tol is None:
        raise ValueError(f"none of {dtypes} is an FP8 dtype; use one of {list(FP8_TOLERANCES)}")
    return tol


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_FORMATS


def assert_same(actual: Any, expected: Any, *, where: str = "result", exact_fp8: bool = True,
                tol: Optional[Tol] = None, device_type: Optional[str] = None) -> None:
    """Walks `expected` (tensors, tuples, lists, dicts, None, plain values) and checks `actual` matches.

    exact_fp8: FP8 tensors must match bit for bit (else within one FP8 step).
    tol: a floor for the float tolerances (the loosest of it and the dtype's is used).
    device_type: when given, every tensor of `actual` must be on a device of that type.
    """
    if isinstance(expected, Tensor):
        if not isinstance(actual, Tensor):
            raise AssertionError(f"{where}: expected a tensor, got {type(actual).__name__}")
        assert_tensor(actual, expected, where=where, exact_fp8=exact_fp8, tol=tol, device_type=device_type)
    elif isinstance(expected, (tuple, list)):
        if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
            got = f"{type(actual).__name__} of {len(actual)}" if isinstance(actual, (tuple, list)) else repr(actual)
            raise AssertionError(f"{where}: expected a {type(expected).__name__} of {len(expected)}, got {got}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, where=f"{where}[{i}]", exact_fp8=exact_fp8, tol=tol, device_type=device_type)
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            raise AssertionError(f"{where}: expected a dict with keys {sorted(expected)}, got {actual!r}")
        for key in expected:
            assert_same(actual[key], expected[key], where=f"{where}[{key!r}]", exact_fp8=exact_fp8, tol=tol,
                        device_type=device_type)
    elif expected is None:
        if actual is not None:
            raise AssertionError(f"{where}: expected None (as the reference returns), got {type(actual).__name__}")
    elif actual != expected:
        raise AssertionError(f"{where}: expected {expected!r}, got {actual!r}")


def assert_tensor(actual: Tensor, expected: Tensor, *, where: str, exact_fp8: bool = True,
                  tol: Optional[Tol] = None, device_type: Optional[str] = None) -> None:
    if device_type is not None and actual.device.type != device_type:
        raise AssertionError(f"{where}: on device {actual.device}, expected the backend's device type {device_type!r}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{where}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{where}: dtype {actual.dtype}, expected {expected.dtype}")
    actual = actual.detach().cpu()
    expected = expected.detach().cpu()
    if is_fp8(expected.dtype):
        if exact_fp8:
            assert_fp8_bitexact(actual, expected, where=where)
        else:
            assert_values(actual.float(), expected.float(), where=where, tol=fp8_tolerance(expected.dtype))
    elif expected.is_floating_point():
        assert_values(actual, expected, where=where, tol=TOLERANCES[expected.dtype].loosest(tol))
    elif not torch.equal(actual, expected):
        assert_values(actual.double(), expected.double(), where=where, tol=Tol(0.0, 0.0))


def assert_fp8_bitexact(actual: Tensor, expected: Tensor, *, where: str) -> None:
    """Bit-for-bit FP8 equality, any NaN encoding matching any other."""
    a_bits, e_bits = actual.view(torch.uint8), expected.view(torch.uint8)
    both_nan = actual.float().isnan() & expected.float().isnan()
    bad = (a_bits != e_bits) & ~both_nan
    if bad.any():
        idx = _first(bad)
        raise AssertionError(
            f"{where}: {int(bad.sum())} of {bad.numel()} FP8 values differ from the reference "
            f"(bit-exact expected at a fixed scale); first at {idx}: got {actual[idx].float().item()!r} "
            f"(0x{a_bits[idx].item():02x}), expected {expected[idx].float().item()!r} (0x{e_bits[idx].item():02x})"
        )


def assert_values(actual: Tensor, expected: Tensor, *, where: str, tol: Tol) -> None:
    """Finite where the reference is finite (catches unwritten NaN-poisoned outputs), then
    |actual - expected| <= atol + rtol |expected|; inf/NaN must match the reference's."""
    unwritten = ~actual.isfinite() & expected.isfinite()
    if unwritten.any():
        idx = _first(unwritten)
        raise AssertionError(
            f"{where}: {int(unwritten.sum())} of {unwritten.numel()} elements are not finite where the "
            f"reference's are (unwritten output still holding its NaN poison, or an overflow); "
            f"first at {idx}: got {actual[idx].item()!r}, expected {expected[idx].item()!r}"
        )
    a, e = actual.double(), expected.double()
    special_mismatch = ~e.isfinite() & ~((a == e) | (a.isnan() & e.isnan()))
    if special_mismatch.any():
        idx = _first(special_mismatch)
        raise AssertionError(f"{where}: at {idx} got {a[idx].item()!r}, the reference has {e[idx].item()!r}")
    finite = e.isfinite()
    err = torch.where(finite, (a - e).abs(), torch.zeros_like(a))
    bad = err > tol.atol + tol.rtol * e.abs()
    if bad.any():
        idx = _first(bad)
        raise AssertionError(
            f"{where}: {int(bad.sum())} of {bad.numel()} elements differ beyond rtol={tol.rtol}, atol={tol.atol}; "
            f"max abs error {err.max().item():.3g}; first at {idx}: got {a[idx].item()!r}, expected {e[idx].item()!r}"
        )


def _first(mask: Tensor) -> tuple:
    return tuple(int(i) for i in mask.nonzero()[0]) if mask.dim() else ()
