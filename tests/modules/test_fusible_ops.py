"""Transformer Engine's fusible operations (te_core.modules.fusible_ops) on every backend: the chains
Megatron-LM's MLP, the Mixtral tutorial's experts and the fused residual RMSNorm build, forward and
every gradient against float64 on fresh random inputs; under te.autocast, BasicLinear and
GroupedLinear bit for bit te-core's Linear(bias=False) and GroupedLinear (the operations run those
modules' code). Sizes are multiples of 16, which the cuda backend's FP8 GEMMs take."""
from __future__ import annotations

import math

import pytest
import torch

import te_core as te
from te_core.modules import fusible_ops as ops
from te_core.recipe import DelayedScaling, Float8CurrentScaling

from ._compare import TOL, seeded

TOKENS, HIDDEN, FFN, GROUPS = 64, 32, 48, 4
SPLITS = [16, 0, 32, 16]  # one expert without tokens


def _chain(name: str, dtype: torch.dtype):
    """(the operations, the kinds of extra inputs Sequential takes for them, in order)."""
    kw = dict(dtype=dtype)
    if name == "rmsnorm-swiglu-bias":
        return [ops.RMSNorm(HIDDEN, **kw), ops.BasicLinear(HIDDEN, 2 * FFN, **kw), ops.Bias(2 * FFN, **kw),
                ops.SwiGLU(), ops.BasicLinear(FFN, HIDDEN, **kw), ops.Bias(HIDDEN, **kw)], []
    if name == "layernorm-gelu":
        return [ops.LayerNorm(HIDDEN, **kw), ops.BasicLinear(HIDDEN, FFN, **kw), ops.Bias(FFN, **kw), ops.GELU(),
                ops.BasicLinear(FFN, HIDDEN, **kw)], []
    if name == "experts-scaled-swiglu":
        return [ops.GroupedLinear(GROUPS, HIDDEN, 2 * FFN, **kw), ops.ScaledSwiGLU(),
                ops.GroupedLinear(GROUPS, FFN, HIDDEN, **kw)], ["splits", "probs", "splits"]
    assert name == "residual-rmsnorm"
    return [ops.MakeExtraOutput(), ops.RMSNorm(HIDDEN, **kw)], []


CHAINS = ["rmsnorm-swiglu-bias", "layernorm-gelu", "experts-scaled-swiglu", "residual-rmsnorm"]


def randn(gen, *shape, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _build(name: str, dtype: torch.dtype, gen):
    """The chain's Sequential, every parameter random (a linear weight of std 1/sqrt(in_features),
    as at initialization, so that activations stay of order 1; norm weights around 1; biases
    around 0), and its extra inputs: split sizes, float32 probabilities."""
    operations, kinds = _chain(name, dtype)
    seq = ops.Sequential(*operations)
    with torch.no_grad():
        for pname, p in seq.named_parameters():
            if p.dim() == 2:
                p.copy_(randn(gen, *p.shape, scale=p.shape[1] ** -0.5))
            else:
                p.copy_(randn(gen, *p.shape, scale=0.3) + (1.0 if pname.endswith("weight") else 0.0))
    extras = {"splits": torch.tensor(SPLITS, dtype=torch.int32), "probs": torch.rand(TOKENS, generator=gen)}
    return seq, [extras[k] for k in kinds]


def _float64_op(op, h, p, *extra):
    """One operation in float64 on h, with its parameters p (by name) and extra inputs."""
    if isinstance(op, ops.RMSNorm):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + op.eps) * p["weight"]
    if isinstance(op, ops.LayerNorm):
        c = h - h.mean(-1, keepdim=True)
        return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + op.eps) * p["weight"] + p["bias"]
    if isinstance(op, ops.BasicLinear):
        return h @ p["weight"].T
    if isinstance(op, ops.GroupedLinear):
        return torch.cat([r @ p[f"weight{g}"].T + p[f"bias{g}"] for g, r in enumerate(h.split(extra[0].tolist()))])
    if isinstance(op, ops.Bias):
        return h + p["bias"]
    if isinstance(op, (ops.SwiGLU, ops.ScaledSwiGLU)):
        a, b = h.chunk(2, dim=-1)  # TE's order: the gate first
        y = a * torch.sigmoid(a) * b
        return y * extra[0][:, None] if extra else y
    if isinstance(op, ops.GELU):  # the tanh approximation, as TE's
        return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    if isinstance(op, ops.MakeExtraOutput):
        return h, h
    raise AssertionError(f"no float64 computation for {type(op).__name__}")


def _float64_leaves(module, *tensors):
    """float64 copies that take gradients: of module's parameters (by name), of the floating-point
    tensors (others as they are)."""
    params = {n: p.detach().double().requires_grad_() for n, p in module.named_parameters()}
    return params, [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in tensors]


def _check(got, want, tol, what):
    torch.testing.assert_close(got.double(), want, **tol, msg=lambda m: f"{what}: {m}")


def _backward_both(gen, outs, wants) -> None:
    """The same random gradients of the outputs, backward through the test and the float64 chain."""
    dys = [randn(gen, *y.shape, dtype=y.dtype) for y in outs]
    torch.autograd.backward(outs, dys)
    torch.autograd.backward(wants, [dy.double() for dy in dys])


