"""The twins' delayed-scaling slot writes (te_backend_cuda.traced.WRITES_SLOTS, off by default)
under inductor, on a CPU backend carrying every twin: the casts, norms and backward epilogues
are traced, their amaxes land in the module's own histories through the max_into op, and the
compiled code allocates no buffer of a history's shape (a functionalized copy of a history,
which CUDA graph trees find alive after a replay). Outputs, gradients and histories follow eager."""
import copy

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import te_core as te
from te_backend_cuda import traced, traced_fused
from te_core import recipe
from twin_backends import cpu_backend_with

# torch 2.8's CPU inductor crashes the process (a segmentation fault) on this step's compiled code, and
# torch 2.7 cannot trace it; torch 2.10 and later run it
pytestmark = pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 10),
                                reason="torch before 2.10 cannot compile these slot writes on a CPU "
                                       "(torch 2.8 crashes the process)")
HISTORY = 7  # no other tensor of the layer has this leading dimension
TRACED_WITH_SLOTS = ("quantize_fp8", "cast_transpose_fp8", "dbias_cast_transpose", "layernorm_fwd", "rmsnorm_fwd",
                     "activation_fwd", "activation_bwd_dbias_cast_transpose", "dbias_cast_transpose_parts")


@pytest.fixture
def cpu_backend_writing_slots(monkeypatch):
    monkeypatch.setattr(traced, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(traced, "WRITES_SLOTS", True)
    with cpu_backend_with(monkeypatch, "cpu_slot_twins", {**traced.TRACED, **traced_fused.twins("cpu")}):
        yield


def _run(step, model, x):
    x = x.clone().requires_grad_(True)
    y = step(model, x)
    y.backward(torch.ones_like(y))
    out = [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _histories(model):
    return [group.amax_history for child in model.modules() if getattr(child, "_recipe_state", None) is not None
            for group in child._recipe_state.scaling_groups().values()]


def test_slot_writes_stay_in_the_histories_under_inductor(cpu_backend_writing_slots):
    torch.manual_seed(0)
    rec = recipe.DelayedScaling(amax_history_len=HISTORY)
    eager = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0)
    compiled_model = copy.deepcopy(eager)
    for model in (eager, compiled_model):  # both start at scale 1, as compiling makes a state
        te.init_quantization_state(model, rec)
    before = _histories(compiled_model)

    def step(model, x):
        with te.autocast(recipe=rec):
            return model(x)

    compiled = torch.compile(step, fullgraph=True)
    for i in range(2):
        x = torch.randn(16, 2, 64) * (i + 1)
        got, code = run_and_get_code(_run, compiled, compiled_model, x)
        want = _run(step, eager, x)
        for j, (g, w) in enumerate(zip(got, want)):
            error = ((g - w).norm() / w.norm().clamp_min(1e-30)).item()
            assert error <= 1e-2, f"step {i} tensor {j}: relative L2 error {error:.3g}"
        source = "\n".join(code)
        copies = [line.strip() for line in source.splitlines() if "empty_strided" in line and f"(({HISTORY}, " in line]
        assert not copies, f"step {i}: history-shaped buffers {copies}"
        assert "te_backend_cuda.max_into" in source
        opaque = [name for name in TRACED_WITH_SLOTS if f"te_core.{name}" in source]
        assert not opaque, f"left opaque: {opaque}"
    after = _histories(compiled_model)
    assert all(a is b for a, b in zip(after, before)) and all(h.abs().sum() > 0 for h in after)
    for got, want in zip(after, _histories(eager)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-5)
