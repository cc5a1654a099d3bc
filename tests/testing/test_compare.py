"""The kit's comparison helpers fail on each kind of difference and pass on equal results."""
from __future__ import annotations

import pytest
import torch

from te_core.testing.compare import TOLERANCES, Tol, assert_same, assert_tensor, fp8_tolerance

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def test_equal_structures_pass():
    x = _x(3, 5)
    assert_same((x, [x.to(E4M3), None], {"k": 1}), (x.clone(), [x.to(E4M3).clone(), None], {"k": 1}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_just_beyond_tolerance_fails(dtype):
    expected = _x(4, 7).to(dtype)
    tol = TOLERANCES[dtype]
    wrong = expected.double() + (tol.atol + tol.rtol * expected.double().abs()) * 4
    with pytest.raises(AssertionError, match="differ beyond rtol"):
        assert_tensor(wrong.to(dtype), expected, where="y")


def test_error_within_fp32_tolerance_passes():
    expected = _x(64)
    assert_tensor(expected * (1 + 5e-7), expected, where="y")


def test_tol_floor_loosens():
    expected = _x(16)
    with pytest.raises(AssertionError):
        assert_tensor(expected + 0.05, expected, where="y")
    assert_tensor(expected + 0.05, expected, where="y", tol=fp8_tolerance(E4M3))


def test_fp8_one_bit_off_fails_bitexact_but_passes_one_step():
    expected = (_x(8, 8) * 10).to(E4M3)
    bits = expected.view(torch.uint8).clone()
    bits[2, 3] ^= 1  # next representable magnitude
    actual = bits.view(E4M3)
    with pytest.raises(AssertionError, match=r"1 of 64 FP8 values differ .* first at \(2, 3\)"):
        assert_tensor(actual, expected, where="data")
    assert_tensor(actual, expected, where="data", exact_fp8=False)


def test_fp8_nan_encodings_match_and_nan_vs_value_fails():
    expected = torch.tensor([float("nan"), 1.0]).to(E4M3)
    other_nan = expected.view(torch.uint8).clone()
    other_nan[0] = 0xFF  # -NaN in E4M3FN
    assert_tensor(other_nan.view(E4M3), expected, where="data")
    with pytest.raises(AssertionError, match="FP8 values differ"):
        assert_tensor(torch.tensor([2.0, 1.0]).to(E4M3), expected, where="data")


def test_unwritten_nan_poison_is_reported():
    expected = _x(3, 4)
    actual = expected.clone()
    actual[1:, :] = float("nan")
    with pytest.raises(AssertionError, match=r"8 of 12 elements are not finite .*NaN poison"):
        assert_tensor(actual, expected, where="out")


def test_inf_must_match_reference():
    expected = torch.tensor([float("inf"), 1.0])
    with pytest.raises(AssertionError, match="the reference has inf"):
        assert_tensor(torch.tensor([float("-inf"), 1.0]), expected, where="y")
    assert_tensor(expected.clone(), expected, where="y")


@pytest.mark.parametrize(
    "actual, expected, message",
    [
        (_x(3, 4), _x(4, 3), r"shape \(3, 4\), expected \(4, 3\)"),
        (_x(3), _x(3, dtype=torch.bfloat16), "dtype torch.float32, expected torch.bfloat16"),
        ((_x(3),), (_x(3), None), "expected a tuple of 2, got tuple of 1"),
        ((_x(3), _x(2)), (_x(3), None), r"\[1\]: expected None"),
        (None, _x(3), "expected a tensor, got NoneType"),
        (torch.tensor([1, 2]), torch.tensor([1, 3]), "differ beyond rtol=0.0"),
        ({"a": _x(2)}, {"b": _x(2)}, "expected a dict with keys"),
    ],
)
def test_structure_mismatches_fail(actual, expected, message):
    with pytest.raises(AssertionError, match=message):
        assert_same(actual, expected, where="r")


def test_wrong_device_type_fails():
    with pytest.raises(AssertionError, match="expected the backend's device type 'meta'"):
        assert_tensor(_x(2), _x(2), where="y", device_type="meta")


def test_fp8_tolerance_takes_loosest_and_rejects_non_fp8():
    assert fp8_tolerance(E4M3) == Tol(0.125, 0.0675)
    assert fp8_tolerance(E4M3, E5M2) == Tol(0.25, 0.125)
    with pytest.raises(ValueError, match="is an FP8 dtype"):
        fp8_tolerance(torch.float32)


def test_fp8_near_allows_a_small_budget_of_one_step_values_only():
    from te_core.testing.compare import FP8_STEP_BUDGET, assert_fp8_near

    expected = (_x(40, 50) * 10).to(E4M3)
    bits = expected.view(torch.uint8).clone()
    budget = int(FP8_STEP_BUDGET * expected.numel())
    flat = bits.view(-1)
    flat[:budget] ^= 1  # the last mantissa bit: the adjacent value of the same sign
    assert_fp8_near(bits.view(E4M3), expected, where="y")
    flat[budget] ^= 1
    with pytest.raises(AssertionError, match=rf"{budget + 1} of 2000 FP8 values are one FP8 step"):
        assert_fp8_near(bits.view(E4M3), expected, where="y")
    two_steps = expected.view(torch.uint8).clone()
    two_steps.view(-1)[7] ^= 2  # two codes away
    with pytest.raises(AssertionError, match="more than one FP8 step"):
        assert_fp8_near(two_steps.view(E4M3), expected, where="y")


def test_fp8_near_counts_zero_and_its_neighbours_as_adjacent():
    from te_core.testing.compare import assert_fp8_near

    tiny = 2.0 ** -9  # E4M3's smallest subnormal
    expected = torch.tensor([0.0, tiny, -tiny, 1.0]).to(E4M3)
    assert_fp8_near(torch.tensor([-0.0, tiny, -tiny, 1.0]).to(E4M3), expected, where="y")  # +0 and -0: equal
    assert_fp8_near(torch.tensor([tiny, tiny, -tiny, 1.0]).to(E4M3), expected, where="y")
    with pytest.raises(AssertionError, match="more than one FP8 step"):
        assert_fp8_near(torch.tensor([0.0, -tiny, -tiny, 1.0]).to(E4M3), expected, where="y")


def test_within_bound_checks_each_element_and_the_norm():
    from te_core.testing.compare import ErrorBound, assert_within

    expected = _x(100)
    loose = ErrorBound(per_element=torch.full((100,), 0.5, dtype=torch.float64), norm=0.2)
    assert_within(expected + 0.01, expected, loose, where="y")  # norm 0.1
    with pytest.raises(AssertionError, match="the error's norm 0.3 exceeds 0.2"):
        assert_within(expected + 0.03, expected, loose, where="y")  # every element within 0.5, norm 0.3
    wrong = expected.clone()
    wrong[3] += 0.6
    with pytest.raises(AssertionError, match=r"1 of 100 elements differ beyond the per-element error bound"):
        assert_within(wrong, expected, ErrorBound(loose.per_element, norm=10.0), where="y")
    with pytest.raises(AssertionError, match=r"shape \(99,\), expected \(100,\)"):
        assert_within(expected[:99], expected, loose, where="y")
