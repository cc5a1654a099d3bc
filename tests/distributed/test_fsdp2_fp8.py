"""FSDP2 with FP8 all-gather (te_core.distributed.fsdp), on 2 gloo ranks: FP8 primary weights
(te.quantized_model_init) stay FP8 when fully_shard shards them, the all-gather moves their FP8
bytes (at most 55% of the BF16 model's bytes per step), the gathered weight is the original
bit for bit, and training matches the single-process run on the ranks' joined batches within
the recipe's tolerance. Formats and placements that cannot be gathered in FP8 raise errors
that say what to do."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from te_core.distributed.comm_bytes import AllGatherBytes
from te_core.modules import LayerNormMLP, Linear
from te_core.quantization import autocast, quantized_model_init
from te_core.quantization.float8_tensor import Float8Tensor
from te_core.quantization.quantizers import Float8CurrentScalingQuantizer
from te_core.quantization.roles import Role
from te_core.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

from . import _torchrun
from ._parity import E4M3, randomize
from ._pool import pool_of

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
except ImportError:  # torch < 2.6 keeps FSDP2 elsewhere; te-core supports torch >= 2.7
    fully_shard = None

pytestmark = pytest.mark.skipif(fully_shard is None, reason="torch.distributed.fsdp.fully_shard is not available")

STEPS, ROWS, HIDDEN, FFN = 3, 16, 64, 128
# reduce: whether amaxes are reduced over the default group (the single-process reference must not)
RECIPES = {"delayed": lambda reduce: DelayedScaling(amax_history_len=4, reduce_amax=reduce),
           "current": lambda reduce: Float8CurrentScaling()}


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


def _device() -> torch.device:
    """The CPU under gloo (the pool), this rank's GPU under NCCL (torchrun, see main)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _model(recipe=None, dtype=torch.bfloat16):
    """The same full model on every rank: FP8 primary weights under `recipe`, else `dtype` ones."""
    torch.manual_seed(0)  # the initial weights set an FP8 primary weight's first scale
    factory = dict(params_dtype=dtype, device=_device())
    with quantized_model_init(enabled=recipe is not None, recipe=recipe):
        model = torch.nn.Sequential(LayerNormMLP(HIDDEN, FFN, **factory), Linear(HIDDEN, HIDDEN, **factory))
        randomize(model, seed=1)
    return model


def _shard(model, **kwargs):
    mesh = DeviceMesh.from_group(dist.group.WORLD, _device().type)
    for module in model:
        fully_shard(module, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(10 * step + rank))
    return x.to(_device(), torch.bfloat16)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.float().square().sum() / 1024


