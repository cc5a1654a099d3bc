"""Column-, row- and sequence-parallel Linear, LayerNormLinear and LayerNormMLP on 2 and 4
gloo ranks: output and every gradient equal the single-process module with the same full
weights (fp32 / bf16 at their tolerances, each FP8 recipe at its format's)."""
from __future__ import annotations

import pytest
import torch

from te_core.modules import LayerNormLinear, LayerNormMLP, Linear

from ._parity import Case, check_parity, randomize, shard

MODULES = [("Linear", "column"), ("Linear", "row"), ("LayerNormLinear", "column"), ("LayerNormMLP", None)]

CASES = (
    [Case(kind, tp, mode, sp) for kind, mode in MODULES for tp in (2, 4) for sp in (False, True)]
    + [Case(kind, 2, mode, sp, dtype="bfloat16") for kind, mode in MODULES for sp in (False, True)]
    + [Case(kind, 2, mode, True, torch_autocast=True) for kind, mode in MODULES]
    + [Case("LayerNormMLP", 2, None, True, activation="swiglu"),
       Case("LayerNormMLP", 4, None, False, activation="swiglu")]
    + [Case(kind, 2, mode, True, recipe=recipe) for kind, mode in MODULES
       for recipe in ("delayed", "current", "block", "mxfp8")]
)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parallel_module_matches_single_process(pool, case):
    results = pool.run(check_parity, case)
    assert results[:case.tp] == [str(case)] * case.tp  # every rank of the group compared its shard


def _return_bias_and_inference(ctx):
    """Row-parallel return_bias=True hands back the summed output without the bias, and the bias;
    without autograd (inference) the same collectives run. The module carries a `_tp_group`
    attribute, as Megatron-LM's wrappers set one."""
    if ctx.rank >= 2:
        return None
    group, rank = ctx.group(2), ctx.rank
    full = Linear(64, 32, params_dtype=torch.float32)
    randomize(full, seed=3)
    part = Linear(64, 32, parallel_mode="row", tp_group=group, return_bias=True)
    part._tp_group = group  # as Megatron-LM's TE wrappers store their group: must not hide te-core's own
    with torch.no_grad():
        part.weight.copy_(full.weight.chunk(2, dim=1)[rank])
        part.bias.copy_(full.bias)
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
        y, bias = part(x.chunk(2, dim=-1)[rank])
        y_full = full(x)
    assert bias is part.bias
    torch.testing.assert_close(y + bias, y_full, rtol=1.3e-6, atol=1e-5)
    return True


def test_row_parallel_return_bias_without_autograd(pool):
    assert pool.run(_return_bias_and_inference)[:2] == [True, True]


def _full_and_part(ctx, make, parallel: dict, seed: int):
    """(the module whole, this rank's tensor-parallel shard of it over 2 ranks with the same
    weights, then three random (8, 2, 64) tensors: an input and two output gradients)."""
    full = make()
    randomize(full, seed=seed)
    part = make(tp_group=ctx.group(2), **parallel)
    with torch.no_grad():
        for name, p in part.named_parameters():
            p.copy_(shard(full.get_parameter(name), p.shape, ctx.rank, 2, gated=False))
    gen = torch.Generator().manual_seed(seed + 1)
    return (full, part, *(torch.randn(8, 2, 64, generator=gen) for _ in range(3)))


