"""te_core.make_graphed_callables over whole models, captured for real (CUDA graphs), every recipe:
replays equal eager steps of an identical model (outputs, gradients, delayed-scaling state, whose
history keeps advancing across replays); weight caching reuses the first microbatch's FP8
weights; FP8 primary weights (quantized_model_init) are updated in place by the optimizer, so
the graphs see each update. tests/modules/test_graphs_model.py checks the same on the CPU
around an emulated capture."""
import copy

import pytest
import torch
from torch import nn

import te_core as te
from te_core import recipe
from te_core.modules._base import QuantizedModule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=8),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
}
HIDDEN, FFN, HEADS, SEQ, BATCH = 256, 512, 4, 128, 2
DTYPE = torch.bfloat16
STEPS = 4


class Stack(nn.Sequential):
    """nn.Sequential that hands is_first_microbatch to each layer (the eager twin)."""

    def forward(self, x, is_first_microbatch=None):
        for layer in self:
            x = layer(x, is_first_microbatch=is_first_microbatch)
        return x


def _layers():
    return [te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=DTYPE,
                                device="cuda") for _ in range(2)]


def _mlp():
    return [te.Linear(HIDDEN, FFN, params_dtype=DTYPE, device="cuda"),
            te.LayerNormMLP(FFN, FFN, params_dtype=DTYPE, device="cuda"),
            te.Linear(FFN, HIDDEN, params_dtype=DTYPE, device="cuda")]


MODELS = {"layers": _layers, "mlp": _mlp}


def _data(seed, *shape):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cuda", dtype=DTYPE)


def _twins(build):
    torch.manual_seed(0)
    model = nn.Sequential(*build())
    eager = Stack(*copy.deepcopy(list(model)))
    for m in (model, eager):  # allocated grads: accumulation never aliases a graph's static buffers
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    return model, eager


def _step(model, x, dy, rec, **kwargs):
    x = x.clone().requires_grad_()
    with te.autocast(recipe=rec):
        y = model(x, **kwargs)
    y.backward(dy)
    out = [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad.zero_()
    return out


def _scaling_state(model):
    return {(name, direction, slot, key): t.clone()
            for name, module in model.named_modules() if isinstance(module, QuantizedModule)
            for direction, slots in module.quantization_state().items()
            for slot, entry in slots.items() for key, t in entry.items()}


def _compare(got, want, what, exact=True):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if exact:
            assert torch.equal(g, w), f"{what}: tensor {i} differs by {(g.float() - w.float()).abs().max()}"
        else:  # attention's backward kernels may accumulate in another order from run to run
            torch.testing.assert_close(g, w, rtol=1.6e-2, atol=1e-5, msg=f"{what}: tensor {i}")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("rec_name", list(RECIPES))
def test_graphed_model_matches_eager_steps(name, rec_name):
    rec = RECIPES[rec_name]()
    model, eager = _twins(MODELS[name])
    te.init_quantization_state(eager, rec)  # graphed modules start at scale 1, as a state made ahead does
    sample = _data(0, SEQ, BATCH, HIDDEN).requires_grad_()
    graphed = te.make_graphed_callables(model, (sample,), num_warmup_iters=3, enabled=True, recipe=rec)
    exact = name == "mlp"
    for step in range(STEPS):
        x, dy = _data(10 + step, SEQ, BATCH, HIDDEN) * (step + 1), _data(20 + step, SEQ, BATCH, HIDDEN)
        got, want = _step(graphed, x, dy, rec), _step(eager, x, dy, rec)
        _compare(got[:1], want[:1], f"step {step} output")
        _compare(got[1:], want[1:], f"step {step} gradients", exact)
    got, want = _scaling_state(graphed), _scaling_state(eager)
    assert got.keys() == want.keys()
    _compare(list(got.values()), list(want.values()), "scaling state", exact)
    if rec_name == "delayed":  # one history row per replay, from the fresh state
        histories = [t for key, t in got.items() if key[-1] == "amax_history"]
        assert histories and all(h[-STEPS:].gt(0).all() and h[:-STEPS].eq(0).all() for h in histories)


@pytest.mark.parametrize("rec_name", list(RECIPES))
def test_weight_cache_across_microbatches(rec_name):
    """The weights change between microbatches: later microbatches replay the graphs that read the
    weights cached by the step's first microbatch, as eager with is_first_microbatch=False."""
    rec = RECIPES[rec_name]()
    model, eager = _twins(_mlp)
    te.init_quantization_state(eager, rec)  # graphed modules start at scale 1, as a state made ahead does
    sample = _data(0, SEQ, BATCH, HIDDEN).requires_grad_()
    graphed = te.make_graphed_callables(model, (sample,), enabled=True, recipe=rec, cache_quantized_params=True)
    fresh_outputs_differ = []
    for step, first in enumerate((True, False, False, True, False)):
        with torch.no_grad():
            for a, b in zip(graphed.parameters(), eager.parameters()):
                noise = _data(100 + step, *a.shape) * 0.05
                a.add_(noise)
                b.add_(noise)
        x, dy = _data(10 + step, SEQ, BATCH, HIDDEN), _data(20 + step, SEQ, BATCH, HIDDEN)
        got = _step(graphed, x, dy, rec, is_first_microbatch=first)
        _compare(got, _step(eager, x, dy, rec, is_first_microbatch=first), f"microbatch {step}")
        if not first:
            with te.autocast(recipe=rec), torch.no_grad():
                fresh = copy.deepcopy(eager)(x)  # quantizes the changed weights
            fresh_outputs_differ.append(not torch.equal(got[0], fresh))
    assert all(fresh_outputs_differ), fresh_outputs_differ
    _compare(list(_scaling_state(graphed).values()), list(_scaling_state(eager).values()), "scaling state")


def _quantized_model(rec):
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=rec):
        return nn.Sequential(te.Linear(HIDDEN, FFN, params_dtype=DTYPE, device="cuda"),
                             te.LayerNormMLP(FFN, FFN, params_dtype=DTYPE, device="cuda"))


