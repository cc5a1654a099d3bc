"""Transformer Engine's FSDP2 deferred initialization, on 2 gloo ranks: a model built on the meta
device (under te.quantized_model_init with preserve_high_precision_init_val=True, or in high
precision), sharded by fully_shard, then reset_parameters() on every module. Each parameter stays
a DTensor of the same mesh, placements and shape, its local shard materialized on the CPU and
initialized there (as Transformer Engine: the init function runs on the local shard, so each
rank draws its shard from the seed), an FP8 primary weight's shard quantized to FP8 and keeping
its value from before quantization. The model then trains: its first step's output matches the
single-process model holding the gathered initial values."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from te_core.modules import LayerNormMLP, Linear
from te_core.quantization import autocast, quantized_model_init
from te_core.quantization.float8_tensor import Float8Tensor
from te_core.recipe import DelayedScaling, Float8CurrentScaling

from ._parity import E4M3
from ._pool import pool_of

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.6 keeps FSDP2 elsewhere; te-core supports torch >= 2.7
    fully_shard = None

pytestmark = pytest.mark.skipif(fully_shard is None, reason="torch.distributed.fsdp.fully_shard is not available")

HIDDEN, FFN, ROWS, SEED = 64, 128, 16, 7
RECIPES = {"none": lambda: None, "delayed": lambda: DelayedScaling(amax_history_len=4),
           "current": Float8CurrentScaling}
WEIGHTS = ("0.fc1_weight", "0.fc2_weight", "1.weight")  # drawn in this order (normal, std 0.023)


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


def _model(recipe, device):
    with quantized_model_init(enabled=recipe is not None, recipe=recipe, preserve_high_precision_init_val=True):
        return torch.nn.Sequential(LayerNormMLP(HIDDEN, FFN, device=device), Linear(HIDDEN, HIDDEN, device=device))


def meta_init_after_fully_shard(ctx, recipe_name: str):
    recipe = RECIPES[recipe_name]()
    model = _model(recipe, "meta")
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for module in model:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layout = {name: (p.device_mesh, p.placements, p.shape) for name, p in model.named_parameters()}
    torch.manual_seed(SEED)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    expected, initial = {}, {}
    torch.manual_seed(SEED)  # each rank draws its own shard of each weight from the seed, in order
    for name in WEIGHTS:
        expected[name] = torch.nn.init.normal_(torch.empty(model.get_parameter(name).to_local().shape), std=0.023)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and isinstance(p, torch.nn.Parameter) and p.requires_grad, name
        assert (p.device_mesh, p.placements, p.shape) == layout[name], f"{name}: the DTensor layout changed"
        local = p._local_tensor  # (as TE's example reads it; to_local() outside no_grad returns a view)
        assert local.device.type == "cpu" and not local.is_meta, name
        value = local
        if recipe is not None and name in WEIGHTS:
            assert isinstance(local, Float8Tensor), f"{name}: {type(local).__name__}"
            value = local.get_high_precision_init_val()
            torch.testing.assert_close(local.dequantize(), value, **E4M3)
        if name in WEIGHTS:
            assert torch.equal(value, expected[name]), f"{name}: not the init of the local shard"
        else:  # norm weights ones, biases zeros
            assert torch.equal(value, torch.full_like(value, 1.0 if name.endswith("layer_norm_weight") else 0.0))
        gathered = [torch.empty_like(value) for _ in range(ctx.world)]
        dist.all_gather(gathered, value.contiguous())
        initial[name] = torch.cat(gathered)
    # the single-process model holding the gathered initial values, in high precision
    reference = _model(None, "cpu")
    reference.load_state_dict(initial, strict=False)
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(3))
    with autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    with autocast(enabled=recipe is not None, recipe=RECIPES[recipe_name]()):
        y_ref = reference(x)
    y.square().sum().backward()
    scale = y_ref.abs().max()
    tol = E4M3 if recipe is not None else dict(rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(y / scale, y_ref / scale, **tol)
    assert all(p.grad is not None for p in model.parameters())
    return True


@pytest.mark.parametrize("recipe_name", list(RECIPES))
def test_meta_init_after_fully_shard(pool, recipe_name):
    assert pool.run(meta_init_after_fully_shard, recipe_name) == [True] * 2
