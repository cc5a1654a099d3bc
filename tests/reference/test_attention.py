"""Reference attention against float64 F.scaled_dot_product_attention, forward and gradients."""
import math

import pytest
import torch
import torch.nn.functional as F

from te_core.reference import attention

TOLS = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def sdpa64(q, k, v, masked, scale):
    """SDPA in float64 with kv heads indexed per query head; SDPA's bool mask is True = attend."""
    group = q.shape[1] // k.shape[1]
    idx = torch.arange(q.shape[1]) // group
    keep = None if masked is None else ~masked
    return F.scaled_dot_product_attention(q, k[:, idx], v[:, idx], attn_mask=keep, scale=scale)


def causal(sq, sk, bottom_right):
    i, j = torch.arange(sq).unsqueeze(1), torch.arange(sk).unsqueeze(0)
    return j > i + (sk - sq if bottom_right else 0)


def make(b, hq, hkv, sq, sk, d, dv, dtype):
    q = torch.randn(b, hq, sq, d).to(dtype).requires_grad_()
    k = torch.randn(b, hkv, sk, d).to(dtype).requires_grad_()
    v = torch.randn(b, hkv, sk, dv).to(dtype).requires_grad_()
    return q, k, v


CASES = [
    # (mask type, b, hq, hkv, sq, sk, d, dv)
    ("no_mask", 2, 4, 2, 5, 7, 16, 8),
    ("causal", 1, 3, 3, 6, 6, 8, 8),
    ("causal_bottom_right", 2, 2, 1, 4, 9, 8, 12),
    ("padding", 2, 4, 4, 5, 6, 8, 8),
    ("padding_causal", 2, 2, 2, 6, 6, 8, 8),
    ("arbitrary", 2, 4, 2, 5, 7, 8, 8),
]


def mask_for(kind, b, hq, sq, sk):
    """(attention_mask argument, full expected mask or None)."""
    if kind == "no_mask":
        return None, None
    if kind in ("causal", "causal_bottom_right"):
        return None, causal(sq, sk, kind == "causal_bottom_right")
    if kind == "arbitrary":
        m = torch.rand(b, 1, sq, sk) < 0.3
        return m, m
    m = torch.zeros(b, 1, 1, sk, dtype=torch.bool)
    m[0, ..., -2:] = True  # padded keys of sequence 0
    return m, (m | causal(sq, sk, False)) if kind == "padding_causal" else m


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_forward_and_grads(case, dtype):
    kind, b, hq, hkv, sq, sk, d, dv = case
    q, k, v = make(b, hq, hkv, sq, sk, d, dv, dtype)
    arg, full = mask_for(kind, b, hq, sq, sk)
    out = attention.attention(q, k, v, attn_mask_type=kind, attention_mask=arg)
    assert out.dtype == dtype and out.shape == (b, hq, sq, dv)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = sdpa64(*leaves, full, 1 / math.sqrt(d))
    torch.testing.assert_close(out.double(), want.to(dtype).double(), **TOLS[dtype])
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout.double())
    for got, ref in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad.to(dtype).double(), **TOLS[dtype])


def test_fully_masked_rows_give_zeros_and_finite_grads():
    q, k, v = make(1, 2, 2, 4, 3, 8, 8, torch.float32)
    out = attention.attention(q, k, v, attn_mask_type="causal_bottom_right", softmax_scale=0.3)
    assert torch.all(out[:, :, 0] == 0)  # sq > sk: query 0 sees no key
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, :, 0] == 0)


def test_dropout_uses_the_default_generator():
    q, k, v = make(2, 2, 2, 5, 6, 8, 8, torch.float32)
    torch.manual_seed(7)
    out = attention.attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(7)
    keep = F.dropout(torch.ones(2, 2, 5, 6), p=0.4)  # same shape, same draws
    probs = torch.softmax((q.double() @ k.double().transpose(-2, -1)) / math.sqrt(8), -1)
    torch.testing.assert_close(out.double(), (probs * keep.double()) @ v.double(), rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    q, k, v = make(1, 3, 2, 4, 4, 8, 8, torch.float32)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of kv heads \(2\)"):
        attention.attention(q, k, v)
    q, k, v = make(1, 2, 2, 4, 4, 8, 8, torch.float32)
    with pytest.raises(ValueError, match=r"attn_mask_type='sliding' is not supported; allowed values: 'no_mask'"):
        attention.attention(q, k, v, attn_mask_type="sliding")
    with pytest.raises(ValueError, match=r"attn_mask_type='padding' needs attention_mask"):
        attention.attention(q, k, v, attn_mask_type="padding")
    with pytest.raises(ValueError, match=r"attention_mask was given but attn_mask_type='causal' ignores it"):
        attention.attention(q, k, v, attn_mask_type="causal", attention_mask=torch.ones(1, 1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"needs attention_mask of shape \(1, 1, 1, 4\), got \(1, 1, 4, 4\)"):
        attention.attention(q, k, v, attn_mask_type="padding", attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"q must be 4-D, got shape \(4, 8\)"):
        attention.attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match=r"k head dim 8 != q head dim 4"):
        attention.attention(q[..., :4], k, v)
    with pytest.raises(ValueError, match=r"dropout_p=1.0 must be in \[0, 1\)"):
        attention.attention(q, k, v, dropout_p=1.0)
