"""torch.compile(fullgraph=True) of te_core modules under a CustomRecipe: the factory's quantizers
(FP8 current scaling, IdentityQuantizer, HybridQuantizer) trace without graph breaks, forward and
backward, and compiled steps equal eager ones bit for bit (on the reference backend the graph runs
the same te_core ops; aot_eager keeps the compile fast). The factory runs outside the trace, where
the module's state is made (modules/_base._prepare), also for a recipe made inside the compiled
function."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

import te_core as te
from te_core.recipe import CustomRecipe

from .conftest import randn
from .test_identity_quantizer import fp8, identity
from .test_identity_quantizer import fp8_forward_identity_backward as hybrid

IN, OUT, TOKENS = 128, 128, 32


FACTORIES = {"current": fp8, "identity": identity, "hybrid-original": hybrid("original"),
             "hybrid-rowwise_dequantized": hybrid("rowwise_dequantized")}
MODULES = {
    "Linear": lambda: te.Linear(IN, OUT, params_dtype=torch.bfloat16),
    "LayerNormLinear": lambda: te.LayerNormLinear(IN, OUT, params_dtype=torch.bfloat16),
    "LayerNormMLP": lambda: te.LayerNormMLP(IN, OUT, params_dtype=torch.bfloat16),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # each case compiles its own step function (same code object)
    yield
    torch._dynamo.reset()


def step_with(recipe):
    def step(model, x):
        with te.autocast(recipe=recipe):
            return model(x)
    return step


def run(step, model, x):
    """Output, input gradient and parameter gradients of one step."""
    x = x.clone().requires_grad_(True)
    y = step(model, x)
    y.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


def assert_identical(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what}[{i}]: compiled differs from eager by {(g.float() - w.float()).abs().max()}"


@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("factory", list(FACTORIES))
def test_compiled_step_equals_eager(gen, factory, module):
    """A CustomRecipe made outside the compiled step: the first call traces (the module's state made
    outside the graph from the recipe's own factory), the second replays the same graph."""
    rec = CustomRecipe(qfactory=FACTORIES[factory])
    torch.manual_seed(0)
    eager_model = MODULES[module]()
    compiled_model = copy.deepcopy(eager_model)
    plain_model = copy.deepcopy(eager_model)
    step = step_with(rec)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i in range(2):
        x = randn(gen, TOKENS, IN, scale=2.0, dtype=torch.bfloat16)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = run(compiled, compiled_model, x)
        assert_identical(got, run(step, eager_model, x), f"step {i}")
        # the factories with FP8 quantizers run an FP8 forward (identity: the layer as it is without autocast)
        plain = run(lambda m, t: m(t), plain_model, x)
        assert torch.equal(got[0], plain[0]) is (factory == "identity")
    assert type(compiled_model._recipe_state.recipe) is CustomRecipe
    assert compiled_model._recipe_state.recipe.qfactory is rec.qfactory


def _defined_in_the_step(role):
    return fp8(role)


@pytest.mark.parametrize("kind", ["function", "lambda", "partial"])
def test_recipe_made_inside_the_compiled_step(gen, kind):
    """`te.autocast(recipe=CustomRecipe(qfactory=...))` inside the compiled function: the factory (a
    lambda or partial made in the trace reaches the state's preparation as dynamo's equal copy) is
    asked outside the graph, and every step equals eager."""
    make = {"function": lambda: CustomRecipe(qfactory=_defined_in_the_step),
            "lambda": lambda: CustomRecipe(qfactory=lambda role: hybrid("original")(role)),
            "partial": lambda: CustomRecipe(qfactory=functools.partial(hybrid("rowwise_dequantized")))}[kind]
    torch.manual_seed(0)
    eager_model = MODULES["Linear"]()
    compiled_model = copy.deepcopy(eager_model)

    def step(model, x):
        with te.autocast(recipe=make()):
            return model(x)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i in range(2):
        x = randn(gen, TOKENS, IN, scale=2.0, dtype=torch.bfloat16)
        assert_identical(run(compiled, compiled_model, x), run(step, eager_model, x), f"step {i}")


def test_field_assigned_between_compiled_steps(gen):
    """backward_override assigned on the recipe between compiled steps retraces with the new value,
    the factory asked again outside the graph; each step equals the eager twin's."""
    rec = CustomRecipe(qfactory=fp8)
    torch.manual_seed(0)
    eager_model = MODULES["Linear"]()
    compiled_model = copy.deepcopy(eager_model)
    step = step_with(rec)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = randn(gen, TOKENS, IN, scale=2.0, dtype=torch.bfloat16)
    results = []
    for override in (None, "dequantized", None):
        rec.backward_override = override
        results.append(run(compiled, compiled_model, x))
        assert_identical(results[-1], run(step, eager_model, x), f"backward_override={override}")
    assert not torch.equal(results[0][1], results[1][1])  # the override reached the compiled backward
    assert_identical(results[2], results[0], "back to backward_override=None")
