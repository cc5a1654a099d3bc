"""Delayed scaling across ranks: with amax_reduction_group spanning the tensor- and data-parallel
ranks, the amaxes of a step reduce in one coalesced all-reduce per direction, and every rank
ends the step with the same scales, though each saw different data and holds different shards."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from te_core.modules import LayerNormMLP, Linear
from te_core.quantization import autocast
from te_core.recipe import DelayedScaling

STEPS = 3
FIRST_CASTS = 12  # forward: 4 inputs and 4 weights; backward: 4 output gradients


def _model(tp_group, tp: int):
    tp_args = dict(tp_group=tp_group, sequence_parallel=True)
    return torch.nn.Sequential(
        LayerNormMLP(64, 128, set_parallel_mode=True, **tp_args),
        Linear(64, 128, parallel_mode="column", **tp_args),
        Linear(128, 64, parallel_mode="row", **tp_args),
    )


def _state_vector(model) -> torch.Tensor:
    """Every scale and amax history of the model, in a fixed order."""
    parts = []
    for module in model:
        for direction in ("forward", "backward"):
            for slot, state in sorted(module.quantization_state()[direction].items()):
                parts += [state["scale"].reshape(-1), state["amax_history"].reshape(-1)]
    return torch.cat(parts)


def scales_after_steps(ctx, tp: int, ranks: int):
    """TP groups of `tp` ranks within the first `ranks` ranks, all of which reduce amaxes together."""
    if ctx.rank >= ranks:
        return None
    reduce_group = ctx.group(ranks)
    torch.manual_seed(ctx.rank)  # each rank draws its own shards
    model = _model(ctx.group(tp), tp)
    max_reductions = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.MAX:
            max_reductions.append(tensor.numel())
        return all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting_all_reduce
    try:
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + ctx.rank)  # every rank its own data
            x = torch.randn(16 // tp, 2, 64, generator=gen) * (1 + ctx.rank)
            with autocast(recipe=DelayedScaling(amax_history_len=4), amax_reduction_group=reduce_group):
                y = model(x)
            y.square().mean().backward()
    finally:
        dist.all_reduce = all_reduce
    # The first step's first cast of each tensor scales by its own amax, reduced over the group
    # first (one element each); then one coalesced reduction per direction and step.
    first, updates = [n for n in max_reductions if n == 1], [n for n in max_reductions if n > 1]
    assert len(first) == FIRST_CASTS and len(updates) == 2 * STEPS, (
        f"expected {FIRST_CASTS} first-cast reductions and one per direction and step: {max_reductions}")
    mine = _state_vector(model)
    everyone = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(everyone, mine, group=reduce_group)
    for rank, theirs in enumerate(everyone):
        assert torch.equal(theirs, mine), f"rank {ctx.rank} and rank {rank} ended the step with different scales"
    # the column-parallel weight's scale comes from the largest shard amax of all ranks
    local_amax = model[1].weight.detach().abs().max().reshape(1)
    amaxes = [torch.empty_like(local_amax) for _ in range(ranks)]
    dist.all_gather(amaxes, local_amax, group=reduce_group)
    assert len(set(a.item() for a in amaxes)) > 1, "the ranks' shards should differ"
    scale = model[1].quantization_state()["forward"]["weight"]["scale"]
    torch.testing.assert_close(scale, 448.0 / torch.cat(amaxes).max().reshape(1), rtol=1.3e-6, atol=0)
    return len(max_reductions)


@pytest.mark.parametrize("tp, ranks", [(2, 2), (2, 4), (4, 4)], ids=["tp2", "tp2-dp2", "tp4"])
def test_every_rank_ends_the_step_with_the_same_scales(pool, tp, ranks):
    results = pool.run(scales_after_steps, tp, ranks)
    assert results[:ranks] == [FIRST_CASTS + 2 * STEPS] * ranks
