"""FSDP2 FP8 all-gather of block-scaled primary weights (te_core.distributed.fsdp_block), on 2
gloo ranks: Float8BlockScaling weights made by te.quantized_model_init stay FP8 when fully_shard
shards them, the all-gather moves their FP8 bytes and tile scales (at most 55% of the BF16
model's bytes), the gathered weight is the unsharded one bit for bit (bytes, scales and the
column-wise copy), an in-place update of the shards requantizes them to what the update of the
whole weight makes, and training matches the single-process run. Shards that would cut a
128x128 tile raise errors that say what to do."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from te_core.distributed.comm_bytes import AllGatherBytes
from te_core.modules import LayerNormMLP, Linear
from te_core.quantization import autocast, quantized_model_init
from te_core.quantization.block_tensor import Float8BlockwiseTensor
from te_core.quantization.quantizers import Float8BlockQuantizer
from te_core.quantization.roles import Role
from te_core.quantization.tensor import QuantizedTensor
from te_core.recipe import Float8BlockScaling

from . import _torchrun
from ._parity import E4M3, randomize
from ._pool import pool_of
from .test_fsdp2_fp8 import _device, _loss, _shard, fully_shard

pytestmark = pytest.mark.skipif(fully_shard is None, reason="torch.distributed.fsdp.fully_shard is not available")

# every weight's dim 0 a multiple of 128 x 2 ranks: each shard holds whole 128x128 tiles
STEPS, ROWS, HIDDEN, FFN, OUT = 3, 16, 256, 512, 256


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


def _model(recipe=Float8BlockScaling(), dtype=torch.bfloat16):
    """The same full model on every rank: block-scaled FP8 primary weights, or `dtype` ones."""
    factory = dict(params_dtype=dtype, device=_device())
    with quantized_model_init(enabled=recipe is not None, recipe=recipe):
        model = torch.nn.Sequential(LayerNormMLP(HIDDEN, FFN, **factory), Linear(HIDDEN, OUT, **factory))
        randomize(model, seed=1)
    return model


def _batch(step: int, rank: int) -> torch.Tensor:
    x = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(10 * step + rank))
    return x.to(_device(), torch.bfloat16)


def _fp8_weights(model):
    return {name: p for name, p in model.named_parameters() if p.dim() == 2}


def _layouts(w: Float8BlockwiseTensor):
    """The FP8 bytes and scales of both layouts."""
    return (w._data.view(torch.uint8), w._scale_inv, w._data_t.view(torch.uint8), w._scale_inv_t)


def gathered_weights_are_the_original(ctx):
    """Each gathered weight has the unsharded weight's FP8 bytes, tile scales and column-wise
    copy; FSDP2 frees them when it reshards; after the same update of the shards and of the
    whole weights (requantized tile by tile), the gathered weights are the updated ones."""
    original = _model()
    sharded = _shard(_model())
    for name, p in _fp8_weights(sharded).items():
        local = p.to_local()
        assert isinstance(local, Float8BlockwiseTensor) and not local.has_columnwise, f"{name} shard: {local!r}"
    deltas = {name: 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)).to(_device())
              for name, p in _fp8_weights(original).items()}
    for label in ("initial", "updated"):
        for module in sharded:  # each module is its own FSDP2 group
            module.unshard()
        for name, p in _fp8_weights(sharded).items():
            expected = original.get_parameter(name)
            assert isinstance(p, Float8BlockwiseTensor), f"{name}: {type(p).__name__}"
            for mine, theirs, what in zip(_layouts(p), _layouts(expected), ("data", "scale_inv", "data_t",
                                                                            "scale_inv_t")):
                assert torch.equal(mine, theirs), f"{label} {name}: the gathered {what} differs"
        gathered = _fp8_weights(sharded)
        for module in sharded:
            module.reshard()
        assert all(p._data.untyped_storage().size() == 0 and p._data_t.untyped_storage().size() == 0
                   for p in gathered.values()), "reshard did not free the gathered weights"
        with torch.no_grad():
            for name, p in _fp8_weights(sharded).items():
                rows = p.shape[0] // ctx.world
                p.to_local().add_(deltas[name][ctx.rank * rows: (ctx.rank + 1) * rows])
                original.get_parameter(name).add_(deltas[name])
    return True


def test_fsdp2_block_fp8_gathers_exactly(pool):
    assert pool.run(gathered_weights_are_the_original) == [True] * 2


def training_matches_single_process(ctx):
    """Forward, input gradient and weight gradients of the sharded model against the single-
    process model on the ranks' joined batches, over a few SGD steps. The first forward and the
    input gradient see the same tile-scaled weights and row-wise (1x128) activations, so they
    are exact; a weight gradient's 1x128 runs along tokens join both ranks' rows in the
    single-process run, so it matches within E4M3's tolerance."""
    sharded, reference = _shard(_model()), _model()
    # the reference's loss sums the ranks' losses and FSDP2 averages the ranks' weight gradients
    opt_sharded = torch.optim.SGD(sharded.parameters(), lr=0.1)
    opt_reference = torch.optim.SGD(reference.parameters(), lr=0.1 / ctx.world)
    for step in range(STEPS):
        x = _batch(step, ctx.rank).requires_grad_()
        with autocast(recipe=Float8BlockScaling()):
            y = sharded(x)
        _loss(y).backward()
        joined = torch.cat([_batch(step, r) for r in range(ctx.world)]).requires_grad_()
        with autocast(recipe=Float8BlockScaling()):
            y_ref = reference(joined)
        _loss(y_ref).backward()
        mine, grad = y_ref.detach().chunk(ctx.world)[ctx.rank], joined.grad.chunk(ctx.world)[ctx.rank]
        if step == 0:
            assert torch.equal(y.detach(), mine), "the first output differs from the single-process run's"
            assert torch.equal(x.grad, grad), "the first input gradient differs from the single-process run's"
        for got, want, what in ((y.detach(), mine, "output"), (x.grad, grad, "input gradient")):
            scale = want.float().abs().max()
            torch.testing.assert_close(got.float() / scale, want.float() / scale, **E4M3,
                                       msg=lambda m: f"step {step} {what}: {m}")
        for (name, p_ref), (_, p) in zip(reference.named_parameters(), sharded.named_parameters()):
            full, want = p.grad.full_tensor().float(), p_ref.grad.float() / ctx.world
            scale = want.abs().max()
            torch.testing.assert_close(full / scale, want / scale, **E4M3,
                                       msg=lambda m: f"step {step} {name}.grad: {m}")
        for optimizer in (opt_sharded, opt_reference):
            optimizer.step()
            optimizer.zero_grad()
    initial = _model()
    for (name, p_ref), (_, p) in zip(reference.named_parameters(), sharded.named_parameters()):
        assert p.dim() == 1 or isinstance(p.to_local(), Float8BlockwiseTensor), f"the step dequantized {name}"
        full, want = p.full_tensor().detach().float(), p_ref.detach().float()
        scale = want.abs().max()
        torch.testing.assert_close(full / scale, want / scale, **E4M3, msg=lambda m: f"{name}: {m}")
        if p.dim() == 2:
            assert not torch.equal(want, initial.get_parameter(name).float()), f"{name} did not train"
    return True


