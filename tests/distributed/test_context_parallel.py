"""te.DotProductAttention's context parallelism (Transformer Engine's cp_group / cp_comm_type), on 4
gloo ranks: each rank holds its load-balanced slice of every sequence (chunks r and 2 x cp - 1 - r
of 2 x cp), and its output and every gradient equal the rows of its tokens in one process's
attention over the whole sequence, in float32 on fresh random inputs."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import te_core as te
from te_core.modules._context_parallel import positions

from ._pool import pool_of

FP32 = dict(rtol=1.3e-6, atol=1e-5)
CHUNK, B, H, G, D = 3, 2, 4, 2, 8


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(4)


def _attention(ctx, fmt, mask_type, comm_type):
    """Max |difference| of this rank's output and q/k/v gradients from the whole-sequence ones."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    seq = 2 * cp * CHUNK
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(seq, B, n, D, generator=g) for n in (H, G, G))
    dy = torch.randn(seq, B, H * D, generator=g)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    whole_out = te.DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type=mask_type)(*whole)
    whole_out.backward(dy)
    mine = positions(rank, cp, 2 * CHUNK, "cpu")
    local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
    if mask_type == "causal":
        attention = te.DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type=mask_type, qkv_format=fmt,
                                           cp_group=dist.group.WORLD, cp_global_ranks=list(range(cp)),
                                           cp_stream=None, cp_comm_type=comm_type)
    else:  # the group set afterwards, as Megatron-LM's models do
        attention = te.DotProductAttention(H, D, num_gqa_groups=G, attn_mask_type=mask_type, qkv_format=fmt)
        attention.set_context_parallel_group(dist.group.WORLD, list(range(cp)), None, comm_type)
    as_fmt = (lambda t: t) if fmt == "sbhd" else (lambda t: t.transpose(0, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the p2p warning: computed by all-gather)
        out = as_fmt(attention(*(as_fmt(t) for t in local)))
    out.backward(dy[mine])
    return [(out - whole_out[mine]).abs().max().item(),
            *((t.grad - w.grad[mine]).abs().max().item() for t, w in zip(local, whole))]


@pytest.mark.parametrize("fmt, mask_type, comm_type", [("sbhd", "causal", "all_gather"), ("bshd", "causal", "p2p"),
                                                       ("sbhd", "no_mask", "all_gather")])
def test_each_rank_gets_its_share_of_the_whole_sequences_attention(pool, fmt, mask_type, comm_type):
    for rank, diffs in enumerate(pool.run(_attention, fmt, mask_type, comm_type)):
        assert max(diffs) <= FP32["atol"], (rank, diffs)


def _max_logit_and_longer_keys(ctx):
    """(|max logit - the whole sequence's|, output and q/k/v gradient differences of a no_mask
    cross-attention whose keys are twice as long as the queries)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    seq = 2 * cp * CHUNK
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, B, h, D, generator=g) for n, h in ((seq, H), (2 * seq, G), (2 * seq, G)))
    mine, mine_kv = positions(rank, cp, 2 * CHUNK, "cpu"), positions(rank, cp, 4 * CHUNK, "cpu")
    build = dict(num_gqa_groups=G, return_max_logit=True)
    _, whole_logit = te.DotProductAttention(H, D, attn_mask_type="causal", **build)(q, k[:seq], v[:seq])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, logit = te.DotProductAttention(H, D, attn_mask_type="causal", cp_group=dist.group.WORLD, **build)(
            q[mine], k[mine], v[mine])
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    cross = dict(num_gqa_groups=G, attn_mask_type="no_mask", attention_type="cross")
    whole_out = te.DotProductAttention(H, D, **cross)(*whole)
    dy = torch.randn(whole_out.shape, generator=g)
    whole_out.backward(dy)
    local = [t[rows].clone().requires_grad_() for t, rows in ((q, mine), (k, mine_kv), (v, mine_kv))]
    out = te.DotProductAttention(H, D, cp_group=dist.group.WORLD, cp_comm_type="all_gather", **cross)(*local)
    out.backward(dy[mine])
    return [(logit - whole_logit).abs().max().item(), (out - whole_out[mine]).abs().max().item(),
            *((t.grad - w.grad[rows]).abs().max().item() for t, w, rows in zip(local, whole, (mine, mine_kv, mine_kv)))]


def test_max_logit_and_cross_attention_keys_of_another_length(pool):
    """return_max_logit gives every rank the whole sequence's max (Transformer Engine reduces it
    over the group); no_mask cross-attention takes keys longer than the queries."""
    for rank, diffs in enumerate(pool.run(_max_logit_and_longer_keys)):
        assert diffs[0] == 0.0, (rank, diffs)
        assert max(diffs[1:]) <= FP32["atol"], (rank, diffs)


def _uneven_shards(ctx):
    rank = dist.get_rank()
    attention = te.DotProductAttention(H, D, attn_mask_type="no_mask", cp_group=dist.group.WORLD,
                                       cp_comm_type="all_gather")
    with pytest.raises(ValueError) as err:
        attention(*(torch.randn(4 + 2 * (rank % 2), B, H, D) for _ in range(3)))  # ranks 1, 3: 6 tokens
    return str(err.value)


def test_ranks_with_shards_of_other_lengths_are_named(pool):
    # the all-gather of keys would hang or abort inside the collective library instead
    for message in pool.run(_uneven_shards):
        assert "the context-parallel ranks disagree on the input" in message
        assert "rank 0: shape (4, 2, 4, 8)" in message and "rank 1: shape (6, 2, 4, 8)" in message


def _errors(ctx):
    group = dist.group.WORLD
    messages = []
    for build, call in (
            (lambda: te.DotProductAttention(H, D, cp_group=group, cp_comm_type="ring"), None),
            (lambda: te.DotProductAttention(H, D, cp_group=[group, group], cp_comm_type="a2a+p2p"), None),
            (lambda: te.DotProductAttention(H, D, cp_group=group, attn_mask_type="padding"),
             lambda m: m(*(torch.randn(6, B, H, D) for _ in range(3)))),
            (lambda: te.DotProductAttention(H, D, cp_group=group),
             lambda m: m(*(torch.randn(5, B, H, D) for _ in range(3))))):
        try:
            module = build()
            call(module)
            messages.append(None)
        except (ValueError, NotImplementedError) as err:
            messages.append(f"{type(err).__name__}: {err}")
    return messages


def test_what_context_parallelism_does_not_take_is_named(pool):
    single = te.DotProductAttention(H, D, cp_group=None, cp_global_ranks=None, cp_stream=None,
                                    cp_comm_type="all_gather")  # no group: no context parallelism
    assert single.cp_size == 1 and single.cp_comm_type == "all_gather"
    # without a group a2a+p2p is kept as Transformer Engine keeps it (refused with one, below)
    assert te.DotProductAttention(H, D, cp_comm_type="a2a+p2p").cp_comm_type == "a2a+p2p"
    with pytest.raises(ValueError, match="cp_comm_type must be one of"):
        te.DotProductAttention(H, D, cp_comm_type="ulysses")
    for messages in pool.run(_errors):
        assert "cp_comm_type must be one of" in messages[0]
        assert "NotImplementedError" in messages[1] and "cp_comm_type 'a2a+p2p'" in messages[1]
        assert "NotImplementedError" in messages[2] and "attn_mask_type 'padding'" in messages[2]
        assert "the same, even, length" in messages[3]


def _layer(ctx, kind):
    """Max |difference| of this rank's rows of a context-parallel layer's output and input
    gradient (rotary embedding included) from one process's layer over the whole sequence."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    hidden, seq = 32, 2 * cp * CHUNK
    g = torch.Generator().manual_seed(1)
    x = torch.randn(seq, B, hidden, generator=g)
    dy = torch.randn(seq, B, hidden, generator=g)
    rope = te.RotaryPositionEmbedding(hidden // H)(seq)

    def build():
        torch.manual_seed(2)
        if kind == "MultiheadAttention":
            return te.MultiheadAttention(hidden, H, attn_mask_type="causal", attention_dropout=0.0,
                                         params_dtype=torch.float32)
        return te.TransformerLayer(hidden, 64, H, self_attn_mask_type="causal", hidden_dropout=0.0,
                                   attention_dropout=0.0, params_dtype=torch.float32)

    whole, split = build(), build()
    split.set_context_parallel_group(dist.group.WORLD, list(range(cp)), None, "all_gather")
    xw = x.clone().requires_grad_()
    out_w = whole(xw, rotary_pos_emb=rope)
    out_w = out_w[0] if isinstance(out_w, tuple) else out_w
    out_w.backward(dy)
    mine = positions(rank, cp, 2 * CHUNK, "cpu")
    xs = x[mine].clone().requires_grad_()
    out_s = split(xs, rotary_pos_emb=rope)
    out_s = out_s[0] if isinstance(out_s, tuple) else out_s
    out_s.backward(dy[mine])
    return (out_s - out_w[mine]).abs().max().item(), (xs.grad - xw.grad[mine]).abs().max().item()


@pytest.mark.parametrize("kind", ["MultiheadAttention", "TransformerLayer"])
def test_a_context_parallel_block_rotates_and_attends_as_the_whole_sequence(pool, kind):
    """set_context_parallel_group on a block (Transformer Engine's): its attention core runs
    context-parallel and its rotary embedding rotates this rank's positions."""
    for rank, diffs in enumerate(pool.run(_layer, kind)):
        assert max(diffs) <= FP32["atol"], (rank, diffs)


def _per_rank_lengths(ctx):
    """max_seqlen_q / max_seqlen_kv under context parallelism are this rank's share (Transformer
    Engine multiplies them by the group's size): given so, the output equals the call without
    them; the whole sequence's length names the rule. thd inputs with TE's whole-sequence
    padded offsets name context parallelism's limit, not their offsets."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(3)
    local = [torch.randn(2 * CHUNK, B, H, D, generator=g) for _ in range(3)]
    attention = te.DotProductAttention(H, D, attn_mask_type="causal", cp_group=dist.group.WORLD,
                                       cp_comm_type="all_gather")
    plain = attention(*local)
    given = attention(*local, max_seqlen_q=2 * CHUNK, max_seqlen_kv=2 * CHUNK)
    messages = []
    try:
        attention(*local, max_seqlen_q=2 * CHUNK * cp, max_seqlen_kv=2 * CHUNK * cp)
    except ValueError as err:
        messages.append(str(err))
    thd = te.DotProductAttention(H, D, attn_mask_type="padding_causal", qkv_format="thd", cp_group=dist.group.WORLD)
    tokens = [torch.randn(8, H, D, generator=g) for _ in range(3)]
    whole = torch.tensor([0, 8 * cp], dtype=torch.int32)
    try:
        thd(*tokens, cu_seqlens_q=whole, cu_seqlens_kv=whole, cu_seqlens_q_padded=whole, cu_seqlens_kv_padded=whole)
    except NotImplementedError as err:
        messages.append(str(err))
    return torch.equal(plain, given), messages


def test_max_seqlens_are_each_ranks_share_and_thd_names_the_limit(pool):
    for same, messages in pool.run(_per_rank_lengths):
        assert same
        assert "max_seqlen_q=24 but the sbhd tensor holds sequences of 6 (under context parallelism" in messages[0]
        assert "context parallelism (cp_group) is not supported by te-core with the thd format" in messages[1]


def _hierarchical_fallback(ctx):
    """cp_comm_type 'a2a+p2p' over [a2a group, p2p group] where one of them has a single rank
    runs as Transformer Engine runs it: plain 'p2p' over the other group, or plain 'a2a': the
    output equals one group's 'all_gather' call."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    singles = [dist.new_group([r]) for r in range(cp)]  # (every rank makes every group)
    g = torch.Generator().manual_seed(4)
    local = [torch.randn(2 * CHUNK, B, H, D, generator=g) for _ in range(3)]

    def run(group, comm_type):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return te.DotProductAttention(H, D, attn_mask_type="causal", cp_group=group, cp_comm_type=comm_type)(*local)

    want = run(dist.group.WORLD, "all_gather")
    as_p2p = run([singles[rank], dist.group.WORLD], "a2a+p2p")
    as_a2a = run([dist.group.WORLD, singles[rank]], "a2a+p2p")
    return torch.equal(as_p2p, want) and torch.equal(as_a2a, want)


def test_a2a_p2p_over_a_single_rank_group_falls_back_as_te(pool):
    assert pool.run(_hierarchical_fallback) == [True] * 4
