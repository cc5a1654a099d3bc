"""Transformer Engine's fusible ops.BasicLinear and ops.Bias with tensor parallelism on gloo ranks:
each rank's operation, built on meta and given its shard of a whole layer's weight (as Megatron-LM
gives it), computes its share of the whole layer's output and gradients (float32); and its
collectives ops.AllReduce and ReduceScatter (after Megatron-LM's FC2), and AllGather; an AllReduce
built before torch.distributed is initialized, as Transformer Engine's can be."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from te_core.modules import Linear
from te_core.modules.fusible_ops import AllGather, AllReduce, BasicLinear, Bias, ReduceScatter, Sequential
from te_core.modules.fusible_ops import Linear as Linear_

from ._parity import FP32, randomize

IN, OUT, TOKENS = 64, 32, 16


def _parallel_basic_linear(ctx, mode: str, sequence_parallel: bool):
    """The operation's output and input / weight gradients against the whole Linear(bias=False)."""
    if ctx.rank >= 2:
        return None
    rank, group = ctx.rank, ctx.group(2)
    whole = Linear(IN, OUT, bias=False, params_dtype=torch.float32)
    randomize(whole, seed=7)
    op = BasicLinear(IN, OUT, device="meta", tensor_parallel_mode=mode, tensor_parallel_group=group,
                     sequence_parallel=sequence_parallel)
    dim = 0 if mode == "column" else 1
    op.weight = torch.nn.Parameter(whole.weight.detach().chunk(2, dim)[rank].clone())
    gen = torch.Generator().manual_seed(8)
    x, dy = torch.randn(TOKENS, IN, generator=gen), torch.randn(TOKENS, OUT, generator=gen)
    x_whole = x.clone().requires_grad_()
    want = whole(x_whole)
    want.backward(dy)
    # this rank's input: the whole (column), its features (row), or its rows under sequence parallelism
    split = {"column": lambda t: t, "row": lambda t: t.chunk(2, -1)[rank]}[mode]
    rows = (lambda t: t.chunk(2, 0)[rank]) if sequence_parallel else (lambda t: t)
    x_op = (rows(x) if mode == "column" else split(x)).clone().requires_grad_()
    y = op(x_op)
    out = want.detach().chunk(2, -1)[rank] if mode == "column" else rows(want.detach())
    torch.testing.assert_close(y, out, **FP32)
    y.backward(dy.chunk(2, -1)[rank] if mode == "column" else rows(dy))
    x_grad = rows(x_whole.grad) if mode == "column" else split(x_whole.grad)
    torch.testing.assert_close(x_op.grad, x_grad, **FP32)
    torch.testing.assert_close(op.weight.grad, whole.weight.grad.chunk(2, dim)[rank], **FP32)
    assert (op.tensor_parallel_mode, op.tensor_parallel_size, op.local_in_features, op.local_out_features) == (
        mode, 2, IN // (2 if mode == "row" else 1), OUT // (2 if mode == "column" else 1))
    return True


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_parallel_basic_linear_matches_the_whole_layer(pool, mode, sequence_parallel):
    assert pool.run(_parallel_basic_linear, mode, sequence_parallel)[:2] == [True, True]


def _parallel_linear(ctx, mode: str, sequence_parallel: bool):
    """ops.Linear(in, out) with bias over two ranks, given its shards of a whole layer's weight and
    bias (under "row", TE's layout: a bias per rank, the layer's bias their sum) against float64:
    the output, and the input, weight and bias gradients of this rank's shard."""
    if ctx.rank >= 2:
        return None
    rank, group = ctx.rank, ctx.group(2)
    gen = torch.Generator().manual_seed(12)
    weight, biases = torch.randn(OUT, IN, generator=gen) * IN ** -0.5, torch.randn(2, OUT, generator=gen)
    x, dy = torch.randn(TOKENS, IN, generator=gen), torch.randn(TOKENS, OUT, generator=gen)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, weight, biases))
    want = x64 @ w64.T + (b64.sum(0) if mode == "row" else b64[0])
    want.backward(dy.double())
    op = Linear_(IN, OUT, tensor_parallel_mode=mode, tensor_parallel_group=group, sequence_parallel=sequence_parallel)
    cols, rows = (lambda t: t.chunk(2, -1)[rank]), (lambda t: t.chunk(2, 0)[rank] if sequence_parallel else t)
    with torch.no_grad():
        op.weight.copy_(cols(weight) if mode == "row" else weight.chunk(2, 0)[rank])
        op.bias.copy_(biases[rank] if mode == "row" else cols(biases[0]))
    x_op = (cols(x) if mode == "row" else rows(x)).clone().requires_grad_()
    y = Sequential(op)(x_op)
    torch.testing.assert_close(y.double(), rows(want.detach()) if mode == "row" else cols(want.detach()), **FP32)
    y.backward(rows(dy) if mode == "row" else cols(dy))
    torch.testing.assert_close(x_op.grad.double(), cols(x64.grad) if mode == "row" else rows(x64.grad), **FP32)
    want_dw, want_db = (cols(w64.grad), b64.grad[rank]) if mode == "row" else (w64.grad.chunk(2, 0)[rank],
                                                                              cols(b64.grad[0]))
    torch.testing.assert_close(op.weight.grad.double(), want_dw, **FP32)
    torch.testing.assert_close(op.bias.grad.double(), want_db, **FP32)
    return [type(m).__name__ for m in op.basic_ops]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("mode", ["column", "row"])
