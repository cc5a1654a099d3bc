"""Tensor-parallel module against the single-process module with the same full weights: the
forward output and every gradient of each rank's shard, on fresh random inputs.

Runs inside the ranks of the process pool (see _pool.py): every rank builds the full module and
its reference result from the same seeds, then its own shard of the parallel module."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from te_core.ops import GATED_ACTIVATIONS
from te_core.modules import LayerNormLinear, LayerNormMLP, Linear
from te_core.quantization import autocast
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

SEQ, BATCH, HIDDEN, FFN = 16, 2, 64, 128
FP32 = dict(rtol=1.3e-6, atol=1e-5)
# bf16 relative to the tensor's largest magnitude: each rank's partial sum is rounded to bf16
# before the ranks' parts are summed, so an entry's error is that of its parts (as large as the
# tensor's typical entries), not of the entry itself, which cancellation can make small
BF16_SUMMED = dict(rtol=1.6e-2, atol=1.6e-2)
E4M3 = dict(rtol=0.125, atol=0.0675)
E5M2 = dict(rtol=0.25, atol=0.125)
# recipe(reduce_amax): the single-process reference must not reduce over the default group
RECIPES = {"delayed": lambda reduce: DelayedScaling(amax_history_len=4, reduce_amax=reduce),
           "current": lambda reduce: Float8CurrentScaling(), "block": lambda reduce: Float8BlockScaling(),
           "mxfp8": lambda reduce: MXFP8BlockScaling()}


@dataclass(frozen=True)
class Case:
    kind: str  # "Linear", "LayerNormLinear", "LayerNormMLP"
    tp: int
    mode: Optional[str] = "column"  # Linear / LayerNormLinear: "column" or "row"
    sp: bool = False
    dtype: str = "float32"
    recipe: Optional[str] = None  # a key of RECIPES; None: high precision
    activation: str = "gelu"
    torch_autocast: bool = False  # float32 parameters and inputs, computed in bf16 under torch.autocast

    def __str__(self) -> str:
        mode = "" if self.kind == "LayerNormMLP" else f"-{self.mode}"
        return (f"{self.kind}{mode}-tp{self.tp}{'-sp' if self.sp else ''}-{self.recipe or self.dtype}"
                f"{'-' + self.activation if self.activation != 'gelu' else ''}"
                f"{'-torch.autocast' if self.torch_autocast else ''}")


def build(case: Case, dtype: torch.dtype, group=None):
    """The module of `case`: the full one without a group, else this rank's tensor-parallel shard."""
    tp = {} if group is None else dict(tp_group=group, tp_size=case.tp, sequence_parallel=case.sp)
    if case.kind == "LayerNormMLP":
        mlp_tp = dict(tp, set_parallel_mode=True) if tp else {}
        return LayerNormMLP(HIDDEN, FFN, activation=case.activation, params_dtype=dtype, **mlp_tp)
    sizes = (FFN, HIDDEN) if case.mode == "row" else (HIDDEN, FFN)
    cls = Linear if case.kind == "Linear" else LayerNormLinear
    return cls(*sizes, parallel_mode=case.mode, params_dtype=dtype, **tp)


