"""Evaluation under torch.inference_mode (as training frameworks run their validation loops)
between training steps, every recipe: the same outputs, gradients and scaling state as
evaluation under torch.no_grad, and the training steps after it still run."""

import pytest
import torch

import te_core as te
from te_core import recipe
from te_core.modules._base import QuantizedModule

RECIPES = {
    "delayed": recipe.DelayedScaling,
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
}
HIDDEN, FFN, HEADS, SEQ, BATCH = 64, 128, 4, 32, 2


def _layer():
    torch.manual_seed(0)
    return te.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                               params_dtype=torch.float32)


def _run(layer, rec, evaluation):
    """Evaluate first (a delayed-scaling state is then made inside `evaluation`), train, evaluate,
    train, evaluate; every output and gradient, then the scaling state."""
    results = []
    for i, phase in enumerate(("eval", "train", "eval", "train", "eval")):
        torch.manual_seed(100 + i)
        x = torch.randn(SEQ, BATCH, HIDDEN)
        if phase == "eval":
            with evaluation():
                with te.autocast(recipe=rec):
                    y = layer(x)
            results.append(y.clone() if y.is_inference() else y)
            continue
        x.requires_grad_()
        with te.autocast(recipe=rec):
            y = layer(x)
        y.backward(torch.randn_like(y))
        results += [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
    for module in layer.modules():
        if isinstance(module, QuantizedModule):
            for slots in module.quantization_state().values():
                results += [t.clone() for entry in slots.values() for t in entry.values()]
    return results


@pytest.mark.parametrize("name", list(RECIPES))
def test_inference_mode_evaluation_between_training_steps(name):
    rec = RECIPES[name]()
    got, want = _run(_layer(), rec, torch.inference_mode), _run(_layer(), rec, torch.no_grad)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert not g.is_inference() and torch.equal(g, w), f"tensor {i}"
    if name == "delayed":  # the state was made and updated: 3 evaluations and 2 training steps
        assert len(got) > 5 + 2 * (2 + sum(1 for _ in _layer().parameters()))


def _module(kind):
    torch.manual_seed(0)
    if kind == "GroupedLinear":
        return te.GroupedLinear(3, 32, 32, params_dtype=torch.float32)
    return getattr(te, kind)(32, 64, params_dtype=torch.float32) if kind != "Linear" else te.Linear(32, 32)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_without_autograd_casts_no_column_wise_copy(monkeypatch, name, kind):
    """Under no_grad and inference_mode no backward runs, so a forward casts each FP8 operand of
    its GEMMs row-wise only, even though the parameters still require grad (an autograd
    Function's forward cannot tell by itself); the output is the training forward's, bit for bit."""
    import importlib

    seen = []
    files = {"Linear": "linear", "LayerNormLinear": "layernorm_linear", "LayerNormMLP": "layernorm_mlp",
             "GroupedLinear": "grouped_linear"}
    where = importlib.import_module(f"te_core.modules.{files[kind]}")
    real = where.fprop_gemm

    def probe(x, w, **kwargs):
        seen.append(x.has_columnwise)
        return real(x, w, **kwargs)

    monkeypatch.setattr(where, "fprop_gemm", probe)
    module, rec = _module(kind), RECIPES[name]()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(7), device="cpu").to(torch.get_default_device())
    args = ([32, 0, 32],) if kind == "GroupedLinear" else ()
    outputs = {}
    for mode in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        seen.clear()
        with mode(), te.autocast(recipe=rec):
            outputs[mode] = module(x.clone().requires_grad_(mode is torch.enable_grad), *args).detach().clone()
        assert seen and all(seen) if mode is torch.enable_grad else not any(seen), (mode.__name__, seen)
    assert torch.equal(outputs[torch.no_grad], outputs[torch.enable_grad])
    assert torch.equal(outputs[torch.inference_mode], outputs[torch.enable_grad])
