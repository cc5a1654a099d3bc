"""Comparing a backend's results with the reference's: structure, dtype, device, values.

Each output is compared at the tolerance its own computation allows:
- high-precision results: Transformer Engine's tolerance of the compared dtype;
- FP8 data: bit for bit where the case makes it deterministic (a pure cast at a fixed scale);
  for fused ops whose FP8 output follows a float32 computation, bit for bit except for a small
  budget of values one FP8 step away (FP8_STEP_BUDGET);
- results with an error model of their own (an FP8 GEMM on exact FP8 operands: only the
  accumulation and the output rounding err): a per-element bound and a bound on the error's
  norm (ErrorBound), never the tolerance of a cast the computation does not do.
Every check raises an AssertionError that names the output (`where`), what differs and by how much.
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
"""One FP8 step of each format (values dequantized from FP8 by an end-to-end model test)."""

FP8_STEP_BUDGET = 0.01
"""Fraction of an FP8 output (at least one value) that may sit one FP8 step from the
reference's when the op computes it in float32 first (activation, norm + cast): two correct
float32 computations differ in the last bits, which moves a value across an FP8 rounding
boundary for about one element in 10^5; a wrong scale, rounding mode or formula moves a large
share of them, and any value two steps off fails."""


@dataclass(frozen=True)
class ErrorBound:
    """What a correct implementation may differ from the reference by, element by element
    (a float64 tensor of the output's shape) and in the Euclidean norm of the whole error."""

    per_element: Tensor
    norm: float


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
            assert_fp8_near(actual, expected, where=where)
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


def _fp8_positions(x: Tensor) -> Tensor:
    """Each value's position among the format's representable values in order (+0 and -0 are
    one value; NaN is left to the caller), so adjacent FP8 values differ by 1."""
    table = torch.arange(256, dtype=torch.uint8).view(x.dtype).float()
    table = torch.unique(table[~table.isnan()])  # sorted; -0.0 == 0.0
    return torch.searchsorted(table, x.float().nan_to_num(0.0).contiguous())


def assert_fp8_near(actual: Tensor, expected: Tensor, *, where: str) -> None:
    """Bit-exact FP8 but for FP8_STEP_BUDGET of the values, which may be one step away."""
    a_nan, e_nan = actual.float().isnan(), expected.float().isnan()
    off = (_fp8_positions(actual) - _fp8_positions(expected)).abs().masked_fill(a_nan & e_nan, 0)
    off = off.masked_fill(a_nan ^ e_nan, 2)  # NaN against a number: never near
    far = off > 1
    if far.any():
        idx = _first(far)
        raise AssertionError(
            f"{where}: {int(far.sum())} of {far.numel()} FP8 values are more than one FP8 step from the "
            f"reference's; first at {idx}: got {actual[idx].float().item()!r}, expected {expected[idx].float().item()!r}"
        )
    stepped, budget = int((off == 1).sum()), max(1, int(FP8_STEP_BUDGET * off.numel()))
    if stepped > budget:
        idx = _first(off == 1)
        raise AssertionError(
            f"{where}: {stepped} of {off.numel()} FP8 values are one FP8 step from the reference's; a float32 "
            f"computation of the same formula moves at most {budget} (a wrong scale or rounding mode moves "
            f"many); first at {idx}: got {actual[idx].float().item()!r}, expected {expected[idx].float().item()!r}"
        )


def assert_values(actual: Tensor, expected: Tensor, *, where: str, tol: Tol) -> None:
    """Finite where the reference is finite (catches unwritten NaN-poisoned outputs), then
    |actual - expected| <= atol + rtol |expected|; inf/NaN must match the reference's."""
    _assert_close(actual, expected, tol.atol + tol.rtol * expected.double().abs(), where=where,
                  what=f"rtol={tol.rtol}, atol={tol.atol}")


FLOAT32_ROUNDOFF = 2.0**-24


def assert_column_sums(actual: Any, expected: Tensor, summed: Tensor, *, where: str,
                       device_type: Optional[str] = None) -> None:
    """A bias gradient: the column sums of `summed` (rows: every dimension but the last),
    accumulated in float32 in whatever order the backend picks. Besides its dtype's tolerance,
    each sum may differ from the reference's by what two float32 summations of its column can
    (2 n u sum_i |x_i| for n rows): where large values cancel, that is far more than a tolerance
    relative to the small result, and a lost or doubled row is still far more than it."""
    if not isinstance(actual, Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
        assert_same(actual, expected, where=where)  # names the type, shape or dtype difference
    if device_type is not None and actual.device.type != device_type:
        raise AssertionError(f"{where}: on device {actual.device}, expected the backend's device type {device_type!r}")
    columns = summed.detach().cpu().double().reshape(-1, expected.shape[-1])
    tol = TOLERANCES[expected.dtype]
    e = expected.detach().cpu()
    allowed = tol.atol + tol.rtol * e.double().abs() + 2 * columns.shape[0] * FLOAT32_ROUNDOFF * columns.abs().sum(0)
    _assert_close(actual.detach().cpu(), e, allowed, where=where,
                  what=f"rtol={tol.rtol}, atol={tol.atol} and two float32 summations' rounding")


def assert_within(actual: Any, expected: Tensor, bound: ErrorBound, *, where: str,
                  device_type: Optional[str] = None) -> None:
    """A result with its own error model: within bound.per_element everywhere, and the error's
    norm within bound.norm (a systematic error, such as a scaled result, shows in the norm long
    before any one element leaves its worst-case bound)."""
    if not isinstance(actual, Tensor) or actual.shape != expected.shape or actual.dtype != expected.dtype:
        assert_same(actual, expected, where=where)  # names the type, shape or dtype difference
    if device_type is not None and actual.device.type != device_type:
        raise AssertionError(f"{where}: on device {actual.device}, expected the backend's device type {device_type!r}")
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    _assert_close(actual, expected, bound.per_element, where=where, what="the per-element error bound")
    err = (actual.double() - expected.double()).nan_to_num(0.0, 0.0, 0.0)
    norm = torch.linalg.vector_norm(err).item()
    if norm > bound.norm:
        raise AssertionError(
            f"{where}: the error's norm {norm:.4g} exceeds {bound.norm:.4g}, what the computation's rounding "
            f"allows (a systematic error, e.g. a result scaled by a constant); max abs error {err.abs().max().item():.3g}"
        )


def _assert_close(actual: Tensor, expected: Tensor, allowed: Tensor, *, where: str, what: str) -> None:
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
    bad = err > allowed
    if bad.any():
        idx = _first(bad)
        raise AssertionError(
            f"{where}: {int(bad.sum())} of {bad.numel()} elements differ beyond {what}; "
            f"max abs error {err.max().item():.3g}; first at {idx}: got {a[idx].item()!r}, expected {e[idx].item()!r}"
        )


def _first(mask: Tensor) -> tuple:
    return tuple(int(i) for i in mask.nonzero()[0]) if mask.dim() else ()
