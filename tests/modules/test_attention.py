import math
import re

import pytest
import torch

import te_core as te
import te_core.modules as tm

from ._compare import seeded


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
    if "padding" in mask_type:  # Transformer Engine: a self-attention padding mask pads queries too
        masked = masked | mask.transpose(-1, -2)
    s = s.masked_fill(masked, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v.double()).to(q.dtype)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("mask_type", ["causal", "no_mask", "padding", "padding_causal"])
@pytest.mark.parametrize("heads, groups", [(4, 4), (6, 2), (3, 1)])
def test_matches_plain_attention_forward_and_grads(fmt, mask_type, heads, groups):
    g = seeded(heads * 10 + groups)
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
    g = seeded(3)
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
        (lambda: tm.DotProductAttention(2, 8, qkv_format="dhts"), None, r"unknown qkv_format='dhts'"),
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
            r"padding mask must be a bool tensor of shape \(2, 1, 1, 4\)",
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
    g = seeded(7)
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


# ---- Transformer Engine's attention semantics against a float64 computation written from its
# documentation: padding (queries and keys), causal top-left / bottom-right, sliding windows
# (left, right) around a top-left or bottom-right diagonal, pre/post-scale bias and ALiBi, GQA.

CAUSAL_TYPES = ("causal", "causal_bottom_right", "padding_causal", "padding_causal_bottom_right")


def te_alibi_slopes(h):
    """ALiBi's default slopes: 2^(-8 k / n) for the largest power of two n <= h, the rest
    at odd multiples of 2^(-4 / n)."""
    n = 2 ** int(math.log2(h))
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    slopes += [2.0 ** (-4.0 * (2 * i + 1) / n) for i in range(h - n)]
    return torch.tensor(slopes, dtype=torch.float64)


def te_attention64(q, k, v, scale, mask_type="no_mask", kv_pad=None, q_pad=None, arbitrary=None, window=None,
                   bottom_right=None, bias_type="no_bias", bias=None, slopes=None, sink=None, max_logit=False):
    """q (b, h, sq, d), k/v (b, g, sk, d): float64, one query-key pair at a time. `sink` (h,):
    Transformer Engine's attention sink, one more logit per row that no mask hides, dropped
    after the softmax. `max_logit`: return the largest visible logit of each head instead."""
    b, h, sq, _ = q.shape
    sk = k.shape[2]
    rep = h // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q64 @ k64.transpose(-1, -2)
    if bias_type == "pre_scale_bias":
        scores = (scores + bias.double()) * scale
    else:
        scores = scores * scale + (bias.double() if bias_type == "post_scale_bias" else 0.0)
    if mask_type in ("causal", "padding_causal"):
        bottom_right = False
    elif mask_type.endswith("bottom_right") or bottom_right is None:
        bottom_right = True
    left, right = window if window is not None else (-1, -1)
    if mask_type in CAUSAL_TYPES:
        right = 0
    slopes = te_alibi_slopes(h) if slopes is None else slopes.double()
    visible = torch.zeros(b, h, sq, sk, dtype=torch.bool)
    for bi in range(b):
        lq = sq if q_pad is None else int((~q_pad[bi]).sum())
        lk = sk if kv_pad is None else int((~kv_pad[bi]).sum())
        shift = ((lk - lq) if "padding" in mask_type else (sk - sq)) if bottom_right else 0
        for i in range(sq):
            for j in range(sk):
                off = j - (i + shift)
                ok = (left == -1 or off >= -left) and (right == -1 or off <= right)
                if "padding" in mask_type:
                    ok = ok and i < lq and j < lk
                visible[bi, :, i, j] = ok
                if bias_type == "alibi":
                    slope = slopes[bi] if slopes.dim() == 2 else slopes
                    scores[bi, :, i, j] -= slope * abs(off)
    if arbitrary is not None:
        visible &= ~arbitrary
    scores = scores.masked_fill(~visible, float("-inf"))
    if max_logit:
        return scores.amax(dim=(0, 2, 3))
    if sink is not None:
        column = sink.double().view(1, h, 1, 1).expand(b, h, sq, 1)
        return torch.softmax(torch.cat([scores, column], -1), -1)[..., :sk] @ v64
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v64


ATTENTION_CASES = [
    dict(mask_type="padding_causal_bottom_right", padded=True),
    dict(mask_type="padding_causal_bottom_right", padded=True, window=(1, 0)),
    dict(mask_type="padding_causal", padded=True, window=(2, 0)),
    dict(mask_type="padding", padded=True, window=(1, 1)),
    dict(mask_type="padding", padded=True, window=(1, 2), bottom_right=False),
    dict(mask_type="causal", window=(2, 0)),
    dict(mask_type="causal_bottom_right", window=(1, 0)),
    dict(mask_type="no_mask", window=(1, 2)),
    dict(mask_type="no_mask", window=(0, 1), bottom_right=False),
    dict(mask_type="arbitrary", window=(2, 2)),
    dict(mask_type="no_mask", bias_type="post_scale_bias"),
    dict(mask_type="causal", bias_type="pre_scale_bias"),
    dict(mask_type="padding_causal", padded=True, bias_type="post_scale_bias", window=(1, 0)),
    dict(mask_type="no_mask", bias_type="alibi"),
    dict(mask_type="causal", bias_type="alibi", window=(2, 0)),
    dict(mask_type="padding_causal_bottom_right", padded=True, bias_type="alibi", slopes="per_batch"),
    dict(mask_type="no_mask", bias_type="alibi", bottom_right=False, slopes="per_head"),
]


def _padding_masks(b, sq, sk):
    kv = torch.arange(sk)[None, :] >= torch.tensor([sk, sk - 2])[:, None]
    q = torch.arange(sq)[None, :] >= torch.tensor([sq - 1, sq])[:, None]
    return q.view(b, 1, 1, sq), kv.view(b, 1, 1, sk)


