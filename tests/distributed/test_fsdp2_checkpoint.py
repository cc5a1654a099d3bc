"""Checkpoints of FSDP2 models with FP8 primary weights (per-tensor scaled, and 128x128
block-scaled) through torch.distributed.checkpoint (DCP) and te_core.distributed.state_dict, on 2
gloo ranks: a loaded model has the saved FP8 bytes and scale_inv (tile scales, column-wise copy) of
every weight, the saved scaling state and optimizer state, and trains on exactly as the
saved one does; the checkpoint loads into one process and as a full state dict (torch.save,
weights_only=True); a dequantized state dict and wrong entries fail with errors that say what to do."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions

from te_core.distributed.state_dict import (get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
                                            set_optimizer_state_dict)
from te_core.modules._base import QuantizedModule
from te_core.quantization.block_tensor import Float8BlockwiseTensor
from te_core.quantization.float8_tensor import Float8Tensor
from te_core.recipe import Float8BlockScaling, MXFP8BlockScaling

from . import _torchrun
from . import test_fsdp2_block_fp8 as fsdp_block
from . import test_fsdp2_fp8 as fsdp_fp8
from ._pool import pool_of

pytestmark = pytest.mark.skipif(fsdp_fp8.fully_shard is None, reason="torch.distributed.fsdp.fully_shard is not available")

# "block": 128x128 tiles, whose weights (dim 0 a multiple of 128 x 2 ranks) are fsdp_block's
RECIPES = dict(fsdp_fp8.RECIPES, block=lambda reduce: Float8BlockScaling())
FP8_WEIGHTS = (Float8Tensor, Float8BlockwiseTensor)


def _model(recipe_name: str):
    """The same unsharded FP8 model on every rank."""
    return (fsdp_block if recipe_name == "block" else fsdp_fp8)._model(RECIPES[recipe_name](True))


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


# Adam keeps state; SGD without momentum keeps none, so torch's optimizer state dict functions
# run a zero-learning-rate step on it each time
OPTIMIZERS = {"adam": lambda params: torch.optim.Adam(params, lr=1e-2),
              "sgd": lambda params: torch.optim.SGD(params, lr=0.1)}


def _trained(recipe_name: str, steps: int = 2, optimizer_name: str = "adam"):
    """An FSDP2 FP8 model and its optimizer after `steps` steps."""
    model = fsdp_fp8._shard(_model(recipe_name))
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    for step in range(steps):
        _train_step(model, optimizer, recipe_name, step)
    return model, optimizer


def _train_step(model, optimizer, recipe_name: str, step: int) -> torch.Tensor:
    x = (fsdp_block if recipe_name == "block" else fsdp_fp8)._batch(step, dist.get_rank())
    return fsdp_fp8._step(model, optimizer, x, RECIPES[recipe_name](True), dist.group.WORLD)


def _snapshot(model) -> dict:
    """Every parameter's local values (an FP8 one as its bytes and scale_inv) and every module's
    scaling state, copied."""
    values = {}
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if isinstance(local, FP8_WEIGHTS):  # an FSDP2 shard keeps no column-wise copy
            values[name] = (local._data.view(torch.uint8).clone(), local._scale_inv.clone())
        else:
            values[name] = (local.detach().clone(),)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedModule):
            for direction, slots in module.quantization_state().items():
                for slot, state in slots.items():
                    for what, tensor in state.items():
                        values[f"{name}.{direction}.{slot}.{what}"] = (tensor.clone(),)
    return values


def _assert_same(mine: dict, theirs: dict, what: str) -> None:
    assert mine.keys() == theirs.keys(), f"{what}: {sorted(mine.keys() ^ theirs.keys())}"
    for key, tensors in mine.items():
        for a, b in zip(tensors, theirs[key]):
            assert torch.equal(a, b), f"{what}: {key} differs"


def _optimizer_state(model, optimizer) -> dict:
    state = get_optimizer_state_dict(model, optimizer)["state"]
    return {f"{name}.{k}": ((v.to_local() if hasattr(v, "to_local") else v).clone(),)
            for name, entries in state.items() for k, v in entries.items()}


def round_trip(ctx, recipe_name: str, optimizer_name: str, path: str):
    """Save a trained model and its optimizer, load both into a fresh model and optimizer: the
    same bytes, scales, scaling and optimizer state; then one step of each gives the same output,
    weights and scaling state. Saving leaves the model as it was."""
    model, optimizer = _trained(recipe_name, optimizer_name=optimizer_name)
    saved = _snapshot(model)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=path)
    _assert_same(_snapshot(model), saved, "after saving")
    fresh = fsdp_fp8._shard(_model(recipe_name))
    fresh_optimizer = OPTIMIZERS[optimizer_name](fresh.parameters())
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(saved.values(), _snapshot(fresh).values()))
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_optimizer, state["optim"])
    _assert_same(_snapshot(fresh), saved, "after loading")
    _assert_same(_optimizer_state(fresh, fresh_optimizer), _optimizer_state(model, optimizer), "optimizer state")
    for sharded in (model, fresh):
        assert isinstance(sharded[0].fc1_weight.to_local(), FP8_WEIGHTS)
    y, y_fresh = _train_step(model, optimizer, recipe_name, 5), _train_step(fresh, fresh_optimizer, recipe_name, 5)
    assert torch.equal(y, y_fresh), "the first step after loading has another output"
    _assert_same(_snapshot(fresh), _snapshot(model), "after one more step")
    return True


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_fsdp2_fp8_checkpoint_round_trip(pool, recipe_name, optimizer_name, tmp_path):
    assert pool.run(round_trip, recipe_name, optimizer_name, str(tmp_path / "ckpt")) == [True] * 2


def high_precision_resume(ctx, path: str):
    """Delayed scaling over bf16 weights (no FP8 primary weights): a checkpoint saved after
    steps loads into a freshly built sharded model that has run nothing yet (the usual resume),
    its scaling state and weights the saved ones, and one more step of each is the same. The
    extra state travels as one value, which DCP restores whole: as a dict it was split into
    entries the fresh model did not have, and the load failed with a missing key."""
    def build():
        return fsdp_fp8._shard(fsdp_fp8._model(None))

    recipe = RECIPES["delayed"](True)
    model = build()
    optimizer = OPTIMIZERS["adam"](model.parameters())
    for step in range(2):
        fsdp_fp8._step(model, optimizer, fsdp_fp8._batch(step, ctx.rank), recipe, dist.group.WORLD)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=path)
    fresh = build()
    fresh_optimizer = OPTIMIZERS["adam"](fresh.parameters())
    state = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_optimizer, state["optim"])
    _assert_same(_snapshot(fresh), _snapshot(model), "after loading")
    assert any(t.abs().sum() > 0 for d in fresh[0].quantization_state().values() for e in d.values()
               for k, t in e.items() if k == "amax_history")
    y = fsdp_fp8._step(model, optimizer, fsdp_fp8._batch(5, ctx.rank), recipe, dist.group.WORLD)
    y_fresh = fsdp_fp8._step(fresh, fresh_optimizer, fsdp_fp8._batch(5, ctx.rank), recipe, dist.group.WORLD)
    assert torch.equal(y, y_fresh), "the first step after loading has another output"
    return True


def test_fsdp2_high_precision_delayed_scaling_resumes_into_a_fresh_model(pool, tmp_path):
    assert pool.run(high_precision_resume, str(tmp_path / "ckpt")) == [True] * 2


def _layouts(w) -> tuple:
    """The FP8 bytes and scale_inv of a weight, and of its column-wise copy where it has one."""
    if isinstance(w, Float8BlockwiseTensor) and w._data_t is not None:
        return w._data.view(torch.uint8), w._scale_inv, w._data_t.view(torch.uint8), w._scale_inv_t
    return w._data.view(torch.uint8), w._scale_inv


def _full_weights(model) -> dict:
    """{name: _layouts} of the whole weights, gathered by FSDP2 (every rank)."""
    units = [m for m in model.modules() if hasattr(m, "unshard")]  # each fully_shard-ed module
    for unit in units:
        unit.unshard()
    weights = {name: tuple(t.clone() for t in _layouts(p))
               for name, p in model.named_parameters() if isinstance(p, FP8_WEIGHTS)}
    for unit in units:
        unit.reshard()
    assert weights, "no FP8 weight was gathered"
    return weights


def _assert_weights(model, expected: dict, what: str) -> None:
    """Each weight's part (a shard's rows of the bytes and of a tile scale grid, or all) is the
    expected weight's; an unsharded block-scaled weight's column-wise copy too."""
    for name, layouts in expected.items():
        param = model.get_parameter(name)
        local = param.to_local() if hasattr(param, "to_local") else param
        sharded = local.shape != layouts[0].shape
        for mine, full, part in zip(_layouts(local), layouts, ("FP8 bytes", "scale_inv", "data_t", "scale_inv_t")):
            if sharded and full.numel() > 1:  # a shard holds whole tiles: its scale rows chunk as its rows do
                full = full.chunk(dist.get_world_size())[dist.get_rank()]
            assert torch.equal(mine, full), f"{what}: {name} {part} differs"
        assert len(_layouts(local)) == (2 if sharded else len(layouts)), f"{what}: {name} column-wise copy"


def other_world_sizes(ctx, recipe_name: str, path: str):
    """The 2-rank checkpoint loads into an unsharded model in one process (DCP without a process
    group), and a full state dict saved by rank 0 with torch.save loads with weights_only=True
    into an unsharded model and into a fresh 2-rank FSDP2 model, all bit for bit; the unsharded
    model's forward equals the sharded one's."""
    recipe = RECIPES[recipe_name](True)
    model, _ = _trained(recipe_name)
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(path, "dcp"))
    expected = _full_weights(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    x = (fsdp_block if recipe_name == "block" else fsdp_fp8)._batch(7, 0)
    with fsdp_fp8.autocast(recipe=recipe):
        y = model(x)
    if ctx.rank == 0:
        torch.save(full, os.path.join(path, "full.pt"))
        single = _model(recipe_name)
        state = get_model_state_dict(single)
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"), no_dist=True)
        set_model_state_dict(single, state)
        _assert_weights(single, expected, "DCP checkpoint in one process")
        with fsdp_fp8.autocast(recipe=RECIPES[recipe_name](False)):  # one process: no amax reduction
            assert torch.equal(single(x), y), "the unsharded model's forward differs from the sharded one's"
        single = _model(recipe_name)
        set_model_state_dict(single, torch.load(os.path.join(path, "full.pt"), weights_only=True))
        _assert_weights(single, expected, "full state dict in one process")
    else:
        assert full == {}, "a full state dict with cpu_offload is rank 0's alone"
    dist.barrier()
    fresh = fsdp_fp8._shard(_model(recipe_name))
    loaded = torch.load(os.path.join(path, "full.pt"), weights_only=True)
    set_model_state_dict(fresh, loaded, options=StateDictOptions(full_state_dict=True))
    _assert_weights(fresh, expected, "full state dict into FSDP2")
    return True


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_fsdp2_fp8_checkpoint_other_world_sizes(pool, recipe_name, tmp_path):
    assert pool.run(other_world_sizes, recipe_name, str(tmp_path)) == [True] * 2


def refused(ctx, path: str):
    """A dequantized state dict (torch's, which test_fsdp2_fp8_training_script checkpoints) and an
    entry of another FP8 format fail with errors that name the way out; nothing is half loaded."""
    model, _ = _trained("delayed", steps=1)
    fresh = fsdp_fp8._shard(fsdp_fp8._model(RECIPES["delayed"](True)))
    before = _snapshot(fresh)
    dequantized = torch_state_dict.get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    with pytest.raises(ValueError, match="dequantized value"):
        set_model_state_dict(fresh, dequantized, options=StateDictOptions(full_state_dict=True))
    state = get_model_state_dict(model)
    state["1.weight"] = dict(state["1.weight"], fp8_format="float8_e5m2")
    with pytest.raises(ValueError, match="float8_e5m2, this model's is float8_e4m3fn"):
        set_model_state_dict(fresh, state)
    state = get_model_state_dict(model)
    del state["0.fc2_weight"]
    with pytest.raises(RuntimeError, match="Missing key.*0.fc2_weight"):
        set_model_state_dict(fresh, state)
    _assert_same(_snapshot(fresh), before, "after refused loads")
    return True


def test_fsdp2_fp8_checkpoint_refusals(pool, tmp_path):
    assert pool.run(refused, str(tmp_path / "ckpt")) == [True] * 2


def block_refused(ctx, path: str):
    """A block-scaled checkpoint with a per-tensor scale_inv, with tile scales of another grid, or
    with a non-positive tile scale fails with an error that names it, on every rank (also when only
    one rank's shard holds the bad scale); nothing is half loaded."""
    model, _ = _trained("block", steps=1, optimizer_name="sgd")
    fresh = fsdp_fp8._shard(_model("block"))
    before = _snapshot(fresh)
    state = get_model_state_dict(model)
    state["1.weight"] = dict(state["1.weight"], fp8_scale_inv=torch.ones(1))
    with pytest.raises(ValueError, match="fp8_scale_inv has shape \\(1,\\).*one per 128x128 tile"):
        set_model_state_dict(fresh, state)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full["0.fc1_weight"] = dict(full["0.fc1_weight"], fp8_scale_inv=full["0.fc1_weight"]["fp8_scale_inv"][:, :1])
    with pytest.raises(ValueError, match="0.fc1_weight: the checkpoint's fp8_scale_inv has shape"):
        set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    full["0.fc2_weight"]["fp8_scale_inv"][0, 0] = 0.0
    with pytest.raises(ValueError, match="0.fc2_weight: fp8_scale_inv holds .* finite and > 0"):
        set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True))
    state = get_model_state_dict(model)  # a bad tile scale in rank 0's shard alone: both ranks raise
    if ctx.rank == 0:
        state["0.fc2_weight"]["fp8_scale_inv"]._local_tensor[0, 0] = float("nan")
    with pytest.raises(ValueError if ctx.rank == 0 else RuntimeError,
                       match="finite and > 0" if ctx.rank == 0 else "another rank refused"):
        set_model_state_dict(fresh, state)
    _assert_same(_snapshot(fresh), before, "after refused loads")
    return True


