"""The four communication steps of tensor parallelism: each forward is its collective and each
backward the transpose, on 2 and 4 gloo ranks with inputs that differ per rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from te_core.distributed import (
    copy_to_tp_region,
    gather_along_first_dim,
    reduce_from_tp_region,
    scatter_reduce_first_dim,
)

FP32 = dict(rtol=1.3e-6, atol=1e-5)


def _per_rank(shape, rank: int, world: int, seed: int):
    """Every rank's tensor (the same list on all ranks), and this rank's."""
    everyone = [torch.randn(shape, generator=torch.Generator().manual_seed(seed + r)) for r in range(world)]
    return everyone, everyone[rank].clone().requires_grad_()


def check_collectives(ctx, world: int):
    if ctx.rank >= world:
        return None
    group, rank = ctx.group(world), ctx.rank
    xs, x = _per_rank((4, 3), rank, world, seed=0)
    dys, _ = _per_rank((4, 3), rank, world, seed=100)
    wide_dys, _ = _per_rank((4 * world, 3), rank, world, seed=200)
    narrow_dys, _ = _per_rank((4 // world, 3), rank, world, seed=300)
    # (function, expected forward, its input gradient given the ranks' output gradients)
    cases = {
        "copy_to_tp_region": (copy_to_tp_region, xs[rank], dys, sum(dys)),
        "reduce_from_tp_region": (reduce_from_tp_region, sum(xs), dys, dys[rank]),
        "gather_along_first_dim": (gather_along_first_dim, torch.cat(xs), wide_dys,
                                   sum(wide_dys).chunk(world)[rank]),
        "scatter_reduce_first_dim": (scatter_reduce_first_dim, sum(xs).chunk(world)[rank], narrow_dys,
                                     torch.cat(narrow_dys)),
    }
    for name, (fn, expected, grads, expected_dx) in cases.items():
        x.grad = None
        y = fn(x, group)
        torch.testing.assert_close(y, expected, **FP32, msg=lambda m: f"{name} forward: {m}")
        y.backward(grads[rank])
        torch.testing.assert_close(x.grad, expected_dx, **FP32, msg=lambda m: f"{name} backward: {m}")
    assert torch.equal(x.detach(), xs[rank]), "a collective changed its input in place"
    return len(cases)


@pytest.mark.parametrize("world", [2, 4])
def test_each_collective_and_its_transpose(pool, world):
    assert pool.run(check_collectives, world)[:world] == [4] * world
