"""ops.GroupedLinear(scale_bias=True), Transformer Engine's bias scaled per row: y_g = x_g W_g^T +
s_g b_g, the scales s (one per input row, a mixture of experts' routing probabilities) a second
extra input after the split sizes. Forward and the gradients of the input, the weights, the biases
and the scales against float64 on fresh random inputs, alone, in a Sequential, and under FP8."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.modules import fusible_ops as ops
from te_core.recipe import Float8CurrentScaling

from ._compare import TOL, seeded

GROUPS = 4


def randn(gen, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _randomize(op, gen):
    """Weights of std 1/sqrt(in_features) (outputs of order 1), biases of order 1, none zero."""
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(randn(gen, *p.shape, scale=p.shape[-1] ** -0.5 if p.dim() == 2 else 1.0))


def _float64(op, x, splits, scales, *, bias=True):
    """The operation in float64 on float64 copies taking gradients: (output, x, params, scales).
    The GEMM's output is rounded to x's dtype before the scaled bias is added, as Transformer
    Engine's split-quantize path adds it (its grouped GEMM epilogue on Hopper rounds once)."""
    x64 = x.detach().double().requires_grad_()
    s64 = scales.detach().double().requires_grad_()
    p64 = {n: p.detach().double().requires_grad_() for n, p in op.named_parameters()}
    rows = x64.reshape(-1, x64.shape[-1])
    outs = []
    for g, (r, s) in enumerate(zip(rows.split(splits), s64.reshape(-1).split(splits))):
        y = _rounded(r @ p64[f"weight{g}"].T, x.dtype)
        outs.append(y + s[:, None] * p64[f"bias{g}"] if bias else y)
    return torch.cat(outs).view(*x.shape[:-1], -1), x64, p64, s64


def _rounded(t, dtype):
    """t rounded to dtype, its gradient passing unchanged (as the GEMM's output is rounded)."""
    return t + (t.detach().to(dtype).double() - t.detach())


def _check(got, want, tol, what):
    torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, splits", [((17, 19), [5, 0, 9, 3]), ((2, 9, 19), [4, 7, 0, 7])], ids=["2d", "3d"])
def test_scaled_bias_matches_float64(dtype, shape, splits):
    """Output and every gradient (input, weight{i}, bias{i}, scales) against float64, with an
    expert without rows (its bias gradient zero) and odd sizes; float32 scales, as routers give."""
    gen = seeded(31)
    op = ops.GroupedLinear(GROUPS, shape[-1], 23, dtype=dtype, scale_bias=True)
    _randomize(op, gen)
    assert op.num_extra_inputs == 2
    x = randn(gen, *shape, dtype=dtype).requires_grad_()
    scales = torch.rand(sum(splits), generator=gen).requires_grad_()
    y = op(x, torch.tensor(splits), scales)
    want, x64, p64, s64 = _float64(op, x, splits, scales)
    assert y.dtype == dtype and y.shape == want.shape
    _check(y, want, TOL[dtype], "output")
    dy = randn(gen, *y.shape, dtype=dtype)
    y.backward(dy)
    want.backward(dy.double())
    _check(x.grad, x64.grad, TOL[dtype], "dx")
    _check(scales.grad, s64.grad, TOL[dtype], "dscales")
    assert scales.grad.dtype == torch.float32
    for name, p in op.named_parameters():
        _check(p.grad, p64[name].grad, TOL[dtype], f"d{name}")
    empty = getattr(op, f"bias{splits.index(0)}")  # the expert without rows: a zero gradient
    assert torch.equal(empty.grad, torch.zeros_like(empty))


def test_scaled_bias_in_experts_sequential():
    """Mixture-of-experts FC1 -> ScaledSwiGLU -> FC2 with scale_bias: Sequential hands FC2 its
    split sizes, then its scales (the routing probabilities), after ScaledSwiGLU's; float32."""
    gen = seeded(32)
    hidden, ffn, splits = 16, 24, [6, 9, 0, 5]
    seq = ops.Sequential(ops.GroupedLinear(GROUPS, hidden, 2 * ffn), ops.ScaledSwiGLU(),
                         ops.GroupedLinear(GROUPS, ffn, hidden, scale_bias=True))
    for op in (seq[0], seq[2]):
        _randomize(op, gen)
    x = randn(gen, sum(splits), hidden).requires_grad_()
    probs = torch.rand(sum(splits), generator=gen).requires_grad_()
    sizes = torch.tensor(splits)
    y = seq(x, sizes, probs, sizes, probs)
    # float64: FC1, SwiGLU scaled by the probabilities, FC2 with its bias scaled by them
    x64, probs64 = x.detach().double().requires_grad_(), probs.detach().double().requires_grad_()
    params = {n: p.detach().double().requires_grad_() for n, p in seq.named_parameters()}
    h = torch.cat([r @ params[f"0.weight{g}"].T + params[f"0.bias{g}"] for g, r in enumerate(x64.split(splits))])
    a, b = h.chunk(2, dim=-1)
    h = a * torch.sigmoid(a) * b * probs64[:, None]
    want = torch.cat([r @ params[f"2.weight{g}"].T + s[:, None] * params[f"2.bias{g}"]
                      for g, (r, s) in enumerate(zip(h.split(splits), probs64.split(splits)))])
    tol = TOL[torch.float32]
    _check(y, want, tol, "output")
    dy = randn(gen, *y.shape)
    y.backward(dy)
    want.backward(dy.double())
    _check(x.grad, x64.grad, tol, "dx")
    _check(probs.grad, probs64.grad, tol, "dprobs (both uses)")
    for name, p in seq.named_parameters():
        _check(p.grad, params[name].grad, tol, f"d{name}")


