"""The FSDP2 training script Transformer Engine users write for FP8 primary weights, on 2 gloo
ranks: a model built on meta under te.quantized_model_init(preserve_high_precision_init_val=True),
fully_shard, reset_parameters(); FusedAdam's float32 master weights seeded with
set_scaled_state(param, "master_param", <the local FP8 shard's high-precision init value>); a
checkpoint of torch's own state dicts (module.state_dict(), optimizer.state_dict()) through
torch.distributed.checkpoint, loaded back with load_state_dict.

Checked: the seeded master weights are the initial values and step as AdamW does in float64;
the checkpoint loads the FP8 weights bit for bit, into the same model and into a fresh one (whose
own scales would saturate the trained weights), and training continues as without the checkpoint."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from te_core.modules import LayerNormMLP, Linear
from te_core.optimizers import FusedAdam
from te_core.quantization import QuantizedTensor, autocast, quantized_model_init
from te_core.recipe import DelayedScaling

from ._parity import FP32
from ._pool import pool_of

try:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
except ImportError:  # pragma: no cover - a torch without FSDP2
    fully_shard = None

pytestmark = pytest.mark.skipif(fully_shard is None, reason="torch.distributed.fsdp.fully_shard is not available")

HIDDEN, FFN, ROWS, LR = 64, 128, 16, 1e-2


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


def _sharded_model(seed: int):
    """The script's model: FP8 primary weights made on meta, sharded, then materialized."""
    with quantized_model_init(enabled=True, recipe=DelayedScaling(), preserve_high_precision_init_val=True):
        model = torch.nn.Sequential(LayerNormMLP(HIDDEN, FFN, device="meta"), Linear(HIDDEN, HIDDEN, device="meta"))
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for module in model:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def _seeded_optimizer(model):
    """FusedAdam whose master weights are the FP8 shards' values from before quantization."""
    optimizer = FusedAdam(model.parameters(), lr=LR, master_weights=True, master_weight_dtype=torch.float32)
    for param in model.parameters():
        optimizer.initialize_state(param, store_param_remainders=False)
        local = param._local_tensor
        if isinstance(local, QuantizedTensor):
            optimizer.set_scaled_state(param, "master_param", local.get_high_precision_init_val().float())
    return optimizer


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ROWS, HIDDEN, generator=g), torch.randn(ROWS, HIDDEN, generator=g)


def _step(model, optimizer, step: int) -> float:
    x, target = _batch(step)
    optimizer.zero_grad(set_to_none=True)
    with autocast(enabled=True):
        out = model(x)
    loss = F.mse_loss(out, target)
    loss.backward()
    optimizer.step()
    return loss.item()


def _fp8_shards(model):
    """{name: (FP8 bytes, scale_inv)} of this rank's shards."""
    return {name: (p._local_tensor._row_bytes().view(torch.uint8).clone(), p._local_tensor._scale_inv.clone())
            for name, p in model.named_parameters() if isinstance(p._local_tensor, QuantizedTensor)}


def seeded_master_weights(ctx):
    model = _sharded_model(seed=3)
    initial = {name: p._local_tensor.get_high_precision_init_val().float().clone()
               for name, p in model.named_parameters() if isinstance(p._local_tensor, QuantizedTensor)}
    optimizer = _seeded_optimizer(model)
    masters = {name: optimizer.state[p]["master_param"] for name, p in model.named_parameters() if name in initial}
    for name, master in masters.items():
        assert hasattr(master, "_local_tensor") and master.shape == model.get_parameter(name).shape, name
        assert torch.equal(master._local_tensor, initial[name]), f"{name}: the master weight is not the init value"
    x, target = _batch(0)
    with autocast(enabled=True):
        out = model(x)
    F.mse_loss(out, target).backward()
    grads = {name: p.grad._local_tensor.double().clone() for name, p in model.named_parameters() if name in initial}
    optimizer.step()
    for name, master in masters.items():  # one AdamW step from zero moments, in float64
        g = grads[name]
        m, v = 0.1 * g, 0.001 * g * g
        want = initial[name].double() - LR * (m / 0.1) / ((v / 0.001).sqrt() + 1e-8)
        torch.testing.assert_close(optimizer.state[model.get_parameter(name)]["master_param"]._local_tensor,
                                   want.float(), **FP32)
    return len(masters)


