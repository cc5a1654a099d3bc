"""Bad tensor-parallel arguments and inputs fail with a message naming the problem: on one
process (sizes, modes, missing groups) and on gloo ranks (wrong group size, ranks that disagree
on shapes, a sequence that cannot be split)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import te_core as te
from te_core.modules import LayerNormLinear, LayerNormMLP, Linear, TransformerLayer

from ._pool import pool_of


@pytest.mark.parametrize("build, match", [
    (lambda: Linear(64, 30, parallel_mode="column", tp_size=4),
     r"Linear: out_features=30 is not divisible by tp_size=4"),
    (lambda: Linear(30, 64, parallel_mode="row", tp_size=4), r"Linear: in_features=30 is not divisible by tp_size=4"),
    (lambda: LayerNormLinear(64, 30, parallel_mode="column", tp_size=4),
     r"LayerNormLinear: out_features=30 is not divisible by tp_size=4"),
    (lambda: LayerNormMLP(64, 30, tp_size=4, set_parallel_mode=True),
     r"LayerNormMLP: ffn_hidden_size=30 is not divisible by tp_size=4"),
    (lambda: LayerNormMLP(64, 32, tp_size=2), r"tp_size=2 needs set_parallel_mode=True"),
    (lambda: Linear(64, 64, tp_size=0), r"tp_size must be a positive integer, got 0"),
    (lambda: Linear(64, 64, parallel_mode="diagonal"), r"parallel_mode='diagonal'"),
    (lambda: Linear(64, 64, sequence_parallel=2), r"sequence_parallel must be True or False"),
    (lambda: Linear(64, 64, get_rng_state_tracker=te.distributed.RNGStatesTracker()),
     r"get_rng_state_tracker must be a function returning the tracker"),
    (lambda: Linear(64, 64, rng_tracker_name=5), r"Linear: rng_tracker_name must be a string .* or None, got 5"),
])
def test_bad_arguments_are_named(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


@pytest.mark.parametrize("build, match", [
    (lambda: LayerNormLinear(64, 64, parallel_mode="row", tp_size=2),
     r"parallel_mode='row' with tp_size > 1 is not supported"),
])
def test_not_implemented_yet_says_so(build, match):
    with pytest.raises(NotImplementedError, match=match):
        build()


def test_shapes_per_rank_and_defaults():
    """tp_size without a group fixes the shapes (the group can come later); tp_size=1 and
    sequence_parallel alone change nothing, as in Transformer Engine."""
    column = Linear(64, 128, parallel_mode="column", tp_size=4, bias=True)
    assert column.weight.shape == (32, 64) and column.bias.shape == (32,) and column.out_features == 32
    row = Linear(128, 64, parallel_mode="row", tp_size=4)
    assert row.weight.shape == (64, 32) and row.bias.shape == (64,) and row.in_features == 32
    mlp = LayerNormMLP(64, 128, tp_size=4, set_parallel_mode=True, activation="swiglu")
    assert mlp.fc1_weight.shape == (64, 64) and mlp.fc2_weight.shape == (64, 32) and mlp.fc2_bias.shape == (64,)
    plain = Linear(64, 64, parallel_mode="column", sequence_parallel=True, tp_group=None, rng_tracker_name=None)
    assert plain.tp_size == 1 and not plain.sequence_parallel
    assert LayerNormLinear(64, 64, parallel_mode="row").weight.shape == (64, 64)  # no-op without parallelism
    x = torch.randn(4, 64)
    torch.testing.assert_close(plain(x), x @ plain.weight.T + plain.bias, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("getter", [lambda: None, lambda: te.distributed.RNGStatesTracker])
def test_tracker_getter_returning_no_tracker_is_named(getter):
    """A get_rng_state_tracker that returns None (or the class) failed with "'NoneType' object has
    no attribute 'fork'"; now the message says what the function must return."""
    with pytest.raises(TypeError, match=r"Linear: get_rng_state_tracker\(\) returned .*not an RNG states tracker"):
        Linear(64, 64, parallel_mode="column", get_rng_state_tracker=getter)
    with pytest.raises(TypeError, match=r"get_rng_state_tracker\(\) returned None"):
        te.MultiheadAttention(32, 2, attention_dropout=0.5, get_rng_state_tracker=lambda: None)