def _mlp_residual(ctx, sequence_parallel: bool):
    """LayerNormMLP(return_residual=True): the residual is this rank's input, and its gradient
    joins the input's after the ranks' parts are summed, not before."""
    if ctx.rank >= 2:
        return None
    rank = ctx.rank
    full, part, x, dy, d_res = _full_and_part(ctx, lambda **kw: LayerNormMLP(64, 128, **kw),
                                              dict(set_parallel_mode=True, sequence_parallel=sequence_parallel), 4)
    local = (lambda t: t.chunk(2, dim=0)[rank]) if sequence_parallel else (lambda t: t)
    x_full, x_part = x.clone().requires_grad_(), local(x).clone().requires_grad_()
    y, residual = full(x_full, return_residual=True)
    torch.autograd.backward((y, residual), (dy, d_res))
    y_part, residual_part = part(x_part, return_residual=True)
    torch.autograd.backward((y_part, residual_part), (local(dy), local(d_res)))
    torch.testing.assert_close(residual_part, local(x), rtol=0, atol=0)
    torch.testing.assert_close(y_part, local(y), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(x_part.grad, local(x_full.grad), rtol=1.3e-6, atol=1e-5)
    return True


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_mlp_residual_under_tensor_parallelism(pool, sequence_parallel):
    assert pool.run(_mlp_residual, sequence_parallel)[:2] == [True, True]


def _norm_output(ctx, kind: str, sequence_parallel: bool):
    """return_layernorm_output=True: the norm output (this rank's shard of it under sequence
    parallelism, as Transformer Engine returns it) and the gradients of the input and of the
    norm's weight, with a gradient flowing into that output too, equal the single process's."""
    if ctx.rank >= 2:
        return None
    group, rank = ctx.group(2), ctx.rank
    make = {"LayerNormLinear": lambda **kw: LayerNormLinear(64, 64, return_layernorm_output=True, **kw),
            "LayerNormMLP": lambda **kw: LayerNormMLP(64, 128, return_layernorm_output=True, **kw)}[kind]
    parallel = dict(parallel_mode="column") if kind == "LayerNormLinear" else dict(set_parallel_mode=True)
    full, part, x, dy, d_ln = _full_and_part(ctx, make, dict(sequence_parallel=sequence_parallel, **parallel), 7)
    local = (lambda t: t.chunk(2, dim=0)[rank]) if sequence_parallel else (lambda t: t)
    # LayerNormLinear is column-parallel: its output holds this rank's features of the whole sequence
    out_part = (lambda t: t.chunk(2, dim=-1)[rank]) if kind == "LayerNormLinear" else local
    x_full, x_part = x.clone().requires_grad_(), local(x).clone().requires_grad_()
    y, ln_out = full(x_full)
    torch.autograd.backward((y, ln_out), (dy, d_ln))
    y_part, ln_part = part(x_part)
    torch.autograd.backward((y_part, ln_part), (out_part(dy), local(d_ln)))
    tol = dict(rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(ln_part, local(ln_out), **tol)
    torch.testing.assert_close(y_part, out_part(y), **tol)
    torch.testing.assert_close(x_part.grad, local(x_full.grad), **tol)
    weight_grad = part.layer_norm_weight.grad
    if sequence_parallel:  # each rank holds its shard's part, summed by the training loop
        torch.distributed.all_reduce(weight_grad, group=group)
    torch.testing.assert_close(weight_grad, full.layer_norm_weight.grad, **tol)
    return True


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_norm_output_under_tensor_parallelism(pool, kind, sequence_parallel):
    assert pool.run(_norm_output, kind, sequence_parallel)[:2] == [True, True]


def _gathered_norm_output(ctx, kind: str, gathered: dict):
    """return_layernorm_output_gathered=True under sequence parallelism (Transformer Engine's):
    the norm output comes back gathered, the whole sequence's, on every rank; the gradients each
    rank gives it are summed over the ranks and join each rank's input shard's gradient."""
    if ctx.rank >= 2:
        return None
    rank = ctx.rank
    make = {"LayerNormLinear": lambda **kw: LayerNormLinear(64, 64, return_layernorm_output=True, **kw),
            "LayerNormMLP": lambda **kw: LayerNormMLP(64, 128, return_layernorm_output=True, **kw)}[kind]
    parallel = dict(parallel_mode="column") if kind == "LayerNormLinear" else dict(set_parallel_mode=True)
    full, part, x, dy, d_ln = _full_and_part(
        ctx, lambda **kw: make(**(gathered if kw else {}), **kw),
        dict(sequence_parallel=True, **parallel), 9)
    local = lambda t: t.chunk(2, dim=0)[rank]  # noqa: E731
    out_part = (lambda t: t.chunk(2, dim=-1)[rank]) if kind == "LayerNormLinear" else local
    x_full, x_part = x.clone().requires_grad_(), local(x).clone().requires_grad_()
    y, ln_out = full(x_full)
    torch.autograd.backward((y, ln_out), (dy, 3 * d_ln))  # the ranks' gradients below: d_ln and 2 * d_ln
    y_part, ln_gathered = part(x_part)
    torch.autograd.backward((y_part, ln_gathered), (out_part(dy), (rank + 1) * d_ln))
    tol = dict(rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(ln_gathered, ln_out, **tol)
    torch.testing.assert_close(x_part.grad, local(x_full.grad), **tol)
    return True


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_gathered_norm_output_under_sequence_parallelism(pool, kind):
    assert pool.run(_gathered_norm_output, kind, dict(return_layernorm_output_gathered=True))[:2] == [True, True]


def _unsplit_with_group(ctx, return_layernorm_output: bool):
    """LayerNormLinear(parallel_mode=None) given a 2-rank tp_group splits nothing and runs no
    collective, as in Transformer Engine: its output and every gradient (the norm's weight and
    bias included, and the input's with a gradient flowing into the returned norm output) equal
    the module's without a group. They came out tp_size times too large."""
    if ctx.rank >= 2:
        return None
    make = lambda **kw: LayerNormLinear(64, 64, return_layernorm_output=return_layernorm_output, **kw)  # noqa: E731
    full, part, x, dy, d_ln = _full_and_part(ctx, make, {}, 11)
    assert part.tp_size == 2 and part.parallel_mode is None
    grads = []
    for module in (full, part):
        xi = x.clone().requires_grad_()
        out = module(xi)
        torch.autograd.backward(list(out) if return_layernorm_output else [out],
                                [dy, d_ln] if return_layernorm_output else [dy])
        grads.append([xi.grad, module.layer_norm_weight.grad, module.layer_norm_bias.grad, module.weight.grad])
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    return True


@pytest.mark.parametrize("return_layernorm_output", [False, True])
def test_layernorm_linear_without_parallel_mode_splits_nothing(pool, return_layernorm_output):
    assert pool.run(_unsplit_with_group, return_layernorm_output)[:2] == [True, True]


def _split_under_tp(ctx):
    if ctx.rank >= 2:
        return None
    messages = []
    for make in (Linear, LayerNormLinear):
        try:
            make(32, 64, parameters_split={"query": 32, "value": 32}, parallel_mode="column", tp_group=ctx.group(2))
        except NotImplementedError as err:
            messages.append(str(err))
    return messages


def test_parameters_split_under_tensor_parallelism_names_what_is_not_supported(pool):
    """The whole out_features' split sizes, as Transformer Engine takes them, are refused for
    tensor parallelism itself, not reported as not summing to this rank's rows."""
    for messages in pool.run(_split_under_tp)[:2]:
        assert messages == [f"{m}: parameters_split with tp_size > 1 is not supported yet"
                            for m in ("Linear", "LayerNormLinear")]