def _case_inputs(case, b, h, sq, sk, g):
    """(DotProductAttention.forward kwargs, te_attention64 kwargs) for one case."""
    fwd, ref = dict(attn_mask_type=case["mask_type"]), dict(mask_type=case["mask_type"])
    if case.get("padded"):
        q_pad, kv_pad = _padding_masks(b, sq, sk)
        fwd["attention_mask"] = (q_pad, kv_pad) if sq != sk or case.get("pair") else kv_pad
        if sq == sk and not case.get("pair"):
            q_pad = kv_pad  # one mask pads both sides of self-attention
        ref.update(q_pad=q_pad.view(b, sq), kv_pad=kv_pad.view(b, sk))
    if case["mask_type"] == "arbitrary":
        fwd["attention_mask"] = ref["arbitrary"] = torch.rand(b, h, sq, sk, generator=g) > 0.7
    for key, ref_key in (("window", "window"), ("bottom_right", "bottom_right")):
        if key in case:
            fwd["window_size" if key == "window" else "bottom_right_diagonal"] = ref[ref_key] = case[key]
    bias_type = case.get("bias_type", "no_bias")
    fwd["core_attention_bias_type"] = ref["bias_type"] = bias_type
    if bias_type.endswith("scale_bias"):
        fwd["core_attention_bias"] = ref["bias"] = torch.randn(1, h, sq, sk, generator=g, requires_grad=True)
    if case.get("slopes"):
        shape = (b, h) if case["slopes"] == "per_batch" else (h,)
        fwd["alibi_slopes"] = ref["slopes"] = torch.rand(*shape, generator=g) * 0.5
    return fwd, ref


def case_tensors(case, heads, groups, sq, sk, g, b=2, d=8, scale=0.35):
    """(q, k, v) in (b, h, s, d), requiring gradients; the case's forward and te_attention64
    kwargs; DotProductAttention's constructor kwargs (bshd)."""
    q = torch.randn(b, heads, sq, d, generator=g, requires_grad=True)
    k = torch.randn(b, groups, sk, d, generator=g, requires_grad=True)
    v = torch.randn(b, groups, sk, d, generator=g, requires_grad=True)
    fwd, ref_kw = _case_inputs(case, b, heads, sq, sk, g)
    dpa_kw = dict(num_gqa_groups=groups, qkv_format="bshd", softmax_scale=scale,
                  attention_type="self" if sq == sk else "cross")
    return q, k, v, fwd, ref_kw, dpa_kw


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("heads, groups, sq, sk", [(4, 4, 5, 5), (4, 2, 4, 6), (4, 1, 6, 4)])
def test_dot_product_attention_matches_float64(case, heads, groups, sq, sk):
    """Every mask type, sliding window, bias type and GQA grouping, forward and gradients
    (q, k, v and a post/pre-scale bias), in bshd."""
    g = seeded(heads * 100 + groups * 10 + sq)
    q, k, v, fwd, ref_kw, dpa_kw = case_tensors(case, heads, groups, sq, sk, g)
    d, scale = q.shape[-1], dpa_kw["softmax_scale"]
    dpa = tm.DotProductAttention(heads, d, **dpa_kw)
    out = dpa(query_layer=q.transpose(1, 2), key_layer=k.transpose(1, 2), value_layer=v.transpose(1, 2), **fwd)
    ref = te_attention64(q, k, v, scale, **ref_kw).transpose(1, 2).reshape(out.shape)
    torch.testing.assert_close(out.double(), ref, rtol=1.3e-6, atol=1e-5)
    inputs = [q, k, v] + ([fwd["core_attention_bias"]] if "core_attention_bias" in fwd else [])
    dy = torch.randn(out.shape, generator=g)
    for name, got, want in zip("qkvb", torch.autograd.grad(out, inputs, dy),
                               torch.autograd.grad(ref, inputs, dy.double())):
        torch.testing.assert_close(got.double(), want.double(), rtol=1.3e-6, atol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_bf16_window_and_alibi_within_bf16_tolerance():
    g = seeded(11)
    q, k, v = (torch.randn(7, 2, 4, 16, generator=g) for _ in range(3))
    dpa = tm.DotProductAttention(4, 16, attn_mask_type="causal", window_size=(3, 0))
    out = dpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), core_attention_bias_type="alibi")
    assert out.dtype == torch.bfloat16
    to_bhsd = lambda t: t.bfloat16().double().permute(1, 2, 0, 3)  # noqa: E731
    ref = te_attention64(*(to_bhsd(t) for t in (q, k, v)), 0.25, "causal", window=(3, 0), bias_type="alibi")
    ref = ref.permute(2, 0, 1, 3).reshape(out.shape)
    # The reference computes in float32 from bf16 inputs: bf16's tolerance. An accelerator's
    # fused kernel also rounds its softmax weights to bf16 before they multiply v, so its error
    # is bounded relative to the output's scale (as the varlen kernel tests bound it): a lost
    # window or bias still errs by far more.
    atol = 1e-5 if te.get_backend().name == "reference" else 2e-2 * ref.abs().max().item()
    torch.testing.assert_close(out.double(), ref, rtol=1.6e-2, atol=atol)


def test_window_set_in_the_constructor_and_overridden_in_forward():
    g = seeded(12)
    q, k, v = (torch.randn(6, 2, 2, 8, generator=g) for _ in range(3))
    perm = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    dpa = tm.DotProductAttention(2, 8, attn_mask_type="no_mask", window_size=(1, 1), bottom_right_diagonal=False)
    want = te_attention64(*map(perm, (q, k, v)), 8 ** -0.5, window=(1, 1), bottom_right=False)
    torch.testing.assert_close(dpa(q, k, v).double(), want.permute(2, 0, 1, 3).reshape(6, 2, 16), rtol=1.3e-6,
                               atol=1e-5)
    want = te_attention64(*map(perm, (q, k, v)), 8 ** -0.5, window=(0, 2))
    got = dpa(q, k, v, window_size=(0, 2), bottom_right_diagonal=True)
    torch.testing.assert_close(got.double(), want.permute(2, 0, 1, 3).reshape(6, 2, 16), rtol=1.3e-6, atol=1e-5)


