"""Reference masked softmax against float64 torch.softmax, backward against float64 autograd."""
import pytest
import torch

from te_core.reference import softmax

TOLS = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def bottom_right_causal(sq, sk):
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    return j > i + (sk - sq)


def softmax64(x, scale, masked):
    s = (x.double() * scale).masked_fill(masked, float("-inf"))
    y = torch.softmax(s, dim=-1)
    return torch.nan_to_num(y, nan=0.0)  # all-masked rows: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sq,sk,causal", [(7, 7, True), (5, 9, True), (6, 11, False)])
def test_softmax(dtype, sq, sk, causal):
    x = (torch.randn(2, 3, sq, sk) * 4).to(dtype)
    mask = torch.rand(2, 1, sq, sk) < 0.3
    y = softmax.softmax_fwd(x, 0.7, mask=mask, causal=causal)
    masked = mask | bottom_right_causal(sq, sk) if causal else mask
    want = softmax64(x, 0.7, masked)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), want.to(dtype).double(), **TOLS[dtype])
    dy = torch.randn(2, 3, sq, sk).to(dtype)
    x64 = x.double().requires_grad_()
    torch.softmax(x64 * 0.7 + torch.zeros_like(x64).masked_fill(masked, float("-inf")), -1).backward(dy.double())
    dx = softmax.softmax_bwd(dy, y, 0.7)
    assert dx.dtype == dtype
    # the spec's formula on the y it was given (a bf16 y carries its rounding into dx) ...
    y64, dy64 = y.double(), dy.double()
    formula = 0.7 * y64 * (dy64 - (dy64 * y64).sum(-1, keepdim=True))
    torch.testing.assert_close(dx.double(), formula.to(dtype).double(), **TOLS[dtype])
    if dtype == torch.float32:  # ... which is the gradient of the forward
        grad = torch.nan_to_num(x64.grad, nan=0.0)
        torch.testing.assert_close(dx.double(), grad, **TOLS[dtype])


def test_fully_masked_rows_are_zero():
    x = torch.randn(1, 2, 3, 4)
    mask = torch.zeros(1, 1, 3, 4, dtype=torch.bool)
    mask[..., 1, :] = True
    y = softmax.softmax_fwd(x, 1.0, mask=mask)
    assert torch.all(y[..., 1, :] == 0) and not torch.isnan(y).any()
    torch.testing.assert_close(y[..., 0, :].sum(-1), torch.ones(1, 2))
    # sq > sk bottom-right causal masks the first sq - sk rows entirely
    y = softmax.softmax_fwd(torch.randn(1, 1, 5, 3), 1.0, causal=True)
    assert torch.all(y[0, 0, :2] == 0) and torch.allclose(y[0, 0, 2:].sum(-1), torch.ones(3))


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"x must be 4-D, got shape \(3, 4\)"):
        softmax.softmax_fwd(torch.randn(3, 4), 1.0)
    with pytest.raises(TypeError, match=r"mask must be a bool tensor.*got torch.float32"):
        softmax.softmax_fwd(torch.randn(1, 1, 3, 4), 1.0, mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 5\) does not broadcast to \(1, 1, 3, 4\)"):
        softmax.softmax_fwd(torch.randn(1, 1, 3, 4), 1.0, mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"dy has shape \(1, 3\); it must match y \(1, 4\)"):
        softmax.softmax_bwd(torch.randn(1, 3), torch.randn(1, 4), 1.0)
