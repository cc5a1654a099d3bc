"""Deliberately broken implementations are caught by the kit's runner; correct ones pass.

Each broken function is what a plausible backend bug looks like; the runner must fail every
case of its op that exercises the bug, with a message naming what went wrong.
"""
from __future__ import annotations

import pytest
import torch

from te_core.backend.types import fp8_max
from te_core.reference.cast import merge_amax
from te_core.reference.plugin import implementations
from te_core.testing.cases import cases_by_op
from te_core.testing.runner import COLUMN_SUMS, map_tensors, run_case

REF = implementations()
CPU = torch.device("cpu")
CASES = cases_by_op()


def _cases(op, must_have=""):
    """The op's cases named *must_have*, but for the empty-batch ones, whose empty results no bug can change."""
    return [c for c in CASES[op] if must_have in c.name and not c.name.startswith("empty")]


def _quantize_toward_zero(x, scale, fp8_dtype, *, amax_out=None):
    """Truncates the float32 mantissa to the FP8 width (round toward zero) before the cast."""
    y = (x.float() * scale).clamp(-fp8_max(fp8_dtype), fp8_max(fp8_dtype))
    drop = 23 - (3 if fp8_dtype == torch.float8_e4m3fn else 2)
    y = (y.view(torch.int32) & ~((1 << drop) - 1)).view(torch.float32)
    return y.to(fp8_dtype), merge_amax(x.float().abs().amax(), amax_out)


def _quantize_ignores_amax_out(x, scale, fp8_dtype, *, amax_out=None):
    """Casts right but leaves the history slot alone (returns a fresh amax instead)."""
    return REF["quantize_fp8"](x, scale, fp8_dtype)


def _transpose_by_reshape(data):
    """(K, M) by reshaping instead of transposing: the right shape, the wrong elements."""
    return data.reshape(data.shape[1], data.shape[0]).contiguous()


def _gemm_without_bias(a, b, *, bias=None, **kwargs):
    return REF["gemm"](a, b, **kwargs)


def _gemm_fp8_without_bias(a, b, a_si, b_si, *, bias=None, **kwargs):
    return REF["gemm_fp8"](a, b, a_si, b_si, **kwargs)


def _gemm_fp8_row_short(a, b, a_si, b_si, **kwargs):
    """A plugin that lies about its output's shape (one row short)."""
    return REF["gemm_fp8"](a, b, a_si, b_si, **kwargs)[:-1]


def _gemm_wrong_dtype(a, b, **kwargs):
    return REF["gemm"](a, b, **kwargs).double()


def _gemm_new_tensor(a, b, *, out=None, **kwargs):
    result = REF["gemm"](a, b, out=None if out is None else out.clone(), **kwargs)
    return result.clone()


