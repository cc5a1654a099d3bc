"""te_core.recipe.CustomRecipe: a factory's quantizers per tensor role, run by te-core's modules
exactly as the built-in recipe of the same scaling kind runs them."""
from __future__ import annotations

import pickle

import pytest
import torch

import te_core as te
from te_core.dtype import DType
from te_core.quantization.custom import QuantizerRole
from te_core.recipe import CustomRecipe, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, Recipe

from .conftest import randn


def current_scaling(role):
    """TE's own test factory: E5M2 for gradients, E4M3 for the rest."""
    fp8 = DType.kFloat8E5M2 if role.tensor_type == "grad_output" else DType.kFloat8E4M3
    return te.Float8CurrentScalingQuantizer(fp8, device="cpu")


def legacy_current_scaling(role):
    """A factory written for Transformer Engine before 2.20, which passed role strings."""
    if role in ("linear_input", "linear_weight", "linear_output"):
        return te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, device="cpu")
    if role in ("linear_grad_output", "linear_grad_input"):
        return te.Float8CurrentScalingQuantizer(DType.kFloat8E5M2, device="cpu")
    return None


def run(module, x, dy, recipe):
    x = x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x)
    y.backward(dy)
    return y, x.grad, [p.grad for p in module.parameters()]


def twins(cls, *args):
    a = cls(*args, params_dtype=torch.float32)
    b = cls(*args, params_dtype=torch.float32)
    b.load_state_dict(a.state_dict())
    return a, b


def assert_bitwise(ref, got):
    (y0, dx0, dw0), (y1, dx1, dw1) = ref, got
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert len(dw0) == len(dw1) and all(torch.equal(a, b) for a, b in zip(dw0, dw1))


@pytest.mark.parametrize("factory", [current_scaling, legacy_current_scaling])
@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear])
def test_a_current_scaling_factory_is_float8_current_scaling(gen, cls, factory):
    """Same casts, same GEMMs: output and every gradient equal bit for bit."""
    a, b = twins(cls, 96, 80)
    x, dy = randn(gen, 3, 16, 96, scale=2.0), randn(gen, 3, 16, 80)
    ref = run(a, x, dy, Float8CurrentScaling())
    got = run(b, x, dy, CustomRecipe(qfactory=factory))
    assert_bitwise(ref, got)
    # and it is FP8: the high-precision output differs
    plain = cls(96, 80, params_dtype=torch.float32)
    plain.load_state_dict(a.state_dict())
    assert not torch.equal(plain(x), got[0])


@pytest.mark.parametrize("recipe, factory", [
    (Float8BlockScaling(), lambda role: te.Float8BlockQuantizer(
        DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=2 if role.tensor_type == "weight" else 1)),
    (MXFP8BlockScaling(), lambda role: te.MXFP8Quantizer(DType.kFloat8E4M3)),
], ids=["block", "mxfp8"])
def test_block_factories_are_their_built_in_recipes(gen, recipe, factory):
    a, b = twins(te.Linear, 128, 64)
    x, dy = randn(gen, 64, 128, scale=3.0), randn(gen, 64, 64)
    assert_bitwise(run(a, x, dy, recipe), run(b, x, dy, CustomRecipe(qfactory=factory)))


def test_a_factory_may_set_the_block_geometry_after_construction(gen):
    """TE's test helpers (make_role_aware_quantizer) build Float8BlockQuantizer() with its default
    128x128 tiles and then set block_scaling_dim = 1 for every tensor but the weight: the attribute
    is writable in TE, and the casts follow it, giving Float8BlockScaling()'s outputs and gradients."""
    def factory(role):
        quantizer = te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True)
        quantizer.block_scaling_dim = 2 if role.tensor_type == "weight" else 1
        return quantizer

    a, b = twins(te.Linear, 128, 64)
    x, dy = randn(gen, 64, 128, scale=3.0), randn(gen, 64, 64)
    ref = run(a, x, dy, Float8BlockScaling())
    assert_bitwise(ref, run(b, x, dy, CustomRecipe(qfactory=factory)))
    # and it is FP8: the high-precision output differs
    assert not torch.equal(a(x), ref[0])


def test_the_factory_is_asked_once_per_slot_with_transformer_engines_roles(gen):
    asked = []

    def factory(role):
        asked.append(role)
        return current_scaling(role)

    recipe = CustomRecipe(qfactory=factory)
    mlp, grouped, linear = te.LayerNormMLP(64, 128), te.GroupedLinear(2, 64, 32), te.Linear(64, 32)
    with te.autocast(recipe=recipe):
        for _ in range(2):  # the state is kept: the factory is not asked again
            mlp(randn(gen, 16, 64))
            grouped(randn(gen, 32, 64), [16, 16])
            linear(randn(gen, 16, 64))
    fields = [(r.module_type, r.tensor_type, r.name) for r in asked]
    gemm = ("input", "weight", "grad_output")
    assert fields == ([("linear", t, "fc1") for t in gemm] + [("linear", t, "fc2") for t in gemm]
                      + [("grouped_linear", t, "") for t in gemm] * 2 + [("linear", t, "") for t in gemm])
    assert [str(r) for r in asked[:3]] == ["linear_input", "linear_weight", "linear_grad_output"]
    assert asked[6] == "linear_input"  # a GroupedLinear tensor was "linear_input" before TE 2.20 too