def test_state_dict_helpers_name_a_wrong_model_or_state_dict():
    from te_core.distributed import state_dict

    with pytest.raises(TypeError, match=r"get_model_state_dict: model must be a torch.nn.Module.*got dict"):
        state_dict.get_model_state_dict({"weight": torch.zeros(2)})
    with pytest.raises(TypeError, match=r"set_model_state_dict: model_state_dict must be a dict.*got list"):
        state_dict.set_model_state_dict(Linear(16, 16), [("weight", torch.zeros(16, 16))])
    with pytest.raises(TypeError, match=r"get_optimizer_state_dict: model must be a torch.nn.Module"):
        state_dict.get_optimizer_state_dict(None, [])
    plain = torch.nn.Linear(4, 4)  # a model without FP8 weights, not sharded: torch's state dict, as is
    assert state_dict.get_model_state_dict(plain).keys() == plain.state_dict().keys()


def test_forward_without_a_group_says_how_to_set_one():
    layer = Linear(64, 64, parallel_mode="column", tp_size=2)
    with pytest.raises(RuntimeError, match=r"no tensor-parallel group is set.*set_tensor_parallel_group"):
        layer(torch.randn(4, 64))


def test_group_without_torch_distributed():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        Linear(64, 64, parallel_mode="column", tp_group=object())


def _messages(builds):
    """Each build's TypeError / ValueError message, or None where it raised nothing."""
    messages = []
    for build in builds:
        try:
            build()
            messages.append(None)
        except (TypeError, ValueError) as err:
            messages.append(str(err))
    return messages


def _group_errors(ctx):
    """The errors a rank sees for a group of the wrong kind or size."""
    return _messages([lambda: Linear(64, 64, parallel_mode="column", tp_group=object()),
                      lambda: Linear(64, 64, parallel_mode="column", tp_group=ctx.group(4), tp_size=2),
                      lambda: Linear(64, 64, parallel_mode="column", tp_size=2).set_tensor_parallel_group(
                          ctx.group(4))])


def test_wrong_group_is_named(pool):
    for messages in pool.run(_group_errors):
        assert "tp_group must be a torch.distributed ProcessGroup" in messages[0]
        assert "has 4 ranks but the module was built with tp_size=2" in messages[1]
        assert "has 4 ranks but the module was built with tp_size=2" in messages[2]


def _group_without_this_rank(ctx):
    """Errors on each rank for the placeholder new_group gives the ranks it leaves out (ranks 2
    and 3 for the group of ranks 0 and 1), and for an amax_reduction_group that is no group."""
    pair = dist.new_group([0, 1])  # every rank creates it; ranks 2 and 3 get a placeholder
    builds = [lambda: Linear(64, 64, parallel_mode="column", tp_group=pair),
              lambda: te.DotProductAttention(2, 16, cp_group=pair, cp_comm_type="all_gather")]
    for group in (pair, object()):
        def step(group=group):
            with te.autocast(amax_reduction_group=group):
                Linear(16, 16)(torch.randn(16, 16))
        builds.append(step)
    return _messages(builds)


def test_group_without_this_rank_is_named(pool):
    """Such a group was refused as "got int" (tp_group) or silently skipped the amax reduction."""
    results = pool.run(_group_without_this_rank)
    for rank, (linear, attention, amax, not_a_group) in enumerate(results):
        assert "amax_reduction_group must be a torch.distributed ProcessGroup" in not_a_group
        if rank < 2:
            assert linear is None and attention is None and amax is None
            continue
        assert f"Linear: tp_group does not contain this rank ({rank})" in linear
        assert f"DotProductAttention: cp_group does not contain this rank ({rank})" in attention
        assert f"autocast: amax_reduction_group does not contain this rank ({rank})" in amax


def _disagreeing_shapes(ctx, sequence_parallel: bool):
    if ctx.rank >= 2:
        return None
    layer = Linear(64, 64, parallel_mode="column", tp_group=ctx.group(2), sequence_parallel=sequence_parallel)
    x = torch.randn(4 + 4 * ctx.rank, 2, 64)  # rank 0: 4 tokens, rank 1: 8
    with pytest.raises(ValueError) as err:
        layer(x)
    return str(err.value)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_ranks_disagreeing_on_shapes_fail_on_every_rank(pool, sequence_parallel):
    for message in pool.run(_disagreeing_shapes, sequence_parallel)[:2]:
        assert "the tensor-parallel ranks disagree on the input" in message
        assert "rank 0: shape (4, 2, 64)" in message and "rank 1: shape (8, 2, 64)" in message


def _disagreeing_recipes(ctx, variant: str):
    if ctx.rank >= 2:
        return None
    layer = LayerNormMLP(32, 64, tp_group=ctx.group(2), set_parallel_mode=True, sequence_parallel=True)
    if variant == "fp8 on one rank":
        autocast = te.autocast(enabled=ctx.rank == 0, recipe=te.recipe.DelayedScaling())
    else:
        autocast = te.autocast(recipe=te.recipe.DelayedScaling() if ctx.rank == 0 else te.recipe.Float8CurrentScaling())
    with pytest.raises(ValueError) as err, autocast:
        layer(torch.randn(16, 2, 32))
    return str(err.value)


