"""MultiheadAttention and TransformerLayer on packed sequences (qkv_format / attn_input_format
"thd", Transformer Engine's layout): (t, hidden) tokens whose sequences cu_seqlens delimits, rotary
embeddings included. Packed, every sequence's output, input gradient and the weights' gradients
equal those of a twin module (the same weights) run on each sequence alone in "bshd"."""
from __future__ import annotations

import pytest
import torch

import te_core.modules as tm

HIDDEN, HEADS = 32, 4
LENGTHS = [3, 6, 1, 4]
TOL = dict(rtol=1.3e-6, atol=1e-5)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _compare(make, alone_kwargs, packed_kwargs, seed):
    """make(format) builds the module; the bshd twin runs each sequence alone, the thd one all
    of them packed."""
    torch.manual_seed(seed)
    alone_module = make("bshd")
    packed_module = make("thd")
    packed_module.load_state_dict(alone_module.state_dict())
    xs = [torch.randn(n, HIDDEN) for n in LENGTHS]
    dy = torch.randn(sum(LENGTHS), HIDDEN)
    inputs = [x.clone().requires_grad_() for x in xs]
    alone = torch.cat([alone_module(x[None], **alone_kwargs).squeeze(0) for x in inputs])
    alone.backward(dy)
    packed_input = torch.cat(xs).requires_grad_()
    packed = packed_module(packed_input, **packed_kwargs)
    assert packed.shape == (sum(LENGTHS), HIDDEN)
    packed.backward(dy)
    torch.testing.assert_close(packed, alone, **TOL)
    torch.testing.assert_close(packed_input.grad, torch.cat([x.grad for x in inputs]), **TOL)
    weights = dict(alone_module.named_parameters())
    assert weights
    for name, p in packed_module.named_parameters():
        torch.testing.assert_close(p.grad, weights[name].grad, **TOL, msg=lambda m: f"{name}: {m}")


def _packed_args(lengths=LENGTHS):
    cu, longest = _cu(lengths), max(lengths)
    return dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("groups", [HEADS, 2])
