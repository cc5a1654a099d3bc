"""torch.compile of te_core modules on the cuda backend, on the GPU only: every recipe with
fullgraph=True, and mode="reduce-overhead" (CUDA graphs), equal to eager steps of an identical
module bit for bit (outputs, gradients, and the delayed-scaling state, whose history must keep
advancing across replays)."""
import copy

import pytest
import torch

import te_core as te
from te_core import recipe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
}


def _step(rec):
    def step(model, x):
        with te.autocast(recipe=rec):
            return model(x)
    return step


def _fwd_bwd(step, model, x, dy, graphs):
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    x = x.clone().requires_grad_(True)
    y = step(model, x)
    y.backward(dy)
    out = {"y": y.detach().clone(), "x.grad": x.grad.clone()}
    out.update((f"{name}.grad", p.grad.clone()) for name, p in model.named_parameters())
    model.zero_grad(set_to_none=True)
    return out


def _assert_equal(got, want, name):
    """Bit for bit, but a bias gradient: the compiled step sums the gradient's rows in the
    compiler's order (the traced twin of dbias_cast_transpose), eager in the fused kernel's.
    And current scaling's input and weight gradients: their GEMMs in the compiled step read
    the gradient's FP8 copy the compiler made from its own amax and scale kernels, which can
    round differently in rare elements (by one bf16 step)."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        exact = not key.endswith("bias.grad") and not (name == "current" and key in ("weight.grad", "x.grad"))
        torch.testing.assert_close(got[key], value, rtol=0 if exact else 1.6e-2, atol=0 if exact else 1e-5,
                                   msg=lambda m: f"{key}: {m}")


def _state(model):
    return {(d, slot, k): v.clone() for d, slots in model.quantization_state().items()
            for slot, entry in slots.items() for k, v in entry.items()}


def _linear_pair(name, mode=None):
    """(eager step, a Linear for it, the compiled step, an identical Linear for that)."""
    torch._dynamo.reset()
    rec = RECIPES[name]()
    step = _step(rec)
    eager = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
    twin = copy.deepcopy(eager)
    te.init_quantization_state(eager, rec)  # as compiling makes the twin's: both start at scale 1
    return step, eager, torch.compile(step, fullgraph=True, mode=mode), twin


def _step_inputs(i):
    """Fresh x and dy of step i (x grows with i, so each step's amaxes differ)."""
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16) * (i + 1)
    return x, torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["inductor", "reduce-overhead"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_linear_equals_eager(name, mode):
    torch.manual_seed(0)
    step, eager, compiled, compiled_model = _linear_pair(name, mode)
    graphs = mode == "reduce-overhead"
    previous = None
    for i in range(5):
        x, dy = _step_inputs(i)
        want = _fwd_bwd(step, eager, x, dy, False)
        got = _fwd_bwd(compiled, compiled_model, x, dy, graphs)
        _assert_equal(got, want, name)
        state = _state(compiled_model)
        assert state.keys() == _state(eager).keys()
        for key, value in _state(eager).items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0)
        if name == "delayed":  # the histories advance on every step, replays included
            history = torch.cat([v.flatten() for (d, s, k), v in sorted(state.items()) if k == "amax_history"])
            assert previous is None or not torch.equal(history, previous)
            previous = history


@pytest.mark.parametrize("name", ["current", "block"])
def test_compiled_linear_with_opaque_casts_equals_eager(name, monkeypatch):
    """Tensors too large for the traced twins keep the opaque ops, whose outputs the compiler
    checks against their fake implementations' shapes and strides (1x128 block scales column by
    column): the limit set to 0, every cast of a small Linear takes that path."""
    from te_backend_cuda import traced, traced_fused

    monkeypatch.setattr(traced, "MAX_NUMEL", 0)
    monkeypatch.setattr(traced_fused, "MAX_NUMEL", 0)
    torch.manual_seed(1)
    step, eager, compiled, compiled_model = _linear_pair(name)
    for i in range(3):
        x, dy = _step_inputs(i)
        want = _fwd_bwd(step, eager, x, dy, False)
        got = _fwd_bwd(compiled, compiled_model, x, dy, False)
        for key, value in want.items():  # the same kernels run: bit for bit
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    torch._dynamo.reset()