def _gemm_half_written(a, b, *, out=None, **kwargs):
    if out is None:
        return REF["gemm"](a, b, **kwargs)
    result = REF["gemm"](a, b, out=out.clone(), **kwargs)
    out[: out.shape[0] // 2] = result[: out.shape[0] // 2]
    return out


def _gemm_ignores_accumulate(a, b, *, accumulate=False, **kwargs):
    return REF["gemm"](a, b, accumulate=False, **kwargs)


def _adam_forgets_second_moment(params, grads, exp_avgs, exp_avg_sqs, **kwargs):
    REF["multi_tensor_adam"](params, grads, exp_avgs, [s.clone() for s in exp_avg_sqs], **kwargs)


def _attention_detached(q, k, v, **kwargs):
    return REF["attention"](q.detach(), k.detach(), v.detach(), **kwargs)


class _DoubleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def _attention_wrong_grad(q, k, v, **kwargs):
    return REF["attention"](_DoubleGrad.apply(q), k, v, **kwargs)


def _cross_entropy_no_ignore(logits, target, *, ignore_index=-100, **kwargs):
    target = torch.where(target == ignore_index, torch.zeros_like(target), target)
    return REF["cross_entropy"](logits, target, ignore_index=ignore_index, **kwargs)


def _layernorm_wrong_dtype(x, *args, **kwargs):
    y, mean, rstd, amax = REF["layernorm_fwd"](x, *args, **kwargs)
    return (y.float() if y.dtype != torch.float32 else y.double()), mean, rstd, amax


def _dbias_clobbers_input(dy):
    result = REF["dbias"](dy)
    dy.mul_(2)
    return result


def _scaling_no_roll(histories, scales, fp8_maxes, **kwargs):
    copies = [h.clone() for h in histories]
    REF["delayed_scaling_update"](copies, scales, fp8_maxes, **kwargs)


BROKEN = [
    ("quantize_fp8", "", _quantize_toward_zero, "FP8 values differ"),
    ("quantize_fp8", "amax-out", _quantize_ignores_amax_out, "differ|after the call|expected"),
    ("transpose_fp8", "", _transpose_by_reshape, "FP8 values differ"),
    ("gemm", "bias", _gemm_without_bias, "differ beyond"),
    ("gemm_fp8", "bias", _gemm_fp8_without_bias, "differ beyond|norm"),
    ("gemm", "out", _gemm_new_tensor, "must return the `out` tensor"),
    ("gemm_fp8", "e4m3-32x48", _gemm_fp8_row_short, r"output: shape \(31, 48\), expected \(32, 48\)"),
    ("gemm", "fp32-33x17", _gemm_wrong_dtype, r"output: dtype torch.float64, expected torch.float32"),
    ("gemm", "poisoned", _gemm_half_written, "NaN poison"),
    ("gemm", "accumulate", _gemm_ignores_accumulate, "differ beyond"),
    ("multi_tensor_adam", "", _adam_forgets_second_moment, r"inputs after the call\[3\]"),
    ("attention", "", _attention_detached, "not differentiable"),
    ("attention", "", _attention_wrong_grad, "gradient of input 0"),
    ("cross_entropy", "ignore", _cross_entropy_no_ignore, "differ beyond"),
    ("layernorm_fwd", "", _layernorm_wrong_dtype, r"output\[0\]: dtype"),
    ("dbias", "", _dbias_clobbers_input, "positional inputs after the call"),
    ("delayed_scaling_update", "", _scaling_no_roll, r"inputs after the call\[0\]"),
]


@pytest.mark.parametrize("op, must_have, broken, message", BROKEN, ids=[b[2].__name__.strip("_") for b in BROKEN])
def test_broken_implementation_is_caught(op, must_have, broken, message):
    cases = _cases(op, must_have)
    assert cases, f"no {op} case named *{must_have}*"
    for case in cases:
        with pytest.raises(AssertionError, match=message):
            run_case(case, broken, REF[op], CPU)


@pytest.mark.parametrize("op", ["quantize_blockwise", "gemm_fp8", "attention", "multi_tensor_adam"])
def test_reference_against_itself_passes(op):
    for case in CASES[op]:
        run_case(case, REF[op], REF[op], CPU)


def _tensors(inputs):
    found = []
    map_tensors(inputs, lambda t: found.append(t) or t)
    return found


def test_case_inputs_are_seeded_fresh_and_nonzero():
    for op_cases in CASES.values():
        for case in op_cases:
            first, again = _tensors(case.inputs()), _tensors(case.inputs())
            assert first and len(first) == len(again), case.id
            for x, y in zip(first, again):
                assert x is not y and torch.equal(x.float().nan_to_num(), y.float().nan_to_num()), case.id
                if x.is_floating_point() and x.numel() > 1:
                    assert x.float().ne(0).float().mean() > 0.5, f"{case.id}: an input is mostly zeros"


def _blockwise_row_major_scales(*args, **kwargs):
    """Right values, but 1x128 scale grids row-major: a compiled graph would reject them."""
    return tuple(None if t is None else t.contiguous() for t in REF["quantize_blockwise"](*args, **kwargs))


def test_block_scales_in_another_layout_fail_and_name_the_strides():
    one_d = [c for c in CASES["quantize_blockwise"] if "-1d-" in c.name]
    assert one_d
    for case in one_d:
        with pytest.raises(AssertionError, match="strides"):
            run_case(case, _blockwise_row_major_scales, REF["quantize_blockwise"], CPU)
        run_case(case, REF["quantize_blockwise"], REF["quantize_blockwise"], CPU)
    two_d = [c for c in CASES["quantize_blockwise"] if "-2d-" in c.name]
    for case in two_d:  # 128x128 grids are row-major in the contract: contiguous() changes nothing
        run_case(case, _blockwise_row_major_scales, REF["quantize_blockwise"], CPU)


def _summed_backwards(op, drop_row=False):
    """The reference's result but its bias gradient summed in float32 from the last row up (one
    row left out with drop_row): what a backend's own reduction order gives, or a lost row."""
    def run(grad, *args, **kwargs):
        result = REF[op](grad, *args, **kwargs)
        dy = torch.cat(list(grad), dim=-1) if isinstance(grad, (tuple, list)) else grad
        rows = dy.reshape(-1, dy.shape[-1]).float()
        rows = rows[1:] if drop_row else rows
        acc = torch.zeros(rows.shape[1])
        for row in reversed(rows):
            acc = acc + row
        dbias = acc.to(dy.dtype)
        index = COLUMN_SUMS[op]
        return dbias if index is None else (*result[:index], dbias, *result[index + 1:])
    return run


@pytest.mark.parametrize("op", list(COLUMN_SUMS))
def test_bias_gradients_summed_in_another_order_pass_and_lost_rows_fail(op):
    """A bias gradient accumulated in float32 in another order passes, even where its column's
    values cancel to a result far smaller than them (there the dtype's tolerance relative to
    the result is tighter than two float32 summations can agree); one row left out fails."""
    cases = _cases(op)
    assert cases
    for case in cases:
        run_case(case, _summed_backwards(op), REF[op], CPU)
        with pytest.raises(AssertionError, match="two float32 summations"):
            run_case(case, _summed_backwards(op, drop_row=True), REF[op], CPU)