def test_master_weights_seeded_from_local_fp8_shards_step_as_adamw(pool):
    assert pool.run(seeded_master_weights) == [3, 3]


def _output(model, step: int) -> torch.Tensor:
    with torch.no_grad(), autocast(enabled=True):
        return model(_batch(step)[0])


def torch_state_dict_checkpoint(ctx, path: str):
    model, twin = _sharded_model(seed=3), _sharded_model(seed=3)
    optimizer, twin_optimizer = _seeded_optimizer(model), _seeded_optimizer(twin)
    for step in range(3):
        _step(model, optimizer, step)
        _step(twin, twin_optimizer, step)
    saved = _fp8_shards(model)
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint_id=path)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    # a model built afresh: other initial values, so other delayed scales than the trained ones; its
    # forward binds its shards to their FSDP group (te_core.distributed.fsdp) before the load
    fresh = _sharded_model(seed=4)
    _output(fresh, 0)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    for target in (model, fresh):
        for name, (data, scale_inv) in _fp8_shards(target).items():
            assert torch.equal(data, saved[name][0]), f"{name}: the loaded FP8 bytes are not the saved ones"
            assert torch.equal(scale_inv, saved[name][1]), f"{name}: the loaded scale_inv is not the saved one"
    # (a forward under autocast updates the delayed scales: twin takes it too, to stay in step)
    torch.testing.assert_close(_output(fresh, 3), _output(model, 3), rtol=0, atol=0)
    _output(twin, 3)
    losses = [(_step(model, optimizer, step), _step(twin, twin_optimizer, step)) for step in (3, 4)]
    for name, (data, _) in _fp8_shards(model).items():
        assert torch.equal(data, _fp8_shards(twin)[name][0]), f"{name}: training after the load drifted"
    return losses


def test_torch_state_dict_checkpoint_of_fsdp2_fp8_weights_round_trips(pool, tmp_path):
    results = pool.run(torch_state_dict_checkpoint, str(tmp_path / "ckpt"))
    for losses in results:
        for resumed, uninterrupted in losses:
            assert resumed == uninterrupted, losses
    assert results[0] == results[1]  # every rank computes the same loss (the same batch, gathered weights)


def torch_full_state_dict(ctx):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    model = _sharded_model(seed=3)
    optimizer = _seeded_optimizer(model)
    for step in range(3):
        _step(model, optimizer, step)
    saved = _fp8_shards(model)
    options = StateDictOptions(full_state_dict=True)
    full = get_model_state_dict(model, options=options)
    fresh = _sharded_model(seed=4)  # other initial values: its own scales would saturate the trained weights
    _output(fresh, 0)
    set_model_state_dict(fresh, full, options=options)
    for name, (data, scale_inv) in _fp8_shards(fresh).items():
        assert torch.equal(data, saved[name][0]), f"{name}: the loaded FP8 bytes are not the saved ones"
        assert torch.equal(scale_inv, saved[name][1]), f"{name}: the loaded scale_inv is not the saved one"
    torch.testing.assert_close(_output(fresh, 3), _output(model, 3), rtol=0, atol=0)
    return len(saved)


def test_torch_full_state_dict_of_fsdp2_fp8_weights_loads_exactly(pool):
    """torch's full state dict (dequantized weights and the extra state) loads into a fresh sharded
    FP8 model with the saved FP8 bytes and scales, as docs/distributed.md says."""
    assert pool.run(torch_full_state_dict) == [3, 3]