@pytest.mark.parametrize("variant", ["fp8 on one rank", "two recipes"])
def test_ranks_disagreeing_on_the_recipe_fail_on_every_rank(pool, variant):
    # the collectives would move FP8 on one rank and bf16 (or other scales) on the other: a hang
    # or an abort inside the collective library, where this names each rank's quantization
    other = ("no FP8 (outside te.autocast or enabled=False)" if variant == "fp8 on one rank"
             else "FP8 with Float8CurrentScaling HYBRID")
    for message in pool.run(_disagreeing_recipes, variant)[:2]:
        assert "the tensor-parallel ranks disagree on the input or its quantization" in message
        assert "rank 0: shape (16, 2, 32) torch.float32, FP8 with DelayedScaling HYBRID" in message
        assert f"rank 1: shape (16, 2, 32) torch.float32, {other}" in message


def _indivisible_sequence(ctx):
    if ctx.rank >= 2:
        return None
    layer = Linear(64, 64, parallel_mode="row", tp_group=ctx.group(2), sequence_parallel=True)
    with pytest.raises(ValueError) as err:
        layer(torch.randn(5, 2, 32))
    return str(err.value)


def _unsplit_row_input(ctx):
    if ctx.rank >= 2:
        return None
    with pytest.raises(ValueError) as err:
        Linear(64, 32, parallel_mode="row", tp_group=ctx.group(2))(torch.randn(4, 64))
    return str(err.value)


def test_row_parallel_input_not_split_is_named(pool):
    for message in pool.run(_unsplit_row_input)[:2]:
        assert "in_features / tp_size = 64 / 2 = 32: split the input along its last dimension" in message


def test_sequence_not_divisible_by_tp_size(pool):
    for message in pool.run(_indivisible_sequence)[:2]:
        assert "its size 5 is not divisible by the tensor-parallel size 2" in message


def _unsplit_sequence(ctx):
    if ctx.rank >= 2:
        return None
    layer = TransformerLayer(32, 64, 4, tp_group=ctx.group(2), set_parallel_mode=True, sequence_parallel=True,
                             seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
    layer(torch.randn(8, 2, 32))  # this rank's shard: taken
    with pytest.raises(ValueError) as err:
        layer(torch.randn(16, 2, 32))  # the whole sequence, not split
    return str(err.value)


def test_transformer_layer_under_sequence_parallel_checks_seq_length(pool):
    """As Transformer Engine's: with seq_length given, an input that holds the whole sequence
    instead of the rank's shard is refused."""
    for message in pool.run(_unsplit_sequence)[:2]:
        assert "seq_length // tp_size = 16 // 2 = 8, got 16" in message


def _late_group(ctx):
    if ctx.rank >= 2:
        return None
    layer = Linear(64, 64, parallel_mode="row", tp_size=2)
    layer.set_tensor_parallel_group(ctx.group(2))
    x = torch.randn(4, 32)
    y = layer(x)
    expected = x @ layer.weight.T
    dist.all_reduce(expected, group=ctx.group(2))
    torch.testing.assert_close(y, expected + layer.bias, rtol=1.3e-6, atol=1e-5)
    return True


def test_set_tensor_parallel_group_after_construction(pool):
    assert pool.run(_late_group)[:2] == [True, True]


@pytest.fixture
def two_ranks():
    """A pool of its own, for tests that break it on purpose."""
    yield from pool_of(2)


def _hang(ctx):
    if ctx.rank == 0:  # the other ranks never join this all-reduce
        dist.all_reduce(torch.ones(1))
    return True


def test_a_hanging_collective_fails_with_a_message(two_ranks):
    """The pool's own timeout: a rank stuck in a collective fails the test instead of hanging it."""
    with pytest.raises(pytest.fail.Exception, match=r"_hang: ranks \[0\] did not answer within 3 s"):
        two_ranks.run(_hang, timeout=3)


def _fails_on_rank_0(ctx):
    if ctx.rank == 0:
        raise AssertionError("rank 0 gives up")
    dist.all_reduce(torch.ones(1))  # waits for rank 0, which never comes
    return True


def _sum_of_ones(ctx):
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return ones.item()


def test_a_failing_rank_is_reported_and_the_pool_starts_afresh(two_ranks):
    with pytest.raises(pytest.fail.Exception, match=r"(?s)_fails_on_rank_0 failed on ranks \[0\].*rank 0 gives up"):
        two_ranks.run(_fails_on_rank_0, timeout=20)
    assert two_ranks.run(_sum_of_ones) == [2.0, 2.0]
