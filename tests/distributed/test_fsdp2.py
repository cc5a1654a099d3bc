"""FSDP2 (torch.distributed.fsdp.fully_shard) over te-core modules trains like DDP: after a few
optimizer steps on 4 gloo ranks, each with its own data, the sharded model's parameters equal
the DDP model's (BF16, and FP8 delayed scaling with the amaxes reduced over the ranks), also
with tensor parallelism inside each data-parallel replica.
These weights are high precision, and FSDP2 all-gathers them as they are; FP8 primary weights
and their FP8 all-gather are tested in test_fsdp2_fp8.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from te_core.modules import LayerNormMLP, Linear
from te_core.quantization import autocast
from te_core.recipe import DelayedScaling

from ._parity import randomize, shard

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6 keeps FSDP2 elsewhere; te-core supports torch >= 2.7
    fully_shard = None

STEPS = 3
BF16_SUMMED = dict(rtol=1.6e-2, atol=1.6e-2)  # relative to each tensor's largest magnitude (see _parity.py)


def _model(dtype):
    model = torch.nn.Sequential(LayerNormMLP(64, 128, params_dtype=dtype), Linear(64, 64, params_dtype=dtype))
    randomize(model, seed=1)  # the same full weights on every rank
    return model


def _train(model, recipe, rank: int):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        x = x.to(next(model.parameters()).dtype)
        if recipe is None:
            y = model(x)
        else:
            with autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
                y = model(x)
        # a sum, not a mean: under tensor parallelism each rank's output is its block of the
        # features, and the full loss is the sum of the ranks' losses
        (y.float().square().sum() / 1024).backward()
        optimizer.step()
        optimizer.zero_grad()


def fsdp_matches_ddp(ctx, dtype_name: str, fp8: bool):
    dtype = getattr(torch, dtype_name)
    recipe = DelayedScaling(amax_history_len=4) if fp8 else None
    ddp = DistributedDataParallel(_model(dtype))
    _train(ddp, recipe, ctx.rank)
    sharded = _model(dtype)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for module in sharded:
        fully_shard(module, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    _train(sharded, recipe, ctx.rank)
    assert sharded[0].fc1_weight.to_local().shape[0] == 128 // ctx.world, "fc1_weight is not sharded"
    if fp8:  # FP8 ran and calibrated its scales, identically on both models
        scale = sharded[0].quantization_state()["forward"]["fc1_input"]["scale"]
        assert scale.item() != 1.0
        torch.testing.assert_close(scale, ddp.module[0].quantization_state()["forward"]["fc1_input"]["scale"])
    for (name, p_ddp), (_, p_fsdp) in zip(ddp.module.named_parameters(), sharded.named_parameters()):
        full = p_fsdp.full_tensor().detach()
        scale = p_ddp.detach().abs().max().clamp_min(1e-12)
        tol = dict(rtol=1.3e-6, atol=1e-5) if dtype == torch.float32 and not fp8 else BF16_SUMMED
        torch.testing.assert_close(full / scale, p_ddp.detach() / scale, **tol, msg=lambda m: f"{name}: {m}")
        assert not torch.equal(p_ddp.detach(), _model(dtype).get_parameter(name).detach()), f"{name} did not train"
    return True


@pytest.mark.skipif(fully_shard is None, reason="torch.distributed.fsdp.fully_shard is not available")
@pytest.mark.parametrize("dtype, fp8", [("float32", False), ("bfloat16", False), ("float32", True)],
                         ids=["fp32", "bf16", "fp8-delayed"])
def test_fsdp2_matches_ddp(fsdp2_training, dtype, fp8):
    assert fsdp2_training.run(fsdp_matches_ddp, dtype, fp8) == [True] * 4


def _tp_model(tp_group, rank_in_tp: int):
    """This rank's tensor-parallel shard (2 ranks) of the same full model on every rank."""
    full = _model(torch.float32)
    part = torch.nn.Sequential(LayerNormMLP(64, 128, tp_group=tp_group, set_parallel_mode=True),
                               Linear(64, 64, parallel_mode="column", tp_group=tp_group))
    with torch.no_grad():
        for name, p in part.named_parameters():
            p.copy_(shard(full.get_parameter(name), p.shape, rank_in_tp, 2, gated=False))
    return part


def tp_inside_fsdp_matches_ddp(ctx):
    """Tensor parallelism over ranks {0, 1} and {2, 3}; data parallelism (DDP, or FSDP2 sharding
    each rank's tensor-parallel shard) over {0, 2} and {1, 3}."""
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
    dp_group, tp_group, tp_rank = dp_groups[ctx.rank % 2], ctx.group(2), ctx.rank % 2
    ddp = DistributedDataParallel(_tp_model(tp_group, tp_rank), process_group=dp_group)
    _train(ddp, None, ctx.rank // 2)  # the data differs between the replicas, not within one
    sharded = _tp_model(tp_group, tp_rank)
    mesh = DeviceMesh.from_group(dp_group, "cpu")
    for module in sharded:
        fully_shard(module, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    _train(sharded, None, ctx.rank // 2)
    unsplit = DistributedDataParallel(_model(torch.float32), process_group=dp_group)  # data parallelism alone
    _train(unsplit, None, ctx.rank // 2)
    for (name, p_ddp), (_, p_fsdp) in zip(ddp.module.named_parameters(), sharded.named_parameters()):
        torch.testing.assert_close(p_fsdp.full_tensor(), p_ddp.detach(), rtol=1.3e-6, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
        expected = shard(unsplit.module.get_parameter(name).detach(), p_ddp.shape, tp_rank, 2, gated=False)
        torch.testing.assert_close(p_ddp.detach(), expected, rtol=1.3e-6, atol=1e-5,
                                   msg=lambda m: f"{name} against data parallelism alone: {m}")
    return True


@pytest.mark.skipif(fully_shard is None, reason="torch.distributed.fsdp.fully_shard is not available")
def test_tensor_parallel_inside_fsdp2_matches_ddp(fsdp2_training):
    assert fsdp2_training.run(tp_inside_fsdp_matches_ddp) == [True] * 4
