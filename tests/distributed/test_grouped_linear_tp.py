"""te.GroupedLinear's tensor parallelism, as Transformer Engine's (Megatron-LM's expert tensor
parallelism): each rank keeps its shard of every expert's weight and the module communicates
nothing, so a column-parallel rank's output is its slice of the whole layer's, and the
row-parallel ranks' outputs sum to it. Checked on one process against the unsharded layer, on
fresh random inputs, in float32."""
import pytest
import torch

import te_core as te
from te_core.distributed import MODEL_PARALLEL_RNG_TRACKER_NAME, RNGStatesTracker

FP32 = dict(rtol=1.3e-6, atol=1e-5)
SPLITS = [5, 0, 7]  # an expert without tokens included


def _whole(seed=0):
    torch.manual_seed(seed)
    return te.GroupedLinear(3, 32, 16, bias=False, params_dtype=torch.float32)


def _shards(whole, mode, tp=2):
    shards = []
    for rank in range(tp):
        shard = te.GroupedLinear(3, 32, 16, bias=False, params_dtype=torch.float32, parallel_mode=mode, tp_size=tp)
        with torch.no_grad():
            for i in range(3):
                full = getattr(whole, f"weight{i}")
                rows, cols = (full.shape[0] // tp, None) if mode == "column" else (None, full.shape[1] // tp)
                part = (full[rank * rows:(rank + 1) * rows] if mode == "column"
                        else full[:, rank * cols:(rank + 1) * cols])
                getattr(shard, f"weight{i}").copy_(part)
        shards.append(shard)
    return shards


def test_column_parallel_ranks_compute_their_slice_of_the_output():
    whole = _whole()
    shards = _shards(whole, "column")
    assert shards[0].weight0.shape == (8, 32) and shards[0].out_features == 8
    assert (shards[0].weight0.tensor_model_parallel, shards[0].weight0.partition_dim) == (True, 0)
    x = torch.randn(sum(SPLITS), 32, requires_grad=True)
    want = whole(x, SPLITS)
    want.backward(torch.ones_like(want))
    grads = []
    for rank, shard in enumerate(shards):
        xr = x.detach().clone().requires_grad_()
        y = shard(xr, SPLITS)
        torch.testing.assert_close(y, want[:, rank * 8:(rank + 1) * 8], **FP32)
        y.backward(torch.ones_like(y))
        torch.testing.assert_close(shard.weight2.grad, whole.weight2.grad[rank * 8:(rank + 1) * 8], **FP32)
        grads.append(xr.grad)
    torch.testing.assert_close(grads[0] + grads[1], x.grad, **FP32)  # the caller sums the input gradient


def test_row_parallel_ranks_sum_to_the_output():
    whole = _whole(1)
    shards = _shards(whole, "row")
    assert shards[1].weight1.shape == (16, 16) and shards[1].in_features == 16
    assert shards[1].weight1.partition_dim == 1
    x = torch.randn(sum(SPLITS), 32)
    partial = [shard(x[:, rank * 16:(rank + 1) * 16], SPLITS) for rank, shard in enumerate(shards)]
    torch.testing.assert_close(partial[0] + partial[1], whole(x, SPLITS), **FP32)


def test_each_rank_draws_its_shard_from_the_tracker():
    """get_rng_state_tracker: the weights are initialized inside the tracker's fork, so ranks
    seeded differently there draw different shards while the default generator is left alone."""
    def build(seed, name=None):
        tracker = RNGStatesTracker()
        tracker.add(name or MODEL_PARALLEL_RNG_TRACKER_NAME, seed)
        torch.manual_seed(0)
        layer = te.GroupedLinear(2, 32, 16, bias=False, params_dtype=torch.float32, parallel_mode="column",
                                 tp_size=2, get_rng_state_tracker=lambda: tracker, rng_tracker_name=name)
        return layer, torch.rand(1)

    (a, after_a), (b, after_b), (c, _), (d, _) = build(10), build(11), build(10), build(10, "expert-rng")
    assert not torch.equal(a.weight0, b.weight0) and torch.equal(a.weight0, c.weight0)
    assert torch.equal(a.weight1, d.weight1)  # the state named by rng_tracker_name
    assert torch.equal(after_a, after_b)  # the default generator drew nothing for the weights


def test_bad_tensor_parallel_arguments_name_the_problem():
    with pytest.raises(ValueError, match="no bias with tp_size > 1"):
        te.GroupedLinear(2, 32, 16, parallel_mode="column", tp_size=2)
    with pytest.raises(ValueError, match="out_features=15 is not divisible by tp_size=2"):
        te.GroupedLinear(2, 32, 15, bias=False, parallel_mode="column", tp_size=2)
    with pytest.raises(ValueError, match="parallel_mode='diagonal'"):
        te.GroupedLinear(2, 32, 16, parallel_mode="diagonal")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        te.GroupedLinear(2, 32, 16, bias=False, parallel_mode="column", tp_group=object())
    layer = te.GroupedLinear(2, 32, 16, bias=False, parallel_mode="row", tp_size=2, sequence_parallel=True)
    assert layer.sequence_parallel and layer.tp_size == 2
    x = torch.randn(4, 16)
    torch.testing.assert_close(layer(x, [1, 3]), torch.cat([x[:1] @ layer.weight0.T, x[1:] @ layer.weight1.T]),
                               **FP32)  # no group needed: the module communicates nothing
