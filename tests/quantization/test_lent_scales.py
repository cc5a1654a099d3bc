"""A delayed-scaling quantizer lends one scale_inv snapshot to every tensor it casts in a step
(one reciprocal per scaling group per step). An in-place write into one of those tensors (copy_,
in-place arithmetic, fill_, zero_, quantize_, out=, update_quantized, a foreach optimizer step)
must leave the others' values, and the step's later casts, bit for bit as they were; aliases of
the written tensor (a detached twin, `.data`, a view, module.half()'s twin) still see the write."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.dtype import DType
from te_core.quantization.quantizers import Float8CurrentScalingQuantizer, Float8Quantizer
from te_core.quantization.roles import Role
from te_core.quantization.scaling import ScalingGroup, update_scales
from te_core.recipe import DelayedScaling

from .conftest import randn

E4M3 = dict(rtol=0.125, atol=0.0675)


def _quantizer(columns: int) -> Float8Quantizer:
    """A delayed quantizer on the last column of a group of `columns` (several columns: the
    snapshot is a view of one aligned tensor of all of them), past a step with another scale."""
    group = ScalingGroup([f"c{i}" for i in range(columns)], torch.float8_e4m3fn, DelayedScaling(amax_history_len=1),
                         torch.device("cpu"))
    group.scale.fill_(448.0 / 64)
    return Float8Quantizer(Role.INPUT, group, columns - 1)


def _next_step(q: Float8Quantizer, gen) -> None:
    q.quantize(randn(gen, 8, 8, scale=4.0))  # this step's amax (~16): the next scale differs
    # (with a second group: one-column groups then take their snapshots together, in one launch)
    spare = ScalingGroup(["spare"], torch.float8_e4m3fn, DelayedScaling(), torch.device("cpu"))
    update_scales([q.scaling_group, spare])


def _live_snapshot_holds(q: Float8Quantizer, gen) -> None:
    """The step's snapshot is still 1 / scale, and a later cast of the step reads right."""
    want = torch.reciprocal(q.scale)
    assert torch.equal(q.scaling_group.scale_inv_of(q.column), want)
    x = randn(gen, 16, 16)
    later = q.quantize(x)
    assert torch.equal(later._scale_inv, want)
    torch.testing.assert_close(later.dequantize().double(), x.double(), **E4M3)


def _copy_fp8(t, v):
    t.copy_(te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3)(v))


WRITERS = {  # name -> (write of v into t, the value t then holds, from its old value and v)
    "copy_": (lambda t, v: t.copy_(v), lambda old, v: v),
    "copy_fp8": (_copy_fp8, lambda old, v: v),
    "add_": (lambda t, v: t.add_(v), lambda old, v: old + v),
    "mul_": (lambda t, v: t.mul_(1.5), lambda old, v: old * 1.5),
    "fill_": (lambda t, v: t.fill_(0.3), lambda old, v: torch.full_like(old, 0.3)),
    "zero_": (lambda t, v: t.zero_(), lambda old, v: torch.zeros_like(old)),
    "quantize_": (lambda t, v: t.quantize_(v), lambda old, v: v),
    "requantize_": (lambda t, v: t.requantize_(v), lambda old, v: v),
    "out=": (lambda t, v: torch.mul(v, 0.5, out=t), lambda old, v: v * 0.5),
    "update_quantized": (lambda t, v: t._get_quantizer().update_quantized(v, t), lambda old, v: v),
    "foreach": (lambda t, v: torch._foreach_add_([t], [v]), lambda old, v: old + v),
}


@pytest.mark.parametrize("columns", [1, 3])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_write_leaves_the_other_casts_of_the_step_alone(writer, columns, gen):
    write, expected = WRITERS[writer]
    q = _quantizer(columns)
    other, target = q.quantize(randn(gen, 16, 16)), q.quantize(randn(gen, 16, 16))
    assert target._scale_inv is other._scale_inv  # lent: no cast pays a reciprocal or a copy
    before = other.dequantize().clone()
    _next_step(q, gen)  # the write requantizes with another scale than the lent one
    old, v = target.dequantize().double(), randn(gen, 16, 16)
    with torch.no_grad():
        write(target, v)
    assert torch.equal(other.dequantize(), before)
    torch.testing.assert_close(target.dequantize().double(), expected(old, v.double()), **E4M3)
    _live_snapshot_holds(q, gen)


