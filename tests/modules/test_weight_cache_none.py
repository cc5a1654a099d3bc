"""is_first_microbatch=None leaves the weight cache alone, as in Transformer Engine (whose modules
pass no cache name then): after True (weights cast and cached), an update of the weights, and a
None call (which casts the current weights), a False call still computes with the weights
cached by the True call, exactly as a module that never made the None call does."""
from __future__ import annotations

import copy

import pytest
import torch

import te_core.modules as tm
from te_core import recipe
from te_core.quantization import autocast

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
}
MODULES = {
    "Linear": (lambda: tm.Linear(64, 64), lambda m, x, flag: m(x, is_first_microbatch=flag)),
    "LayerNormLinear": (lambda: tm.LayerNormLinear(64, 64), lambda m, x, flag: m(x, is_first_microbatch=flag)),
    "LayerNormMLP": (lambda: tm.LayerNormMLP(64, 128), lambda m, x, flag: m(x, is_first_microbatch=flag)),
}


def _inputs(n: int):
    gen = torch.Generator().manual_seed(7)  # (on the CPU, then to the backend's device)
    return [torch.randn(32, 64, generator=gen, device="cpu").to(torch.get_default_device()) for _ in range(n)]


def _first_and_update(module, call, rec, x) -> None:
    """The first microbatch (weights cast and cached), then an update of every parameter."""
    with autocast(recipe=rec):
        call(module, x, True)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5)


def _last(module, call, rec, x, backward: bool):
    """A later microbatch (False): its output, and with backward its input and weight gradients."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(backward)
    with autocast(recipe=rec):
        y = call(module, x, False)
    if not backward:
        return [y.detach()]
    y.backward(torch.ones_like(y))
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()]


def _copy_scaling_state(src, dst) -> None:
    """dst's delayed-scaling scales and amax histories set to src's: the None call also records
    amaxes (delayed scaling then moves the scales, as in Transformer Engine), which is not what
    is compared here."""
    with torch.no_grad():
        for a, b in zip(src.modules(), dst.modules()):
            if not hasattr(a, "quantization_state"):
                continue
            target = b.quantization_state()
            for direction, slots in a.quantization_state().items():
                for slot, entries in slots.items():
                    for key, value in entries.items():
                        target[direction][slot][key].copy_(value)


@pytest.mark.parametrize("backward", [False, True], ids=["no_grad", "backward"])
@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("rec_name", list(RECIPES))
def test_none_call_leaves_weight_cache_alone(rec_name, name, backward, module_backend):
    build, call = MODULES[name]
    torch.manual_seed(0)
    module = build()
    skipped = copy.deepcopy(module)
    rec = RECIPES[rec_name]()
    x_first, x_none, x_last = _inputs(3)
    with torch.enable_grad() if backward else torch.no_grad():
        for m in (module, skipped):
            _first_and_update(m, call, rec, x_first)
        with autocast(recipe=rec):
            y_none = call(module, x_none, None).detach()
        _copy_scaling_state(module, skipped)
        got = _last(module, call, rec, x_last, backward)
        want = _last(skipped, call, rec, x_last, backward)
    exact = module_backend.device_type == "cpu"  # (the reference backend: bit for bit)
    for g, w in zip(got, want):
        if exact:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w)
    # the None call cast the updated weights, not the cached ones
    with torch.no_grad(), autocast(recipe=rec):
        y_cached = call(module, x_none, False)
    assert not torch.equal(y_none, y_cached)


@pytest.mark.parametrize("rec_name", list(RECIPES))
def test_none_call_keeps_cached_tensor(rec_name, module_backend):
    module = tm.Linear(64, 64)
    rec = RECIPES[rec_name]()
    x = _inputs(1)[0]
    with torch.no_grad(), autocast(recipe=rec):
        module(x, is_first_microbatch=True)
        cached = dict(module._weight_cache)
        module(x, is_first_microbatch=None)
    assert cached and all(module._weight_cache.get(slot) is t for slot, t in cached.items())
