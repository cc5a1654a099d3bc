"""te_triton.softmax and te_triton.rope under the Triton interpreter against the reference."""
import pytest
import torch
from te_core.reference import rope as ref_rope
from te_core.reference import softmax as ref_softmax
from te_triton import Config, rope, softmax

TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def _randn(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("mask_shape", [None, (2, 1, 1, 37), (2, 3, 5, 37), (1, 1, 5, 37)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax(mask_shape, causal, dtype):
    x = _randn((2, 3, 5, 37), 1, dtype) * 4
    mask = None
    if mask_shape is not None:
        mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(2)) > 0.6
        mask[..., 0, :] = True  # a fully masked row: zeros
    y = softmax.softmax_fwd(x, 0.7, mask=mask, causal=causal, cfg=Config(num_warps=1, max_programs=4))
    want = ref_softmax.softmax_fwd(x, 0.7, mask=mask, causal=causal)
    torch.testing.assert_close(y, want, **TOL[dtype])
    dy = _randn(x.shape, 3, dtype)
    torch.testing.assert_close(softmax.softmax_bwd(dy, y, 0.7), ref_softmax.softmax_bwd(dy, y, 0.7), **TOL[dtype])


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("r", [16, 10])
def test_rope(fmt, interleaved, r):
    s, b, h, d = 7, 2, 3, 16
    x = _randn((s, b, h, d) if fmt == "sbhd" else (b, s, h, d), 4)
    half = _randn((s + 2, 1, 1, r // 2), 5) * 3
    # angles as Transformer Engine builds them: cat(f, f), or [f0, f0, f1, f1, ...] when interleaved
    freqs = half.repeat_interleave(2, dim=-1) if interleaved else torch.cat([half, half], -1)
    y = rope.rope_fwd(x, freqs, tensor_format=fmt, interleaved=interleaved, cfg=Config(num_warps=1, max_programs=3))
    torch.testing.assert_close(y, ref_rope.rope_fwd(x, freqs, tensor_format=fmt, interleaved=interleaved), **TOL[torch.float32])
    dx = rope.rope_bwd(y, freqs, tensor_format=fmt, interleaved=interleaved)
    torch.testing.assert_close(dx, ref_rope.rope_bwd(y, freqs, tensor_format=fmt, interleaved=interleaved), **TOL[torch.float32])
    torch.testing.assert_close(dx, x, rtol=1e-5, atol=1e-5)  # the backward rotation undoes the forward


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_backward_is_the_exact_transpose_for_any_angles(fmt, interleaved):
    """freqs whose paired channels have different angles: dx = J^T dy of the forward, checked
    against float64 autograd through the reference forward."""
    s, b, h, d, r = 5, 2, 2, 16, 12
    shape = (s, b, h, d) if fmt == "sbhd" else (b, s, h, d)
    freqs = _randn((s + 1, 1, 1, r), 6) * 3
    x, dy = _randn(shape, 7).double().requires_grad_(), _randn(shape, 8)
    ref_rope.rope_fwd(x, freqs.double(), tensor_format=fmt, interleaved=interleaved).backward(dy.double())
    dx = rope.rope_bwd(dy, freqs, tensor_format=fmt, interleaved=interleaved, cfg=Config(num_warps=1, max_programs=3))
    torch.testing.assert_close(dx, x.grad.float(), **TOL[torch.float32])


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="must be 4-D"):
        softmax.softmax_fwd(torch.randn(3, 4), 1.0)
    with pytest.raises(TypeError, match="must be a bool tensor"):
        softmax.softmax_fwd(torch.randn(1, 1, 2, 4), 1.0, mask=torch.ones(1, 1, 2, 4))
    with pytest.raises(ValueError, match="r must be even"):
        rope.rope_fwd(torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 5))
    with pytest.raises(ValueError, match="tensor_format must be"):
        rope.rope_fwd(torch.randn(4, 1, 2, 8), torch.randn(4, 1, 1, 8), tensor_format="bhsd")


def test_integer_inputs_other_devices_and_unbroadcastable_masks_are_refused():
    """Unchecked, integer scores would give a softmax of zeros and integer rope input truncated values;
    a mask that does not broadcast would fail in expand with a RuntimeError."""
    with pytest.raises(TypeError, match="x must be float32, bfloat16, float16 or float64, got torch.int64"):
        softmax.softmax_fwd(torch.randint(-3, 3, (1, 1, 2, 8)), 1.0)
    with pytest.raises(TypeError, match="dy must be float32, bfloat16, float16 or float64"):
        softmax.softmax_bwd(torch.randint(-3, 3, (1, 1, 2, 8)), torch.rand(1, 1, 2, 8), 1.0)
    with pytest.raises(ValueError, match=r"mask of shape \(1, 1, 2, 5\) does not broadcast to x's shape \(1, 1, 2, 8\)"):
        softmax.softmax_fwd(torch.randn(1, 1, 2, 8), 1.0, mask=torch.zeros(1, 1, 2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="does not broadcast"):
        softmax.softmax_fwd(torch.randn(1, 1, 2, 8), 1.0, mask=torch.zeros(1, 1, 1, 2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask is on meta but x is on cpu"):
        softmax.softmax_fwd(torch.randn(1, 1, 2, 8), 1.0,
                            mask=torch.zeros(1, 1, 2, 8, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="y is on meta but dy is on cpu"):
        softmax.softmax_bwd(torch.randn(1, 1, 2, 8), torch.rand(1, 1, 2, 8, device="meta"), 1.0)
    with pytest.raises(TypeError, match="x must be float32, bfloat16, float16 or float64, got torch.int64"):
        rope.rope_fwd(torch.randint(-3, 3, (2, 1, 2, 8)), torch.randn(2, 1, 1, 8))
    with pytest.raises(ValueError, match="freqs is on meta but x is on cpu"):
        rope.rope_fwd(torch.randn(2, 1, 2, 8), torch.randn(2, 1, 1, 8, device="meta"))