def test_checkpoint_core_attention_gives_the_same_values_and_gradients():
    g = seeded(13)
    qkv = [torch.randn(5, 2, 2, 8, generator=g, requires_grad=True) for _ in range(3)]
    dpa = tm.DotProductAttention(2, 8, window_size=(2, 0))
    plain = dpa(*qkv)
    recomputed = dpa(*qkv, checkpoint_core_attention=True)
    torch.testing.assert_close(recomputed, plain)
    dy = torch.randn(plain.shape, generator=g)
    for a, e in zip(torch.autograd.grad(recomputed, qkv, dy), torch.autograd.grad(plain, qkv, dy)):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(window_size=(2,)), ValueError, r"window_size must be None or \(left, right\)"),
        (dict(core_attention_bias_type="post_scale_bias"), ValueError, r"needs core_attention_bias"),
        (dict(core_attention_bias_type="alibi", core_attention_bias=torch.zeros(1, 2, 4, 4)), ValueError,
         r"takes no core_attention_bias"),
        (dict(alibi_slopes=torch.ones(2)), ValueError, r"alibi_slopes needs core_attention_bias_type='alibi'"),
        (dict(core_attention_bias_type="alibi", alibi_slopes=torch.ones(3)), ValueError,
         r"alibi_slopes must have shape \(2,\) or \(2, 2\)"),
        (dict(cu_seqlens_q=torch.tensor([0, 4, 8])), ValueError, r"cu_seqlens_q and cu_seqlens_kv stand for"),
        (dict(max_seqlen_q=5), ValueError, r"max_seqlen_q=5 but the sbhd tensor holds sequences of 4"),
        (dict(inference_params=object()), TypeError, r"inference_params must be a te_core.InferenceParams"),
    ],
)
def test_attention_arguments_are_checked(kwargs, exc, match):
    qkv = [torch.randn(4, 2, 2, 8)] * 3
    with pytest.raises(exc, match=match):
        tm.DotProductAttention(2, 8)(*qkv, **kwargs)


def test_query_key_value_on_meta_or_another_device_or_dtype_are_refused():
    # these used to run: meta tensors gave memory never written, other dtypes were cast silently
    dpa = tm.DotProductAttention(2, 8)
    q = torch.randn(4, 2, 2, 8)
    with pytest.raises(ValueError, match=r"DotProductAttention: query_layer is on the meta device, which holds no data"):
        dpa(*[q.to("meta")] * 3)
    with pytest.raises(ValueError, match=r"DotProductAttention: query_layer is on the meta device"):
        dpa(qkv_layer=torch.empty(4, 2, 3, 2, 8, device="meta"))
    with pytest.raises(ValueError, match=r"DotProductAttention: key_layer is on meta but query_layer is on \w+"):
        dpa(q, q.to("meta"), q)
    with pytest.raises(ValueError, match=r"DotProductAttention: value_layer is on meta but query_layer is on \w+"):
        dpa(q, q, q.to("meta"))
    with pytest.raises(TypeError, match=r"DotProductAttention: key_layer has dtype torch.float16 but query_layer has "
                                        r"torch.float32; .*\(key_layer.to\(query_layer.dtype\)\)"):
        dpa(q, q.half(), q)
    with pytest.raises(TypeError, match=r"value_layer has dtype torch.bfloat16 but query_layer has torch.float32"):
        dpa(q, q, q.bfloat16())
    with pytest.raises(TypeError, match=r"DotProductAttention: key_layer must be a torch.Tensor, got list"):
        dpa(q, [[0.0]], q)
    # through the blocks that forward to it
    on_meta = tm.MultiheadAttention(16, 2, device="meta")
    with pytest.raises(ValueError, match=r"MultiheadAttention: hidden_states is on the meta device"):
        on_meta(torch.empty(4, 2, 16, device="meta"))
    cross = tm.MultiheadAttention(16, 2, attention_type="cross", attn_mask_type="no_mask")
    with pytest.raises(TypeError, match=r"Linear: the input is torch.bfloat16 but the parameter 'weight' is "
                                        r"torch.float32"):  # (the key/value projection's check, as in TE)
        cross(torch.randn(4, 2, 16), encoder_output=torch.randn(4, 2, 16, dtype=torch.bfloat16))


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(kv_channels=8.0), TypeError, r"kv_channels must be a positive int, or a \(key, value\) pair of them, got 8.0"),
    (dict(kv_channels="8"), TypeError, r"kv_channels must be a positive int, or a \(key, value\) pair .* got '8'"),
    (dict(kv_channels=(8, 8, 8)), TypeError, r"kv_channels must be a positive int, or a \(key, value\) pair"),
    (dict(kv_channels=(8, 0)), ValueError, r"kv_channels must be a positive integer, got 0"),
    (dict(attention_dropout="0.1"), TypeError, r"attention_dropout must be a number in \[0, 1\), got '0.1'"),
    (dict(attention_dropout=None), TypeError, r"attention_dropout must be a number in \[0, 1\), got None"),
    (dict(attention_dropout=float("nan")), ValueError, r"attention_dropout must be in \[0, 1\), got nan"),
    (dict(attention_dropout=1.0), ValueError, r"attention_dropout must be in \[0, 1\), got 1.0"),
    (dict(bottom_right_diagonal="yes"), TypeError, r"bottom_right_diagonal must be True, False or None, got 'yes'"),
    (dict(sequence_parallel="no"), TypeError, r"sequence_parallel must be True or False, got 'no'"),
])
def test_dot_product_attention_constructor_arguments_are_checked(kwargs, exc, match):
    kwargs = {"kv_channels": 8, **kwargs}
    with pytest.raises(exc, match=rf"DotProductAttention: {match}"):
        tm.DotProductAttention(2, **kwargs)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(bias="no"), TypeError, r"bias must be True or False, got 'no'"),
    (dict(fuse_qkv_params="yes"), TypeError, r"fuse_qkv_params must be True or False, got 'yes'"),
    (dict(input_layernorm=2), TypeError, r"input_layernorm must be True or False, got 2"),
    (dict(qk_norm_before_rope=None), TypeError, r"qk_norm_before_rope must be True or False, got None"),
    (dict(fuse_wgrad_accumulation="no"), TypeError, r"fuse_wgrad_accumulation must be True or False, got 'no'"),
    (dict(kv_channels="8"), ValueError, r"kv_channels must be a positive integer, got '8'"),
    (dict(attention_dropout=1.5), ValueError, r"attention_dropout must be in \[0, 1\), got 1.5"),
    (dict(input_layernorm=True, layernorm_epsilon=-1.0), ValueError, r"layernorm_epsilon must be finite and >= 0"),
    (dict(qk_norm_type="RMSNorm", qk_norm_eps="1e-6"), TypeError, r"qk_norm_eps must be a finite number >= 0"),
])
def test_multihead_attention_constructor_arguments_are_checked(kwargs, exc, match):
    with pytest.raises(exc, match=rf"MultiheadAttention: {match}"):
        tm.MultiheadAttention(32, 4, **kwargs)