def _train(model, rec, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    results = []
    for step in range(steps):
        x, dy = _data(10 + step, SEQ * BATCH, HIDDEN).requires_grad_(), _data(20 + step, SEQ * BATCH, FFN)
        with te.autocast(recipe=rec):
            y = model(x)
        y.backward(dy)
        results += [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return results + [p.detach().dequantize() if hasattr(p, "dequantize") else p.detach() for p in model.parameters()]


@pytest.mark.parametrize("rec_name", list(RECIPES))
def test_quantized_model_init_weights_under_capture(rec_name):
    rec = RECIPES[rec_name]()
    model, eager = _quantized_model(rec), _quantized_model(rec)
    te.init_quantization_state(eager, rec)  # graphed modules start at scale 1, as a state made ahead does
    for m in (model, eager):
        for p in m.parameters():
            p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    sample = _data(0, SEQ * BATCH, HIDDEN).requires_grad_()
    graphed = te.make_graphed_callables(model, (sample,), enabled=True, recipe=rec)
    _compare(_train(graphed, rec, STEPS), _train(eager, rec, STEPS), "graphed vs eager")


def test_tuple_of_modules_with_fp8_per_module():
    rec = RECIPES["delayed"]()
    torch.manual_seed(0)
    first = te.Linear(HIDDEN, FFN, params_dtype=DTYPE, device="cuda")
    second = te.Linear(FFN, HIDDEN, params_dtype=DTYPE, device="cuda")
    eager_first, eager_second = copy.deepcopy(first), copy.deepcopy(second)
    te.init_quantization_state(eager_first, rec)  # graphed modules start at scale 1, as a state made ahead does
    for m in (first, second, eager_first, eager_second):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    samples = ((_data(0, SEQ, HIDDEN).requires_grad_(),), (_data(1, SEQ, FFN).requires_grad_(),))
    te.make_graphed_callables((first, second), samples, enabled=(True, False), recipe=rec)
    for step in range(STEPS):
        x, dy = _data(10 + step, SEQ, HIDDEN), _data(20 + step, SEQ, HIDDEN)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        with te.autocast(recipe=rec):
            y = second(first(xs[0]))
            h = eager_first(xs[1])
        y_eager = eager_second(h)  # high precision, as the second module's graphs
        y.backward(dy)
        y_eager.backward(dy)
        _compare([y, xs[0].grad, first.weight.grad, second.weight.grad],
                 [y_eager, xs[1].grad, eager_first.weight.grad, eager_second.weight.grad], f"step {step}")
        for m in (first, second, eager_first, eager_second):
            for p in m.parameters():
                p.grad.zero_()
    _compare(list(_scaling_state(first).values()), list(_scaling_state(eager_first).values()), "scaling state")


class _KeywordBlock(nn.Module):
    """Keyword inputs of a captured forward: a tensor, a (tensor, tensor) pair, a baked-in float."""

    def __init__(self):
        super().__init__()
        self.proj = te.LayerNormLinear(HIDDEN, HIDDEN, params_dtype=DTYPE, device="cuda")

    def forward(self, x, *, shift, pair, scale=1.0):
        return (self.proj(x) * scale + shift) * pair[0] + pair[1]


@pytest.mark.parametrize("rec_name", ["delayed", "current"])
def test_sample_kwargs_are_graph_inputs(rec_name):
    """Each replay reads the call's own keyword tensors (copied into the graph's buffers): outputs,
    input and keyword gradients and parameters' gradients equal an eager twin's, bit for bit."""
    rec = RECIPES[rec_name]()
    torch.manual_seed(0)
    block = _KeywordBlock()
    eager = copy.deepcopy(block)
    te.init_quantization_state(eager, rec)  # graphed modules start at scale 1, as a state made ahead does
    for m in (block, eager):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    sample = {"shift": _data(1, HIDDEN).requires_grad_(), "pair": (_data(2, HIDDEN), _data(3, HIDDEN)), "scale": 2.0}
    te.make_graphed_callables(block, (_data(0, SEQ, BATCH, HIDDEN).requires_grad_(),), sample_kwargs=sample,
                              enabled=True, recipe=rec)
    for step in range(STEPS):
        x, dy = _data(10 + step, SEQ, BATCH, HIDDEN), _data(20 + step, SEQ, BATCH, HIDDEN)
        shift, pair = _data(30 + step, HIDDEN), (_data(40 + step, HIDDEN), _data(50 + step, HIDDEN))
        results = []
        for model in (block, eager):
            xs, ss = x.clone().requires_grad_(), shift.clone().requires_grad_()
            with te.autocast(recipe=rec):
                y = model(xs, shift=ss, pair=pair, scale=2.0)
            y.backward(dy)
            results.append([y.detach().clone(), xs.grad, ss.grad] + [p.grad.clone() for p in model.parameters()])
            for p in model.parameters():
                p.grad.zero_()
        _compare(results[0], results[1], f"step {step}")