def test_fp8_gemms_then_scaled_bias():
    """Under te.autocast the GEMMs are the FP8 ones of the same operation without a bias, bit for
    bit (output, dx, dweight), and the scaled bias is added after them: the difference of the
    outputs, and the gradients of the biases and the scales, against float64."""
    gen = seeded(33)
    splits = [16, 0, 32, 16]
    op = ops.GroupedLinear(GROUPS, 32, 48, scale_bias=True)
    plain = ops.GroupedLinear(GROUPS, 32, 48, bias=False)
    _randomize(op, gen)
    with torch.no_grad():
        for i in range(GROUPS):
            getattr(plain, f"weight{i}").copy_(getattr(op, f"weight{i}"))
    x = randn(gen, sum(splits), 32, scale=2.0)
    x_op, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    scales = torch.rand(sum(splits), generator=gen).requires_grad_()
    sizes = torch.tensor(splits)
    with te.autocast(recipe=Float8CurrentScaling()):
        y, y_plain = op(x_op, sizes, scales), plain(x_plain, sizes)
    with torch.no_grad():
        assert not torch.allclose(y_plain, plain(x, sizes), **TOL[torch.float32])  # FP8 GEMMs ran
    s64 = scales.detach().double().requires_grad_()
    b64 = [getattr(op, f"bias{i}").detach().double().requires_grad_() for i in range(GROUPS)]
    scaled = torch.cat([s[:, None] * b for s, b in zip(s64.split(splits), b64)])
    _check(y - y_plain, scaled, TOL[torch.float32], "scaled bias")
    dy = randn(gen, *y.shape)
    y.backward(dy)
    y_plain.backward(dy)
    scaled.backward(dy.double())
    assert torch.equal(x_op.grad, x_plain.grad)
    for i in range(GROUPS):
        assert torch.equal(getattr(op, f"weight{i}").grad, getattr(plain, f"weight{i}").grad)
        _check(getattr(op, f"bias{i}").grad, b64[i].grad, TOL[torch.float32], f"dbias{i}")
    _check(scales.grad, s64.grad, TOL[torch.float32], "dscales")


def test_without_bias_scale_bias_is_ignored():
    """As in Transformer Engine: scale_bias=True with bias=False takes only the split sizes."""
    gen = seeded(34)
    op = ops.GroupedLinear(GROUPS, 19, 23, bias=False, scale_bias=True)
    _randomize(op, gen)
    assert op.num_extra_inputs == 1
    splits = [3, 4, 0, 6]
    x = randn(gen, sum(splits), 19)
    want, *_ = _float64(op, x, splits, torch.ones(sum(splits)), bias=False)
    _check(op(x, torch.tensor(splits)), want, TOL[torch.float32], "output")


def test_bad_scales_say_what_is_wrong():
    op = ops.GroupedLinear(GROUPS, 8, 8, scale_bias=True)
    x, sizes = torch.randn(6, 8), torch.tensor([1, 2, 0, 3])
    with pytest.raises(ValueError, match=r"one bias scale per input row: expected 6 values \(shape \(6,\)\), got "
                                         r"shape \(5,\)"):
        op(x, sizes, torch.rand(5))
    with pytest.raises(TypeError, match="must be a floating-point tensor of one bias scale per input row.*torch.int64"):
        op(x, sizes, torch.ones(6, dtype=torch.long))
    with pytest.raises(TypeError, match=r"takes the input and 2 extra input\(s\)"):
        op(x, sizes)
    with pytest.raises(TypeError, match="scale_bias"):
        ops.GroupedLinear(GROUPS, 8, 8, scale_bias="yes")