def test_multihead_attention_flags_take_0_and_1():
    block = tm.MultiheadAttention(32, 4, bias=0, fuse_qkv_params=1, layernorm_epsilon=None)  # (eps unread here)
    assert block.fuse_qkv_params is True and block.qkv.bias is None


def test_causal_window_with_a_right_extent_warns_as_transformer_engine():
    q = torch.randn(4, 1, 1, 8)
    with pytest.warns(UserWarning, match=r"using \(1, 0\)"):
        tm.DotProductAttention(1, 8, attn_mask_type="causal")(q, q, q, window_size=(1, 1))


# ---- MultiheadAttention and TransformerLayer hand every attention argument to the core

def qk_norm64(kind, norm, t, eps):
    """Transformer Engine's QK normalization of t over its last dimension, in float64."""
    t = t.double()
    if kind == "L2Normalization":
        return t / torch.sqrt(t.square().sum(-1, keepdim=True) + eps)
    if kind == "RMSNorm":
        return t / torch.sqrt(t.square().mean(-1, keepdim=True) + eps) * norm.weight.double()
    centered = t - t.mean(-1, keepdim=True)
    return centered / torch.sqrt(centered.square().mean(-1, keepdim=True) + eps) * norm.weight.double() \
        + norm.bias.double()


def mha64(mha, x, freqs=None, rope_interleaved=False, qk_norm=None, **ref_kw):
    """A self-attention MultiheadAttention (no input norm) computed from its parameters in
    float64, with Transformer Engine's two fused-QKV layouts. x is (s, b, hidden). qk_norm:
    (kind, eps, before_rope) of the block's QK normalization."""
    h, g, d = mha.num_attention_heads, mha.num_gqa_groups, mha.kv_channels
    s, b, _ = x.shape
    qkv = x.double() @ mha.qkv.weight.double().T + mha.qkv.bias.double()
    if mha.qkv_weight_interleaved:
        q, k, v = qkv.view(s, b, g, h // g + 2, d).split([h // g, 1, 1], dim=-2)
    else:
        q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
    q, k, v = q.reshape(s, b, h, d), k.reshape(s, b, g, d), v.reshape(s, b, g, d)
    kind, eps, before = qk_norm or (None, None, None)
    if kind is not None and before:
        q, k = qk_norm64(kind, mha.q_norm, q, eps), qk_norm64(kind, mha.k_norm, k, eps)
    if freqs is not None:
        q, k = (tm.apply_rotary_pos_emb(t, freqs, interleaved=rope_interleaved) for t in (q, k))
    if kind is not None and not before:
        q, k = qk_norm64(kind, mha.q_norm, q, eps), qk_norm64(kind, mha.k_norm, k, eps)
    out = te_attention64(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), d ** -0.5, **ref_kw)
    out = out.permute(2, 0, 1, 3).reshape(s, b, h * d)
    return out @ mha.proj.weight.double().T + mha.proj.bias.double()


def _mha(**kw):
    torch.manual_seed(5)
    mha = tm.MultiheadAttention(32, 4, num_gqa_groups=2, attention_dropout=0.0, **kw)
    with torch.no_grad():
        for p in mha.parameters():
            p.add_(torch.randn(p.shape) * 0.2)
    return mha


@pytest.mark.parametrize("fuse_qkv_params, qkv_weight_interleaved", [(False, True), (True, True), (True, False)])
def test_multihead_attention_window_bias_and_qkv_layouts(fuse_qkv_params, qkv_weight_interleaved):
    mha = _mha(attn_mask_type="causal", window_size=(2, 0), fuse_qkv_params=fuse_qkv_params,
               qkv_weight_interleaved=qkv_weight_interleaved)
    assert mha.qkv_weight_interleaved == (fuse_qkv_params and qkv_weight_interleaved)
    x = torch.randn(6, 2, 32, generator=seeded(6))
    want = mha64(mha, x, mask_type="causal", window=(2, 0))
    torch.testing.assert_close(mha(x).double(), want, rtol=1.3e-6, atol=1e-5)
    slopes = torch.rand(4, generator=seeded(7))
    got = mha(x, attn_mask_type="no_mask", window_size=(1, 1), bottom_right_diagonal=False,
              core_attention_bias_type="alibi", alibi_slopes=slopes)
    want = mha64(mha, x, window=(1, 1), bottom_right=False, bias_type="alibi", slopes=slopes)
    torch.testing.assert_close(got.double(), want, rtol=1.3e-6, atol=1e-5)


def test_multihead_attention_bias_padding_rope_and_checkpoint():
    mha = _mha(attn_mask_type="padding", rotary_pos_interleaved=True)
    g = seeded(8)
    x = torch.randn(5, 2, 32, generator=g)
    pad = (torch.arange(5)[None, :] >= torch.tensor([5, 3])[:, None]).view(2, 1, 1, 5)
    bias = torch.randn(1, 4, 5, 5, generator=g)
    freqs = tm.RotaryPositionEmbedding(8, interleaved=True)(5)
    got = mha(x, attention_mask=pad, rotary_pos_emb=freqs, core_attention_bias_type="post_scale_bias",
              core_attention_bias=bias, checkpoint_core_attention=True)
    want = mha64(mha, x, freqs, True, mask_type="padding", q_pad=pad.view(2, 5), kv_pad=pad.view(2, 5),
                 bias_type="post_scale_bias", bias=bias)
    torch.testing.assert_close(got.double(), want, rtol=1.3e-6, atol=1e-5)
    assert not torch.allclose(got, mha(x, attention_mask=pad, rotary_pos_emb=freqs))  # the bias is not ignored


