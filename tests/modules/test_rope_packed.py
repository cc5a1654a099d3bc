"""apply_rotary_pos_emb for packed sequences (tensor_format="thd" with cu_seqlens) and for a
context-parallel rank's share of each sequence (cp_size, cp_rank), as Transformer Engine takes
them: each token rotated by the angle of its position in its own whole sequence."""
from __future__ import annotations

import pytest
import torch

import te_core.modules as tm

from ._rope import DIM, HEADS, rank_share as _rank_share, rotated as _rotated


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_starts", [False, True])
def test_packed_sequences_each_from_its_start(interleaved, with_starts):
    torch.manual_seed(0)
    lengths, starts = [3, 0, 5, 1], [2, 9, 0, 4]  # an empty sequence among them
    cu = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32)
    t = torch.randn(sum(lengths), HEADS, DIM, requires_grad=True)
    freqs = tm.RotaryPositionEmbedding(DIM, interleaved=interleaved)(16)
    kwargs = dict(start_positions=torch.tensor(starts)) if with_starts else {}
    y = tm.apply_rotary_pos_emb(t, freqs, "thd", interleaved=interleaved, cu_seqlens=cu, **kwargs)
    positions = [(s if with_starts else 0) + i for n, s in zip(lengths, starts) for i in range(n)]
    want = _rotated(t.detach(), positions, interleaved)
    torch.testing.assert_close(y.double(), want, rtol=1.3e-6, atol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    t64 = t.detach().double().requires_grad_()
    _rotated(t64, positions, interleaved).backward(dy.double())
    torch.testing.assert_close(t.grad.double(), t64.grad, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("cp_size", [2, 4])
def test_context_parallel_share_of_a_padded_batch(cp_size):
    """Each rank's share, rotated with cp_size/cp_rank, equals those tokens of the whole
    sequence's rotation."""
    torch.manual_seed(1)
    seq, batch = 4 * cp_size, 3
    whole = torch.randn(seq, batch, HEADS, DIM)
    freqs = tm.RotaryPositionEmbedding(DIM)(seq)
    full = tm.apply_rotary_pos_emb(whole, freqs, "sbhd")
    for rank in range(cp_size):
        share = _rank_share(seq, cp_size, rank)
        got = tm.apply_rotary_pos_emb(whole[share].transpose(0, 1).contiguous(), freqs, "bshd",
                                      cp_size=cp_size, cp_rank=rank)
        torch.testing.assert_close(got.transpose(0, 1), full[share], rtol=1.3e-6, atol=1e-5)


def test_context_parallel_share_of_packed_sequences():
    torch.manual_seed(2)
    cp_size, lengths = 2, [8, 4, 12]
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)  # the whole sequences' offsets
    sequences = [torch.randn(n, HEADS, DIM) for n in lengths]
    freqs = tm.RotaryPositionEmbedding(DIM)(12)
    for rank in range(cp_size):
        shares = [_rank_share(n, cp_size, rank) for n in lengths]
        local = torch.cat([x[s] for x, s in zip(sequences, shares)])
        got = tm.apply_rotary_pos_emb(local, freqs, "thd", cu_seqlens=cu, cp_size=cp_size, cp_rank=rank)
        want = torch.cat([_rotated(x[s], s, False) for x, s in zip(sequences, shares)])
        torch.testing.assert_close(got.double(), want, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_format="thd"), "needs cu_seqlens"),
    (dict(tensor_format="thd", cu_seqlens=torch.tensor([0, 3, 6])), r"end at the number of packed tokens \(9\)"),
    (dict(tensor_format="thd", cu_seqlens=torch.tensor([0.0, 9.0])), "1-D integer tensor"),
    (dict(tensor_format="thd", cu_seqlens=torch.tensor([0, 9])), r"reach position 8, but freqs hold positions 0..7"),
    (dict(tensor_format="thd", cu_seqlens=torch.tensor([0, 4, 9]), start_positions=torch.tensor([0, 4])),
     "reach position 8"),
    (dict(tensor_format="thd", cu_seqlens=torch.tensor([0, 4, 9]), start_positions=torch.tensor([0])),
     r"shape \(2,\)"),
    (dict(tensor_format="thd", cu_seqlens=torch.tensor([0, 6, 18]), cp_size=2), "multiple of 2 \\* cp_size = 4"),
    (dict(tensor_format="sbhd", cu_seqlens=torch.tensor([0, 9])), "cu_seqlens is for tensor_format='thd'"),
    (dict(tensor_format="thd", cu_seqlens=torch.tensor([0, 9]), cp_size=2, cp_rank=2), "0 <= cp_rank < cp_size"),
])
def test_bad_packed_arguments_say_what_is_wrong(kwargs, match):
    t = torch.randn(9, HEADS, DIM)
    if kwargs["tensor_format"] == "sbhd":
        t = t.unsqueeze(1)
    freqs = tm.RotaryPositionEmbedding(DIM)(8)
    with pytest.raises(ValueError, match=match):
        tm.apply_rotary_pos_emb(t, freqs, **kwargs)


def test_context_parallel_needs_the_whole_sequences_angles():
    t = torch.randn(4, 2, HEADS, DIM)  # a rank's 4 tokens of a sequence of 8
    with pytest.raises(ValueError, match="fewer than the 8 of t .* across 2 context-parallel ranks"):
        tm.apply_rotary_pos_emb(t, tm.RotaryPositionEmbedding(DIM)(6), cp_size=2, cp_rank=1)
    with pytest.raises(ValueError, match="length must be even"):
        tm.apply_rotary_pos_emb(torch.randn(3, 2, HEADS, DIM), tm.RotaryPositionEmbedding(DIM)(6), cp_size=2)

