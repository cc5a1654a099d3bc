"""OpImpl.traced: while torch.compile traces, a backend's plain-torch twin of an op is traced
into the graph instead of the opaque op; a twin returning NotImplemented leaves the opaque op."""
import copy
import types

import pytest
import torch

import te_core as te
from registry_fakes import FakeEntryPoint, make_plugin
from te_core import backend, recipe
from te_core.backend.types import OpImpl
from te_core.reference import cast as ref_cast
from te_core.reference.plugin import implementations


def _twin_cast_transpose(x, scale, fp8_dtype, *, amax_out=None):
    data = ref_cast.saturating_cast(x.float() * scale.reshape(()), fp8_dtype)
    amax = x.abs().amax().float()
    if amax_out is not None:
        amax_out.copy_(torch.maximum(amax_out, amax.reshape(amax_out.shape)))
        amax = amax_out
    return data, data.t().contiguous(), amax


@pytest.fixture
def twin_backend(plugins):
    """A CPU backend running the reference everywhere, with a traced twin of cast_transpose_fp8."""
    state = types.SimpleNamespace(decline=False)
    ops = {name: OpImpl(fn) for name, fn in implementations().items()}
    ops["cast_transpose_fp8"] = OpImpl(
        implementations()["cast_transpose_fp8"], None,
        lambda *a, **k: NotImplemented if state.decline else _twin_cast_transpose(*a, **k))
    plugins([FakeEntryPoint("twin", make_plugin("twin", device_type="cpu", ops=ops))])
    backend.set_backend("twin")
    return state


def _run(step, model, x, dy):
    x = x.clone().requires_grad_(True)
    y = step(model, x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("decline", [False, True], ids=["twin", "declined"])
def test_compiled_step_traces_the_twin(twin_backend, decline):
    torch._dynamo.reset()
    twin_backend.decline = decline
    rec = recipe.DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    eager = te.Linear(64, 32, params_dtype=torch.float32, device="cpu")
    compiled_model = copy.deepcopy(eager)
    te.init_quantization_state(eager, rec)  # as compiling makes the twin's: both start at scale 1

    def step(model, x):
        with te.autocast(recipe=rec):
            return model(x)

    graphs = []

    def capture(gm, example_inputs):  # dynamo's graphs, run as traced
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(step, fullgraph=True, backend=capture)
    for i in range(3):
        x, dy = torch.randn(16, 64) * (i + 1), torch.randn(16, 32)
        want = _run(step, eager, x, dy)
        got = _run(compiled, compiled_model, x, dy)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    targets = {str(node.target) for gm in graphs for sub in gm.modules()  # autograd.Function bodies too
               if isinstance(sub, torch.fx.GraphModule) for node in sub.graph.nodes}
    opaque = any("te_core.cast_transpose_fp8" in t for t in targets)
    assert graphs and opaque == decline, sorted(targets)
    history = compiled_model.quantization_state()
    assert history.keys() == eager.quantization_state().keys()
