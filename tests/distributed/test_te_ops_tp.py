"""Transformer Engine's fusible ops.BasicLinear and ops.Bias with tensor parallelism on gloo ranks:
each rank's operation, built on meta and given its shard of a whole layer's weight (as Megatron-LM
gives it), computes its share of the whole layer's output and gradients (float32)."""
from __future__ import annotations

import pytest
import torch

from te_core.modules import Linear
from te_core.modules.fusible_ops import BasicLinear, Bias

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


def _default_group_and_bias(ctx):
    """TE's default group, the world's; a tensor-parallel Bias holds its share of the values."""
    linear = BasicLinear(IN, OUT, tensor_parallel_mode="column")
    bias = Bias(OUT, tensor_parallel=True, tensor_parallel_group=ctx.group(2) if ctx.rank < 2 else None)
    return linear.tensor_parallel_size, linear.weight.shape, bias.local_size, bias.bias.shape


def test_default_group_is_the_world_and_bias_is_split(pool):
    results = pool.run(_default_group_and_bias)
    assert results[:2] == [(4, (OUT // 4, IN), OUT // 2, (OUT // 2,))] * 2
    assert results[2:] == [(4, (OUT // 4, IN), OUT // 4, (OUT // 4,))] * 2