@pytest.mark.parametrize("kind", ["L2Normalization", "RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("before_rope", [False, True])
def test_multihead_attention_qk_norm(kind, before_rope):
    """QK normalization (Transformer Engine's qk_norm_type): outputs and the norms' parameter
    gradients match a float64 computation; before and after the rotary embedding differ (but
    for L2 normalization)."""
    mha = _mha(attn_mask_type="causal", qk_norm_type=kind, qk_norm_eps=1e-5, qk_norm_before_rope=before_rope)
    if kind != "L2Normalization":
        with torch.no_grad():
            for p in (*mha.q_norm.parameters(), *mha.k_norm.parameters()):
                p.add_(torch.randn(p.shape, generator=seeded(11)) * 0.3)
    else:
        assert mha.q_norm is mha.k_norm and not list(mha.q_norm.parameters())
    x = torch.randn(6, 2, 32, generator=seeded(12))
    freqs = tm.RotaryPositionEmbedding(8)(6)
    got = mha(x, rotary_pos_emb=freqs)
    want = mha64(mha, x, freqs, qk_norm=(kind, 1e-5, before_rope), mask_type="causal")
    torch.testing.assert_close(got.double(), want, rtol=1.3e-6, atol=1e-5)
    if kind != "L2Normalization":  # (a rotation keeps a vector's L2 norm: there the order cannot matter)
        other = mha64(mha, x, freqs, qk_norm=(kind, 1e-5, not before_rope), mask_type="causal")
        assert not torch.allclose(want, other)  # the order relative to the rotary embedding matters
    if kind != "L2Normalization":
        dy = torch.randn(got.shape, generator=seeded(13))
        got.backward(dy)
        norms = (mha.q_norm, mha.k_norm)
        grads = [p.grad.clone() for n in norms for p in n.parameters()]
        for n in norms:
            for p in n.parameters():
                p.grad = None
        want.backward(dy.double())  # mha64 reads the same parameters, through float64 copies
        for g, n_p in zip(grads, [p for n in norms for p in n.parameters()]):
            assert g.abs().sum() > 0
            torch.testing.assert_close(g, n_p.grad, rtol=1e-5, atol=1e-5)


def test_multihead_attention_qk_norm_with_the_interleaved_qkv_layout():
    """QK normalization reads each head whatever the fused QKV layout (TE's interleaved one here)."""
    mha = _mha(attn_mask_type="causal", fuse_qkv_params=True, qkv_weight_interleaved=True, qk_norm_type="RMSNorm")
    with torch.no_grad():
        for p in (mha.q_norm.weight, mha.k_norm.weight):
            p.add_(torch.randn(p.shape, generator=seeded(14)) * 0.3)
    x = torch.randn(6, 2, 32, generator=seeded(15))
    want = mha64(mha, x, qk_norm=("RMSNorm", 1e-6, False), mask_type="causal")
    torch.testing.assert_close(mha(x).double(), want, rtol=1.3e-6, atol=1e-5)


class _Float64MHA(torch.nn.Module):
    """mha64 of a self-attention block with causal mask and L2 QK normalization (eps 1e-3), as a
    module whose parameters torch.func.functional_call can replace by float64 leaves."""

    def __init__(self, mha):
        super().__init__()
        self.mha = mha

    def forward(self, x, freqs):
        return mha64(self.mha, x, freqs, qk_norm=("L2Normalization", 1e-3, False), mask_type="causal")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_l2_qk_norm_is_te_fusible_operation(dtype):
    """As Transformer Engine's: q_norm and k_norm of qk_norm_type="L2Normalization" are one
    instance of the fusible operation ops.L2Normalization (transformer_engine.pytorch.ops), with
    qk_norm_eps as its eps. In the block, its outputs and input gradients (q's and k's) match
    float64 x / sqrt(sum(x^2) + eps) of its inputs; in float32 the whole block's output and every
    gradient match float64 too (in bf16 the block's GEMMs round more than bf16's tolerance)."""
    from te_core.modules import fusible_ops

    mha = _mha(attn_mask_type="causal", qk_norm_type="L2Normalization", qk_norm_eps=1e-3, params_dtype=dtype,
               seq_length=6, micro_batch_size=2)
    assert isinstance(mha.q_norm, fusible_ops.L2Normalization) and mha.q_norm is mha.k_norm
    assert mha.q_norm.eps == 1e-3
    layer = tm.TransformerLayer(32, 64, 4, qk_norm_type="L2Normalization", qk_norm_eps=1e-4, seq_length=6)
    assert isinstance(layer.self_attention.q_norm, fusible_ops.L2Normalization)
    assert layer.self_attention.q_norm is layer.self_attention.k_norm and layer.self_attention.k_norm.eps == 1e-4
    seen = []  # (input, output) of each call: q's, then k's

    def keep(_, args, out):
        args[0].retain_grad()
        out.retain_grad()
        seen.append((args[0], out))

    mha.q_norm.register_forward_hook(keep)
    x = torch.randn(6, 2, 32, generator=seeded(16)).to(dtype).requires_grad_()
    freqs = tm.RotaryPositionEmbedding(8)(6)
    got = mha(x, rotary_pos_emb=freqs)
    dy = torch.randn(got.shape, generator=seeded(17)).to(dtype)
    got.backward(dy)
    tols = dict(rtol=1.6e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1.3e-6, atol=1e-5)
    assert [out.dtype for _, out in seen] == [dtype, dtype]
    for inp, out in seen:
        t = inp.detach().double().requires_grad_()
        want = t / torch.sqrt(t.square().sum(-1, keepdim=True) + 1e-3)
        torch.testing.assert_close(out.double(), want, **tols)
        want.backward(out.grad.double())
        assert inp.grad.abs().sum() > 0
        torch.testing.assert_close(inp.grad.double(), t.grad, **tols)
    if dtype != torch.float32:
        return
    grads = [x.grad] + [p.grad for p in mha.parameters()]
    x64 = x.detach().double().requires_grad_()
    params64 = {f"mha.{name}": p.detach().double().requires_grad_() for name, p in mha.named_parameters()}
    want = torch.func.functional_call(_Float64MHA(mha), params64, (x64, freqs))
    torch.testing.assert_close(got.double(), want, **tols)
    want.backward(dy.double())
    for g, w in zip(grads, [x64.grad, *(p.grad for p in params64.values())]):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g.double(), w, **tols)


def test_qk_norm_names_and_errors():
    layer = tm.TransformerLayer(32, 64, 4, layer_type="decoder", qk_norm_type="LayerNorm", qk_norm_eps=1e-4,
                                qk_norm_before_rope=True, hidden_dropout=0.0, attention_dropout=0.0)
    names = set(layer.state_dict())
    for block in ("self_attention", "inter_attention"):  # as Transformer Engine: both attention blocks
        assert {f"{block}.q_norm.weight", f"{block}.q_norm.bias", f"{block}.k_norm.weight"} <= names
        assert getattr(layer, block).q_norm.eps == 1e-4 and getattr(layer, block).qk_norm_before_rope
    with pytest.raises(ValueError, match="qk_norm_type"):
        tm.MultiheadAttention(32, 4, qk_norm_type="rms")


def test_multihead_attention_constructor_options_reach_their_parts(module_backend):
    calls, device = [], module_backend.device
    mha = tm.MultiheadAttention(
        32, 4, kv_channels=16, attention_dropout=0.25, layernorm_epsilon=1e-3, num_gqa_groups=2,
        init_method=lambda w: calls.append("qkv") or torch.nn.init.ones_(w),
        output_layer_init_method=lambda w: calls.append("proj") or torch.nn.init.zeros_(w),
        attn_mask_type="padding", window_size=(3, 3), bottom_right_diagonal=False, params_dtype=torch.bfloat16,
        return_layernorm_output=True, input_layernorm=True, attention_type="self", zero_centered_gamma=True,
        bias=False, normalization="RMSNorm", device=device, qkv_format="bshd",
    )
    qkv, core = mha.layernorm_qkv, mha.core_attention
    assert calls == ["qkv", "proj"] and torch.all(qkv.weight == 1) and torch.all(mha.proj.weight == 0)
    assert qkv.weight.shape == (4 * 16 + 2 * 2 * 16, 32) and qkv.weight.dtype == torch.bfloat16
    assert qkv.weight.device == device and qkv.bias is None and mha.proj.bias is None
    assert qkv.eps == 1e-3 and qkv.zero_centered_gamma and qkv.normalization == "RMSNorm"
    assert (core.attention_dropout, core.attn_mask_type, core.window_size) == (0.25, "padding", (3, 3))
    assert core.bottom_right_diagonal is False and core.qkv_format == "bshd" and core.num_gqa_groups == 2
    out, ln_out = mha.eval()(torch.randn(2, 5, 32, dtype=torch.bfloat16),
                             attention_mask=torch.zeros(2, 1, 1, 5, dtype=torch.bool))
    assert out.shape == (2, 5, 32) and ln_out.shape == (2, 5, 32)


def _decoder(**kw):
    torch.manual_seed(9)
    layer = tm.TransformerLayer(32, 64, 4, num_gqa_groups=2, hidden_dropout=0.0, attention_dropout=0.0,
                                layer_type="decoder", **kw)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    return layer


def test_transformer_layer_passes_attention_arguments_to_the_right_block():
    """The decoder's output equals its blocks called one by one with the arguments
    Transformer Engine gives each: self-attention the self_* ones, cross-attention the
    enc_dec_* ones, both the bias type (and checkpointing changes nothing)."""
    layer = _decoder(self_attn_mask_type="causal", enc_dec_attn_mask_type="padding")
    g = seeded(10)
    x, enc = torch.randn(5, 2, 32, generator=g), torch.randn(6, 2, 32, generator=g)
    q_pad = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    kv_pad = (torch.arange(6)[None, :] >= torch.tensor([6, 4])[:, None]).view(2, 1, 1, 6)
    got = layer(x, self_attn_mask_type="causal_bottom_right", window_size=(1, 0), encoder_output=enc,
                enc_dec_attn_mask=(q_pad, kv_pad), enc_dec_attn_mask_type="padding", enc_dec_window_size=(2, 2),
                enc_dec_bottom_right_diagonal=False, core_attention_bias_type="alibi", checkpoint_core_attention=True)
    hidden = x + layer.self_attention(x, attn_mask_type="causal_bottom_right", window_size=(1, 0),
                                      core_attention_bias_type="alibi")
    hidden = hidden + layer.inter_attention(hidden, attention_mask=(q_pad, kv_pad), encoder_output=enc,
                                            window_size=(2, 2), bottom_right_diagonal=False,
                                            core_attention_bias_type="alibi")
    torch.testing.assert_close(got, hidden + layer.layernorm_mlp(hidden), rtol=1.3e-6, atol=1e-5)


def test_transformer_layer_bias_and_window_from_the_constructor():
    torch.manual_seed(14)
    layer = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="padding",
                                window_size=(1, 1), bottom_right_diagonal=False)
    g = seeded(15)
    x, bias = torch.randn(5, 2, 32, generator=g), torch.randn(1, 4, 5, 5, generator=g)
    slopes = torch.rand(2, 4, generator=g)
    pad = (torch.arange(5)[None, :] >= torch.tensor([5, 3])[:, None]).view(2, 1, 1, 5)
    for extra in (dict(core_attention_bias_type="post_scale_bias", core_attention_bias=bias),
                  dict(core_attention_bias_type="alibi", alibi_slopes=slopes)):
        got = layer(x, attention_mask=pad, **extra)
        hidden = x + layer.self_attention(x, attention_mask=pad, attn_mask_type="padding", window_size=(1, 1),
                                          bottom_right_diagonal=False, **extra)
        torch.testing.assert_close(got, hidden + layer.layernorm_mlp(hidden), rtol=1.3e-6, atol=1e-5)
        assert not torch.allclose(got, layer(x, attention_mask=pad))  # not ignored


