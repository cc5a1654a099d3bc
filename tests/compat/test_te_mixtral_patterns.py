"""API patterns of Transformer Engine's Mixtral tutorial model, on te-core's own small code through
the stand-in (reference backend, CPU): expert weights kept stacked in one parameter of the model,
with views of it set back on an ops.GroupedLinear whose own parameters were taken out, then
reset_parameters() on the meta-device build (the tutorial's init_empty_weights)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

FP32 = dict(rtol=1.3e-6, atol=1e-5)
GROUPS, HIDDEN, FFN = 3, 24, 20
SPLITS = [7, 0, 6]  # one expert without tokens


def _stack_into_views(op, kinds=("weight",)):
    """The tutorial's loop mode: pop each weight{i} (bias{i}) out of the operation's parameters,
    stack them into one model-owned parameter, and set views of it back as plain attributes."""
    stacked = {}
    for kind in kinds:
        stacked[kind] = nn.Parameter(torch.stack([op._parameters.pop(f"{kind}{i}").data for i in range(GROUPS)]))
        for i in range(GROUPS):
            object.__setattr__(op, f"{kind}{i}", stacked[kind][i])
    return stacked


def _float64_grouped(x, op, bias: bool):
    rows = x.double().split(SPLITS)
    outs = [r @ getattr(op, f"weight{g}").double().T + (getattr(op, f"bias{g}").double() if bias else 0.0)
            for g, r in enumerate(rows)]
    return torch.cat(outs)


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_reset_parameters_registers_popped_weights_again(stand_in, device, bias):
    """reset_parameters() on an operation whose weights were popped into a stacked parameter and
    replaced by views (the tutorial's init_empty_weights in its loop mode) initializes them as a
    fresh operation does under the same seed, registers them as parameters again on new storage
    (TE's operation setattr's a new Parameter for each), leaves the model's stacked tensor
    untouched, and computes float64's grouped product with them."""
    from transformer_engine.pytorch.ops import GroupedLinear

    kinds = ("weight", "bias") if bias else ("weight",)
    op = GroupedLinear(GROUPS, HIDDEN, FFN, bias=bias, device=device)
    stacked = _stack_into_views(op, kinds)
    before = {k: (None if t.is_meta else t.detach().clone()) for k, t in stacked.items()}
    fresh = GroupedLinear(GROUPS, HIDDEN, FFN, bias=bias, device="meta")
    torch.manual_seed(3)
    op.reset_parameters()
    torch.manual_seed(3)
    fresh.reset_parameters()

    names = [f"{k}{i}" for k in kinds for i in range(GROUPS)]
    assert [n for n, _ in op.named_parameters()] == names  # TE's order: every weight, then every bias
    for name in names:
        param = op._parameters[name]
        assert isinstance(param, nn.Parameter) and not param.is_meta and getattr(op, name) is param
        assert param.untyped_storage().data_ptr() != stacked[name.rstrip("0123456789")].untyped_storage().data_ptr()
        torch.testing.assert_close(param, fresh._parameters[name], rtol=0, atol=0)
    assert op.weight0.abs().max() > 0
    for kind, old in before.items():
        if old is not None:
            torch.testing.assert_close(stacked[kind].detach(), old, rtol=0, atol=0)

    x = torch.randn(sum(SPLITS), HIDDEN)
    y = op(x, torch.tensor(SPLITS, dtype=torch.int32))
    torch.testing.assert_close(y.double(), _float64_grouped(x, op, bias), **FP32)


def test_reset_parameters_without_a_stand_in_says_what_to_do(stand_in):
    """A weight popped with nothing set in its place: a clear error naming it and the fix."""
    from transformer_engine.pytorch.ops import GroupedLinear

    op = GroupedLinear(GROUPS, HIDDEN, FFN, bias=False, device="meta")
    op._parameters.pop("weight1")
    with pytest.raises(RuntimeError, match=r"ops.GroupedLinear: reset_parameters\(\) found no parameter weight1 .*"
                                           r"set a tensor of shape \(20, 24\) as weight1"):
        op.reset_parameters()
    object.__setattr__(op, "weight1", torch.empty(HIDDEN, FFN))
    with pytest.raises(RuntimeError, match=r"stand-in attribute, shape \(24, 20\)"):
        op.reset_parameters()


HEADS, KV_HEADS, WIDTH = 4, 2, 32


def _tutorial_attention(te):
    """The tutorial's attention: RMSNorm + fused, interleaved QKV, grouped KV heads, packed (thd)
    sequences, padding_causal, no biases."""
    return te.MultiheadAttention(WIDTH, HEADS, num_gqa_groups=KV_HEADS, bias=False, attention_dropout=0.0,
                                 fuse_qkv_params=True, qkv_weight_interleaved=True, normalization="RMSNorm",
                                 input_layernorm=True, qkv_format="thd", attn_mask_type="padding_causal",
                                 layer_number=1)


def _whole_sequences_float64(attention, seqs, freqs):
    """Each sequence's outputs without a cache, in plain float64 torch: RMSNorm, the interleaved
    QKV rows (per KV group: its query heads, its key, its value), rotary embedding on each
    sequence's positions, causal attention with each query head reading its group's key/value."""
    d, per_group = WIDTH // HEADS, HEADS // KV_HEADS
    gamma = attention.layernorm_qkv.layer_norm_weight.detach().double()
    w_qkv = attention.layernorm_qkv.weight.detach().double().view(KV_HEADS, per_group + 2, d, WIDTH)
    w_proj = attention.proj.weight.detach().double()
    outs = []
    for x in seqs:
        x = x.double()
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
        qkv = torch.einsum("sw,gjdw->sgjd", h, w_qkv)  # (s, groups, per_group + 2, d)
        q, k, v = qkv[:, :, :per_group].flatten(1, 2), qkv[:, :, per_group], qkv[:, :, per_group + 1]
        angles = freqs[:len(x)].double().view(len(x), 1, d)
        rotate = lambda t: t * angles.cos() + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * angles.sin()
        q, k = rotate(q), rotate(k)
        k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
        causal = torch.ones(len(x), len(x), dtype=torch.bool).triu(1)
        context = torch.einsum("hqk,khd->qhd", scores.masked_fill(causal, float("-inf")).softmax(-1), v)
        outs.append(context.flatten(1) @ w_proj.T)
    return outs


def test_kv_cached_packed_steps_with_trailing_padding_rows(stand_in):
    """The tutorial's THD generation pads the packed tokens to a multiple of 32 (for MXFP8 GEMMs)
    after InferenceParams.pre_step counted the real ones, and passes cu_seqlens whose last
    sequence takes the padding. As in Transformer Engine (whose cache and attention read only the
    step's cu_seqlens_q), the rows past the step's tokens are padding: the real rows' outputs
    equal the whole sequences' without a cache (float64), and the padding rows' are zeros."""
    from collections import OrderedDict

    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention import InferenceParams
    from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

    torch.manual_seed(0)
    attention = _tutorial_attention(te).eval()
    freqs = RotaryPositionEmbedding(WIDTH // HEADS)(32)
    seqs = [torch.randn(7, WIDTH), torch.randn(5, WIDTH)]
    want = _whole_sequences_float64(attention, seqs, freqs)
    params = InferenceParams(2, 32, num_heads_kv=KV_HEADS, head_dim_k=WIDTH // HEADS, dtype=torch.float32,
                             qkv_format="thd", max_ctx_len=8)
    done = [0, 0]
    with torch.no_grad():
        for lengths, padded in (([5, 3], 16), ([1, 1], 8), ([1, 1], 2)):  # prefill, then decoding
            params.pre_step(OrderedDict(zip("ab", lengths)))
            rows = [s[d:d + n] for s, d, n in zip(seqs, done, lengths)]
            x = torch.cat(rows + [torch.randn(padded - sum(lengths), WIDTH)])
            cu = torch.tensor([0, lengths[0], padded], dtype=torch.int32)  # the tutorial's: padding in the last
            out = attention(x, rotary_pos_emb=freqs, inference_params=params, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            max_seqlen_q=padded - lengths[0], max_seqlen_kv=padded - lengths[0])
            assert out.shape == (padded, WIDTH)
            for got, w, d, n in zip(out[:sum(lengths)].split(lengths), want, done, lengths):
                torch.testing.assert_close(got.double(), w[d:d + n], **FP32)
            assert not out[sum(lengths):].any()
            done = [d + n for d, n in zip(done, lengths)]


def test_kv_cached_packed_step_with_too_few_rows_says_what_to_do(stand_in):
    from collections import OrderedDict

    from transformer_engine.pytorch.attention import InferenceParams

    params = InferenceParams(2, 32, num_heads_kv=KV_HEADS, head_dim_k=WIDTH // HEADS, dtype=torch.float32,
                             qkv_format="thd", max_ctx_len=8)
    params.pre_step(OrderedDict(a=5, b=3))
    with pytest.raises(ValueError, match=r"bring 8 tokens, but the packed input holds 6; give every new token .* "
                                         r"\(padding rows may follow them\)"):
        params.packed_tokens(torch.randn(6, KV_HEADS, WIDTH // HEADS), "thd")