def _check_grads(module, inputs, leaves, params64, tol, what) -> None:
    """The floating-point inputs' and the parameters' gradients against their float64 copies'."""
    for i, (t, leaf) in enumerate(zip(inputs, leaves)):
        if t.is_floating_point():
            _check(t.grad, leaf.grad, tol, f"{what}: d(input {i})")
    for name, p in module.named_parameters():
        _check(p.grad, params64[name].grad, tol, f"{what}: d{name}")


def _as_tuple(y):
    return y if isinstance(y, tuple) else (y,)


@pytest.mark.parametrize("chain", CHAINS)
def test_sequential_matches_float64(chain):
    """In float32 the whole Sequential: its output(s) and the gradients of the input, of the
    probabilities and of every parameter against the chain computed in float64."""
    gen = seeded(11)
    seq, extras = _build(chain, torch.float32, gen)
    inputs = [randn(gen, TOKENS, HIDDEN).requires_grad_()] + [e.requires_grad_() if e.is_floating_point() else e
                                                              for e in extras]
    outs = _as_tuple(seq(*inputs))
    params64, leaves = _float64_leaves(seq, *inputs)
    h, rest, wants = leaves[0], leaves[1:], []
    for key, op in seq.named_children():
        extra, rest = rest[:op.num_extra_inputs], rest[op.num_extra_inputs:]
        h, *made = _as_tuple(_float64_op(op, h, {n: params64[f"{key}.{n}"] for n, _ in op.named_parameters()},
                                         *extra))
        wants += made
    wants = [h, *wants]
    assert len(outs) == len(wants)
    for i, (y, want) in enumerate(zip(outs, wants)):
        _check(y, want, TOL[torch.float32], f"output {i}")
    _backward_both(gen, outs, wants)
    _check_grads(seq, inputs, leaves, params64, TOL[torch.float32], chain)


@pytest.mark.parametrize("chain", CHAINS)
def test_each_operation_in_bf16_matches_float64(chain):
    """In bfloat16 each operation of the chain on the bf16 tensor the one before produced: its
    output(s) and gradients against float64 on the same operands (bf16 roundings compound through
    a chain and cancel in sums beyond any bf16 tolerance, so the chain is checked one operation at
    a time); Sequential's output is those operations' composed, bit for bit."""
    gen = seeded(12)
    seq, extras = _build(chain, torch.bfloat16, gen)
    x = randn(gen, TOKENS, HIDDEN, dtype=torch.bfloat16)
    h, rest = x, extras
    for key, op in seq.named_children():
        extra, rest = rest[:op.num_extra_inputs], rest[op.num_extra_inputs:]
        inputs = [h.detach().requires_grad_()] + [e.detach().requires_grad_() if e.is_floating_point() else e
                                                  for e in extra]
        outs = _as_tuple(op(*inputs))
        params64, leaves = _float64_leaves(op, *inputs)
        wants = _as_tuple(_float64_op(op, leaves[0], params64, *leaves[1:]))
        what = f"{type(op).__name__} at {key!r}"
        for i, (y, want) in enumerate(zip(outs, wants, strict=True)):
            assert y.dtype == torch.bfloat16
            _check(y, want, TOL[torch.bfloat16], f"{what}: output {i}")
        _backward_both(gen, outs, wants)
        _check_grads(op, inputs, leaves, params64, TOL[torch.bfloat16], what)
        h = outs[0].detach()
    assert torch.equal(_as_tuple(seq(x, *extras))[0], h)


def _linear_pair(gen, grouped: bool):
    """(the operation, te-core's module, how each is called) with the same parameters."""
    if grouped:
        op, module = ops.GroupedLinear(GROUPS, HIDDEN, FFN), te.GroupedLinear(GROUPS, HIDDEN, FFN)
        splits = torch.tensor(SPLITS, dtype=torch.int32)
        calls = (lambda x: op(x, splits), lambda x: module(x, SPLITS))
    else:
        op, module = ops.BasicLinear(HIDDEN, FFN), te.Linear(HIDDEN, FFN, bias=False)
        calls = (op, module)
    with torch.no_grad():
        for name, p in op.named_parameters():
            p.copy_(randn(gen, *p.shape, scale=0.3))
            module.get_parameter(name).copy_(p)
    return op, module, calls


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
@pytest.mark.parametrize("grouped", [False, True], ids=["BasicLinear", "GroupedLinear"])
def test_fp8_operation_is_te_cores_module(recipe, grouped):
    """Under te.autocast an operation's output and gradients are bitwise its te-core module's, over
    two steps (delayed scaling's second step uses the scales the first recorded), and FP8's: not
    the high-precision output."""
    gen = seeded(14)
    op, module, (call_op, call_module) = _linear_pair(gen, grouped)
    for step in range(2):
        x = randn(gen, TOKENS, HIDDEN, scale=2.0)
        x_op, x_mod = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            y, want = call_op(x_op), call_module(x_mod)
        assert torch.equal(y, want), f"step {step}: output"
        with torch.no_grad():
            assert not torch.allclose(y, call_op(x), **TOL[torch.float32])  # FP8 GEMMs ran
        dy = randn(gen, *y.shape)
        y.backward(dy)
        want.backward(dy)
        assert torch.equal(x_op.grad, x_mod.grad), f"step {step}: dx"
        for name, p in op.named_parameters():
            assert torch.equal(p.grad, module.get_parameter(name).grad), f"step {step}: d{name}"
