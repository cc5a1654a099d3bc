import math

import pytest
import torch

import te_core.modules as tm


def plain_attention(q, k, v, mask_type, mask, scale):
    """q (b, hq, sq, d), k/v (b, hkv, sk, d); float64 math."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    sq, sk = q.shape[2], k.shape[2]
    masked = torch.zeros(sq, sk, dtype=torch.bool)
    if "causal" in mask_type:
        masked = torch.ones(sq, sk, dtype=torch.bool).triu(1)
    masked = masked.expand(q.shape[0], 1, sq, sk)
    if mask is not None:
        masked = masked | mask
    s = s.masked_fill(masked, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v.double()).to(q.dtype)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["causal", "no_mask", "padding", "padding_causal"])
@pytest.mark.parametrize("heads, groups", [(4, 4), (6, 2), (3, 1)])
def test_matches_plain_attention_forward_and_grads(fmt, mask_type, heads, groups):
    g = torch.Generator().manual_seed(heads * 10 + groups)
    b, s, d = 2, 7, 12
    q = torch.randn(b, heads, s, d, generator=g, requires_grad=True)
    k = torch.randn(b, groups, s, d, generator=g, requires_grad=True)
    v = torch.randn(b, groups, s, d, generator=g, requires_grad=True)
    mask = None
    if "padding" in mask_type:
        lengths = torch.tensor([7, 4])
        mask = (torch.arange(s)[None, :] >= lengths[:, None]).view(b, 1, 1, s)
    dpa = tm.DotProductAttention(heads, d, num_gqa_groups=groups, qkv_format=fmt, attn_mask_type=mask_type)
    perm = (2, 0, 1, 3) if fmt == "sbhd" else (0, 2, 1, 3)
    out = dpa(*(t.permute(*perm) for t in (q, k, v)), attention_mask=mask)
    ref = plain_attention(q, k, v, mask_type, mask, 1 / math.sqrt(d))  # (b, h, s, d)
    ref = ref.permute(*perm).reshape(*out.shape)
    torch.testing.assert_close(out, ref, rtol=1.3e-6, atol=1e-5)
    dy = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dy)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dy)
    for name, a, e in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, e, rtol=1.3e-6, atol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_softmax_scale_and_kv_channels_tuple():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 2, 2, 8, generator=g), torch.randn(5, 2, 2, 8, generator=g)
    v = torch.randn(5, 2, 2, 4, generator=g)
    dpa = tm.DotProductAttention(2, (8, 4), attn_mask_type="no_mask", softmax_scale=0.3)
    out = dpa(q, k, v)
    assert out.shape == (5, 2, 8)
    ref = plain_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), "no_mask", None, 0.3)
    torch.testing.assert_close(out, ref.permute(2, 0, 1, 3).reshape(5, 2, 8), rtol=1.3e-6, atol=1e-5)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    q = torch.randn(6, 2, 2, 8)
    dpa = tm.DotProductAttention(2, 8, attention_dropout=0.5).eval()
    torch.testing.assert_close(dpa(q, q, q), dpa(q, q, q))
    dpa.train()
    assert not torch.allclose(dpa(q, q, q), dpa.eval()(q, q, q))


@pytest.mark.parametrize(
    "build, call, match",
    [
        (
            lambda: tm.DotProductAttention(6, 8, num_gqa_groups=4),
            None,
            r"num_attention_heads=6 is not divisible by num_gqa_groups=4",
        ),
        (lambda: tm.DotProductAttention(2, 8, qkv_format="thd"), None, r"unknown qkv_format='thd'"),
        (lambda: tm.DotProductAttention(2, 8, attn_mask_type="weird"), None, r"unknown attn_mask_type='weird'"),
        (lambda: tm.DotProductAttention(2, 8), lambda m: m(*[torch.randn(4, 2, 16)] * 3), r"query_layer must be 4-D"),
        (
            lambda: tm.DotProductAttention(2, 8),
            lambda m: m(torch.randn(4, 2, 3, 8), *[torch.randn(4, 2, 2, 8)] * 2),
            r"query_layer has 3 heads of size 8; expected num_attention_heads=2",
        ),
        (
            lambda: tm.DotProductAttention(2, 8),
            lambda m: m(*[torch.randn(4, 2, 2, 8).half().int()] * 3),
            r"query_layer has dtype torch.int32",
        ),
        (
            lambda: tm.DotProductAttention(2, 8, attn_mask_type="padding"),
            lambda m: m(*[torch.randn(4, 2, 2, 8)] * 3),
            r"needs attention_mask",
        ),
        (
            lambda: tm.DotProductAttention(2, 8, attn_mask_type="padding"),
            lambda m: m(*[torch.randn(4, 2, 2, 8)] * 3, attention_mask=torch.zeros(2, 1, 1, 5, dtype=torch.bool)),
            r"padding attention_mask must have shape \(2, 1, 1, 4\)",
        ),
    ],
)
def test_bad_input_messages(build, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(build())


def plain_rope(x, freqs):  # x (s, b, h, d), non-interleaved, full rotary dim
    x1, x2 = x.chunk(2, dim=-1)
    return x * freqs.cos() + torch.cat((-x2, x1), dim=-1) * freqs.sin()


def test_rotary_embedding_matches_plain_formula_and_grads():
    g = torch.Generator().manual_seed(7)
    freqs = tm.RotaryPositionEmbedding(16)(9)
    assert freqs.shape == (9, 1, 1, 16) and freqs.dtype == torch.float32
    x = torch.randn(5, 2, 3, 16, generator=g, requires_grad=True)
    y = tm.apply_rotary_pos_emb(x, freqs, tensor_format="sbhd")
    ref = plain_rope(x, freqs[:5])
    torch.testing.assert_close(y, ref, rtol=1.3e-6, atol=1e-5)
    dy = torch.randn(y.shape, generator=g)
    torch.testing.assert_close(
        torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(ref, x, dy)[0], rtol=1.3e-6, atol=1e-5
    )
    yb = tm.apply_rotary_pos_emb(x.detach().transpose(0, 1), freqs, tensor_format="bshd")
    torch.testing.assert_close(yb.transpose(0, 1), ref.detach(), rtol=1.3e-6, atol=1e-5)
