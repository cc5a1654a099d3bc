"""get_quantizer_roles: Transformer Engine's list of the QuantizerRole of each quantizer slot, the
same roles a CustomRecipe factory is asked with in a forward and backward, and the lists TE's
modules (module/linear.py, layernorm_linear.py, layernorm_mlp.py, grouped_linear.py) and fusible
operations (ops/basic/basic_linear.py, grouped_linear.py) return for the same configuration."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.dtype import DType
from te_core.modules import fusible_ops as te_ops
from te_core.quantization.custom import QuantizerRole
from te_core.recipe import CustomRecipe, Float8CurrentScaling

from .conftest import randn

H, F = 32, 64


def current_scaling(role):
    fp8 = DType.kFloat8E5M2 if role.tensor_type == "grad_output" else DType.kFloat8E4M3
    return te.Float8CurrentScalingQuantizer(fp8, device="cpu")


def _fields(roles):
    return [None if r is None else (r.module_type, r.tensor_type, r.name) for r in roles]


def L(tensor_type, name=""):  # noqa: N802 (TE's role of a linear GEMM tensor)
    return ("linear", tensor_type, name)


def G(tensor_type, name=""):  # noqa: N802
    return ("grouped_linear", tensor_type, name)


# (build, forward arguments beyond x, num_gemms)
MODULES = {
    "Linear": (lambda **kw: te.Linear(H, F, **kw), (), 1),
    "LayerNormLinear": (lambda **kw: te.LayerNormLinear(H, F, **kw), (), 1),
    "LayerNormMLP": (lambda **kw: te.LayerNormMLP(H, F, **kw), (), 2),
    "GroupedLinear": (lambda **kw: te.GroupedLinear(3, H, F, **kw), ([8, 4, 4],), 3),
}


def _run(module, x, extra, recipe, dy_gen):
    x = x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x, *extra)
    y.backward(randn(dy_gen, *y.shape))
    return y.detach(), x.grad


@pytest.mark.parametrize("name", [None, "blocks.0.proj"])
@pytest.mark.parametrize("kind", list(MODULES))
def test_the_roles_returned_are_the_roles_the_factory_is_asked_with(kind, name, gen):
    build, extra, gemms = MODULES[kind]
    module = build(name=name, params_dtype=torch.float32)
    asked = []
    recipe = CustomRecipe(qfactory=lambda role: asked.append(role) or current_scaling(role))
    x = randn(gen, 16, H)
    y, dx = _run(module, x, extra, recipe, torch.Generator().manual_seed(7))

    fwd = module.get_quantizer_roles(fwd=True, num_quantizers=3 * gemms)
    bwd = module.get_quantizer_roles(fwd=False, num_quantizers=2 * gemms)
    # TE's slots per GEMM g: forward 3g input, 3g+1 weight; backward 2g grad_output (te-core asks
    # for these, GEMM by GEMM; the output and grad_input slots it never quantizes)
    expected = [role for g in range(gemms) for role in (fwd[3 * g], fwd[3 * g + 1], bwd[2 * g])]
    assert _fields(asked) == _fields(expected)
    assert all(type(r) is QuantizerRole for r in asked + expected)

    # and the factory's quantizers are the ones the GEMMs ran with: the built-in recipe of the
    # same scaling gives the same result, bit for bit
    twin = build(params_dtype=torch.float32)
    twin.load_state_dict(module.state_dict())
    y_ref, dx_ref = _run(twin, x, extra, Float8CurrentScaling(), torch.Generator().manual_seed(7))
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


def test_linear_roles_are_transformer_engines():
    for kind in ("Linear", "LayerNormLinear"):
        module = MODULES[kind][0](name="enc.qkv")
        assert _fields(module.get_quantizer_roles(fwd=True, num_quantizers=3)) == [
            L("input", "enc.qkv"), L("weight", "enc.qkv"), None]
        assert _fields(module.get_quantizer_roles(fwd=False, num_quantizers=2)) == [L("grad_output", "enc.qkv"), None]
        # TE repeats the pattern up to num_quantizers
        assert _fields(module.get_quantizer_roles(fwd=False, num_quantizers=5)) == [
            L("grad_output", "enc.qkv"), None, L("grad_output", "enc.qkv"), None, L("grad_output", "enc.qkv")]
    assert _fields(te.Linear(H, F).get_quantizer_roles(fwd=True, num_quantizers=3)) == [L("input"), L("weight"), None]


@pytest.mark.parametrize("name, fc1, fc2", [(None, "fc1", "fc2"), ("mlp", "mlp.fc1", "mlp.fc2")])
def test_layernorm_mlp_roles_are_transformer_engines(name, fc1, fc2):
    module = te.LayerNormMLP(H, F, name=name)
    # fc1's output is fc2's input; fc2's input gradient is fc1's output gradient (TE labels the
    # internal boundaries with their consumer's role)
    assert _fields(module.get_quantizer_roles(fwd=True, num_quantizers=6)) == [
        L("input", fc1), L("weight", fc1), L("input", fc2), L("input", fc2), L("weight", fc2), None]
    assert _fields(module.get_quantizer_roles(fwd=False, num_quantizers=4)) == [
        L("grad_output", fc1), None, L("grad_output", fc2), L("grad_output", fc1)]


def test_grouped_linear_roles_are_transformer_engines():
    module = te.GroupedLinear(3, H, F, name="moe.experts")
    assert _fields(module.get_quantizer_roles(fwd=True, num_quantizers=9)) == [
        G("input", "moe.experts"), G("weight", "moe.experts"), None] * 3
    assert _fields(module.get_quantizer_roles(fwd=False, num_quantizers=6)) == [G("grad_output", "moe.experts"),
                                                                                 None] * 3


def test_boundary_roles_fill_the_output_and_grad_input_slots():
    consumer_fwd, consumer_bwd = QuantizerRole("dpa", "qkv", "attn"), QuantizerRole("linear", "grad_output", "prev")
    mlp, linear = te.LayerNormMLP(H, F, name="mlp"), te.Linear(H, F, name="proj")
    for module in (mlp, linear):
        module.output_quantizer_role, module.grad_input_quantizer_role = consumer_fwd, consumer_bwd
        assert module.output_quantizer_role is consumer_fwd and module.grad_input_quantizer_role is consumer_bwd
    assert mlp.get_quantizer_roles(fwd=True, num_quantizers=6)[2:] == [
        QuantizerRole("linear", "input", "mlp.fc2"), QuantizerRole("linear", "input", "mlp.fc2"),
        QuantizerRole("linear", "weight", "mlp.fc2"), consumer_fwd]
    assert mlp.get_quantizer_roles(fwd=False, num_quantizers=4)[1] is consumer_bwd
    assert linear.get_quantizer_roles(fwd=True, num_quantizers=3)[2] is consumer_fwd
    assert linear.get_quantizer_roles(fwd=False, num_quantizers=2)[1] is consumer_bwd


def test_fusible_operations_roles_are_transformer_engines_and_the_factorys(gen):
    linear, grouped = te_ops.BasicLinear(H, F, dtype=torch.float32), te_ops.GroupedLinear(2, H, F, dtype=torch.float32)
    assert _fields(linear.get_quantizer_roles("forward")) == [L("input"), L("weight")]
    assert _fields(linear.get_quantizer_roles("backward")) == [L("grad_output")]
    # TE's grouped operation asks with module_type "linear" (its module: "grouped_linear")
    assert _fields(grouped.get_quantizer_roles("forward")) == [L("input"), L("weight")] * 2
    assert _fields(grouped.get_quantizer_roles("backward")) == [L("grad_output")] * 2
    for op, extra in ((linear, ()), (grouped, (torch.tensor([8, 8]),))):
        asked = []
        recipe = CustomRecipe(qfactory=lambda role: asked.append(role) or current_scaling(role))
        _run(op, randn(gen, 16, H), extra, recipe, gen)
        fwd, bwd = op.get_quantizer_roles("forward"), op.get_quantizer_roles("backward")
        expected = [r for g in range(len(bwd)) for r in (fwd[2 * g], fwd[2 * g + 1], bwd[g])]
        assert _fields(asked) == _fields(expected)


def test_bad_arguments_say_what_to_pass():
    module = te.Linear(H, F)
    with pytest.raises(TypeError, match="fwd must be a bool"):
        module.get_quantizer_roles(fwd="forward", num_quantizers=3)
    with pytest.raises(ValueError, match="num_quantizers must be an int >= 0"):
        module.get_quantizer_roles(fwd=True, num_quantizers=-1)
    with pytest.raises(TypeError, match="positional"):
        module.get_quantizer_roles(True, 3)  # keyword-only, as in TE
    with pytest.raises(TypeError, match="output_quantizer_role must be a te.QuantizerRole or None"):
        module.output_quantizer_role = "linear_input"
    with pytest.raises(ValueError, match="mode must be 'forward' or 'backward'"):
        te_ops.BasicLinear(H, F).get_quantizer_roles("fwd")


def test_the_base_classes_answer_no_explicit_roles_as_transformer_engines():
    """TE's base module and base operation return None ("no explicit roles"): a module or operation
    that describes no GEMM slots answers that, and a subclass overriding the hook can call it."""
    from te_core.modules import TransformerEngineBaseModule

    class Custom(TransformerEngineBaseModule):
        def get_quantizer_roles(self, *, fwd, num_quantizers):
            base = super().get_quantizer_roles(fwd=fwd, num_quantizers=num_quantizers)
            return [QuantizerRole("custom", "input", "mine")] * num_quantizers if base is None else base

    assert Custom().get_quantizer_roles(fwd=True, num_quantizers=2) == [QuantizerRole("custom", "input", "mine")] * 2
    assert te.DotProductAttention(2, 16).get_quantizer_roles(fwd=True, num_quantizers=9) is None
    assert te.DotProductAttention(2, 16).get_quantizer_roles(fwd=False, num_quantizers=6) is None
    for op in (te_ops.Bias(H), te_ops.GELU(), te_ops.LayerNorm(H)):
        assert op.get_quantizer_roles("forward") is None and op.get_quantizer_roles("backward") is None
    with pytest.raises(ValueError, match="mode must be 'forward' or 'backward', got 'fwd'"):
        te_ops.Bias(H).get_quantizer_roles("fwd")
    with pytest.raises(TypeError, match="fwd must be a bool"):
        Custom().get_quantizer_roles(fwd="yes", num_quantizers=2)
    with pytest.raises(ValueError, match="num_quantizers must be an int >= 0"):
        te.DotProductAttention(2, 16).get_quantizer_roles(fwd=True, num_quantizers=-1)
