"""te_core.make_graphed_callables captured for real (CUDA graphs), on the GPU only: replays must
match eager steps of an identical module bit for bit, scales and gradients included."""
import pytest
import torch

import te_core as te

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("recipe", [te.recipe.DelayedScaling(amax_history_len=8), te.recipe.Float8CurrentScaling()])
def test_graphed_linear_matches_eager_steps(recipe):
    torch.manual_seed(0)
    graphed = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    eager = te.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = te.make_graphed_callables(graphed, (x,), fp8_enabled=True, fp8_recipe=recipe)
    eager.load_state_dict(graphed.state_dict())  # same weights and scaling state after the warm-up
    for module in (graphed, eager):  # allocated grads: accumulation never aliases a graph's static buffers
        for p in module.parameters():
            p.grad = torch.zeros_like(p)
    for step in range(4):
        new_x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * (step + 1)
        dy = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        x.data.copy_(new_x)
        x.grad = None
        with te.autocast(recipe=recipe):
            y_graphed = graphed(x)
        y_graphed.backward(dy)
        x_eager = new_x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            y_eager = eager(x_eager)
        y_eager.backward(dy)
        assert torch.equal(y_graphed, y_eager), step
        assert torch.equal(x.grad, x_eager.grad), step
    assert torch.equal(graphed.weight.grad, eager.weight.grad)
    assert torch.equal(graphed.bias.grad, eager.bias.grad)
    wrong = []
    for direction, slots in eager.quantization_state().items():
        for slot, state in slots.items():
            got = graphed.quantization_state()[direction][slot]
            for key in ("scale", "amax_history"):
                if not torch.equal(got[key], state[key]):
                    wrong.append(f"{slot}.{key}: graphed {got[key].flatten()[:4].tolist()} "
                                 f"eager {state[key].flatten()[:4].tolist()}")
    assert not wrong, wrong
