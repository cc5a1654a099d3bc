"""apply_fused_qkv_rotary_pos_emb (Transformer Engine's, as Megatron-LM's fused single-QKV RoPE
calls it): a fused QKV projection's output split per kv group into query heads, key and value,
query and key rotated, against float64 rotations."""
from __future__ import annotations

import pytest
import torch

import te_core.modules as tm

from ._compare import seeded
from ._rope import DIM, rank_share, rotated

GROUPS, Q_PER_GROUP = 2, 3
SPLIT = [Q_PER_GROUP * DIM, DIM, DIM]


def _rotated_heads(x, positions, interleaved, base, seq_dim):
    """(s, b, h, d) or (b, s, h, d) heads rotated in float64 by the angles of `positions` along seq_dim."""
    x = x.movedim(seq_dim, 0)
    s, rest = x.shape[0], x.shape[1:]
    out = rotated(x.reshape(s, -1, DIM), positions, interleaved, base).reshape(s, *rest)
    return out.movedim(0, seq_dim)


def _qkv(seq, batch, fmt, seed):
    shape = (seq, batch) if fmt == "sbhd" else (batch, seq)
    return torch.randn(*shape, GROUPS, sum(SPLIT), generator=seeded(seed)).requires_grad_()


@pytest.mark.parametrize("tensor_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_query_and_key_rotated_value_passed_through(tensor_format, interleaved):
    seq, batch = 6, 2
    qkv = _qkv(seq, batch, tensor_format, 0)
    q_freqs = tm.RotaryPositionEmbedding(DIM, interleaved=interleaved)(seq)
    k_freqs = tm.RotaryPositionEmbedding(DIM, interleaved=interleaved, rotary_base=500)(seq)
    q, k, v = tm.apply_fused_qkv_rotary_pos_emb(qkv, q_freqs, k_freqs, SPLIT, tensor_format=tensor_format,
                                                interleaved=interleaved)
    seq_dim = 0 if tensor_format == "sbhd" else 1
    lead = qkv.shape[:2]
    assert q.shape == (*lead, GROUPS * Q_PER_GROUP, DIM) and k.shape == (*lead, GROUPS, DIM)
    assert v.shape == (*lead, GROUPS, DIM)

    def reference(x):  # float64: split per group, the group's query heads one after another
        xq, xk, xv = x.split(SPLIT, dim=-1)
        xq = xq.reshape(*lead, GROUPS * Q_PER_GROUP, DIM)
        return (_rotated_heads(xq, range(seq), interleaved, 10000.0, seq_dim),
                _rotated_heads(xk, range(seq), interleaved, 500.0, seq_dim), xv.double())

    want = reference(qkv.detach())
    for got, exp in zip((q, k, v), want):
        torch.testing.assert_close(got.double(), exp, rtol=1.3e-6, atol=1e-5)
    grads = [torch.randn_like(t) for t in (q, k, v)]
    torch.autograd.backward((q, k, v), grads)
    qkv64 = qkv.detach().double().requires_grad_()
    torch.autograd.backward(reference(qkv64), [g.double() for g in grads])
    torch.testing.assert_close(qkv.grad.double(), qkv64.grad, rtol=1.3e-6, atol=1e-5)
    assert v.data_ptr() != qkv.data_ptr() and v.is_contiguous()  # a tensor of its own, as TE returns


def test_start_positions_and_context_parallel_shares():
    """start_positions (inference) and a context-parallel rank's share rotate as
    apply_rotary_pos_emb does: each token by its position in its whole sequence."""
    seq, batch = 8, 2
    qkv = _qkv(seq, batch, "sbhd", 1).detach()
    freqs = tm.RotaryPositionEmbedding(DIM)(16)
    starts = torch.tensor([3, 0])
    q, k, _ = tm.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, SPLIT, start_positions=starts)
    for b, start in enumerate(starts.tolist()):
        xq, xk, _ = qkv[:, b:b + 1].split(SPLIT, dim=-1)
        positions = range(start, start + seq)
        torch.testing.assert_close(q[:, b:b + 1].double(), _rotated_heads(xq.reshape(seq, 1, -1, DIM), positions,
                                                                          False, 10000.0, 0), rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(k[:, b:b + 1].double(), _rotated_heads(xk, positions, False, 10000.0, 0),
                                   rtol=1.3e-6, atol=1e-5)
    cp_size = 2
    whole = _qkv(2 * seq, batch, "sbhd", 2).detach()
    full_q, full_k, _ = tm.apply_fused_qkv_rotary_pos_emb(whole, freqs, freqs, SPLIT)
    for rank in range(cp_size):
        share = rank_share(2 * seq, cp_size, rank)
        q, k, _ = tm.apply_fused_qkv_rotary_pos_emb(whole[share], freqs, freqs, SPLIT, cp_size=cp_size, cp_rank=rank)
        torch.testing.assert_close(q, full_q[share], rtol=1.3e-6, atol=1e-5)
        torch.testing.assert_close(k, full_k[share], rtol=1.3e-6, atol=1e-5)


def test_cu_seqlens_is_accepted_and_not_read():
    """As in Transformer Engine, whose fused QKV rotation takes no packed sequences."""
    qkv = _qkv(4, 2, "sbhd", 4).detach()
    freqs = tm.RotaryPositionEmbedding(DIM)(4)
    plain = tm.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, SPLIT)
    given = tm.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, SPLIT, cu_seqlens=torch.tensor([0, 4, 8]))
    assert all(torch.equal(a, b) for a, b in zip(plain, given))


@pytest.mark.parametrize("kwargs, match", [
    (dict(qkv_split_arg_list=[3 * DIM, DIM]), "three positive sizes"),
    (dict(qkv_split_arg_list=[3 * DIM, DIM, 2 * DIM]), r"add up to qkv's last dimension \(80\)"),
    (dict(qkv_split_arg_list=[DIM + 1, DIM, 3 * DIM - 1]), "a multiple of k"),
    (dict(tensor_format="thd"), "tensor_format"),
    (dict(start_positions=torch.tensor([0, 0]), cp_size=2), "do not go together"),
    (dict(qkv=torch.randn(4, 2, 5 * DIM)), r"qkv must be 4-D \(sbhd\), got shape \(4, 2, 80\)"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, match):
    freqs = tm.RotaryPositionEmbedding(DIM)(8)
    kwargs = {"qkv": _qkv(4, 2, "sbhd", 3).detach(), "qkv_split_arg_list": SPLIT, **kwargs}
    qkv, split = kwargs.pop("qkv"), kwargs.pop("qkv_split_arg_list")
    with pytest.raises(ValueError, match=match):
        tm.apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split, **kwargs)


def test_the_stand_in_exports_it_where_megatron_imports_it():
    import importlib.util
    import sys

    from te_core.compat.transformer_engine import uninstall_transformer_engine

    import te_core as te

    if "transformer_engine" not in sys.modules and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("a real transformer_engine is installed here")
    te.install_as_transformer_engine()
    try:
        from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb
        assert apply_fused_qkv_rotary_pos_emb is tm.apply_fused_qkv_rotary_pos_emb
    finally:
        uninstall_transformer_engine()
