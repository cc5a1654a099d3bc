"""FP8 primary weights under a sharded optimizer (te_core.distributed.master_weights: Transformer
Engine's tensor.utils, as Megatron-LM's distributed optimizer calls it with --fp8-param-gather),
on 2 gloo ranks laid out as that optimizer lays them out: the FP8 weights' bytes in one flat
uint8 buffer, each rank the float32 master of one contiguous half of it (cutting a weight
mid-row and mid-tile; one weight wholly on one rank, so the other passes None), an SGD step on
the master halves, the cast into the bytes, an all-gather of the buffer, and the column-wise
copies remade. After every step each weight is, bit for bit, the whole master weight cast once
(in bf16, then FP8, with the recipe's scale of the whole weight) on every rank, and training
tracks the single-process run on the joined batches."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from te_core.distributed import master_weights as mw
from te_core.modules import Linear
from te_core.quantization import autocast, quantized_model_init
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling
from te_core.reference import cast as ref

from ._parity import E4M3
from ._pool import pool_of

STEPS, ROWS, LR = 3, 16, 0.5
PAD = 100  # the buffer's first bytes belong to no weight, so the ranks' halves cut both weights mid-row
SIZES = ((144, 272), (272, 176))  # (in, out): weights of 272x144 and 176x272, neither a multiple of 128
RECIPES = {"delayed": lambda: DelayedScaling(amax_history_len=4), "current": Float8CurrentScaling,
           "block": Float8BlockScaling}


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


def _model(recipe):
    torch.manual_seed(0)
    with quantized_model_init(enabled=True, recipe=recipe, preserve_high_precision_init_val=True):
        return torch.nn.Sequential(*(Linear(i, o, params_dtype=torch.bfloat16) for i, o in SIZES))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(ROWS, SIZES[0][0], generator=torch.Generator().manual_seed(100 * step + rank))


class _Layout:
    """Where each weight's bytes sit in the flat buffer, and a rank's half of it."""

    def __init__(self, weights, world: int):
        self.offsets, end = [], PAD
        for w in weights:
            self.offsets.append(end)
            end += w.numel()
        self.size = -(-end // world) * world

    def ranges(self, weights, rank: int, world: int):
        """Per weight: (start in the weight, start in the buffer, count) of this rank's half, or None."""
        lo, hi = rank * self.size // world, (rank + 1) * self.size // world
        out = []
        for w, off in zip(weights, self.offsets):
            a, b = max(lo, off), min(hi, off + w.numel())
            out.append((a - off, a, b - a) if a < b else None)
        return out


def _train(model, recipe, group, world: int, rank: int, check=None):
    """STEPS of SGD through the sharded-master flow; the losses (averaged over the ranks)."""
    weights = [layer.weight for layer in model]
    layout = _Layout(weights, world)
    buffer = torch.zeros(layout.size, dtype=torch.uint8)
    for w, off in zip(weights, layout.offsets):
        mw.replace_raw_data(w, buffer[off : off + w.numel()].view(w.shape))  # as Megatron: a view of param shape
    master_buffer = torch.zeros(layout.size, dtype=torch.float32)
    ranges = layout.ranges(weights, rank, world)
    for w, off in zip(weights, layout.offsets):  # the masters start from the values before quantization
        master_buffer[off : off + w.numel()] = w.get_high_precision_init_val().float().reshape(-1)
    masters = [None if r is None else master_buffer[r[1] : r[1] + r[2]] for r in ranges]
    starts = [None if r is None else r[0] for r in ranges]
    losses = []
    for step in range(STEPS):
        x = _batch(step, rank) if world > 1 else torch.cat([_batch(step, r) for r in range(2)])
        with autocast(recipe=recipe, amax_reduction_group=group):
            y = model(x.to(torch.bfloat16))
        loss = y.float().pow(2).mean()
        loss.backward()
        grads = [p.grad.float() for p in model.parameters()]
        if world > 1:
            for g in grads:
                dist.all_reduce(g, group=group)
                g.div_(world)
            dist.all_reduce(loss := loss.detach().clone(), group=group)
            loss /= world
        losses.append(loss.item())
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p.grad = None
                if p.dim() == 1:  # biases: plain bf16 parameters, updated whole on every rank
                    p.sub_((LR * g).to(p.dtype))
            for master, r, g in zip(masters, ranges, grads[0::2]):
                if master is not None:
                    master.sub_(LR * g.reshape(-1)[r[0] : r[0] + r[2]])
        before = [(w._quantizer.scale.clone(), w._quantizer.scaling_group.amax_slot(w._quantizer.column).clone())
                  if isinstance(recipe, DelayedScaling) else None for w in weights]
        mw.quantize_master_weights(weights, masters, starts, group, manual_post_all_gather_processing=True)
        if world > 1:  # the all-gather of the ranks' halves of both buffers (the masters only for the checks)
            for buf in (buffer, master_buffer):
                mine = buf.chunk(world)[rank].clone()
                dist.all_gather(list(buf.chunk(world)), mine, group=group)
        mw.post_all_gather_processing(weights)
        if check is not None:
            for w, off, prior in zip(weights, layout.offsets, before):
                check(w, master_buffer[off : off + w.numel()].reshape(w.shape), prior)
    return losses


