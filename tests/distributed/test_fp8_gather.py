"""FP8 all-gather of column-parallel inputs under sequence parallelism, on 2 gloo ranks.

Delayed and current scaling quantize each shard with the whole input's scale and gather FP8
bytes: a Linear's output and every gradient are bit-identical to the rank's shard of the module
run on the whole input (gathered in high precision, then quantized), LayerNormLinear's output
and GEMM gradients too, and the forward all-gathers move 1 byte per element, half of BF16's.
Recipes and settings that cannot share one scale gather in high precision. (The comparison with
the single-process module at the recipes' tolerances is test_tensor_parallel's tp2-sp cases,
which take the same path.) torchrun_parity runs the same checks on real devices."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from te_core.distributed.comm_bytes import AllGatherBytes
from te_core.modules import LayerNormLinear, Linear
from te_core.quantization import autocast
from te_core.recipe import DelayedScaling

from ._parity import BF16_SUMMED, RECIPES, Case, _compare, _run, build, randomize

SEQ, BATCH, HIDDEN, FFN = 16, 2, 64, 128
# delayed scales that no amax reduction keeps in step: each rank's scale is its own
GATHER_RECIPES = {**RECIPES, "delayed-local": lambda reduce: DelayedScaling(amax_history_len=4, reduce_amax=False)}


def _copy_shards(part, plain, full, rank: int) -> None:
    """The rank's column block of `full`'s parameters into `part` and `plain` (norm weights whole)."""
    with torch.no_grad():
        for module in (part, plain):
            for name, p in module.named_parameters():
                whole = full.get_parameter(name)
                p.copy_(whole if whole.shape == p.shape else whole.chunk(2)[rank])


def _inputs(dtype: torch.dtype, device):
    """x (SEQ, BATCH, HIDDEN) and the output gradient of a rank's FFN // 2 features."""
    gen = torch.Generator().manual_seed(11)
    x, dy = torch.randn(SEQ, BATCH, HIDDEN, generator=gen), torch.randn(SEQ, BATCH, FFN // 2, generator=gen)
    return x.to(device, dtype), dy.to(device, dtype)


def _both_runs(full, part, plain, ctx, recipe_name: str):
    """Two steps (the second with the delayed scales the first one's amaxes made) of the
    sequence-parallel module `part` on the rank's shard of x and of `plain` on the whole x, both
    holding the rank's block of `full`: their (y, dx, grads), then x and dy. Checks what the two
    share bit for bit: the output and the GEMM's weight and bias gradients. `plain`'s dx, the
    rank's share of the whole input's gradient, comes back summed over the ranks."""
    group, rank = ctx.group(2), ctx.rank
    _copy_shards(part, plain, full, rank)
    x, dy = _inputs(torch.bfloat16, full.weight.device)
    recipe = RECIPES[recipe_name](True)
    ours, ref = _run(part, x.chunk(2)[rank], dy, recipe, group, steps=2), _run(plain, x, dy, recipe, group, steps=2)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    for name in ("weight", "bias"):
        torch.testing.assert_close(ours[2][name], ref[2][name], rtol=0, atol=0, msg=name)
    dist.all_reduce(ref[1], group=group)
    return ours, ref, x, dy


def check_bit_identical(ctx, recipe_name: str):
    """Linear: the sequence-parallel module against the plain module of the same shard fed the
    whole input: every result bit for bit."""
    if ctx.rank >= 2:
        return None
    group, rank, dtype = ctx.group(2), ctx.rank, torch.bfloat16
    full = Linear(HIDDEN, FFN, params_dtype=dtype)
    randomize(full, seed=7)
    part = Linear(HIDDEN, FFN, parallel_mode="column", tp_group=group, sequence_parallel=True, params_dtype=dtype)
    plain = Linear(HIDDEN, FFN // 2, params_dtype=dtype)
    (y, dx, _), (_, dx_ref, _), x, dy = _both_runs(full, part, plain, ctx, recipe_name)
    torch.testing.assert_close(dx, dx_ref.chunk(2)[rank], rtol=0, atol=0)
    assert not torch.equal(y, _run(plain, x, dy, None)[0]), "the output equals high precision: FP8 did not run"
    return True


def check_norm_then_gather(ctx, recipe_name: str):
    """LayerNormLinear: the norm runs on the shard and its FP8 output is gathered. The output and
    the GEMM's weight and bias gradients equal those of the plain module fed the whole input bit
    for bit (the norm works row by row, and the FP8 bytes and scale are the same). The input's and
    the norm's gradients are summed over the ranks before the norm's backward instead of after
    it, so they agree at bf16's tolerance."""
    if ctx.rank >= 2:
        return None
    group, rank, dtype = ctx.group(2), ctx.rank, torch.bfloat16
    full = LayerNormLinear(HIDDEN, FFN, params_dtype=dtype)
    randomize(full, seed=8)
    part = build(Case("LayerNormLinear", 2, "column", sp=True), dtype, group)
    plain = LayerNormLinear(HIDDEN, FFN // 2, params_dtype=dtype)
    (_, dx, grads), (_, dx_ref, grads_ref), _, _ = _both_runs(full, part, plain, ctx, recipe_name)
    _compare(dx, dx_ref.chunk(2)[rank], BF16_SUMMED, f"{recipe_name} dx", scaled=True)
    for name in ("layer_norm_weight", "layer_norm_bias"):  # each rank's part, summed (param.sequence_parallel)
        for grad in (grads[name], grads_ref[name]):
            dist.all_reduce(grad, group=group)
        _compare(grads[name], grads_ref[name], BF16_SUMMED, f"{recipe_name} d{name}", scaled=True)
    return True


def check_gathered_bytes(ctx, kind: str, recipe_name, dtype_name: str, bytes_per_element: int):
    """The all-gather bytes this rank sends in a forward of `kind` are bytes_per_element per
    element of its input shard."""
    if ctx.rank >= 2:
        return None
    group, rank, dtype = ctx.group(2), ctx.rank, getattr(torch, dtype_name)
    part = build(Case(kind, 2, None if kind == "LayerNormMLP" else "column", sp=True), dtype, group)
    randomize(part, seed=5)
    x = _inputs(dtype, next(part.parameters()).device)[0].chunk(2)[rank].requires_grad_()
    part(x)  # the first forward also checks that the ranks agree on the input's shape (a small all-gather)
    recipe = None if recipe_name is None else GATHER_RECIPES[recipe_name](True)
    with AllGatherBytes() as counted:
        with autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=group):
            part(x)
    assert counted.sent == bytes_per_element * x.numel(), (kind, recipe_name, dtype_name, counted.sent, x.numel())
    return True


BYTES_CASES = [
    ("Linear", None, "bfloat16", 2), ("Linear", None, "float32", 4),
    ("Linear", "delayed", "bfloat16", 1), ("Linear", "current", "bfloat16", 1), ("Linear", "delayed", "float32", 1),
    # block and MXFP8 column-wise scales span the shards; delayed scales without reduce_amax differ per rank
    ("Linear", "block", "bfloat16", 2), ("Linear", "mxfp8", "bfloat16", 2), ("Linear", "delayed-local", "bfloat16", 2),
    # the norm's output, gathered: FP8 from the fused norm cast (delayed) or cast after the norm (current)
    ("LayerNormLinear", None, "bfloat16", 2), ("LayerNormLinear", "delayed", "bfloat16", 1),
    ("LayerNormLinear", "current", "bfloat16", 1), ("LayerNormLinear", "delayed-local", "bfloat16", 2),
    ("LayerNormMLP", None, "bfloat16", 2), ("LayerNormMLP", "delayed", "bfloat16", 1),
    ("LayerNormMLP", "current", "bfloat16", 1), ("LayerNormMLP", "block", "bfloat16", 2),
]
# (check, arguments): what torchrun_parity runs on 2 devices
CHECKS = ([(check_bit_identical, (r,)) for r in ("delayed", "current")]
          + [(check_norm_then_gather, (r,)) for r in ("delayed", "current")]
          + [(check_gathered_bytes, case) for case in BYTES_CASES])


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_gather_is_bit_identical_to_quantizing_the_gathered_input(pool, recipe):
    assert pool.run(check_bit_identical, recipe)[:2] == [True, True]


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_norm_output_gathered_in_fp8_matches_the_whole_input(pool, recipe):
    assert pool.run(check_norm_then_gather, recipe)[:2] == [True, True]


@pytest.mark.parametrize("case", BYTES_CASES, ids=str)
def test_fp8_gather_moves_one_byte_per_element(pool, case):
    assert pool.run(check_gathered_bytes, *case)[:2] == [True, True]
