"""te_triton.loss (chunked cross-entropy) under the Triton interpreter against the reference."""
import pytest
import torch
from te_core.reference import loss as ref
from te_triton import Config, loss


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_grad(reduction, smoothing, dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 300, generator=g) * 4).to(dtype)
    target = torch.randint(0, 300, (9,), generator=g)
    target[2] = -100
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    got = loss.cross_entropy(a, target, label_smoothing=smoothing, reduction=reduction, cfg=Config(block=128))
    want = ref.cross_entropy(b, target, label_smoothing=smoothing, reduction=reduction)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    dout = torch.rand(want.shape, generator=g) + 0.5
    got.backward(dout)
    want.backward(dout)
    tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1.3e-6, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, **tol)
    assert a.grad[2].abs().sum() == 0  # the ignored row gets no gradient


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="contiguous 2-D"):
        loss.cross_entropy(torch.randn(3, 4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor of shape"):
        loss.cross_entropy(torch.randn(3, 4), torch.zeros(3))
    with pytest.raises(ValueError, match="reduction must be"):
        loss.cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="target is on meta but logits is on cpu"):
        loss.cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.long, device="meta"))


@pytest.mark.parametrize("bad", [-1, 300, 10**6])
def test_target_outside_the_vocabulary_is_nan_in_its_row(bad):
    """A class outside [0, V) (not ignore_index): that row's loss and gradient are NaN, the
    other rows match the reference, and the mean is NaN (never a finite wrong loss)."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 300, generator=g) * 4
    target = torch.randint(0, 300, (6,), generator=g)
    target[3] = bad
    a = logits.clone().requires_grad_()
    rows = loss.cross_entropy(a, target, reduction="none", cfg=Config(block=128))
    assert torch.isnan(rows[3]) and not torch.isnan(rows[torch.arange(6) != 3]).any()
    good = target.clone()
    good[3] = -100
    torch.testing.assert_close(rows[torch.arange(6) != 3], ref.cross_entropy(logits, good, reduction="none")[
        torch.arange(6) != 3], rtol=1.3e-6, atol=1e-5)
    rows.sum().backward()
    assert torch.isnan(a.grad[3]).all() and not torch.isnan(a.grad[torch.arange(6) != 3]).any()
    assert torch.isnan(loss.cross_entropy(logits, target, cfg=Config(block=128)))
