"""Runs one conformance case on a backend implementation and checks it against the reference.

The reference runs on CPU copies of the inputs, the implementation under test on copies on
its device, both laid out as the case made them (a column slice stays a strided view, an amax
slot a view into its history). Checked: `amax_out` after the call (the contract's max, not an
overwrite); the returned structure, shapes, dtypes and device; values within tolerance (FP8
casts bit-exact); every input afterwards (in-place updates, `out=` buffers — NaN-poisoned, so
an element left unwritten shows — and inputs that must stay untouched); `out` returned when
given; and, for differentiable ops, the gradients of the inputs.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from ..backend.types import OpImpl
from .compare import assert_column_sums, assert_same, assert_within
from .inputs import Case, Inputs, generator


def map_tensors(tree: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_tensors(t, fn) for t in tree)
    if isinstance(tree, dict):
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    return tree


def copy_to(inputs: Inputs, device: torch.device) -> Inputs:
    """A deep copy of (args, kwargs) with every tensor on `device` (never shared storage), with
    its strides and storage offset: a plain clone would hand the op dense memory where a case
    gives it a column slice, and a kernel that ignores strides would pass."""
    return map_tensors(inputs, lambda t: copy_laid_out(t, device))


def is_plain(t: Tensor) -> bool:
    """Whether t is dense row-major memory filling its storage from the start: what a clone
    reproduces, and what a kernel walking t's data pointer without its strides assumes."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def copy_laid_out(t: Tensor, device: torch.device) -> Tensor:
    """A copy of `t` on `device` with t's shape, strides and storage offset, in a copy of the
    whole storage t views (what lies around a slice is copied too, as a kernel could read it)."""
    t = t.detach()
    if is_plain(t):
        return t.clone().to(device)
    storage = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return storage.clone().to(device).as_strided(t.shape, t.stride(), t.storage_offset())


def decline_reason(case: Case, op, impl: OpImpl, capabilities, device: torch.device) -> Optional[str]:
    """Why the backend would not run this case (its capability check or supports()), or None."""
    args, kwargs = copy_to(case.inputs(), device)
    reason = op.check_capabilities(capabilities, args, kwargs)
    if reason:
        return f"declined by capability check: {reason}"
    if impl.supports is not None:
        ok, why = impl.supports(*args, **kwargs)
        if not ok:
            return f"declined by supports(): {why or '(no reason given)'}"
    return None


# The ops returning a bias gradient: where it sits in their result (None: the result itself).
# Their first argument is the gradient whose columns it sums (a tuple of column blocks of it).
COLUMN_SUMS = {"dbias": None, "dbias_cast_transpose": 2, "dbias_cast_transpose_parts": 2,
               "dbias_cast_transpose_current": 2, "dbias_cast_transpose_blockwise": 4}


def _split_column_sums(case: Case, actual: Any, expected: Any, device: torch.device) -> tuple:
    """Checks the bias gradient of a COLUMN_SUMS op (assert_column_sums) and returns
    (actual, expected) with it set to None in both, for the rest of the comparison."""
    if case.op not in COLUMN_SUMS:
        return actual, expected
    (grad, *_), _ = case.inputs()
    summed = torch.cat(list(grad), dim=-1) if isinstance(grad, (tuple, list)) else grad
    where = f"{case.id} output"
    index = COLUMN_SUMS[case.op]
    if index is None:
        assert_column_sums(actual, expected, summed, where=where, device_type=device.type)
        return None, None
    if not isinstance(actual, (tuple, list)) or len(actual) != len(expected):
        return actual, expected  # assert_same names the structure's difference
    assert_column_sums(actual[index], expected[index], summed, where=f"{where}[{index}]", device_type=device.type)
    return ([None if i == index else a for i, a in enumerate(actual)],
            [None if i == index else e for i, e in enumerate(expected)])


