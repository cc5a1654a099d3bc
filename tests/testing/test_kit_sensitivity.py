"""The kit proves its sensitivity: every case fails a known-good backend (the reference) once
its results are perturbed as a plausible kernel bug would perturb them: every result scaled by
1 + eps, one element shifted, and, where the op casts to FP8, the rounding mode swapped. Per op,
some case fails an amax_out overwritten (or left alone) instead of maxed into; every case with a
strided input fails a kernel that reads it as dense memory or from its storage's start."""
from __future__ import annotations

from typing import Callable, List

import pytest
import torch
from torch import Tensor

from te_core.backend.types import fp8_max
from te_core.ops import CONTRACT
from te_core.reference import cast as reference_cast
from te_core.reference.plugin import implementations
from te_core.testing.cases import CASES
from te_core.testing.compare import is_fp8
from te_core.testing.runner import is_plain, map_tensors, run_case

REF = implementations()
CPU = torch.device("cpu")
EPS = 0.05  # below the 10% a wrong GEMM was off by; above bf16's tolerance (1.6e-2)


def _tensors(tree) -> List[Tensor]:
    found: List[Tensor] = []
    map_tensors(tree, lambda t: found.append(t) or t)
    return found


def _perturbable(t: Tensor) -> bool:
    return (t.is_floating_point() or is_fp8(t.dtype)) and t.numel() > 0


def _scaled(t: Tensor) -> Tensor:
    """A high-precision result scaled by 1 + EPS. An FP8 result is scaled before its cast
    (_scaled_before_cast) where the op casts; scaling FP8 values after it can round back to the
    same values (E5M2's half step is 6% to 12%), so FP8 data an op only moves (a transpose) is
    scaled by one E5M2 step instead."""
    if is_fp8(t.dtype):
        fmax = fp8_max(t.dtype)
        return (t.float() * 1.25).clamp(-fmax, fmax).to(t.dtype)
    return t * (1 + EPS)


def _shifted(t: Tensor) -> Tensor:
    """The first element moved by the tensor's largest magnitude, toward zero (so an FP8 value
    stays in range): a value written to the wrong place, or twice."""
    first = t.detach().reshape(-1)[0].float()
    step = t.detach().float().abs().max()
    delta = torch.zeros(t.shape, dtype=torch.float32)
    delta.view(-1)[0] = -step if first > 0 else step
    if is_fp8(t.dtype):
        return (t.float() + delta).to(t.dtype)
    return t + delta.to(t.dtype)


def _outputs_changed(fn, args, kwargs):
    """Call fn; return its result and the inputs it wrote (in-place updates, `out`, amax slots)."""
    inputs = _tensors((args, kwargs))
    before = [t.detach().clone() for t in inputs]
    result = fn(*args, **kwargs)
    written = [t for t, old in zip(inputs, before)
               if not torch.equal(t.detach().float().nan_to_num(7.0), old.float().nan_to_num(7.0))]
    return result, written


class NothingToPerturb(Exception):
    """The op returned and wrote nothing non-zero (an empty batch: empty results, zero sums)."""


def perturbed(fn: Callable, change: Callable[[Tensor], Tensor], only_first: bool) -> Callable:
    """fn with `change` applied to each result (or, only_first, to the first result that can
    take it): returned tensors are replaced, written inputs are changed in place."""

    def wrapper(*args, **kwargs):
        result, written = _outputs_changed(fn, args, kwargs)
        done = []

        def apply(t: Tensor) -> Tensor:
            if not _perturbable(t) or (only_first and done) or not t.detach().float().abs().max() > 0:
                return t
            done.append(t)
            if any(t is w for w in written):
                with torch.no_grad():
                    t.copy_(change(t.detach()))
                return t
            return change(t)

        result = map_tensors(result, apply)
        for t in written:
            if not any(t is d for d in done):
                apply(t)
        if not done:
            raise NothingToPerturb(f"{getattr(fn, '__name__', fn)} returned and wrote no non-zero floating-point tensor")
        return result

    return wrapper


