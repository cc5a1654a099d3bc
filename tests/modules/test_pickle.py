"""Whole-module serialization: torch.save(model) / torch.load and pickle (what multiprocessing
does) keep every module usable, its FP8 scaling state and its FP8 primary weights included."""

import io
import pickle

import pytest
import torch

import te_core as te
from te_core import recipe
from te_core.quantization import QuantizedTensor

HIDDEN, HEADS, SEQ, BATCH = 64, 4, 32, 2

MODULES = {
    "Linear": lambda: te.Linear(HIDDEN, HIDDEN),
    "LayerNormLinear": lambda: te.LayerNormLinear(HIDDEN, HIDDEN),
    "LayerNormMLP": lambda: te.LayerNormMLP(HIDDEN, 2 * HIDDEN),
    "GroupedLinear": lambda: te.GroupedLinear(2, HIDDEN, HIDDEN),
    "MultiheadAttention": lambda: te.MultiheadAttention(HIDDEN, HEADS, attention_dropout=0.0),
    "TransformerLayer": lambda: te.TransformerLayer(HIDDEN, 2 * HIDDEN, HEADS, hidden_dropout=0.0,
                                                    attention_dropout=0.0),
}


def _forward(module, x, rec):
    with te.autocast(recipe=rec):
        if isinstance(module, te.GroupedLinear):
            return module(x.reshape(-1, HIDDEN), [SEQ, SEQ])
        return module(x)


def _reloaded(module, how="torch.save"):
    if how == "pickle":  # (what multiprocessing does)
        return pickle.loads(pickle.dumps(module))
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling, "mxfp8": recipe.MXFP8BlockScaling}


def _train_step(module, rec, seed):
    torch.manual_seed(seed)
    y = _forward(module, torch.randn(SEQ, BATCH, HIDDEN), rec)
    y.float().sum().backward()
    grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    module.zero_grad(set_to_none=True)
    return [y.detach(), *grads]


def _scaling_state(module):
    return [t for direction in module.quantization_state().values() for slot in direction.values()
            for t in slot.values()]


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
@pytest.mark.parametrize("rec_name", list(RECIPES))
@pytest.mark.parametrize("quantized_weights", [False, True], ids=["bf16-weights", "fp8-weights"])
@pytest.mark.parametrize("name", list(MODULES))
def test_a_copy_trains_on_as_the_module_does(name, quantized_weights, rec_name, how):
    """A copy made after a step trains on exactly as the original: the same outputs, gradients
    and scaling state (its casts record into its own history and read its own scales)."""
    rec = RECIPES[rec_name]()
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=quantized_weights, recipe=rec):
        module = MODULES[name]()
    _train_step(module, rec, 1)
    copy = _reloaded(module, how)
    for seed in (2, 3):
        want, got = _train_step(module, rec, seed), _train_step(copy, rec, seed)
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want)), seed
        assert all(torch.equal(g, w) for g, w in zip(_scaling_state(copy), _scaling_state(module))), seed
    if rec_name == "delayed":  # the histories moved on: the copy's casts recorded into its own
        assert any(t.count_nonzero() > 1 for t in _scaling_state(copy))


@pytest.mark.parametrize("quantized_weights", [False, True], ids=["bf16-weights", "fp8-weights"])
@pytest.mark.parametrize("name", list(MODULES))
def test_saved_module_loads_and_computes_the_same(name, quantized_weights):
    torch.manual_seed(0)
    rec = recipe.DelayedScaling()
    with te.quantized_model_init(enabled=quantized_weights, recipe=rec):
        module = MODULES[name]()
    _forward(module, torch.randn(SEQ, BATCH, HIDDEN), rec).float().sum().backward()  # scaling state made
    loaded = _reloaded(module)
    for (key, param), (loaded_key, loaded_param) in zip(module.named_parameters(), loaded.named_parameters()):
        assert key == loaded_key and type(loaded_param) is type(param), key
        assert loaded_param.requires_grad and isinstance(loaded_param, torch.nn.Parameter), key
    if quantized_weights:
        assert any(isinstance(p, QuantizedTensor) for p in loaded.parameters())
    x = torch.randn(SEQ, BATCH, HIDDEN)
    want, got = _forward(module, x, rec), _forward(loaded, x, rec)  # same weights and delayed scales
    assert torch.equal(got, want)
    got.float().sum().backward()
    assert all(p.grad is not None for p in loaded.parameters())


def test_pickled_default_init_keeps_its_distribution():
    """The default init method travels with a pickled module and still draws normal(0, 0.023)."""
    loaded = _reloaded(te.LayerNormMLP(HIDDEN, 2 * HIDDEN))
    weight = torch.empty(512, 512)
    loaded.init_method(weight)
    assert abs(weight.std().item() - 0.023) < 0.001 and abs(weight.mean().item()) < 0.001