def run_case(case: Case, fn: Callable[..., Any], reference: Callable[..., Any], device: torch.device) -> None:
    """Raises AssertionError (naming the case and what differs) unless `fn` matches `reference`."""
    ref_args, ref_kwargs = copy_to(case.inputs(), torch.device("cpu"))
    args, kwargs = copy_to(case.inputs(), device)
    _require_grad(case, ref_args)
    _require_grad(case, args)
    slot = ref_kwargs.get("amax_out")
    slot_before = slot.item() if isinstance(slot, Tensor) else None
    expected = reference(*ref_args, **ref_kwargs)
    actual = fn(*args, **kwargs)
    opts = dict(exact_fp8=case.exact_fp8, tol=case.tol)
    if case.returns_out and actual is not kwargs["out"]:
        raise AssertionError(f"{case.id}: must return the `out` tensor it was given, returned another object")
    if slot_before is not None:
        _assert_amax_out(case, kwargs["amax_out"], ref_kwargs["amax_out"], slot_before)
    if case.bound is None:
        rest, expected_rest = _split_column_sums(case, actual, expected, device)
        assert_same(rest, expected_rest, where=f"{case.id} output", device_type=device.type, **opts)
        if case.same_strides:
            _assert_strides(actual, expected, where=f"{case.id} output")
    else:  # `out`, when given, is the output itself: checked here, by the case's error model
        bound = case.bound(case.inputs(), expected)
        assert_within(actual, expected, bound, where=f"{case.id} output", device_type=device.type)
        kwargs, ref_kwargs = ({k: v for k, v in kw.items() if k != "out"} for kw in (kwargs, ref_kwargs))
    assert_same(_detached(args), _detached(ref_args), where=f"{case.id} positional inputs after the call", **opts)
    assert_same(_detached(kwargs), _detached(ref_kwargs), where=f"{case.id} keyword inputs after the call", **opts)
    if case.grad_of:
        _check_grads(case, actual, expected, args, ref_args, device)


def _assert_amax_out(case: Case, actual: Any, expected: Tensor, before: float) -> None:
    """The amax_out slot, by name, before the outputs that return it: an op that overwrites it
    (or leaves it alone) instead of maxing its amax in loses an earlier amax of the step."""
    assert_same(actual.detach() if isinstance(actual, Tensor) else actual, expected.detach(),
                where=f"{case.id} amax_out after the call (it held {before:g} before: the contract writes "
                      f"max(that, the op's amax) into it, never the op's amax alone)")


def _assert_strides(actual: Any, expected: Any, where: str) -> None:
    if isinstance(expected, Tensor):
        if actual.stride() != expected.stride():
            raise AssertionError(f"{where}: strides {actual.stride()}, expected {expected.stride()} (the layout the "
                                 "contract gives this output; a compiled graph checks an op's outputs against it)")
    elif isinstance(expected, (tuple, list)):
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_strides(a, e, f"{where}[{i}]")


def _require_grad(case: Case, args: tuple) -> None:
    for i in case.grad_of:
        args[i].requires_grad_(True)


def _detached(tree: Any) -> Any:
    return map_tensors(tree, lambda t: t.detach())


def _check_grads(case: Case, actual: Tensor, expected: Tensor, args: tuple, ref_args: tuple, device) -> None:
    if not isinstance(actual, Tensor) or not actual.requires_grad:
        raise AssertionError(f"{case.id}: the output is not differentiable (requires_grad is False); "
                             f"the contract requires autograd for inputs {case.grad_of}")
    grad_out = torch.randn(expected.shape, generator=generator(case.id + "/grad")).to(expected.dtype)
    inputs = [args[i] for i in case.grad_of]
    grads = torch.autograd.grad(actual, inputs, grad_out.to(device), allow_unused=True)
    ref_grads = torch.autograd.grad(expected, [ref_args[i] for i in case.grad_of], grad_out, allow_unused=True)
    for i, got, want in zip(case.grad_of, grads, ref_grads):
        if got is None and want is not None:
            raise AssertionError(f"{case.id}: no gradient reaches input {i}; the reference has one")
        assert_same(got, want, where=f"{case.id} gradient of input {i}", device_type=device.type, tol=case.tol)