def test_transformer_layer_constructor_attention_options_reach_the_blocks():
    calls = []
    layer = tm.TransformerLayer(
        32, 64, 4, kv_channels=16, layernorm_epsilon=1e-3, attention_dropout=0.2, layer_type="decoder",
        init_method=lambda w: calls.append("in") or torch.nn.init.ones_(w),
        output_layer_init_method=lambda w: calls.append("out") or torch.nn.init.zeros_(w),
        self_attn_mask_type="causal_bottom_right", window_size=(4, 0), bottom_right_diagonal=True,
        enc_dec_attn_mask_type="padding", enc_dec_window_size=(2, 2), enc_dec_bottom_right_diagonal=False,
        fuse_qkv_params=True, qkv_weight_interleaved=True, rotary_pos_interleaved=True, zero_centered_gamma=True,
        bias=False, params_dtype=torch.bfloat16,
    )
    assert layer.layernorm_mlp.fc1_weight.dtype == torch.bfloat16
    sa, ca = layer.self_attention, layer.inter_attention
    assert "in" in calls and "out" in calls and torch.all(sa.proj.weight == 0)
    assert sa.kv_channels == 16 and sa.layernorm_qkv.eps == 1e-3 and sa.layernorm_qkv.zero_centered_gamma
    assert sa.qkv_weight_interleaved and sa.rotary_pos_interleaved and sa.layernorm_qkv.bias is None
    assert (sa.core_attention.attn_mask_type, sa.core_attention.window_size) == ("causal_bottom_right", (4, 0))
    assert sa.core_attention.bottom_right_diagonal is True and sa.core_attention.attention_dropout == 0.2
    assert (ca.core_attention.attn_mask_type, ca.core_attention.window_size) == ("padding", (2, 2))
    assert ca.core_attention.bottom_right_diagonal is False