def test_multihead_attention_packed_with_rotary(interleaved, groups):
    freqs = tm.RotaryPositionEmbedding(HIDDEN // HEADS, interleaved=interleaved)(8)
    make = lambda fmt: tm.MultiheadAttention(  # noqa: E731
        HIDDEN, HEADS, qkv_format=fmt, attention_dropout=0.0, num_gqa_groups=groups, input_layernorm=True,
        rotary_pos_interleaved=interleaved, attn_mask_type="causal")
    _compare(make, dict(rotary_pos_emb=freqs), dict(rotary_pos_emb=freqs, **_packed_args()), seed=11 + groups)


@pytest.mark.parametrize("fuse_qkv_params", [False, True])
def test_transformer_layer_packed_with_rotary(fuse_qkv_params):
    freqs = tm.RotaryPositionEmbedding(HIDDEN // HEADS)(8)
    make = lambda fmt: tm.TransformerLayer(  # noqa: E731
        HIDDEN, 2 * HIDDEN, HEADS, attn_input_format=fmt, hidden_dropout=0.0, attention_dropout=0.0,
        fuse_qkv_params=fuse_qkv_params, self_attn_mask_type="causal", normalization="RMSNorm")
    # TransformerLayer's self-attention takes the query lengths for its keys
    packed = dict(rotary_pos_emb=freqs, cu_seqlens_q=_cu(LENGTHS), max_seqlen_q=max(LENGTHS))
    _compare(make, dict(rotary_pos_emb=freqs), packed, seed=21)


def test_decoder_layer_packed_with_packed_encoder_output():
    """Cross-attention on packed sequences: query sequence i attends to encoder sequence i."""
    torch.manual_seed(31)
    enc_lengths = [2, 5, 3, 1]
    make = lambda fmt: tm.TransformerLayer(  # noqa: E731
        HIDDEN, 2 * HIDDEN, HEADS, attn_input_format=fmt, layer_type="decoder", hidden_dropout=0.0,
        attention_dropout=0.0, self_attn_mask_type="causal")
    alone_module, packed_module = make("bshd"), make("thd")
    packed_module.load_state_dict(alone_module.state_dict())
    xs = [torch.randn(n, HIDDEN) for n in LENGTHS]
    encs = [torch.randn(n, HIDDEN) for n in enc_lengths]
    alone = torch.cat([alone_module(x[None], encoder_output=e[None]).squeeze(0) for x, e in zip(xs, encs)])
    packed = packed_module(torch.cat(xs), encoder_output=torch.cat(encs), cu_seqlens_q=_cu(LENGTHS),
                           cu_seqlens_kv=_cu(enc_lengths), max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(enc_lengths))
    torch.testing.assert_close(packed, alone, **TOL)


def test_packed_layers_check_their_input():
    shape, match = (3, 2, HIDDEN), r"hidden_states must be 2-D \(thd: packed tokens, hidden\), got shape \(3, 2, 32\)"
    layer = tm.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, attn_input_format="thd")
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(shape), **_packed_args())
    mha = tm.MultiheadAttention(HIDDEN, HEADS, qkv_format="thd")
    with pytest.raises(ValueError, match=match):
        mha(torch.randn(shape), **_packed_args())
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        mha(torch.randn(sum(LENGTHS), HIDDEN), rotary_pos_emb=tm.RotaryPositionEmbedding(HIDDEN // HEADS)(8))


# ---- padding between the packed sequences (cu_seqlens_*_padded, Transformer Engine's pad_between_seqs)

GAPS = [2, 0, 3, 1]  # padding rows after each sequence


def _padded_layout(lengths=LENGTHS, gaps=GAPS):
    """(cu_seqlens_padded, the rows of the sequences' tokens in the padded layout)."""
    starts = torch.tensor([0, *torch.tensor([n + g for n, g in zip(lengths, gaps)]).cumsum(0).tolist()])
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts[:-1].tolist(), lengths)])
    return starts.to(torch.int32), rows


def test_attention_with_padding_between_sequences_equals_packed():
    torch.manual_seed(41)
    cu_padded, rows = _padded_layout()
    total = int(cu_padded[-1])
    q, k, v = (torch.randn(total, HEADS, 8) for _ in range(3))  # the gap rows hold garbage
    dpa = tm.DotProductAttention(HEADS, 8, qkv_format="thd", attn_mask_type="padding_causal")
    args = _packed_args()
    compact = [t[rows].clone().requires_grad_() for t in (q, k, v)]
    padded = [t.clone().requires_grad_() for t in (q, k, v)]
    want = dpa(*compact, **args)
    got = dpa(*padded, cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded, pad_between_seqs=True, **args)
    assert got.shape == (total, HEADS * 8)
    torch.testing.assert_close(got[rows], want, **TOL)
    gaps = torch.ones(total, dtype=torch.bool)
    gaps[rows] = False
    assert torch.equal(got[gaps], torch.zeros_like(got[gaps]))
    dy = torch.randn(total, HEADS * 8)
    got.backward(dy)
    want.backward(dy[rows])
    for p_, c in zip(padded, compact):
        torch.testing.assert_close(p_.grad[rows], c.grad, **TOL)
        assert torch.equal(p_.grad[gaps], torch.zeros_like(p_.grad[gaps]))


def test_transformer_layer_with_padding_between_sequences():
    """Rotary positions count from each sequence's own start in the padded layout."""
    torch.manual_seed(42)
    cu_padded, rows = _padded_layout()
    freqs = tm.RotaryPositionEmbedding(HIDDEN // HEADS)(8)
    layer = tm.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, attn_input_format="thd", hidden_dropout=0.0,
                                attention_dropout=0.0, self_attn_mask_type="causal")
    x = torch.randn(int(cu_padded[-1]), HIDDEN)
    packed = dict(rotary_pos_emb=freqs, cu_seqlens_q=_cu(LENGTHS), max_seqlen_q=max(LENGTHS))
    want = layer(x[rows], **packed)
    got = layer(x, cu_seqlens_q_padded=cu_padded, **packed)
    torch.testing.assert_close(got[rows], want, **TOL)