def _expected(w, full: torch.Tensor, prior):
    """(bytes, scale_inv, column-wise bytes, column-wise scale_inv) of the whole master weight,
    cast to bf16 then quantized as the recipe quantizes the whole weight."""
    hp = full.to(torch.bfloat16)
    q = w._quantizer
    if prior is not None:  # delayed: the weight's scale at the cast
        data, _ = ref.quantize_fp8(hp, prior[0], q.fp8_dtype)
        return data, torch.reciprocal(prior[0]), data.t(), torch.reciprocal(prior[0])
    if hasattr(q, "block_2d"):
        data, scale_inv, data_t, scale_inv_t = ref.quantize_blockwise(hp, q.fp8_dtype, block_2d=True,
                                                                      with_transpose=True)
        return data, scale_inv, data_t, scale_inv_t
    data, data_t, _, scale_inv, _ = ref.quantize_fp8_current(hp, q.fp8_dtype, with_transpose=True)
    return data, scale_inv, data_t, scale_inv


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _check_exact(w, full, prior) -> None:
    data, scale_inv, data_t, scale_inv_t = _expected(w, full, prior)
    assert torch.equal(_bits(w._data), _bits(data)), "FP8 bytes differ from the whole master weight cast once"
    assert torch.equal(w._scale_inv, scale_inv.reshape(w._scale_inv.shape)), "scale_inv differs"
    column = w.columnwise()
    assert torch.equal(_bits(column.data), _bits(data_t)), "column-wise copy differs from the gathered bytes"
    assert torch.equal(column.scale_inv, scale_inv_t.reshape(column.scale_inv.shape))
    if prior is not None:  # delayed: the whole weight's amax went into the history on every rank
        slot = w._quantizer.scaling_group.amax_slot(w._quantizer.column)
        assert torch.equal(slot, torch.maximum(prior[1], full.to(torch.bfloat16).abs().amax().float().reshape(1)))


def _sharded(ctx, name: str):
    model = _model(RECIPES[name]())
    losses = _train(model, RECIPES[name](), dist.group.WORLD, ctx.world, ctx.rank, check=_check_exact)
    digest = [(_bits(p._data).sum().item(), p._scale_inv.sum().item()) for p in (m.weight for m in model)]
    return losses, digest


@pytest.mark.parametrize("name", RECIPES)
def test_sharded_masters_match_the_whole_weight_cast(pool, name):
    """Each weight, after the cast of both halves and the all-gather, is the whole master weight
    cast once (checked bit for bit on each rank, every step), the ranks hold the same bytes and
    scales, and the losses track one process training on the joined batches."""
    results = pool.run(_sharded, name)
    (losses, digest), (losses1, digest1) = results
    assert losses == losses1 and digest == digest1, "the ranks disagree"
    single = _train(_model(RECIPES[name]()), RECIPES[name](), None, 1, 0, check=_check_exact)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(single), **E4M3)
    assert single[-1] < single[0], "training did not lower the loss"