def test_fsdp2_block_fp8_checkpoint_refusals(pool, tmp_path):
    assert pool.run(block_refused, str(tmp_path / "ckpt")) == [True] * 2


@pytest.mark.parametrize("recipe", [Float8BlockScaling(w_block_scaling_dim=1), MXFP8BlockScaling()],
                         ids=["block_1x128", "mxfp8"])
def test_fp8_checkpoint_refuses_other_block_formats(recipe):
    """Weights that no entry describes (1x128 blocks, MXFP8) are refused with the way out."""
    with fsdp_fp8.quantized_model_init(recipe=recipe):
        model = torch.nn.Sequential(fsdp_fp8.Linear(128, 128, params_dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="0.weight: .*module.state_dict"):
        get_model_state_dict(model)


def uneven_shards(ctx, path: str):
    """A weight of 33 rows (17 and 16 per rank; FSDP2 pads the second shard) round-trips through
    DCP and through a full state dict. (Block-scaled shards are even: each holds whole tiles.)"""
    def build():
        torch.manual_seed(0)
        with fsdp_fp8.quantized_model_init(recipe=RECIPES["delayed"](True)):
            linear = fsdp_fp8.Linear(fsdp_fp8.HIDDEN, 33, params_dtype=torch.bfloat16, device=fsdp_fp8._device())
        return fsdp_fp8._shard(torch.nn.Sequential(linear))

    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    # in high precision (FP8 GEMMs need multiples of 16); the step requantizes the FP8 shards
    fsdp_fp8._loss(model(fsdp_fp8._batch(0, ctx.rank))).backward()
    optimizer.step()
    expected = _full_weights(model)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    fresh = build()
    with pytest.raises(AssertionError):  # the step changed the weight
        _assert_weights(fresh, expected, "before loading")
    assert fresh[0].weight.to_local().shape[0] == (17, 16)[ctx.rank]
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state)
    _assert_weights(fresh, expected, "uneven shards through DCP")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    fresh = build()
    set_model_state_dict(fresh, full, options=StateDictOptions(full_state_dict=True))
    _assert_weights(fresh, expected, "uneven shards through a full state dict")
    return True


def test_fsdp2_fp8_checkpoint_uneven_shards(pool, tmp_path):
    assert pool.run(uneven_shards, str(tmp_path / "ckpt")) == [True] * 2


def main() -> None:
    """The same checks with one process per GPU on NCCL (gloo on CPU without GPUs):
    torchrun --nproc-per-node 2 -m tests.distributed.test_fsdp2_checkpoint"""
    ctx, report = _torchrun.start()
    root = [tempfile.mkdtemp(prefix="te_core_fsdp2_checkpoint_") if ctx.rank == 0 else None]
    dist.broadcast_object_list(root)  # the ranks share one directory (one node)
    cases = [(round_trip, (r, o)) for r in sorted(RECIPES) for o in sorted(OPTIMIZERS)]
    cases += [(other_world_sizes, (r,)) for r in sorted(RECIPES)] + [(uneven_shards, ()), (refused, ())]
    cases += [(block_refused, ())]
    for number, (case, args) in enumerate(cases):
        path = os.path.join(root[0], str(number))
        if ctx.rank == 0:
            os.makedirs(path)
        dist.barrier()
        case(ctx, *args, path)
        report(f"{case.__name__}{args}: ok")
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(root[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
