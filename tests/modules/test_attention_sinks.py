"""Attention sinks: Transformer Engine's softmax_type "off-by-one" and "learnable" on
DotProductAttention, MultiheadAttention and TransformerLayer: every query's softmax denominator
also holds exp(offset_h), a logit of 0 or a learned one per head. Checked against float64 for
every mask type, window, bias and GQA grouping, the learned offsets' gradient included."""
from __future__ import annotations

import warnings

import pytest
import torch

import te_core.modules as tm
from te_core import ops

from ._compare import seeded
from .test_attention import ATTENTION_CASES, _packed_case, case_tensors, te_attention64

TOL = dict(rtol=1.3e-6, atol=1e-5)


@pytest.fixture(autouse=True)
def _quiet_fallback():
    """A backend without sinks hands them to the reference, with a warning said once per reason."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*softmax_offset.*")
        yield


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
@pytest.mark.parametrize("heads, groups, sq, sk", [(4, 4, 5, 5), (4, 2, 4, 6)])
def test_learnable_sink_matches_float64(case, heads, groups, sq, sk):
    g = seeded(heads * 100 + groups * 10 + sq + 7)
    q, k, v, fwd, ref_kw, dpa_kw = case_tensors(case, heads, groups, sq, sk, g)
    scale = dpa_kw["softmax_scale"]
    dpa = tm.DotProductAttention(heads, q.shape[-1], softmax_type="learnable", **dpa_kw)
    with torch.no_grad():
        dpa.softmax_offset.copy_(torch.randn(heads, generator=g))
    out = dpa(query_layer=q.transpose(1, 2), key_layer=k.transpose(1, 2), value_layer=v.transpose(1, 2), **fwd)
    sink = dpa.softmax_offset.detach().clone().requires_grad_()
    ref = te_attention64(q, k, v, scale, sink=sink, **ref_kw).transpose(1, 2).reshape(out.shape)
    torch.testing.assert_close(out.double(), ref, **TOL)
    inputs = [q, k, v] + ([fwd["core_attention_bias"]] if "core_attention_bias" in fwd else [])
    dy = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, inputs + [dpa.softmax_offset], dy)
    want = torch.autograd.grad(ref, inputs + [sink], dy.double())
    for name, a, w in zip(["q", "k", "v", "bias"][:len(inputs)] + ["softmax_offset"], got, want):
        torch.testing.assert_close(a.double(), w.double(), **TOL, msg=lambda m: f"d{name}: {m}")


def test_off_by_one_is_a_zero_sink_and_padded_queries_stay_zero():
    g = seeded(3)
    q, k, v = (torch.randn(2, 6, 4, 8, generator=g) for _ in range(3))  # bshd
    pad = (torch.arange(6)[None, :] >= torch.tensor([6, 3])[:, None]).view(2, 1, 1, 6)
    dpa = tm.DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="padding", softmax_type="off-by-one")
    assert "softmax_offset" not in dpa.state_dict()  # not a parameter, as in Transformer Engine
    out = dpa(q, k, v, attention_mask=pad)
    perm = lambda t: t.transpose(1, 2)  # noqa: E731
    want = te_attention64(perm(q), perm(k), perm(v), 8 ** -0.5, "padding", q_pad=pad.view(2, 6),
                          kv_pad=pad.view(2, 6), sink=torch.zeros(4))
    torch.testing.assert_close(out.double(), perm(want).reshape(out.shape), **TOL)
    assert torch.equal(out[1, 3:], torch.zeros_like(out[1, 3:]))
    # the sink takes weight: the output is smaller than vanilla attention's
    vanilla = tm.DotProductAttention(4, 8, qkv_format="bshd", attn_mask_type="padding")(q, k, v, attention_mask=pad)
    assert out[0].norm() < vanilla[0].norm()


def test_sink_on_packed_sequences():
    g = seeded(4)
    heads, groups, d = 4, 2, 8
    lq, lkv = [3, 5, 1], [4, 5, 2]
    q, k, v, cu_q, cu_kv = _packed_case(lq, lkv, heads, groups, d, g)
    dpa = tm.DotProductAttention(heads, d, num_gqa_groups=groups, qkv_format="thd", attn_mask_type="padding_causal",
                                 softmax_type="learnable")
    with torch.no_grad():
        dpa.softmax_offset.copy_(torch.randn(heads, generator=g))
    out = dpa(torch.cat(q), torch.cat(k), torch.cat(v), cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    sink = dpa.softmax_offset.detach()
    want = torch.cat([
        te_attention64(qi.permute(1, 0, 2)[None], ki.permute(1, 0, 2)[None], vi.permute(1, 0, 2)[None], d ** -0.5,
                       "causal", sink=sink)[0].permute(1, 0, 2).flatten(1)
        for qi, ki, vi in zip(q, k, v)])
    torch.testing.assert_close(out.double(), want, **TOL)


def test_blocks_pass_the_sink_to_their_attention():
    """MultiheadAttention and TransformerLayer: a learnable sink of 0 is off-by-one, one far
    below every logit is vanilla attention; the parameter has Transformer Engine's name."""
    torch.manual_seed(5)
    x = torch.randn(5, 2, 32)
    kw = dict(attention_dropout=0.0, attn_mask_type="causal")
    outs = {}
    for softmax_type in ("vanilla", "off-by-one", "learnable"):
        torch.manual_seed(6)
        outs[softmax_type] = tm.MultiheadAttention(32, 4, softmax_type=softmax_type, **kw)
    learnable = outs["learnable"]
    assert "core_attention.softmax_offset" in learnable.state_dict()
    offset = learnable.core_attention.softmax_offset  # per head: split with the heads under TP
    assert offset.tensor_model_parallel and offset.partition_dim == 0
    torch.testing.assert_close(learnable(x), outs["off-by-one"](x), **TOL)
    with torch.no_grad():
        learnable.core_attention.softmax_offset.fill_(-1e4)
    torch.testing.assert_close(learnable(x), outs["vanilla"](x), **TOL)
    assert not torch.allclose(outs["off-by-one"](x), outs["vanilla"](x), **TOL)
    layer = tm.TransformerLayer(32, 64, 4, softmax_type="learnable", hidden_dropout=0.0, attention_dropout=0.0)
    layer(x).sum().backward()
    grad = layer.self_attention.core_attention.softmax_offset.grad
    assert grad is not None and grad.shape == (4,) and bool(grad.abs().sum() > 0)


def test_bad_softmax_type_and_offset_say_what_is_wrong():
    with pytest.raises(ValueError, match="softmax_type"):
        tm.DotProductAttention(4, 8, softmax_type="sink")
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises(ValueError, match=r"softmax_offset must be a float32 tensor of shape \(4,\)"):
        ops.attention(q, q, q, softmax_offset=torch.zeros(2))
