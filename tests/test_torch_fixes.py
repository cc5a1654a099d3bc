"""te_core._torch_fixes: the fixes for older torch releases hold on the torch running the tests."""
import pytest
import torch

import te_core  # noqa: F401 - applies the fixes
from te_core import _torch_fixes


def _inverse(t):
    scale_inv = torch.reciprocal(t)  # one name at every call: the traced graphs' nodes repeat it
    return scale_inv


class _TwoScales(torch.autograd.Function):
    """A backward that reads two forward tensors made by one helper, after making its own node of
    that helper: the case where torch 2.7's traced backward read one saved tensor for the other."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.save_for_backward(_inverse(a), _inverse(b))
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        own = _inverse(grad.abs().sum() + 1)
        first, second = ctx.saved_tensors
        return grad * own * first + grad * second, None, None


def _two_scales(x, a, b):
    return _TwoScales.apply(x, a, b)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_backward_reads_each_saved_tensor(backend):
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    a, b = torch.rand(1) + 1, torch.rand(1) + 4  # distinct: reading one for the other changes dx
    grads = []
    for fn in (_two_scales, torch.compile(_two_scales, fullgraph=True, backend=backend)):
        xi = x.clone().requires_grad_(True)
        fn(xi, a, b).sum().backward()
        grads.append(xi.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1.3e-6, atol=1e-5)
    # the backward's formula: the incoming gradient is all ones (a sum), so own = 1 / (32 + 1)
    torch.testing.assert_close(grads[0], ((1 / 33) / a + 1 / b).expand(4, 8), rtol=1.3e-6, atol=1e-5)


def _tag(x):
    y = x * 2
    y.te_tag = 3
    return y + 1


def test_traced_tensor_attributes_flag_matches_this_torch():
    """SETS_TRACED_TENSOR_ATTRIBUTES says whether dynamo traces setting an attribute on a tensor
    made in the graph; te-core leaves such tags out while tracing where it does not."""
    torch._dynamo.reset()
    compiled = torch.compile(_tag, fullgraph=True, backend="eager")
    x = torch.randn(3)
    if _torch_fixes.SETS_TRACED_TENSOR_ATTRIBUTES:
        torch.testing.assert_close(compiled(x), x * 2 + 1)
    else:
        with pytest.raises(Exception, match="setattr"):
            compiled(x)


@pytest.mark.parametrize("shape, pads, want", [((0, 100), (28, 0), (0, 128)), ((0, 100), (28, 128), (128, 128)),
                                               ((3, 5), (0, 2), (5, 5)), ((3, 5), (3, 0), (3, 8))])
def test_pad_end_pads_empty_batches(shape, pads, want):
    x = torch.randn(shape)
    y = _torch_fixes.pad_end(x, *pads)
    assert y.shape == want
    torch.testing.assert_close(y[: shape[0], : shape[1]], x, rtol=0, atol=0)
    assert int(torch.count_nonzero(y)) == int(torch.count_nonzero(x))  # the padding is zeros
