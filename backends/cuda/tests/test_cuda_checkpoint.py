"""Checkpoints of FP8 modules whose scaling state lives on the GPU: state_dict() and
load_state_dict() round trips (the extra state's placeholder columns are made on the CPU, the
module's scales on its device) and a resumed module stepping exactly as the saved one."""
import io

import pytest
import torch

import te_core as te

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = "cuda"
RECIPES = [te.recipe.DelayedScaling(amax_history_len=4), te.recipe.Float8CurrentScaling()]


def _modules():
    kw = dict(params_dtype=torch.bfloat16, device=DEVICE)
    return {
        "Linear": (lambda: te.Linear(128, 256, **kw), (32, 128), {}),
        "LayerNormMLP": (lambda: te.LayerNormMLP(128, 256, **kw), (32, 128), {}),
        "GroupedLinear": (lambda: te.GroupedLinear(2, 128, 256, **kw), (32, 128), {"m_splits": [16, 16]}),
        "TransformerLayer": (lambda: te.TransformerLayer(128, 256, 4, hidden_dropout=0.0, attention_dropout=0.0, **kw),
                             (16, 2, 128), {}),
    }


def _step(module, x, recipe, kwargs):
    x = x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x, **kwargs)
    y.float().square().mean().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("recipe", RECIPES, ids=["delayed", "current"])
@pytest.mark.parametrize("name", list(_modules()))
def test_state_dict_round_trip_on_the_gpu_resumes_exactly(name, recipe):
    make, shape, kwargs = _modules()[name]
    torch.manual_seed(0)
    module = make()
    inputs = [torch.randn(shape, device=DEVICE, dtype=torch.bfloat16) * (i + 1) for i in range(4)]
    for x in inputs[:2]:  # scaling state made and updated on the GPU
        _step(module, x, recipe, kwargs)
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(buffer, weights_only=True, map_location=DEVICE))
    for x in inputs[2:]:
        y, dx = _step(module, x, recipe, kwargs)
        y_resumed, dx_resumed = _step(resumed, x, recipe, kwargs)
        assert torch.equal(y, y_resumed)
        assert torch.equal(dx, dx_resumed)
    for (key, a), (_, b) in zip(module.state_dict().items(), resumed.state_dict().items()):
        if not key.endswith("_extra_state"):
            assert torch.equal(a, b), key
