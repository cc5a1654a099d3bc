"""Reference attention over packed sequences against float64 SDPA on each sequence alone,
forward and gradients, and its input checks."""
import pytest
import torch
import torch.nn.functional as F

from te_core.reference import attention

FP32 = dict(rtol=1.3e-6, atol=1e-5)


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def per_sequence64(q, k, v, lengths_q, lengths_kv, scale, visible):
    """float64 SDPA of each sequence alone; visible(lq, lk) -> bool (lq, lk) mask of seen keys."""
    group = q.shape[1] // k.shape[1]
    outs = []
    for qi, ki, vi, lq, lk in zip(q.split(lengths_q), k.split(lengths_kv), v.split(lengths_kv), lengths_q,
                                  lengths_kv):
        qi, ki, vi = (t.double().transpose(0, 1) for t in (qi, ki, vi))
        ki, vi = ki.repeat_interleave(group, 0), vi.repeat_interleave(group, 0)
        seen = visible(lq, lk)
        probs = torch.softmax((qi @ ki.transpose(1, 2) * scale).masked_fill(~seen, float("-inf")), -1)
        outs.append((probs.nan_to_num(0.0) @ vi).transpose(0, 1))
    return torch.cat(outs)


def bottom_right(left=None, right=None):
    def visible(lq, lk):
        i, j = torch.arange(lq)[:, None] + (lk - lq), torch.arange(lk)[None, :]
        seen = torch.ones(lq, lk, dtype=torch.bool)
        if left is not None:
            seen &= j >= i - left
        if right is not None:
            seen &= j <= i + right
        return seen
    return visible


@pytest.mark.parametrize("mask_type, options, visible", [
    ("padding", {}, bottom_right()),
    ("padding_causal_bottom_right", {}, bottom_right(right=0)),
    ("padding", dict(window_size=(2, 1)), bottom_right(2, 1)),
    ("padding_causal_bottom_right", dict(window_size=(3, 0)), bottom_right(3, 0)),
])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 1)])
def test_matches_each_sequence_alone(mask_type, options, visible, hq, hkv):
    lengths_q, lengths_kv = [3, 0, 7, 1], [5, 0, 7, 4]  # an empty sequence, a query row seeing all keys
    q = torch.randn(sum(lengths_q), hq, 16, requires_grad=True)
    k = torch.randn(sum(lengths_kv), hkv, 16, requires_grad=True)
    v = torch.randn(sum(lengths_kv), hkv, 16, requires_grad=True)
    out = attention.attention_varlen(q, k, v, _cu(lengths_q), _cu(lengths_kv), 7, 7, attn_mask_type=mask_type,
                                     softmax_scale=0.3, **options)
    want = per_sequence64(q, k, v, lengths_q, lengths_kv, 0.3, visible)
    assert out.shape == (sum(lengths_q), hq, 16) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, **FP32)
    dout = torch.randn(out.shape)
    for got, ref in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(got, ref.float(), **FP32)


def test_top_left_causal_and_a_bias_in_padded_coordinates():
    lengths = [4, 6]
    q, k, v = (torch.randn(10, 2, 8) for _ in range(3))
    bias = torch.randn(1, 2, 6, 6)
    out = attention.attention_varlen(q, k, v, _cu(lengths), _cu(lengths), 6, 6, attn_mask_type="padding_causal",
                                     core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    parts = []
    for qi, ki, vi, n in zip(q.split(lengths), k.split(lengths), v.split(lengths), lengths):
        qi, ki, vi = (t.double().transpose(0, 1) for t in (qi, ki, vi))
        mask = torch.ones(n, n, dtype=torch.bool).tril().logical_not()
        scores = qi @ ki.transpose(1, 2) * 8 ** -0.5 + bias[0, :, :n, :n].double()
        parts.append((torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ vi).transpose(0, 1))
    torch.testing.assert_close(out.double(), torch.cat(parts), **FP32)


@pytest.mark.parametrize("change, error, match", [
    (dict(attn_mask_type="causal"), ValueError, "must be a padding type"),
    (dict(cu_seqlens_kv=_cu([3, 3, 0])), ValueError, "different numbers of sequences"),
    (dict(cu_seqlens_q=_cu([3, 2])), ValueError, r"cu_seqlens_q must start at 0.*\(6\)"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 6.0])), ValueError, "1-D integer tensor"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen for cu_seqlens_q is 2, shorter than a sequence of 3"),
    (dict(q=torch.randn(6, 2, 2, 8)), ValueError, "q"),
])
def test_bad_inputs_say_what_is_wrong(change, error, match):
    call = dict(q=torch.randn(6, 2, 8), k=torch.randn(6, 2, 8), v=torch.randn(6, 2, 8), cu_seqlens_q=_cu([3, 3]),
                cu_seqlens_kv=_cu([3, 3]), max_seqlen_q=3, max_seqlen_kv=3)
    call.update(change)
    with pytest.raises(error, match=match):
        attention.attention_varlen(**call)


def test_float64_sdpa_agrees_with_the_per_sequence_oracle():
    """The oracle above is plain SDPA on one sequence (guards the test's own helper)."""
    q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    want = F.scaled_dot_product_attention(*(t.double().transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
    torch.testing.assert_close(per_sequence64(q, k, v, [5], [5], 8 ** -0.5, bottom_right()), want)
