"""Arguments of Transformer Engine's fusible operations (transformer_engine.pytorch.ops) that the
other operation tests leave at their defaults: GroupedLinear's and BasicLinear's
rng_state_tracker_function, GroupedLinear's single_grouped_weight / single_grouped_bias, and the
norms' sm_margin. Each is read, as TE reads it (test_te_signatures.py lists them)."""
from __future__ import annotations

import math

import pytest
import torch

from te_core.distributed import MODEL_PARALLEL_RNG_TRACKER_NAME, RNGStatesTracker
from te_core.modules import fusible_ops as ops

FP32 = dict(rtol=1.3e-6, atol=1e-5)
IN, OUT, SPLITS = 16, 8, [3, 0, 5]


def _kaiming_draws(seed: int, count: int):
    """TE's operations' initial weights (torch.nn.Linear's), drawn one after the other from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.init.kaiming_uniform_(torch.empty(OUT, IN), a=math.sqrt(5), generator=gen) for _ in range(count)]


def _tracker(seed: int) -> RNGStatesTracker:
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, seed)
    return tracker


@pytest.mark.parametrize("device", [None, "meta"], ids=["built", "meta-then-first-forward"])
def test_linear_weights_are_drawn_in_the_trackers_region(device):
    """rng_state_tracker_function: the weights are drawn inside its tracker's fork() (the
    model-parallel state), so tensor-parallel ranks seeded apart draw different shards; on the meta
    device at the first forward, where TE initializes them. The default generator is untouched."""
    tracker = _tracker(1234)
    torch.manual_seed(0)
    linear = ops.BasicLinear(IN, OUT, device=device, rng_state_tracker_function=lambda: tracker)
    grouped = ops.GroupedLinear(len(SPLITS), IN, OUT, device=device, rng_state_tracker_function=lambda: tracker)
    if device == "meta":
        state = torch.get_rng_state()
        linear(torch.ones(2, IN))
        grouped(torch.ones(sum(SPLITS), IN), torch.tensor(SPLITS))
        torch.set_rng_state(state)
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(0)))
    want = _kaiming_draws(1234, 1 + len(SPLITS))
    assert torch.equal(linear.weight, want[0])
    for g in range(len(SPLITS)):
        assert torch.equal(getattr(grouped, f"weight{g}"), want[1 + g])


@pytest.mark.parametrize("flags", [dict(single_grouped_weight=True), dict(single_grouped_bias=True),
                                   dict(single_grouped_weight=True, single_grouped_bias=True)],
                         ids=["weight", "bias", "both"])
def test_single_grouped_parameters_fall_back_or_are_refused(monkeypatch, flags):
    """single_grouped_weight / single_grouped_bias: without NVTE_GROUPED_LINEAR_SINGLE_PARAM, TE warns
    and keeps one parameter per group, as te-core does (output and gradients float64's); with it set,
    TE packs them into one GroupedTensor, which te-core refuses by name."""
    monkeypatch.delenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", raising=False)
    with pytest.warns(UserWarning, match="per-expert parameters are used"):
        op = ops.GroupedLinear(len(SPLITS), IN, OUT, **flags)
    assert [name for name, _ in op.named_parameters()] == [f"{kind}{g}" for kind in ("weight", "bias")
                                                          for g in range(len(SPLITS))]
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(sum(SPLITS), IN, generator=gen, requires_grad=True)
    dy = torch.randn(sum(SPLITS), OUT, generator=gen)
    y = op(x, torch.tensor(SPLITS))
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = [getattr(op, f"weight{g}").detach().double().requires_grad_() for g in range(len(SPLITS))]
    b64 = [getattr(op, f"bias{g}").detach().double().requires_grad_() for g in range(len(SPLITS))]
    want = torch.cat([r @ w.T + b for r, w, b in zip(x64.split(SPLITS), w64, b64)])
    want.backward(dy.double())
    torch.testing.assert_close(y.double(), want.detach(), **FP32)
    torch.testing.assert_close(x.grad.double(), x64.grad, **FP32)
    for g in range(len(SPLITS)):
        torch.testing.assert_close(getattr(op, f"weight{g}").grad.double(), w64[g].grad, **FP32)
        torch.testing.assert_close(getattr(op, f"bias{g}").grad.double(), b64[g].grad, **FP32)
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
    with pytest.raises(NotImplementedError, match="single_grouped_weight / single_grouped_bias"):
        ops.GroupedLinear(len(SPLITS), IN, OUT, **flags)


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_norms_take_transformer_engines_sm_margin(norm):
    """sm_margin (multiprocessors TE's kernels leave to overlapping communication; an int or one per
    pass) is checked and changes no value: output and gradients are float64's; a negative one is
    refused."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, IN, generator=gen, requires_grad=True)
    dy = torch.randn(5, IN, generator=gen)
    for sm_margin in (4, {"forward": 2, "backward": 0, "inference": 1}):
        op = getattr(ops, norm)(IN, eps=1e-3, sm_margin=sm_margin)
        with torch.no_grad():
            for p in op.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        x.grad = None
        y = op(x)
        y.backward(dy)
        x64 = x.detach().double().requires_grad_()
        h = x64 - x64.mean(-1, keepdim=True) if norm == "LayerNorm" else x64
        want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-3) * op.weight.detach().double()
        if norm == "LayerNorm":
            want = want + op.bias.detach().double()
        want.backward(dy.double())
        torch.testing.assert_close(y.double(), want.detach(), **FP32)
        torch.testing.assert_close(x.grad.double(), x64.grad, **FP32)
    with pytest.raises(TypeError, match="sm_margin must be an int >= 0"):
        getattr(ops, norm)(IN, sm_margin=-1)