def test_parallel_ops_linear_matches_the_whole_layer(pool, mode, sequence_parallel):
    last = {"column": [], "row": ["ReduceScatter" if sequence_parallel else "AllReduce"]}[mode]
    assert pool.run(_parallel_linear, mode, sequence_parallel)[:2] == [["BasicLinear", "Bias"] + last] * 2


def _default_group_and_bias(ctx):
    """TE's default group, the world's; a tensor-parallel Bias holds its share of the values."""
    linear = BasicLinear(IN, OUT, tensor_parallel_mode="column")
    bias = Bias(OUT, tensor_parallel=True, tensor_parallel_group=ctx.group(2) if ctx.rank < 2 else None)
    return linear.tensor_parallel_size, linear.weight.shape, bias.local_size, bias.bias.shape


def test_default_group_is_the_world_and_bias_is_split(pool):
    results = pool.run(_default_group_and_bias)
    assert results[:2] == [(4, (OUT // 4, IN), OUT // 2, (OUT // 2,))] * 2
    assert results[2:] == [(4, (OUT // 4, IN), OUT // 4, (OUT // 4,))] * 2


def _fc2_with_collective(ctx, sequence_parallel: bool):
    """Megatron-LM's FC2 above one tensor-parallel rank: Sequential(BasicLinear over this rank's input
    features, AllReduce), or ReduceScatter under sequence parallelism, against the unsharded layer in
    float64: the output (this rank's rows under sequence parallelism), the input and weight gradients."""
    if ctx.rank >= 2:
        return None
    rank, group = ctx.rank, ctx.group(2)
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(OUT, IN, generator=gen) * IN ** -0.5
    x, dy = torch.randn(TOKENS, IN, generator=gen), torch.randn(TOKENS, OUT, generator=gen)
    x64, w64 = x.double().requires_grad_(), weight.double().requires_grad_()
    want = x64 @ w64.T
    want.backward(dy.double())
    linear = BasicLinear(IN // 2, OUT, device="meta")  # (Megatron-LM builds FC2's without tensor_parallel_mode)
    linear.weight = torch.nn.Parameter(weight.chunk(2, 1)[rank].clone())
    seq = Sequential(linear, ReduceScatter(group) if sequence_parallel else AllReduce(group))
    x_op = x.chunk(2, 1)[rank].clone().requires_grad_()
    y = seq(x_op)
    rows = (lambda t: t.chunk(2, 0)[rank]) if sequence_parallel else (lambda t: t)
    torch.testing.assert_close(y.double(), rows(want.detach()), **FP32)
    y.backward(rows(dy))
    torch.testing.assert_close(x_op.grad.double(), x64.grad.chunk(2, 1)[rank], **FP32)
    torch.testing.assert_close(linear.weight.grad.double(), w64.grad.chunk(2, 1)[rank], **FP32)
    return seq[1].process_group_size


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["all-reduce", "sp-reduce-scatter"])
def test_fc2_with_all_reduce_or_reduce_scatter_matches_the_whole_layer(pool, sequence_parallel):
    assert pool.run(_fc2_with_collective, sequence_parallel)[:2] == [2, 2]


def _all_gather(ctx):
    """AllGather: the ranks' blocks concatenated in rank order (exactly); the gradient is the sum of
    the ranks' output gradients, of which each rank keeps its block (float64's)."""
    if ctx.rank >= 2:
        return None
    rank, group = ctx.rank, ctx.group(2)
    whole = torch.randn(TOKENS, 3, IN, generator=torch.Generator().manual_seed(10))
    dys = [torch.randn(TOKENS, 3, IN, generator=torch.Generator().manual_seed(11 + r)) for r in range(2)]
    x = whole.chunk(2, 0)[rank].clone().requires_grad_()
    y = AllGather(group)(x)
    assert torch.equal(y, whole)
    y.backward(dys[rank])
    torch.testing.assert_close(x.grad.double(), (dys[0].double() + dys[1].double()).chunk(2, 0)[rank], **FP32)
    return True


def test_all_gather_forward_and_backward(pool):
    assert pool.run(_all_gather)[:2] == [True, True]


def _groups_of_one_and_the_world(ctx):
    """Over a group of one rank each collective is the identity (gradient included); without a
    group they run over the world's ranks (AllReduce: the sum of all four ranks' inputs, its gradient
    passed on unchanged whatever reduce_in_backward says, as in TE)."""
    alone = [dist.new_group([r]) for r in range(ctx.world)][ctx.rank]  # (every rank creates every group)
    inputs = [torch.randn(4, IN, generator=torch.Generator().manual_seed(20 + r)) for r in range(ctx.world)]
    x = inputs[ctx.rank].clone().requires_grad_()
    dy = torch.randn(4, IN)
    for op in (AllReduce(alone), ReduceScatter(alone), AllGather(alone)):
        x.grad = None
        y = op(x)
        assert torch.equal(y, x) and op.process_group_size == 1
        y.backward(dy)
        assert torch.equal(x.grad, dy)
    for reduce_in_backward in (True, False):  # TE's flag changes nothing: the gradient passes on either way
        world, x.grad = AllReduce(reduce_in_backward=reduce_in_backward), None
        summed = world(x)
        torch.testing.assert_close(summed.double(), sum(t.double() for t in inputs), **FP32)
        summed.backward(dy)
        assert torch.equal(x.grad, dy)
    return world.process_group_size


def test_groups_of_one_rank_are_the_identity_and_the_default_is_the_world(pool):
    assert pool.run(_groups_of_one_and_the_world) == [4] * 4


def _built_before_init(ctx, op):
    """An AllReduce built (and pickled) in the test's process before torch.distributed was
    initialized there: its first forward reads the group (the world's four ranks), as TE's does;
    given a pair's group afterwards, it sums over that pair. The gradient passes unchanged."""
    inputs = [torch.randn(3, IN, generator=torch.Generator().manual_seed(30 + r)) for r in range(ctx.world)]
    x = inputs[ctx.rank].clone().requires_grad_()
    y = op(x)
    torch.testing.assert_close(y.double(), sum(t.double() for t in inputs), **FP32)
    dy = torch.randn(3, IN)
    y.backward(dy)
    assert torch.equal(x.grad, dy)
    if ctx.rank >= 2:
        return op.process_group_size, None
    op.process_group = ctx.group(2)
    pair = op(inputs[ctx.rank])
    torch.testing.assert_close(pair.double(), inputs[0].double() + inputs[1].double(), **FP32)
    return 4, op.process_group_size


def test_all_reduce_built_before_init_process_group(pool):
    assert not dist.is_initialized()  # (the pool's ranks initialize theirs; this process never does)
    op = AllReduce()
    assert "the world group, once torch.distributed is initialized" in repr(op)
    assert pool.run(_built_before_init, op) == [(4, 2)] * 2 + [(4, None)] * 2


def test_collectives_without_torch_distributed_say_so():
    """Without an initialized torch.distributed, AllReduce's forward (where TE's reads the world
    group's size) and the construction of ReduceScatter and AllGather (where TE's read it) say what
    to do instead of failing inside torch.distributed."""
    assert not dist.is_initialized()
    op = AllReduce(reduce_in_backward=False)
    with pytest.raises(RuntimeError, match="ops.AllReduce: process_group was not given, whose default is the world "
                                           r"group, but torch.distributed is not initialized; call "
                                           r"torch.distributed.init_process_group\(\) first"):
        op(torch.randn(4, IN))
    for op_type in (ReduceScatter, AllGather):
        with pytest.raises(RuntimeError, match=f"ops.{op_type.__name__}: process_group was not given.* not "
                                               "initialized"):
            op_type()


def _collective_errors(ctx):
    """A first dimension that the ranks cannot share, and ranks whose inputs differ, fail with a
    message saying so on every rank (not inside the collective)."""
    if ctx.rank >= 2:
        return None
    group = ctx.group(2)
    with pytest.raises(ValueError, match=r"ops.ReduceScatter: the input's first dimension \(5, shape \(5, 64\)\) "
                                         r"must be divisible by the 2 ranks of process_group"):
        ReduceScatter(group)(torch.randn(5, IN))
    with pytest.raises(ValueError, match=r"ops.AllGather: input must have at least one dimension"):
        AllGather(group)(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"ops.AllGather: the tensor-parallel ranks disagree .*rank 0: shape "
                                         r"\(4, 64\).*rank 1: shape \(6, 64\)"):
        AllGather(group)(torch.randn(4 + 2 * ctx.rank, IN))
    return True


def test_collectives_say_what_is_wrong(pool):
    assert pool.run(_collective_errors)[:2] == [True, True]