# ---- packed sequences: qkv_format="thd" with cu_seqlens, and cu_seqlens standing for padding masks


def _packed_case(lengths_q, lengths_kv, heads, groups, d, g):
    q = [torch.randn(n, heads, d, generator=g) for n in lengths_q]
    k = [torch.randn(n, groups, d, generator=g) for n in lengths_kv]
    v = [torch.randn(n, groups, d, generator=g) for n in lengths_kv]
    cu = lambda ns: torch.tensor([0] + list(torch.tensor(ns).cumsum(0)))  # noqa: E731
    return q, k, v, cu(lengths_q), cu(lengths_kv)


@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right", "causal",
                                       "no_mask"])
@pytest.mark.parametrize("heads, groups", [(4, 4), (4, 1)])
def test_thd_packed_sequences_match_each_sequence_alone(mask_type, heads, groups):
    """Each packed sequence attends only to itself: the packed result equals float64 attention
    on every sequence separately (causal types on thd are their padding twins, as in TE)."""
    g = seeded(21 + heads + groups)
    d, lq, lkv = 8, [3, 5, 1], [4, 5, 2]
    q, k, v, cu_q, cu_kv = _packed_case(lq, lkv, heads, groups, d, g)
    packed = [torch.cat(parts).requires_grad_() for parts in (q, k, v)]
    dpa = tm.DotProductAttention(heads, d, num_gqa_groups=groups, qkv_format="thd", attn_mask_type=mask_type,
                                 window_size=(2, 0) if "causal" in mask_type else None)
    out = dpa(*packed, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=6, max_seqlen_kv=5)
    assert out.shape == (sum(lq), heads * d)
    kind = mask_type.replace("padding_", "").replace("padding", "no_mask")
    want = torch.cat([
        te_attention64(qi.permute(1, 0, 2)[None], ki.permute(1, 0, 2)[None], vi.permute(1, 0, 2)[None], d ** -0.5,
                       kind, window=(2, 0) if "causal" in mask_type else None)[0].permute(1, 0, 2).flatten(1)
        for qi, ki, vi in zip(packed[0].split(lq), packed[1].split(lkv), packed[2].split(lkv))])
    torch.testing.assert_close(out.double(), want, rtol=1.3e-6, atol=1e-5)
    dy = torch.randn(out.shape, generator=g)
    for got, ref in zip(torch.autograd.grad(out, packed, dy), torch.autograd.grad(want, packed, dy.double())):
        torch.testing.assert_close(got.double(), ref.double(), rtol=1.3e-6, atol=1e-5)


def test_thd_with_every_query_sequence_empty():
    """No query tokens at all (cross attention of empty queries): an empty output, and the keys
    and values get zero gradients."""
    g = seeded(24)
    k, v = (torch.randn(8, 2, 8, generator=g, requires_grad=True) for _ in range(2))
    q = torch.randn(0, 2, 8, requires_grad=True)
    dpa = tm.DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding_causal_bottom_right",
                                 attention_type="cross")
    out = dpa(q, k, v, cu_seqlens_q=torch.tensor([0, 0, 0]), cu_seqlens_kv=torch.tensor([0, 6, 8]))
    assert out.shape == (0, 16)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


@pytest.mark.parametrize("mask_type, window", [("no_mask", (2, -1)), ("padding", (-1, 3)), ("causal", (-1, 3)),
                                               ("padding_causal_bottom_right", (-1, 1))])
def test_windows_transformer_engine_refuses_are_refused(mask_type, window):
    """One unbounded side with the other bounded (TE asserts): a clear error, not a window TE
    code would not run."""
    q = torch.randn(4, 1, 2, 8)
    dpa = tm.DotProductAttention(2, 8, attn_mask_type=mask_type, window_size=window)
    pad = torch.zeros(1, 1, 1, 4, dtype=torch.bool) if "padding" in mask_type else None
    with pytest.raises(ValueError, match=rf"window_size={re.escape(str(window))} with attn_mask_type='{mask_type}'"):
        dpa(q, q, q, attention_mask=pad)


def test_cu_seqlens_stand_for_padding_masks_in_bshd_and_through_the_layer():
    g = seeded(22)
    q, k, v = (torch.randn(2, 5, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 5, 8])
    pad = (torch.arange(5)[None, :] >= torch.tensor([5, 3])[:, None]).view(2, 1, 1, 5)
    dpa = tm.DotProductAttention(2, 8, qkv_format="bshd", attn_mask_type="padding_causal")
    torch.testing.assert_close(dpa(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu), dpa(q, k, v, attention_mask=pad))
    torch.manual_seed(23)
    layer = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, self_attn_mask_type="padding")
    x = torch.randn(5, 2, 32, generator=g)
    torch.testing.assert_close(layer(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5),
                               layer(x, attention_mask=pad))
    mha = layer.self_attention
    torch.testing.assert_close(mha(x, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5),
                               mha(x, attention_mask=pad))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), r"qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 6]), cu_seqlens_kv=torch.tensor([0, 3, 7])),
         r"cu_seqlens_kv must start at 0, never decrease and end at the number of packed tokens \(6\)"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 6]), cu_seqlens_kv=torch.tensor([0, 3, 6]), max_seqlen_q=2),
         r"max_seqlen for cu_seqlens_q is 2, shorter than a sequence of 3"),
        (dict(cu_seqlens_q=torch.tensor([0, 6]), cu_seqlens_kv=torch.tensor([0, 3, 6])),
         r"different numbers of sequences"),
    ],
)
def test_thd_inputs_are_checked(kwargs, match):
    t = torch.randn(6, 2, 8)
    with pytest.raises(ValueError, match=match):
        tm.DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding")(t, t, t, **kwargs)