def _one_weight(recipe, shape=(144, 272)):
    with quantized_model_init(enabled=True, recipe=recipe):
        return Linear(*shape, params_dtype=torch.bfloat16).weight


def test_replace_raw_data_keeps_values_and_shares_the_buffer():
    w = _one_weight(Float8CurrentScaling())
    value = w.dequantize().clone()
    buffer = torch.zeros(w.numel() + 8, dtype=torch.uint8)
    mw.replace_raw_data(w, buffer[8:])
    assert torch.equal(w.dequantize(), value)
    buffer[8:].fill_(0)  # writing the buffer writes the weight
    assert torch.count_nonzero(w.dequantize()) == 0


@pytest.mark.parametrize("bad, match", [
    (lambda w: torch.zeros(w.numel(), dtype=torch.float32), "data types of raw data don't match"),
    (lambda w: torch.zeros(w.numel() - 1, dtype=torch.uint8), "elements"),
    (lambda w: torch.zeros(2, w.numel(), dtype=torch.uint8)[:, 0], "elements"),
    (lambda w: torch.zeros(w.numel(), 2, dtype=torch.uint8)[:, 0], "contiguous"),
])
def test_replace_raw_data_refuses_mismatched_buffers(bad, match):
    w = _one_weight(DelayedScaling())
    with pytest.raises(ValueError, match=match):
        mw.replace_raw_data(w, bad(w))


def test_unsupported_weights_and_arguments_are_refused():
    mx = _one_weight(MXFP8BlockScaling(), (128, 128))
    with pytest.raises(NotImplementedError, match="MXFP8"):
        mw.replace_raw_data(mx, torch.zeros(mx.numel(), dtype=torch.uint8))
    with pytest.raises(NotImplementedError, match="MXFP8"):
        mw.quantize_master_weights([mx], [torch.zeros(4)], [0], None)
    plain = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="expected an FP8 primary weight"):
        mw.quantize_master_weights([plain], [torch.zeros(4)], [0], None)
    w = _one_weight(Float8CurrentScaling())
    with pytest.raises(ValueError, match="differ in length"):
        mw.quantize_master_weights([w, w], [None], [0, 0], None)
    with pytest.raises(ValueError, match="covers elements"):
        mw.quantize_master_weights([w], [torch.zeros(10)], [w.numel() - 5], None)
    with pytest.raises(ValueError, match="start_offset must be an integer"):
        mw.quantize_master_weights([w], [torch.zeros(10)], [None], None)
    block_1d = _one_weight(Float8BlockScaling(w_block_scaling_dim=1))
    assert not block_1d._block_2d
    with pytest.raises(NotImplementedError, match="1x128"):
        mw.quantize_master_weights([block_1d], [torch.zeros(10)], [0], None)


def test_cast_without_manual_processing_drops_the_column_wise_copy_and_remakes_it():
    """Without manual_post_all_gather_processing the stale column-wise copy is dropped, and the
    backward GEMM's read makes it again from the new bytes, exactly."""
    for recipe in (Float8CurrentScaling(), Float8BlockScaling()):
        w = _one_weight(recipe)
        assert w.has_columnwise
        master = torch.randn(w.numel()) * 0.05
        mw.cast_master_weights_to_fp8([w], [master], [0], None)
        assert not w.has_columnwise
        expected = w._quantizer.quantize(master.reshape(w.shape).to(torch.bfloat16), columnwise=True)
        assert torch.equal(_bits(w.columnwise().data), _bits(expected.columnwise().data))


def test_helpers_of_transformer_engine():
    w = _one_weight(Float8CurrentScaling())
    assert not mw.is_custom() and not mw.is_custom(w) and not mw.is_custom(w._quantizer)
    with pytest.raises(TypeError, match="expected a quantizer"):
        mw.is_custom("quantizer")
    mw.clear_columnwise_cache(w)
    assert not w.has_columnwise and w._data is not None
    saved = w.columnwise_only()
    with pytest.raises(ValueError, match="lose its data"):
        mw.clear_columnwise_cache(saved)