def test_fsdp2_block_fp8_training_matches_single_process(fsdp2_training):
    assert fsdp2_training.run(training_matches_single_process) == [True] * 2


def all_gather_bytes_per_step(ctx):
    """Bytes this rank sends in one forward and backward, for BF16 weights and block FP8 ones."""
    sent = {}
    for label, recipe in (("bf16", None), ("fp8", Float8BlockScaling())):
        model = _shard(_model(recipe))
        with AllGatherBytes() as counted:
            with autocast(recipe=Float8BlockScaling()):
                y = model(_batch(0, ctx.rank))
            _loss(y).backward()
        sent[label] = counted.sent
    return sent


def test_fsdp2_block_fp8_all_gather_bytes(pool):
    sent = pool.run(all_gather_bytes_per_step)[0]
    ratio = sent["fp8"] / sent["bf16"]
    assert ratio <= 0.55, f"block FP8 all-gather sent {sent['fp8']} bytes per rank per step, BF16 {sent['bf16']}"


def tile_cutting_shards_refused(ctx):
    """300 rows over 2 ranks: shards of 150 rows would cut 128x128 tiles; the error names the
    shape, the world size and the fix. 1x128 weights shard, but are refused at the all-gather."""
    with quantized_model_init(recipe=Float8BlockScaling()):
        model = _shard(torch.nn.Sequential(Linear(HIDDEN, 300, params_dtype=torch.bfloat16, device=_device())))
    with pytest.raises(ValueError, match=r"\(300, 256\).*world size 2.*multiple of 128 x world size"), \
            autocast(recipe=Float8BlockScaling()):
        model(_batch(0, ctx.rank))  # (refused at the all-gather, on every rank)
    recipe = Float8BlockScaling(w_block_scaling_dim=1)
    with quantized_model_init(recipe=recipe):
        model = _shard(torch.nn.Sequential(Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device=_device())))
    with pytest.raises(NotImplementedError, match="1x128 scale blocks"), autocast(recipe=recipe):
        model(_batch(0, ctx.rank))
    return True