def randomize(module, seed: int) -> None:
    """Every parameter random and nonzero, scaled by 1/sqrt(fan-in) so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            values = torch.randn(p.shape, generator=gen)
            if "layer_norm" in name:
                values = 1 + 0.2 * values if name.endswith("weight") else 0.2 * values
            elif p.dim() == 2:
                values = values / p.shape[1] ** 0.5
            p.copy_(values.to(p.dtype))


def shard(full: torch.Tensor, shape, rank: int, tp: int, gated: bool) -> torch.Tensor:
    """This rank's block of a full parameter (the whole of a replicated one); a gated fc1 holds
    its block of each half."""
    if tuple(full.shape) == tuple(shape):
        return full
    dim = next(d for d, (a, b) in enumerate(zip(full.shape, shape)) if a != b)
    if gated:
        return torch.cat([half.chunk(tp, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(tp, dim)[rank]


def _input_slice(case: Case, full: torch.Tensor, rank: int) -> torch.Tensor:
    if case.kind == "Linear" and case.mode == "row":  # features split; the sequence is whole
        return full.chunk(case.tp, -1)[rank]
    return full.chunk(case.tp, 0)[rank] if case.sp else full


def _output_slice(case: Case, full: torch.Tensor, rank: int) -> torch.Tensor:
    if case.kind != "LayerNormMLP" and case.mode == "column":  # features split; the sequence gathered
        return full.chunk(case.tp, -1)[rank]
    return full.chunk(case.tp, 0)[rank] if case.sp else full


def _run(module, x, dy, recipe, group=None, steps: int = 1, bf16_autocast: bool = False):
    """Output, input gradient and parameter gradients after `steps` iterations (FP8 recipes need
    the first to calibrate delayed scales)."""
    for _ in range(steps):
        module.zero_grad(set_to_none=True)
        x_in = x.detach().clone().requires_grad_(True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16_autocast):
            if recipe is None:
                y = module(x_in)
            else:
                with autocast(recipe=recipe, amax_reduction_group=group):
                    y = module(x_in)
        y.backward(dy.to(y.dtype))
    return y.detach(), x_in.grad, {n: p.grad for n, p in module.named_parameters()}


def _compare(actual, expected, tol, what: str, scaled: bool) -> None:
    if scaled:  # low precision: errors relative to the tensor's magnitude
        scale = expected.abs().max().clamp_min(1e-12)
        actual, expected = actual / scale, expected / scale
    torch.testing.assert_close(actual.float(), expected.float(), **tol, msg=lambda m: f"{what}: {m}")


def check_parity(ctx, case: Case) -> Optional[str]:
    """Runs on every rank; ranks after the first case.tp return at once."""
    if ctx.rank >= case.tp:
        return None
    group = ctx.group(case.tp)
    rank, dtype = dist.get_rank(group), getattr(torch, case.dtype)
    recipe = None if case.recipe is None else RECIPES[case.recipe](True)
    steps = 1 if recipe is None else 2
    full = build(case, dtype)
    randomize(full, seed=7)
    in_features = FFN if case.kind == "Linear" and case.mode == "row" else HIDDEN
    gen, device = torch.Generator().manual_seed(11), next(full.parameters()).device
    x = torch.randn(SEQ, BATCH, in_features, generator=gen).to(device, dtype)
    y_shape = (SEQ, BATCH, FFN if case.kind != "LayerNormMLP" and case.mode == "column" else HIDDEN)
    dy = torch.randn(y_shape, generator=gen).to(device, dtype)
    y_ref, dx_ref, grads_ref = _run(full, x, dy, recipe and RECIPES[case.recipe](False), steps=steps,
                                    bf16_autocast=case.torch_autocast)

    part = build(case, dtype, group)
    gated = case.activation in GATED_ACTIVATIONS
    with torch.no_grad():
        for name, p in part.named_parameters():
            p.copy_(shard(dict(full.named_parameters())[name], p.shape, rank, case.tp, gated and "fc1" in name))
    y, dx, grads = _run(part, _input_slice(case, x, rank), _output_slice(case, dy, rank), recipe, group, steps,
                        bf16_autocast=case.torch_autocast)

    exact = case.dtype == "float32" and recipe is None and not case.torch_autocast
    fwd_tol, bwd_tol = (FP32, FP32) if exact else (BF16_SUMMED, BF16_SUMMED)
    if recipe is not None:
        fwd_tol, bwd_tol = E4M3, E5M2
        y_hp = _run(full, x, dy, None)[0]
        assert not torch.equal(y, _output_slice(case, y_hp, rank)), "output equals high precision: FP8 did not run"
    scaled = fwd_tol is not FP32
    _compare(y, _output_slice(case, y_ref, rank), fwd_tol, f"{case} forward", scaled)
    _compare(dx, _input_slice(case, dx_ref, rank), bwd_tol, f"{case} dx", scaled)
    compare_param_grads(part, grads, group, lambda name, p: shard(grads_ref[name], p.shape, rank, case.tp,
                                                                  gated and "fc1" in name), bwd_tol, case, scaled)
    return str(case)


def compare_param_grads(part, grads, group, expected_of, tol, case, scaled: bool) -> None:
    """Each parameter's gradient against expected_of(name, param), this rank's block of the
    single-process gradient."""
    for name, p in part.named_parameters():
        grad = grads[name]
        assert grad is not None, f"{case}: {name} got no gradient"
        if getattr(p, "sequence_parallel", False):  # each rank holds a part: the training loop sums them
            grad = grad.clone()
            dist.all_reduce(grad, group=group)
        _compare(grad, expected_of(name, p), tol, f"{case} d{name}", scaled)