def test_a_delayed_weights_views_follow_its_new_scale():
    """The new scale_inv is written into the tensor the weight holds (as its requantization
    does), so `w.data` and views taken before the cast dequantize as the weight does."""
    w = _one_weight(DelayedScaling())
    alias, view = w.data, w.view(-1)
    state, column = w._quantizer.scaling_group, w._quantizer.column
    state.scale_of(column).mul_(0.5)  # as a scale update between steps would
    state.scale_changed()
    mw.quantize_master_weights([w], [torch.randn(w.numel()) * 0.05], [0], None)
    assert torch.equal(alias.dequantize(), w.dequantize())
    assert torch.equal(view.dequantize(), w.dequantize().reshape(-1))


def test_an_fsdp_shard_of_another_dtype_is_refused():
    w = _one_weight(Float8CurrentScaling())
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e5m2):
        with pytest.raises(ValueError, match="cannot hold the weight's"):
            mw.quantize_master_weights([w], [torch.randn(100)], [0], None,
                                       fsdp_shard_model_weights=[torch.zeros(100, dtype=dtype)])


def test_column_wise_copies_that_cannot_be_remade_are_kept():
    for recipe in (MXFP8BlockScaling(), Float8BlockScaling(w_block_scaling_dim=1)):
        w = _one_weight(recipe, (128, 128))
        with pytest.raises(ValueError, match="cannot remake its column-wise copy"):
            mw.clear_columnwise_cache(w)


def _nan_on(ctx, holder: int):
    """A 128x128 current- and block-scaled weight, each rank casting half of it, a NaN in the
    half of rank `holder`: every rank gets the whole weight's cast (its amax is NaN), whichever
    rank held the NaN."""
    out = []
    for recipe in (Float8CurrentScaling(), Float8BlockScaling()):
        w = _one_weight(recipe, (128, 128))
        master = torch.randn(w.numel(), generator=torch.Generator().manual_seed(3)) * 0.05
        master[holder * 8192 + 100] = float("nan")
        half = master.numel() // 2
        mine = master[ctx.rank * half : (ctx.rank + 1) * half]
        mw.quantize_master_weights([w], [mine], [ctx.rank * half], dist.group.WORLD)
        out.append(w._scale_inv.clone())
    return out


def test_a_nan_gives_the_whole_weights_scale_whichever_rank_holds_it(pool):
    first, second = pool.run(_nan_on, 0), pool.run(_nan_on, 1)
    for results in (first, second):
        for got, want in zip(results[0], results[1]):
            assert torch.equal(got, want)
    for a, b in zip(first[0], second[0]):
        assert torch.equal(a, b)
    whole = _one_weight(Float8CurrentScaling(), (128, 128))
    master = torch.randn(whole.numel(), generator=torch.Generator().manual_seed(3)) * 0.05
    master[100] = float("nan")
    mw.quantize_master_weights([whole], [master], [0], None)
    assert torch.equal(first[0][0], whole._scale_inv)


def _mismatched(ctx):
    weights = [_one_weight(Float8CurrentScaling()) for _ in range(2 if ctx.rank == 0 else 1)]
    try:
        mw.quantize_master_weights(weights, [None] * len(weights), [None] * len(weights), dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return None


def test_ranks_passing_different_weights_all_fail(pool):
    for message in pool.run(_mismatched):
        assert message is not None and "the ranks passed different model weights" in message


def _outside_group(ctx):
    solo = dist.new_group([0])  # every rank takes part in creating it; rank 1 gets the placeholder
    w = _one_weight(Float8CurrentScaling())
    if ctx.rank == 0:
        mw.quantize_master_weights([w], [torch.randn(w.numel())], [0], solo)
        return None
    with pytest.raises(ValueError, match="does not contain this rank"):
        mw.quantize_master_weights([w], [torch.randn(w.numel())], [0], solo)
    return True


def test_a_group_without_this_rank_is_named(pool):
    assert pool.run(_outside_group) == [None, True]