@pytest.mark.parametrize("input_layernorm", [False, True])
def test_multihead_attention_return_bias_leaves_the_projection_bias_out(input_layernorm):
    """return_bias=True: (output without proj's bias, proj's bias[, layernorm output]), in
    Transformer Engine's order; adding the bias back gives the default output and gradients."""
    torch.manual_seed(0)
    kw = dict(attention_dropout=0.0, input_layernorm=input_layernorm, return_layernorm_output=input_layernorm)
    base = tm.MultiheadAttention(32, 4, **kw)
    split = tm.MultiheadAttention(32, 4, return_bias=True, **kw)
    split.load_state_dict(base.state_dict())
    with torch.no_grad():
        split.proj.bias.normal_()  # a bias that shows where it goes
        base.proj.bias.copy_(split.proj.bias)
    x = torch.randn(5, 2, 32)
    want, got = base(x), split(x)
    if input_layernorm:
        (want, want_ln), (out, bias, ln_out) = want, got
        torch.testing.assert_close(ln_out, want_ln, rtol=1.3e-6, atol=1e-5)
    else:
        out, bias = got
    assert bias is split.proj.bias
    torch.testing.assert_close(out, want - bias, rtol=1.3e-6, atol=1e-5)
    dy = torch.randn_like(out)
    (out + bias).backward(dy)
    want.backward(dy)
    for (name, p), q in zip(split.named_parameters(), base.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1.3e-6, atol=1e-5, msg=name)


def test_multihead_attention_return_bias_must_be_a_bool():
    with pytest.raises(TypeError, match="return_bias must be True or False"):
        tm.MultiheadAttention(32, 4, return_bias=2)


def test_a_mask_the_mask_type_does_not_read_is_left_out_with_a_warning():
    """As Transformer Engine: attn_mask_type='causal' reads no attention_mask (Megatron-LM passes its
    data loader's causal mask with it); the output is the causal one, and a warning says so."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 2, 8) for _ in range(3))
    dpa = tm.DotProductAttention(2, 8, attn_mask_type="causal")
    mask = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1).view(1, 1, 4, 4)
    with pytest.warns(UserWarning, match="attention_mask is not read with attn_mask_type='causal'"):
        out = dpa(q, k, v, attention_mask=mask)
    torch.testing.assert_close(out, dpa(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("spelling", ["padding,causal", "causal,padding", "causal_padding"])
def test_transformer_engines_other_mask_type_spellings_mean_padding_causal(spelling):
    """TE reads commas as underscores and "causal_padding" as "padding_causal", in the constructor
    and in forward; the outputs equal those of the canonical spelling."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 2, 2, 8, generator=g, device="cpu").to(torch.get_default_device()) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 5, dtype=torch.bool, device=q.device)
    mask[1, ..., 3:] = True
    want = tm.DotProductAttention(2, 8, attn_mask_type="padding_causal")(q, k, v, attention_mask=mask)
    built = tm.DotProductAttention(2, 8, attn_mask_type=spelling)
    assert built.attn_mask_type == "padding_causal"
    torch.testing.assert_close(built(q, k, v, attention_mask=mask), want, rtol=0, atol=0)
    given = tm.DotProductAttention(2, 8, attn_mask_type="no_mask")(q, k, v, attention_mask=mask,
                                                                   attn_mask_type=spelling)
    torch.testing.assert_close(given, want, rtol=0, atol=0)
    layer = tm.TransformerLayer(16, 32, 2, self_attn_mask_type=spelling, enc_dec_attn_mask_type=spelling)
    assert layer.enc_dec_attn_mask_type == "padding_causal"


@pytest.mark.parametrize("padded", [False, True])
def test_thd_rows_after_the_last_sequence_are_tail_padding_as_in_transformer_engine(padded):
    """TE takes thd tensors with rows after cu_seqlens[-1] (with or without cu_seqlens_*_padded
    ending before them): the sequences attend as if the rows were not there, and the tail rows of
    the output and of the gradients are zeros."""
    g = torch.Generator().manual_seed(8)
    dev = torch.get_default_device()
    q, k, v = (torch.randn(13, 2, 8, generator=g, device="cpu").to(dev) for _ in range(3))
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32, device=dev)
    cu_kv = torch.tensor([0, 6, 11], dtype=torch.int32, device=dev)
    extra = dict(cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=cu_kv) if padded else {}
    dpa = tm.DotProductAttention(2, 8, qkv_format="thd", attn_mask_type="padding_causal")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = dpa(*leaves, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **extra)
    trimmed = [t[:n].clone().requires_grad_() for t, n in zip((q, k, v), (10, 11, 11))]
    want = dpa(*trimmed, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    assert out.shape == (13, 16)
    torch.testing.assert_close(out[:10], want, rtol=1.3e-6, atol=1e-5)
    assert torch.count_nonzero(out[10:]) == 0
    dy = torch.randn(13, 16, generator=g, device="cpu").to(dev)
    out.backward(dy)
    want.backward(dy[:10])
    for leaf, ref, n in zip(leaves, trimmed, (10, 11, 11)):
        torch.testing.assert_close(leaf.grad[:n], ref.grad, rtol=1.3e-6, atol=1e-5)
        assert torch.count_nonzero(leaf.grad[n:]) == 0


def test_a_strict_load_without_core_attentions_extra_state_passes():
    """As Transformer Engine's post-hook: Megatron-LM's sharded checkpoints and older TE ones hold
    no core_attention._extra_state, and a strict load of them passes (other missing keys fail)."""
    torch.manual_seed(0)
    layer = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
    state = {k: v for k, v in layer.state_dict().items() if not k.endswith("core_attention._extra_state")}
    assert len(state) < len(layer.state_dict())
    layer.load_state_dict(state, strict=True)
    del state["layernorm_mlp.fc1_weight"]
    with pytest.raises(RuntimeError, match="layernorm_mlp.fc1_weight"):
        layer.load_state_dict(state, strict=True)
