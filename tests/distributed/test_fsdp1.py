"""FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) over te-core modules, prepared with
Transformer Engine's prepare_te_modules_for_fsdp: each wrapped te-core module records its FSDP
group, FP8 delayed scaling trains as under DDP on 4 gloo ranks (every rank computes the same
weight scales from the whole unsharded weight; input and gradient amaxes are reduced over the
autocast's group), and FP8 primary weights or a model that is not FSDP1-wrapped are refused."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.nn.parallel import DistributedDataParallel

from te_core.distributed import prepare_te_modules_for_fsdp
from te_core.modules import LayerNormMLP, Linear
from te_core.quantization import autocast, quantized_model_init
from te_core.recipe import DelayedScaling

from ._parity import randomize

STEPS = 3
SUMMED = dict(rtol=1.6e-2, atol=1.6e-2)  # relative to each tensor's largest magnitude (see _parity.py)
RECIPE = DelayedScaling(amax_history_len=4)


def _model():
    model = torch.nn.Sequential(LayerNormMLP(64, 128), Linear(64, 64))
    randomize(model, seed=1)  # the same full weights on every rank
    return model


def _wrap(model, use_orig_params: bool):
    def policy(module, recurse, nonwrapped_numel):
        return recurse or isinstance(module, (LayerNormMLP, Linear))

    with warnings.catch_warnings():  # FSDP1's deprecation notice in favour of FSDP2
        warnings.simplefilter("ignore", FutureWarning)
        return FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=policy, use_orig_params=use_orig_params)


def _train(model, rank: int):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        with autocast(recipe=RECIPE, amax_reduction_group=dist.group.WORLD):
            y = model(x)
        (y.square().sum() / 1024).backward()
        optimizer.step()
        optimizer.zero_grad()


def fsdp1_matches_ddp(ctx, use_orig_params: bool):
    ddp = DistributedDataParallel(_model())
    _train(ddp, ctx.rank)
    fsdp = _wrap(_model(), use_orig_params)
    prepare_te_modules_for_fsdp(fsdp)
    inner = [w.module for w in FSDP.fsdp_modules(fsdp) if isinstance(w.module, (LayerNormMLP, Linear))]
    assert len(inner) == 2 and all(m.fsdp_group is fsdp.process_group for m in inner)
    assert dist.get_world_size(inner[0].fsdp_group) == ctx.world
    _train(fsdp, ctx.rank)
    states = [m.quantization_state() for m in inner]
    for mine, theirs in zip(states, (ddp.module[0].quantization_state(), ddp.module[1].quantization_state())):
        for direction, slots in theirs.items():
            for slot, entry in slots.items():
                torch.testing.assert_close(mine[direction][slot]["scale"], entry["scale"],
                                           msg=lambda m: f"{slot} scale: {m}")
    assert states[0]["forward"]["fc1_input"]["scale"].item() != 1.0  # FP8 ran and calibrated
    with FSDP.summon_full_params(fsdp, writeback=False):  # (names keep the nested wrappers' prefix)
        full = {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for name, p in fsdp.module.named_parameters()}
    assert sorted(full) == sorted(name for name, _ in ddp.module.named_parameters())
    for name, p_ddp in ddp.module.named_parameters():
        scale = p_ddp.detach().abs().max().clamp_min(1e-12)
        torch.testing.assert_close(full[name] / scale, p_ddp.detach() / scale, **SUMMED, msg=lambda m: f"{name}: {m}")
        assert not torch.equal(p_ddp.detach(), _model().get_parameter(name).detach()), f"{name} did not train"
    # the weight scales, made from each rank's own (whole) weight, agree on every rank
    return torch.cat([states[0]["forward"]["fc1_weight"]["scale"], states[1]["forward"]["weight"]["scale"]])


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat-params", "orig-params"])
def test_fsdp1_prepared_matches_ddp(pool, use_orig_params):
    scales = pool.run(fsdp1_matches_ddp, use_orig_params)
    assert all(torch.equal(s, scales[0]) for s in scales) and (scales[0] != 1.0).all()


def refusals(ctx):
    with quantized_model_init(recipe=RECIPE):
        fp8 = torch.nn.Sequential(Linear(32, 32), torch.nn.ReLU(), LayerNormMLP(32, 64))
    wrapped = _wrap(fp8, use_orig_params=False)
    with pytest.raises(RuntimeError, match=r"prepare_te_modules_for_fsdp: .*0.*2.* hold FP8 primary weights \(made "
                                           "under te.quantized_model_init\\), which FSDP1 flattens"):
        prepare_te_modules_for_fsdp(wrapped)
    with pytest.raises(TypeError, match="fsdp_root must be an FSDP1-wrapped model .* got Sequential; wrap the model "
                                        "first"):
        prepare_te_modules_for_fsdp(_model())
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    fsdp2 = fully_shard(_model(), mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    with pytest.raises(TypeError, match="FSDP2's fully_shard needs no preparation; leave this call out"):
        prepare_te_modules_for_fsdp(fsdp2)
    return True


def test_fp8_primary_weights_and_unwrapped_models_are_refused(pool):
    assert pool.run(refusals) == [True] * 4