def test_fsdp2_block_fp8_refuses_shards_that_cut_tiles(pool):
    assert pool.run(tile_cutting_shards_refused) == [True] * 2


def test_block_views_stay_fp8():
    """The ops FSDP2 shards with (split, new_zeros, narrow, copy_, view(-1), as_strided) keep a
    block tensor FP8 with its exact values where they cut at 128-row tiles; cuts starting inside a
    tile are the dequantized values' cuts (as in Transformer Engine); an in-place update of a view
    requantizes its own tiles into the viewed buffers."""
    quantizer = Float8BlockQuantizer(Role.WEIGHT, torch.float8_e4m3fn, block_2d=True)
    weight = quantizer.quantize(torch.randn(384, 200), columnwise=True)
    value = weight.dequantize()
    parts = weight.split(128)
    assert all(isinstance(p, Float8BlockwiseTensor) and not p.has_columnwise for p in parts)
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), value)
    padded = parts[0].new_zeros((256, 200))
    padded.narrow(0, 0, 128).copy_(parts[2])  # writes through the view, as FSDP2's padding does
    assert isinstance(padded, Float8BlockwiseTensor)
    assert torch.equal(padded.dequantize(), torch.cat([value[256:], value.new_zeros(128, 200)]))
    flat = padded.view(-1)
    assert isinstance(flat, Float8BlockwiseTensor) and torch.equal(flat.dequantize(), padded.dequantize().view(-1))
    same = weight.as_strided((384, 200), (200, 1), 0)
    assert isinstance(same, Float8BlockwiseTensor) and same.has_columnwise and torch.equal(same.dequantize(), value)
    for got, want in ((weight.split(100), value.split(100)), (torch.chunk(weight, 4), torch.chunk(value, 4)),
                      ((weight[64:192],), (value[64:192],))):
        assert len(got) == len(want) and all(torch.equal(g.dequantize() if isinstance(g, QuantizedTensor) else g, w)
                                             for g, w in zip(got, want))
    view, update = padded.narrow(0, 0, 128), torch.randn(128, 200)
    expected = quantizer.quantize(view.dequantize() + update)
    view.add_(update)
    assert torch.equal(padded._data[:128].view(torch.uint8), expected._data.view(torch.uint8))
    assert torch.equal(padded._scale_inv[:1], expected._scale_inv)


def main() -> None:
    """The same checks with one process per GPU on NCCL (gloo on CPU without GPUs), on the
    selected te-core backend:  torchrun --nproc-per-node 2 -m tests.distributed.test_fsdp2_block_fp8"""
    ctx, report = _torchrun.start()
    for case in (gathered_weights_are_the_original, training_matches_single_process, tile_cutting_shards_refused):
        case(ctx)
        report(f"{case.__name__}: ok")
    sent = all_gather_bytes_per_step(ctx)
    ratio = sent["fp8"] / sent["bf16"]
    report(f"all-gather bytes sent per rank per step: block FP8 {sent['fp8']:,}, BF16 {sent['bf16']:,} ({ratio:.1%})")
    assert ratio <= 0.55, f"block FP8 all-gather bytes are {ratio:.1%} of BF16's"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
