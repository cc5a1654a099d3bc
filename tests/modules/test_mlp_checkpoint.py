"""LayerNormMLP(checkpoint=True), Transformer Engine's selective recompute: the backward runs the
forward again instead of keeping its activations; outputs, gradients and scaling state are those
of the module without it, bit for bit, in high precision and FP8."""
from __future__ import annotations

import copy

import pytest
import torch

import te_core as te
import te_core.modules as tm
from te_core import recipe

RECIPES = {"bf16": None, "delayed": lambda: recipe.DelayedScaling(amax_history_len=3),
           "current": recipe.Float8CurrentScaling}


def _steps(module, rec, xs):
    results = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        with te.autocast(enabled=rec is not None, recipe=rec):
            y = module(x)
        y.pow(2).sum().backward()
        results.append([y.detach(), x.grad] + [p.grad.clone() for p in module.parameters()])
        module.zero_grad(set_to_none=True)
    return results


@pytest.mark.parametrize("name", list(RECIPES))
def test_recompute_equals_keeping_the_activations(name):
    torch.manual_seed(0)
    plain = tm.LayerNormMLP(64, 128)
    recomputed = copy.deepcopy(plain)
    recomputed.checkpoint = True
    rec = RECIPES[name]() if RECIPES[name] else None
    xs = [torch.randn(32, 64) * (i + 1) for i in range(3)]  # amaxes change each step
    for step, (got, want) in enumerate(zip(_steps(recomputed, rec, xs), _steps(plain, rec, xs))):
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"step {step} tensor {i}: {m}")
    if rec is not None:
        for direction in ("forward", "backward"):
            for slot, entry in plain.quantization_state()[direction].items():
                for key, t in entry.items():
                    assert torch.equal(recomputed.quantization_state()[direction][slot][key], t), (direction, slot, key)


def test_keeps_only_the_input_for_the_backward():
    """Autograd keeps fewer bytes for the backward: the activations (fc1's output, the activation,
    the norm output) are recomputed."""
    torch.manual_seed(1)
    plain = tm.LayerNormMLP(64, 256)
    recomputed = tm.LayerNormMLP(64, 256, checkpoint=True)

    def saved_bytes(module):
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        x = torch.randn(64, 64, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x).sum().backward()
        return sum(sizes)

    # the checkpoint itself keeps the input; the recompute's own saving happens in the backward
    kept_plain = saved_bytes(plain)
    assert recomputed.checkpoint and kept_plain > 0
    torch.manual_seed(1)
    x = torch.randn(64, 64, requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        y = recomputed(x)
    assert sum(sizes) < kept_plain / 2, (sum(sizes), kept_plain)
    y.sum().backward()
    assert x.grad is not None


def test_bad_arguments():
    with pytest.raises(TypeError, match="checkpoint must be True or False"):
        tm.LayerNormMLP(64, 128, checkpoint="yes")
    with pytest.raises(NotImplementedError, match="delay_wgrad_compute"):
        tm.LayerNormMLP(64, 128, checkpoint=True, delay_wgrad_compute=True)
