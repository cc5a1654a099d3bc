"""Tensor- and sequence-parallel MultiheadAttention and TransformerLayer (heads split across
ranks, GQA, causal) on 2 and 4 gloo ranks: output and every gradient equal the single-process
block with the same full weights; bad head counts and settings fail with clear errors."""
from __future__ import annotations

import pytest
import torch

from te_core.distributed import RNGStatesTracker
from te_core.modules import MultiheadAttention, TransformerLayer

from ._attention_parity import AttnCase, check_attention_parity

MHA, LAYER = "MultiheadAttention", "TransformerLayer"
CASES = (
    [AttnCase(kind, 2, sp) for kind in (MHA, LAYER) for sp in (False, True)]
    + [AttnCase(MHA, 2, True, fuse_qkv=True), AttnCase(MHA, 2, False, input_layernorm=False),
       AttnCase(LAYER, 4, True, fuse_qkv=True), AttnCase(LAYER, 2, True, recipe="current"),
       AttnCase(LAYER, 2, False, decoder=True), AttnCase(LAYER, 2, True, fuse_qkv=True, decoder=True),
       AttnCase(LAYER, 2, False, post_ln_residual=True), AttnCase(LAYER, 2, True, post_ln_residual=True),
       AttnCase(MHA, 2, False, softmax_type="learnable"), AttnCase(LAYER, 2, True, softmax_type="off-by-one")]
)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parallel_attention_matches_single_process(pool, case):
    results = pool.run(check_attention_parity, case)
    assert results[:case.tp] == [str(case)] * case.tp  # every rank of the group compared its shard


@pytest.mark.parametrize("cls", [MultiheadAttention, TransformerLayer], ids=lambda c: c.__name__)
@pytest.mark.parametrize("heads, groups, tp, what", [(6, 6, 4, "num_attention_heads"),
                                                     (8, 2, 4, "num_gqa_groups")])
def test_heads_not_divisible_by_tp_size(cls, heads, groups, tp, what):
    args = (48, heads) if cls is MultiheadAttention else (48, 96, heads)
    with pytest.raises(ValueError, match=f"{what}={groups if what == 'num_gqa_groups' else heads} is not "
                                         f"divisible by tp_size={tp}"):
        cls(*args, num_gqa_groups=groups, tp_size=tp, set_parallel_mode=True)


@pytest.mark.parametrize("cls", [MultiheadAttention, TransformerLayer], ids=lambda c: c.__name__)
def test_tp_needs_set_parallel_mode(cls):
    args = (64, 4) if cls is MultiheadAttention else (64, 128, 4)
    with pytest.raises(ValueError, match="needs set_parallel_mode=True"):
        cls(*args, tp_size=2)


def test_sequence_parallel_needs_sbhd():
    with pytest.raises(ValueError, match="qkv_format='sbhd'"):
        MultiheadAttention(64, 4, tp_size=2, set_parallel_mode=True, sequence_parallel=True, qkv_format="bshd")


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_tp_refuses_qk_norms_with_weights(kind):
    """Their weights are shared by heads split over the ranks: refused rather than left to diverge."""
    with pytest.raises(NotImplementedError, match="gradients would need a sum over the tensor-parallel group"):
        MultiheadAttention(64, 4, tp_size=2, set_parallel_mode=True, qk_norm_type=kind)
    assert MultiheadAttention(64, 4, tp_size=2, set_parallel_mode=True, qk_norm_type="L2Normalization").q_norm


def test_tp_without_group_names_the_fix():
    mha = MultiheadAttention(64, 4, tp_size=2, set_parallel_mode=True)
    with pytest.raises(RuntimeError, match="set_tensor_parallel_group"):
        mha(torch.randn(4, 2, 64))


@pytest.mark.parametrize("cls", [MultiheadAttention, TransformerLayer], ids=lambda c: c.__name__)
def test_group_without_torch_distributed(cls):
    args = (64, 4) if cls is MultiheadAttention else (64, 128, 4)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        cls(*args, tp_group=object(), set_parallel_mode=True)


def _wrong_group_size(ctx):
    """A group of 2 ranks given to a block built for 4, at construction and later."""
    if ctx.rank >= 2:
        return None
    for build in (lambda: MultiheadAttention(64, 4, tp_size=4, tp_group=ctx.group(2), set_parallel_mode=True),
                  lambda: TransformerLayer(64, 128, 4, tp_size=4, set_parallel_mode=True)
                  .set_tensor_parallel_group(ctx.group(2))):
        try:
            build()
        except ValueError as err:
            assert "has 2 ranks but the module was built with tp_size=4" in str(err), str(err)
        else:
            raise AssertionError("a group of the wrong size was accepted")
    return True


def test_group_of_wrong_size(pool):
    assert pool.run(_wrong_group_size)[:2] == [True, True]


def _set_group_later(ctx):
    """set_tensor_parallel_group() on the block reaches every projection: the forward runs."""
    if ctx.rank >= 2:
        return None
    layer = TransformerLayer(64, 128, 4, tp_size=2, set_parallel_mode=True, hidden_dropout=0.0,
                             attention_dropout=0.0)
    layer.set_tensor_parallel_group(ctx.group(2))
    out = layer(torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(3)))
    return tuple(out.shape)


def test_set_tensor_parallel_group_reaches_submodules(pool):
    assert pool.run(_set_group_later)[:2] == [(8, 2, 64)] * 2


def test_attention_dropout_runs_on_the_tracker():
    """With get_rng_state_tracker, attention dropout draws from the tracker's state: the default
    generator is left as it was, and the same tracker seed gives the same mask."""
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    mha = MultiheadAttention(64, 4, attention_dropout=0.5, get_rng_state_tracker=lambda: tracker)
    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(5))
    seeded, outs = tracker.get_states(), []
    for _ in range(2):
        tracker.set_states(seeded)
        before = torch.get_rng_state()
        outs.append(mha(x))
        assert torch.equal(torch.get_rng_state(), before), "dropout drew from the default generator"
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    mha.eval()
    assert not torch.allclose(mha(x), outs[0]), "dropout did not run"