def _step(model, optimizer, x, recipe, group) -> torch.Tensor:
    with autocast(recipe=recipe, amax_reduction_group=group):
        y = model(x)
    loss = _loss(y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return y.detach()


def fsdp_fp8_matches_single_process(ctx, recipe_name: str):
    sharded = _shard(_model(RECIPES[recipe_name](True)))
    local = sharded[0].fc1_weight.to_local()
    assert isinstance(local, Float8Tensor) and local.shape[0] == FFN // ctx.world, f"fc1_weight shard: {local!r}"
    reference = _model(RECIPES[recipe_name](False))
    opt_sharded = torch.optim.SGD(sharded.parameters(), lr=0.1)
    # the reference's loss is the sum of the ranks' losses, so each row's output gradient is what
    # its rank's is (FP8 casts see the same values); FSDP2 averages the ranks' weight gradients,
    # which the reference's learning rate does
    opt_reference = torch.optim.SGD(reference.parameters(), lr=0.1 / ctx.world)
    for step in range(STEPS):
        y = _step(sharded, opt_sharded, _batch(step, ctx.rank), RECIPES[recipe_name](True), dist.group.WORLD)
        # the single-process run on the ranks' batches joined
        joined = torch.cat([_batch(step, r) for r in range(ctx.world)])
        with autocast(recipe=RECIPES[recipe_name](False)):
            y_ref = reference(joined)
        _loss(y_ref).backward()
        opt_reference.step()
        opt_reference.zero_grad()
        mine = y_ref.detach().chunk(ctx.world)[ctx.rank]
        if step == 0 and recipe_name == "delayed":  # same weights, same scales (the first from the ranks' amaxes)
            assert torch.equal(y, mine), "the first step's output differs from the single-process run's"
        scale = mine.abs().max()
        torch.testing.assert_close(y.float() / scale, mine.float() / scale, **E4M3, msg=lambda m: f"step {step}: {m}")
    assert isinstance(sharded[0].fc1_weight.to_local(), Float8Tensor), "the optimizer step dequantized the shard"
    initial = _model(RECIPES[recipe_name](False))
    for (name, p_ref), (_, p) in zip(reference.named_parameters(), sharded.named_parameters()):
        full, ref = p.full_tensor().detach().float(), p_ref.detach().float()
        scale = ref.abs().max()
        torch.testing.assert_close(full / scale, ref / scale, **E4M3, msg=lambda m: f"{name}: {m}")
        if p.dim() == 2:  # the FP8 weights (a bf16 norm weight near 1 may not move in a few steps)
            assert not torch.equal(ref, initial.get_parameter(name).float()), f"{name} did not train"
    return True


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_fsdp2_fp8_all_gather_matches_single_process(fsdp2_training, recipe_name):
    assert fsdp2_training.run(fsdp_fp8_matches_single_process, recipe_name) == [True] * 2


class _AllReduces:
    """Counts torch.distributed.all_reduce calls inside the block (collectives issued from
    within a tensor subclass's dispatch are out of a dispatch mode's sight)."""

    def __enter__(self):
        self.calls, self._original = 0, dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


def fused_adam_steps_delayed_shards_in_place(ctx, recipe_name):
    """FusedAdam without master weights on FSDP2 shards of FP8 primary weights: delayed
    scaling's are stepped in place, as unsharded (the all-gather wraps the shard's quantizer,
    which the optimizer's check must see through), and the sharded and single-process weights
    agree after the steps; current scaling's are refused, as in Transformer Engine."""
    from te_core.optimizers import FusedAdam

    sharded = _shard(_model(RECIPES[recipe_name](True)))
    reference = _model(RECIPES[recipe_name](False))
    opt_sharded, opt_reference = FusedAdam(sharded.parameters(), lr=1e-3), FusedAdam(reference.parameters(), lr=1e-3)
    try:
        for step in range(STEPS):
            _step(sharded, opt_sharded, _batch(step, ctx.rank), RECIPES[recipe_name](True), dist.group.WORLD)
            joined = torch.cat([_batch(s, r) for s in (step,) for r in range(ctx.world)])
            with autocast(recipe=RECIPES[recipe_name](False)):
                y_ref = reference(joined)
            (_loss(y_ref) / ctx.world).backward()  # FSDP2 averages the ranks' gradients
            opt_reference.step()
            opt_reference.zero_grad()
    except RuntimeError as err:
        return str(err)
    for (name, p_ref), (_, p) in zip(reference.named_parameters(), sharded.named_parameters()):
        full, ref = p.full_tensor().detach().float(), p_ref.detach().float()
        scale = ref.abs().max()
        torch.testing.assert_close(full / scale, ref / scale, **E4M3, msg=lambda m: f"{name}: {m}")
    return True


def test_fsdp2_fused_adam_without_master_weights(pool):
    assert pool.run(fused_adam_steps_delayed_shards_in_place, "delayed") == [True] * 2
    for message in pool.run(fused_adam_steps_delayed_shards_in_place, "current"):
        assert "without master_weights does not support Float8Tensor parameters of Float8CurrentScalingQuantizer" \
            in message


def foreach_step_reduces_once(ctx, recipe_name):
    """A foreach optimizer step requantizes every FP8 shard with one amax all-reduce (a looping
    step: one per FP8 weight), to the same FP8 bytes and scales."""
    results = {}
    for foreach in (False, True):
        model = _shard(_model(RECIPES[recipe_name](True)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=foreach)
        with autocast(recipe=RECIPES[recipe_name](True), amax_reduction_group=dist.group.WORLD):
            y = model(_batch(0, ctx.rank))
        _loss(y).backward()
        with _AllReduces() as counted:
            optimizer.step()
        shards = [p.to_local() for p in model.parameters() if isinstance(p.to_local(), Float8Tensor)]
        results[foreach] = (counted.calls, [(s._data.view(torch.uint8).clone(), s._scale_inv.clone()) for s in shards])
    (looped, looped_shards), (batched, batched_shards) = results[False], results[True]
    assert looped == len(looped_shards) == 3 and batched == 1, (looped, batched)
    for (data, scale_inv), (data_b, scale_inv_b) in zip(looped_shards, batched_shards):
        assert torch.equal(data, data_b) and torch.equal(scale_inv, scale_inv_b)
    return True


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_fsdp2_fp8_foreach_step_reduces_amaxes_once(pool, recipe_name):
    assert pool.run(foreach_step_reduces_once, recipe_name) == [True] * 2


def all_gather_bytes_per_step(ctx, recipe_name):
    """(bytes sent by this rank in one forward and backward) for BF16 weights and FP8 ones."""
    sent = {}
    for label, recipe in (("bf16", None), ("fp8", RECIPES[recipe_name](True))):
        model = _shard(_model(recipe))
        with AllGatherBytes() as counted:
            with autocast(recipe=RECIPES[recipe_name](True)):
                y = model(_batch(0, ctx.rank))
            _loss(y).backward()
        sent[label] = counted.sent
        if recipe is not None:
            assert counted.by_dtype.get(torch.uint8, 0) > 0, f"no FP8 bytes gathered: {counted.by_dtype}"
    return sent


@pytest.mark.parametrize("recipe_name", sorted(RECIPES))
def test_fsdp2_fp8_all_gather_bytes(pool, recipe_name):
    sent = pool.run(all_gather_bytes_per_step, recipe_name)[0]
    ratio = sent["fp8"] / sent["bf16"]
    assert ratio <= 0.55, f"FP8 all-gather sent {sent['fp8']} bytes per rank per step, BF16 {sent['bf16']}: {ratio:.1%}"


def gathered_weight_is_the_original(ctx):
    """An unevenly sharded weight (33 rows over 2 ranks: FSDP2 pads the second shard) gathers
    back to the same FP8 bytes, column-wise copy and scale, which FSDP2 frees when it reshards;
    a high-precision forward reads it as the original."""
    recipe = DelayedScaling(reduce_amax=False)
    with quantized_model_init(recipe=recipe):
        model = Linear(HIDDEN, 33, params_dtype=torch.bfloat16, device=_device())
        randomize(model, seed=2)
    original = model.weight.detach().clone()
    x = _batch(0, 0)
    expected = model(x).detach()
    _shard(torch.nn.Sequential(model))
    model.unshard()
    weight = model.weight
    assert isinstance(weight, Float8Tensor), type(weight)
    assert torch.equal(weight._data.view(torch.uint8), original._data.view(torch.uint8)), "FP8 bytes differ"
    assert torch.equal(weight._scale_inv, original._scale_inv)
    assert torch.equal(weight.columnwise().data.view(torch.uint8), original.columnwise().data.view(torch.uint8))
    model.reshard()  # frees the gathered bytes and the column-wise copy, as FSDP2 frees a parameter
    assert weight._data.untyped_storage().size() == 0 and weight._transpose.untyped_storage().size() == 0
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    return True


def test_fsdp2_fp8_uneven_shards_gather_exactly(pool):
    assert pool.run(gathered_weight_is_the_original) == [True] * 2


def test_float8_views_stay_fp8():
    """The ops FSDP2 shards with (split, new_zeros, narrow, copy_, view, as_strided) keep a
    Float8Tensor FP8, with its values; a copy between different scales requantizes."""
    quantizer = Float8CurrentScalingQuantizer(Role.WEIGHT, torch.float8_e4m3fn)
    weight = quantizer.quantize(torch.randn(33, HIDDEN), columnwise=True)
    value = weight.dequantize()
    parts = weight.split(17)
    assert all(isinstance(p, Float8Tensor) and not p.has_columnwise for p in parts)
    torch.testing.assert_close(torch.cat([p.dequantize() for p in parts]), value, rtol=0, atol=0)
    padded = parts[1].new_zeros((17, HIDDEN))
    padded.narrow(0, 0, 16).copy_(parts[1])  # writes through the view, as FSDP2's padding does
    assert isinstance(padded, Float8Tensor) and torch.equal(padded._scale_inv, weight._scale_inv)
    torch.testing.assert_close(padded.dequantize(), torch.cat([value[17:], value.new_zeros(1, HIDDEN)]), rtol=0, atol=0)
    flat = weight.view(-1)
    assert isinstance(flat, Float8Tensor) and torch.equal(flat.dequantize(), value.view(-1))
    strided = flat.as_strided((33, HIDDEN), (HIDDEN, 1), 0)
    assert isinstance(strided, Float8Tensor) and torch.equal(strided.dequantize(), value)
    other = quantizer.quantize(2 * torch.randn(16, HIDDEN))
    target = parts[1].detach().clone()
    target.copy_(other)  # another scale: requantized by the target's quantizer
    torch.testing.assert_close(target.dequantize(), other.dequantize(), **E4M3)


def mxfp8_weights_refused(ctx):
    """(Block-scaled weights: tests/distributed/test_fsdp2_block_fp8.py.)"""
    with pytest.raises(NotImplementedError, match="DelayedScaling, Float8CurrentScaling or Float8BlockScaling"):
        _shard(_model(MXFP8BlockScaling()))
    return True


def column_sharding_refused(ctx):
    model = _shard(_model(RECIPES["delayed"](True)), shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    with pytest.raises(NotImplementedError, match="Shard\\(0\\)"):
        model(_batch(0, ctx.rank))
    return True


@pytest.mark.parametrize("case", [mxfp8_weights_refused, column_sharding_refused], ids=["mxfp8", "shard-dim-1"])
def test_fsdp2_fp8_unsupported_combinations(pool, case):
    assert pool.run(case) == [True] * 2


def main() -> None:
    """The same checks with one process per GPU on NCCL (gloo on CPU without GPUs), on the
    selected te-core backend:  torchrun --nproc-per-node 2 -m tests.distributed.test_fsdp2_fp8"""
    ctx, report = _torchrun.start()
    for recipe_name in sorted(RECIPES):
        fsdp_fp8_matches_single_process(ctx, recipe_name)
        report(f"{recipe_name}: FSDP2 FP8 all-gather training matches the single-process run")
        sent = all_gather_bytes_per_step(ctx, recipe_name)
        ratio = sent["fp8"] / sent["bf16"]
        report(f"{recipe_name}: all-gather bytes sent per rank per step: FP8 {sent['fp8']:,}, BF16 {sent['bf16']:,} "
               f"({ratio:.1%})")
        assert ratio <= 0.55, f"FP8 all-gather bytes are {ratio:.1%} of BF16's"
    for case in (gathered_weight_is_the_original, mxfp8_weights_refused, column_sharding_refused):
        case(ctx)
        report(f"{case.__name__}: ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