@pytest.mark.parametrize("kwargs, match", [
    (dict(pad_between_seqs=True), "needs cu_seqlens_q and cu_seqlens_kv .* and cu_seqlens_q_padded"),
    (dict(cu_seqlens_q_padded="same"), "needs cu_seqlens_q and cu_seqlens_kv .* and cu_seqlens_q_padded"),
    (dict(cu_seqlens_q_padded="short", cu_seqlens_kv_padded="short"), "each no longer than the room"),
    (dict(cu_seqlens_q_padded="same", cu_seqlens_kv_padded="same", qkv_format="bshd"), "qkv_format='thd'"),
])
def test_padding_between_sequences_is_checked(kwargs, match):
    cu_padded, _ = _padded_layout()
    values = {"same": cu_padded, "short": torch.tensor([0, 2, 10, 15, 20])}  # 2 rows for a sequence of 3
    kwargs = {k: values.get(v, v) if isinstance(v, str) and k != "qkv_format" else v for k, v in kwargs.items()}
    t = torch.randn(int(cu_padded[-1]), HEADS, 8)
    dpa = tm.DotProductAttention(HEADS, 8, qkv_format="thd", attn_mask_type="padding")
    with pytest.raises(ValueError, match=match):
        dpa(t, t, t, **_packed_args(), **kwargs)


# ---- Transformer Engine's packed q/k/v inputs: qkv_layer, or query_layer with kv_layer


@pytest.mark.parametrize("fmt", ["bshd", "sbhd", "thd"])
@pytest.mark.parametrize("dim", [-3, -2])
def test_packed_qkv_inputs_are_views_of_the_separate_ones(fmt, dim):
    torch.manual_seed(51)
    lead = {"bshd": (2, 5), "sbhd": (5, 2), "thd": (9,)}[fmt]
    extra = _packed_args([4, 5]) if fmt == "thd" else {}
    dpa = tm.DotProductAttention(HEADS, 8, qkv_format=fmt, attn_mask_type="causal")
    qkv = torch.randn(*lead, *((3, HEADS) if dim == -3 else (HEADS, 3)), 8)
    q, k, v = (qkv.select(dim, i) for i in range(3))
    want = dpa(q, k, v, **extra)
    torch.testing.assert_close(dpa(qkv_layer=qkv, qkv_interleave_dim=dim, **extra), want, rtol=0, atol=0)
    kv = qkv.narrow(dim, 1, 2)
    torch.testing.assert_close(dpa(q, kv_layer=kv, qkv_interleave_dim=dim, **extra), want, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "give query_layer, key_layer and value_layer"),
    (dict(qkv_layer="qkv", kv_layer="kv"), "exclude each other"),
    (dict(qkv_layer="qkv", query_layer="q"), "already holds query, key and value"),
    (dict(kv_layer="kv"), "pass query_layer too"),
    (dict(qkv_layer="qkv", qkv_interleave_dim=-1), "must be -3 .* or -2"),
    (dict(qkv_layer="kv"), r"qkv_layer must be 5-D for qkv_format='bshd' with 3 at qkv_interleave_dim=-3"),
])
def test_packed_qkv_inputs_are_checked(kwargs, match):
    values = {"qkv": torch.randn(2, 5, 3, HEADS, 8), "kv": torch.randn(2, 5, 2, HEADS, 8),
              "q": torch.randn(2, 5, HEADS, 8)}
    kwargs = {k: values.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        tm.DotProductAttention(HEADS, 8, qkv_format="bshd")(**kwargs)