def test_factory_results_are_checked(gen):
    x = randn(gen, 16, 64)
    for factory, error, match in [
        (lambda role: None, ValueError, r"returned None for role QuantizerRole\(module_type='linear', "
                                        "tensor_type='input'.*return a quantizer"),
        (lambda role: None if role.tensor_type == "grad_output" else current_scaling(role), ValueError,
         "returned None for role.*'linear_grad_output'"),
        (lambda role: torch.float8_e4m3fn, TypeError, "qfactory returned a dtype for role .* it must return one of "
                                                      "te.Float8Quantizer, te.Float8CurrentScalingQuantizer"),
        (lambda role: Float8CurrentScaling().quantizer_for(te.quantization.Role.INPUT), TypeError,
         "returned a Float8CurrentScalingQuantizer"),
    ]:
        with pytest.raises(error, match=match), te.autocast(recipe=CustomRecipe(qfactory=factory)):
            te.Linear(64, 32)(x)


def test_the_recipe_validates_its_fields():
    assert CustomRecipe.custom() and CustomRecipe(qfactory=current_scaling).custom()
    assert not any(r.custom() for r in (Float8CurrentScaling(), MXFP8BlockScaling()))
    assert isinstance(CustomRecipe(qfactory=current_scaling), Recipe) and te.recipe.CustomRecipe is CustomRecipe
    with pytest.raises(TypeError, match="qfactory must be a callable role -> quantizer"):
        CustomRecipe()
    with pytest.raises(NotImplementedError, match="fp8_dpa / fp8_mha"):
        CustomRecipe(qfactory=current_scaling, fp8_dpa=True)
    with pytest.raises(ValueError, match="quantization_alignment must be an int >= 1"):
        CustomRecipe(qfactory=current_scaling, quantization_alignment=0)
    with pytest.raises(ValueError, match="backward_override"):
        CustomRecipe(qfactory=current_scaling, backward_override="bf16")


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
def test_backward_override_runs_custom_quantizers_as_the_built_in_recipe(monkeypatch, mode):
    """backward_override with a factory of current-scaling quantizers gives the built-in
    Float8CurrentScaling's results bit for bit under the same override (and other input
    gradients than without one); NVTE_BACKWARD_OVERRIDE, which TE's CustomRecipe reads as its
    default, no longer makes CustomRecipe() raise."""
    def run(rec):
        torch.manual_seed(0)
        layer = te.Linear(64, 32)
        x = randn(torch.Generator().manual_seed(1), 16, 64).requires_grad_()
        with te.autocast(recipe=rec):
            y = layer(x)
        y.backward(randn(torch.Generator().manual_seed(2), 16, 32))
        return [y.detach(), x.grad, layer.weight.grad, layer.bias.grad]

    custom = run(CustomRecipe(qfactory=current_scaling, backward_override=mode))
    for got, want in zip(custom, run(Float8CurrentScaling(backward_override=mode))):
        assert torch.equal(got, want)
    assert not torch.equal(custom[1], run(CustomRecipe(qfactory=current_scaling))[1])
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", mode)
    assert CustomRecipe(qfactory=current_scaling).backward_override == mode


def test_a_quantizer_returned_for_several_roles_is_not_shared():
    one = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, device="cpu")
    layer = te.Linear(64, 32)
    with te.autocast(recipe=CustomRecipe(qfactory=lambda role: one)):
        layer(torch.randn(16, 64))
    held = layer._recipe_state.quantizers
    assert len({id(q) for q in held.values()}) == 3 and one not in held.values()
    assert [q.role.value for q in held.values()] == ["input", "weight", "grad_output"] and one.role is None


def test_quantizer_role_is_both_of_transformer_engines_forms():
    role = QuantizerRole(module_type="linear", tensor_type="weight", name="fc2")
    assert role == "linear_weight" and "linear_weight" == role and role in ("linear_input", "linear_weight")
    assert {"linear_weight": 1}[role] == 1 and role.startswith("linear_")
    assert role == QuantizerRole("linear", "weight", "fc2") and role != QuantizerRole("linear", "weight", "fc1")
    assert (role.module_type, role.tensor_type, role.name) == ("linear", "weight", "fc2")
    assert repr(role) == "QuantizerRole(module_type='linear', tensor_type='weight', name='fc2')"
    assert pickle.loads(pickle.dumps(role)) == role
    assert QuantizerRole() == "unknown" and QuantizerRole("dpa", "qkv") == "dpa_qkv"
    with pytest.raises(AttributeError):
        role.name = "x"
    with pytest.raises(TypeError, match="tensor_type must be a str"):
        QuantizerRole("linear", 3)
    assert te.QuantizerRole is QuantizerRole
