"""FusedAdam's compact states on FSDP2-sharded parameters (DTensors), on 2 gloo ranks: each rank
scales its own shard of a scaled state (FP8 or float16 moments: one scale per shard, from the
shard's largest magnitude, as Transformer Engine's FusedAdam does), and param remainders rebuild
each shard's float32 master weights exactly, so that model trains bit for bit as it does
unsharded in one process, and the scaled one within its formats' precision."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from te_core.optimizers import FusedAdam
from te_core.optimizers import _scaled_states as compact

from ._pool import pool_of

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - a torch without FSDP2
    fully_shard = None

pytestmark = pytest.mark.skipif(fully_shard is None, reason="torch.distributed.fsdp.fully_shard is not available")

LR = 1e-2
CASES = {"scaled moments": (torch.float32, dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16)),
         "float16 master weights": (torch.bfloat16, dict(master_weights=True, master_weight_dtype=torch.float16)),
         "param remainders": (torch.bfloat16, dict(master_weights=True, store_param_remainders=True))}


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)).to(dtype)


def _train(model, optimizer, dtype, steps=3):
    for step in range(steps):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step)).to(dtype)
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _sharded_against_unsharded(ctx, case):
    dtype, kwargs = CASES[case]
    sharded = _model(dtype)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    plain = _model(dtype)
    optimizer = FusedAdam(sharded.parameters(), lr=LR, weight_decay=0.01, **kwargs)
    _train(sharded, optimizer, dtype)
    _train(plain, FusedAdam(plain.parameters(), lr=LR, weight_decay=0.01, **kwargs), dtype)
    worst = max((p.full_tensor().float() - q.detach().float()).abs().max().item()
                for p, q in zip(sharded.parameters(), plain.parameters()))
    scales_per_shard = True
    for p in sharded.parameters():
        for name, dtype_ in optimizer.name_to_dtype_map.items():
            if dtype_ in compact.SCALED and name in optimizer.state[p]:
                local = optimizer.get_unscaled_state(p, name)._local_tensor
                stored = optimizer.state[p][name]._local_tensor
                want = stored.float().abs().max() * optimizer._scales[p][name].view(())
                scales_per_shard &= bool(torch.isclose(local.abs().max(), want))
    return worst, scales_per_shard


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_compact_states_train_as_unsharded_ones(fsdp2_training, case):
    for worst, scales_per_shard in fsdp2_training.run(_sharded_against_unsharded, case):
        assert scales_per_shard
        if case == "param remainders":
            assert worst == 0.0
        else:  # per-shard scales round the states differently from one whole-tensor scale
            assert worst <= 3 * LR * 0.125, worst