@pytest.mark.parametrize("columns", [1, 3])
def test_copy_of_another_scale_leaves_the_step_snapshot_alone(columns, gen):
    """copy_ from an FP8 tensor of another scale takes that scale: not into the snapshot that
    the step's later casts still read."""
    q = _quantizer(columns)
    other, target = q.quantize(randn(gen, 16, 16)), q.quantize(randn(gen, 16, 16))
    before = other.dequantize().clone()
    source = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3)(randn(gen, 16, 16, scale=100.0))
    target.copy_(source)
    assert torch.equal(target.dequantize(), source.dequantize())
    assert torch.equal(other.dequantize(), before)
    _live_snapshot_holds(q, gen)


ALIASES = {
    "detach": lambda t: t.detach(),
    "parameter": lambda t: torch.nn.Parameter(t, requires_grad=False),
    "data": lambda t: torch.nn.Parameter(t, requires_grad=False).data,
    "half": lambda t: t.with_nominal_dtype(torch.bfloat16),
}


@pytest.mark.parametrize("alias", list(ALIASES))
def test_aliases_still_share_writes(alias, gen):
    q = _quantizer(1)
    other, target = q.quantize(randn(gen, 16, 16)), q.quantize(randn(gen, 16, 16))
    before = other.dequantize().clone()
    twin = ALIASES[alias](target)
    _next_step(q, gen)
    v = randn(gen, 16, 16)
    want = target.dequantize().double() + v.double()
    held = twin._scale_inv
    twin.add_(v)
    assert twin._scale_inv is held  # written in place now: a captured graph keeps reading it
    torch.testing.assert_close(target.dequantize().double(), want, **E4M3)
    assert torch.equal(twin.dequantize(torch.float32), target.dequantize(torch.float32))
    assert torch.equal(other.dequantize(), before)


def test_a_view_and_its_tensor_share_writes(gen):
    q = _quantizer(1)
    other, target = q.quantize(randn(gen, 16, 16)), q.quantize(randn(gen, 16, 16))
    before = other.dequantize().clone()
    row = target[3]
    _next_step(q, gen)
    want = target.dequantize().double() * 1.5
    target.mul_(1.5)
    torch.testing.assert_close(row.dequantize().double(), want[3], **E4M3)
    assert torch.equal(row.dequantize(), target.dequantize()[3])
    row.add_(1.0)  # through the view, into the tensor
    want[3] += 1.0
    torch.testing.assert_close(target.dequantize().double(), want, **E4M3)
    assert torch.equal(other.dequantize(), before)


def test_an_optimizer_step_leaves_the_other_casts_alone(gen):
    """A foreach SGD step on FP8 tensors a delayed quantizer cast (each its own gradient)."""
    q = _quantizer(1)
    params = [q.quantize(randn(gen, 16, 16)).requires_grad_() for _ in range(2)]
    other = q.quantize(randn(gen, 16, 16))
    before = other.dequantize().clone()
    _next_step(q, gen)
    grads = [randn(gen, 16, 16) for _ in params]
    want = [p.dequantize().double() - 0.5 * g.double() for p, g in zip(params, grads)]
    for p, g in zip(params, grads):
        p.grad = g
    torch.optim.SGD(params, lr=0.5, foreach=True).step()
    for p, w in zip(params, want):
        torch.testing.assert_close(p.dequantize().double(), w, **E4M3)
    assert torch.equal(other.dequantize(), before)
    _live_snapshot_holds(q, gen)


def test_selected_rows_write_leaves_their_source_alone():
    """Rows selected from a Float8Tensor (a token permutation) hold a scale of their own: requantizing
    them in place leaves the source's scale and value as they were."""
    torch.manual_seed(5)
    src = Float8CurrentScalingQuantizer(Role.INPUT, torch.float8_e4m3fn).quantize(torch.randn(6, 32))
    before = src.dequantize().clone()
    rows = src.select_rows(torch.tensor([3, 0, 5, 1]))
    rows.copy_(torch.randn(4, 32) * 100)
    assert torch.equal(src.dequantize(), before)
