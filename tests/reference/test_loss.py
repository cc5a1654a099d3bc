"""Reference cross-entropy against float64 F.cross_entropy, loss and gradient."""
import pytest
import torch
import torch.nn.functional as F

from te_core.reference import loss


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy(reduction, label_smoothing, dtype):
    logits = (torch.randn(13, 101) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, 101, (13,))
    target[[2, 7]] = -100
    out = loss.cross_entropy(logits, target, label_smoothing=label_smoothing, reduction=reduction)
    assert out.dtype == torch.float32 and out.shape == ((13,) if reduction == "none" else ())
    l64 = logits.detach().double().requires_grad_()
    want = F.cross_entropy(l64, target, label_smoothing=label_smoothing, reduction=reduction)
    torch.testing.assert_close(out.double(), want, rtol=1.3e-6, atol=1e-5)
    w = torch.randn(out.shape)
    (out * w).sum().backward()
    (want * w.double()).sum().backward()
    assert logits.grad.dtype == dtype
    tol = dict(rtol=1.3e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), l64.grad.to(dtype).double(), **tol)
    assert torch.all(logits.grad[[2, 7]] == 0)


def test_custom_ignore_index_and_all_ignored():
    logits = torch.randn(4, 5)
    target = torch.tensor([1, 3, 3, 0])
    out = loss.cross_entropy(logits, target, ignore_index=3)
    torch.testing.assert_close(out, F.cross_entropy(logits, target, ignore_index=3))
    assert torch.isnan(loss.cross_entropy(logits, torch.full((4,), -100)))  # 0 / 0, as torch


def test_bad_inputs():
    logits = torch.randn(4, 5)
    with pytest.raises(ValueError, match=r"reduction='avg' is not supported; allowed values: 'mean', 'sum', 'none'"):
        loss.cross_entropy(logits, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(TypeError, match=r"target must be an integer \(int64\) tensor.*got torch.float32"):
        loss.cross_entropy(logits, torch.zeros(4))
    with pytest.raises(ValueError, match=r"target has 3 entries; logits \(4, 5\) has 4 rows"):
        loss.cross_entropy(logits, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"target holds class 5, outside \[0, 5\)"):
        loss.cross_entropy(logits, torch.tensor([0, 5, 1, 1]))
    with pytest.raises(ValueError, match=r"label_smoothing=1.5 must be in \[0, 1\]"):
        loss.cross_entropy(logits, torch.zeros(4, dtype=torch.long), label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"logits must be 2-D"):
        loss.cross_entropy(logits[0], torch.zeros(4, dtype=torch.long))


def test_compiled_fullgraph_matches_float64_and_keeps_the_class_check():
    """torch.compile(fullgraph=True) traces the loss (no branch on the targets' values), equal to
    float64 F.cross_entropy with its gradient; a class outside the vocabulary, which a graph
    cannot raise on, makes its row's loss and gradient NaN (and so the mean) as the contract
    allows, rather than a wrong number."""
    torch._dynamo.reset()
    try:
        compiled = torch.compile(lambda x, t: loss.cross_entropy(x, t, label_smoothing=0.1), fullgraph=True)
        logits = (torch.randn(13, 101) * 4).requires_grad_()
        target = torch.randint(0, 101, (13,))
        target[5] = -100
        out = compiled(logits, target)
        out.backward()
        l64 = logits.detach().double().requires_grad_()
        want = F.cross_entropy(l64, target, label_smoothing=0.1)
        want.backward()
        torch.testing.assert_close(out.double(), want, rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(logits.grad.double(), l64.grad, rtol=1.3e-6, atol=1e-5)
        target[3] = 101
        assert torch.isnan(compiled(logits.detach(), target))
        logits.grad = None
        rows = torch.compile(lambda x, t: loss.cross_entropy(x, t, reduction="none"), fullgraph=True)(logits, target)
        rows.backward(torch.ones_like(rows))
        others = torch.arange(13) != 3
        assert torch.isnan(rows[3]) and torch.isfinite(rows[others]).all()
        assert torch.isnan(logits.grad[3]).all() and torch.isfinite(logits.grad[others]).all()
        with pytest.raises(ValueError, match=r"target holds class 101, outside \[0, 101\)"):
            loss.cross_entropy(logits, target)  # eagerly: the error
    finally:
        torch._dynamo.reset()