def _toward_zero(x32: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """The reference's saturating cast with round-toward-zero instead of round-to-nearest-even."""
    fmax = fp8_max(fp8_dtype)
    y = torch.clamp(x32, -fmax, fmax).float()
    drop = 23 - (3 if fp8_dtype == torch.float8_e4m3fn else 2)
    truncated = (y.view(torch.int32) & ~((1 << drop) - 1)).view(torch.float32)
    return torch.where(truncated.abs() < y.abs(), truncated, y).to(fp8_dtype)


def _ids(cases):
    return [c.id for c in cases]


def assert_kit_fails(case, wrong: Callable) -> None:
    """run_case must fail `wrong`; skipped where the case's results leave nothing to perturb."""
    args, kwargs = case.inputs()
    try:
        wrong(*args, **kwargs)
    except NothingToPerturb as exc:
        pytest.skip(f"{exc}: a perturbation cannot change it")
    with pytest.raises(AssertionError):
        run_case(case, wrong, REF[case.op], CPU)


def _cast_patched(monkeypatch, op: str, cast: Callable) -> Callable:
    """REF[op] with the reference's one FP8 cast (saturating_cast) replaced by `cast` during the
    call, or None where the op's cases never cast to FP8."""
    real = reference_cast.saturating_cast
    calls = []

    def counted(x32, fp8_dtype):
        calls.append(x32.numel())
        return cast(x32, fp8_dtype)

    def patched(*args, **kwargs):
        monkeypatch.setattr(reference_cast, "saturating_cast", counted)
        try:
            return REF[op](*args, **kwargs)
        finally:
            monkeypatch.setattr(reference_cast, "saturating_cast", real)

    return patched, calls


def _scaled_before_cast(x32: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    fmax = fp8_max(fp8_dtype)
    return torch.clamp(x32 * (1 + EPS), -fmax, fmax).to(fp8_dtype)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_kit_fails_scaled_results(case, monkeypatch):
    """Every high-precision result scaled by 1 + EPS, and every FP8 result cast from values
    scaled by 1 + EPS."""
    op, calls = _cast_patched(monkeypatch, case.op, _scaled_before_cast)
    args, kwargs = case.inputs()
    op(*args, **kwargs)
    change = _scaled if not calls else (lambda t: t if is_fp8(t.dtype) else _scaled(t))
    assert_kit_fails(case, perturbed(op, change, only_first=False))


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_kit_fails_one_shifted_element(case):
    assert_kit_fails(case, perturbed(REF[case.op], _shifted, only_first=True))


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_kit_fails_swapped_rounding(case, monkeypatch):
    """Where the op casts to FP8 (through the reference's one saturating cast), casting with
    round-toward-zero instead must fail the case."""
    truncating, calls = _cast_patched(monkeypatch, case.op, _toward_zero)
    args, kwargs = case.inputs()
    truncating(*args, **kwargs)
    if not any(calls):
        pytest.skip("the op casts no value to FP8 here: no rounding mode to swap")
    with pytest.raises(AssertionError):
        run_case(case, truncating, REF[case.op], CPU)


def test_reference_passes_its_own_kit():
    """The perturbations are what fails above, not the kit failing everything."""
    for case in CASES:
        run_case(case, REF[case.op], REF[case.op], CPU)


def test_a_gemm_10_percent_too_large_fails():
    """The fault the kit once certified: every gemm_fp8 case catches it."""
    for case in (c for c in CASES if c.op == "gemm_fp8" and not c.name.startswith("empty")):
        wrong = perturbed(REF["gemm_fp8"], lambda t: t * 1.1, only_first=False)
        with pytest.raises(AssertionError, match="norm|beyond"):
            run_case(case, wrong, REF["gemm_fp8"], CPU)


def _other_layout(t: Tensor) -> Tensor:
    """The same values in the other order of a 2-D tensor's dimensions (row-major <-> column-major)."""
    return t.t().contiguous().t() if t.is_contiguous() else t.contiguous()


STRIDED = [c for c in CASES if c.same_strides]


@pytest.mark.parametrize("case", STRIDED, ids=_ids(STRIDED))
def test_kit_fails_another_layout(case):
    """Where a case fixes the outputs' layout (same_strides), the same values laid out the other
    way must fail it: a compiled graph asserts the reference's strides."""
    def wrong(*args, **kwargs):
        return map_tensors(REF[case.op](*args, **kwargs),
                           lambda t: _other_layout(t) if t.dim() == 2 and min(t.shape) > 1 else t)

    with pytest.raises(AssertionError, match="strides"):
        run_case(case, wrong, REF[case.op], CPU)


AMAX_OUT_OPS = [name for name, op in CONTRACT.items() if "amax_out" in op.signature.parameters]


def _amax_out_cases(op):
    """The op's cases with an amax_out slot, but for the empty-batch ones (nothing to max in)."""
    return [c for c in CASES if c.op == op and "amax_out" in c.inputs()[1] and not c.name.startswith("empty")]


def test_amax_out_ops_are_the_known_ones():
    """AMAX_OUT_OPS comes from the contract's signatures, so a new op taking amax_out joins the
    tests below by itself; it holds at least the ops known to take one."""
    known = {"quantize_fp8", "cast_transpose_fp8", "layernorm_fwd", "rmsnorm_fwd", "activation_fwd",
             "dbias_cast_transpose", "dbias_cast_transpose_parts", "activation_bwd_dbias_cast_transpose"}
    assert known <= set(AMAX_OUT_OPS)


@pytest.mark.parametrize("op", AMAX_OUT_OPS)
def test_amax_out_slots_start_below_and_above_the_amax(op):
    """A slot below the op's amax tells maxing from ignoring the slot; only a slot above it tells
    maxing from overwriting (both give the op's amax when the slot is below)."""
    raised, kept = [], []
    for case in _amax_out_cases(op):
        args, kwargs = case.inputs()
        before = kwargs["amax_out"].item()
        REF[op](*args, **kwargs)
        (raised if kwargs["amax_out"].item() > before else kept).append(case.id)
    assert raised, f"{op}: no case whose amax_out slot starts below the op's amax"
    assert kept, f"{op}: no case whose amax_out slot starts above the op's amax (an overwrite would pass)"


def _overwriting_amax_out(fn):
    """fn writing its own amax into amax_out, the earlier value lost (the slot returned as the amax)."""

    def wrong(*args, amax_out=None, **kwargs):
        result = fn(*args, **kwargs)
        if amax_out is None:
            return result
        amax_out.copy_(result[-1].reshape(amax_out.shape))
        return (*result[:-1], amax_out)

    return wrong


def _ignoring_amax_out(fn):
    """fn leaving amax_out alone and returning a fresh amax of its own."""

    def wrong(*args, amax_out=None, **kwargs):
        return fn(*args, **kwargs)

    return wrong


@pytest.mark.parametrize("wrong", [_overwriting_amax_out, _ignoring_amax_out], ids=["overwritten", "ignored"])
@pytest.mark.parametrize("op", AMAX_OUT_OPS)
def test_kit_fails_amax_out_not_maxed(op, wrong):
    """Every op taking amax_out has a case that fails, naming amax_out, when the slot is
    overwritten with the op's amax, and one when it is left alone (a fresh amax returned)."""
    caught = []
    for case in _amax_out_cases(op):
        try:
            run_case(case, wrong(REF[op]), REF[op], CPU)
        except AssertionError as exc:
            if "amax_out after the call" in str(exc):
                caught.append(case.id)
    assert caught, f"no {op} case fails, naming amax_out, against {wrong.__name__}: {wrong.__doc__}"


def _as_dense(t: Tensor) -> Tensor:
    """t's memory walked as dense row-major from where t starts (strides ignored)."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.insert(0, step)
        step *= max(size, 1)
    return torch.as_strided(t, t.shape, strides)


def _from_storage_start(t: Tensor) -> Tensor:
    """t's strides walked from the start of its storage (the storage offset ignored)."""
    return torch.as_strided(t, t.shape, t.stride(), 0)


MISREADS = {"read-as-dense": _as_dense, "read-from-storage-start": _from_storage_start}


def _misread_pairs():
    """(case, misread) where the misread changes a positional input the case lays out unusually."""
    pairs = []
    for case in CASES:
        args, _ = case.inputs()
        laid_out = [t for t in _tensors(args) if t.numel() and not is_plain(t)]
        for name, misread in MISREADS.items():
            if any(not torch.equal(misread(t).float().nan_to_num(), t.float().nan_to_num()) for t in laid_out):
                pairs.append(pytest.param(case, misread, id=f"{case.id}-{name}"))
    return pairs


MISREAD_PAIRS = _misread_pairs()


@pytest.mark.parametrize("op", [name for name, op in CONTRACT.items() if op.family == "cast"])
def test_every_cast_op_has_a_strided_case(op):
    """The contract lets callers pass strided inputs to the cast ops (te_core/ops/cast.py)."""
    assert any(p.values[0].op == op for p in MISREAD_PAIRS), \
        f"no {op} case passes a strided input (column slice, transposed view or offset range)"


@pytest.mark.parametrize("case, misread", MISREAD_PAIRS)
def test_kit_fails_an_input_read_without_its_strides(case, misread):
    """A kernel that takes a strided input's data pointer and walks it as dense row-major memory,
    or from its storage's start, fails the case: the kit hands the op the layout the case made."""

    def wrong(*args, **kwargs):
        args = map_tensors(args, lambda t: t if is_plain(t) or not t.numel() else misread(t).clone())
        return REF[case.op](*args, **kwargs)

    with pytest.raises(AssertionError):
        run_case(case, wrong, REF[case.op], CPU)
