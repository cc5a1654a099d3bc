"""te.DotProductAttention's tensor-parallel arguments, as Transformer Engine's: the heads and GQA
groups split over tp_size ranks (each rank's module takes its own, communicating nothing), and
attention dropout drawn from the RNG tracker's fork (not under sequence parallelism). Checked in
one process against the unsplit module, in float32 on fresh random inputs."""
import pytest
import torch

import te_core as te
from te_core.distributed import MODEL_PARALLEL_RNG_TRACKER_NAME, RNGStatesTracker

FP32 = dict(rtol=1.3e-6, atol=1e-5)
S, B, D = 12, 2, 16


def _qkv(heads, groups, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(S, B, n, D, generator=g) for n in (heads, groups, groups)]


def test_each_rank_attends_with_its_own_heads():
    whole = te.DotProductAttention(8, D, num_gqa_groups=4, attn_mask_type="causal")
    q, k, v = _qkv(8, 4)
    want = whole(q, k, v).view(S, B, 8, D)
    for rank in range(2):
        shard = te.DotProductAttention(8, D, num_gqa_groups=4, attn_mask_type="causal", tp_size=2)
        assert (shard.num_attention_heads, shard.num_attention_heads_per_partition,
                shard.num_gqa_groups_per_partition) == (8, 4, 2)
        heads, groups = slice(4 * rank, 4 * rank + 4), slice(2 * rank, 2 * rank + 2)
        got = shard(q[:, :, heads], k[:, :, groups], v[:, :, groups]).view(S, B, 4, D)
        torch.testing.assert_close(got, want[:, :, heads], **FP32)


def test_attention_dropout_draws_from_the_trackers_fork():
    def tracker():
        t = RNGStatesTracker()
        t.add(MODEL_PARALLEL_RNG_TRACKER_NAME, 77)
        return t

    q, k, v = _qkv(4, 4, seed=1)
    tracked, states = tracker(), tracker()
    attention = te.DotProductAttention(4, D, attention_dropout=0.5, tp_size=2, get_rng_state_tracker=lambda: tracked)
    plain = te.DotProductAttention(4, D, attention_dropout=0.5, tp_size=2)
    torch.manual_seed(3)
    got = attention(q[:, :, :2], k[:, :, :2], v[:, :, :2])
    after = torch.rand(1)
    torch.manual_seed(3)
    with states.fork():  # the same draws from the tracker's state; the default generator untouched
        want = plain(q[:, :, :2], k[:, :, :2], v[:, :, :2])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(1), after, rtol=0, atol=0)
    # under sequence parallelism Transformer Engine leaves the dropout on the default generator
    sequence = te.DotProductAttention(4, D, attention_dropout=0.5, tp_size=2, sequence_parallel=True,
                                      get_rng_state_tracker=lambda: tracked)
    outputs = []
    for module in (sequence, plain):
        torch.manual_seed(3)
        outputs.append(module(q[:, :, :2], k[:, :, :2], v[:, :, :2]))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert not torch.equal(outputs[0], got)


def test_bad_tensor_parallel_arguments_name_the_problem():
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tp_size=4"):
        te.DotProductAttention(6, D, tp_size=4)
    with pytest.raises(ValueError, match="num_gqa_groups=2 is not divisible by tp_size=4"):
        te.DotProductAttention(8, D, num_gqa_groups=2, tp_size=4)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        te.DotProductAttention(8, D, tp_group=object())
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        te.DotProductAttention(8, D, tp_size=0)
    with pytest.raises(TypeError, match="get_rng_state_tracker must be a function"):
        te.DotProductAttention(8, D, get_rng_state_tracker=RNGStatesTracker())
    shard = te.DotProductAttention(8, D, tp_size=2)
    q, k, v = _qkv(8, 8)
    with pytest.raises(ValueError, match=r"query_layer has 8 heads .* num_attention_heads=8 / tp_size=2 heads"):
        shard(q, k, v)
    learnable = te.DotProductAttention(8, D, tp_size=2, softmax_type="learnable")
    assert learnable.softmax_offset.shape == (4,)  # one sink logit per head of this rank
