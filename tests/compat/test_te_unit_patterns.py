"""Behaviour that Transformer Engine's own unit tests (tests/pytorch) check through its public API,
exercised on te-core's modules: where running those tests against the stand-in showed te-core
diverging, this pins TE's behaviour."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.dtype import DType
from te_core.recipe import CustomRecipe

E4M3 = dict(rtol=0.125, atol=0.0675)  # Transformer Engine's tolerances for E4M3 results


def _factory_by_layer(names, asked):
    """A CustomRecipe factory that dispatches on role.name, as TE documents ("the factory can
    dispatch on this to target specific layers"): an unknown layer name is an error."""
    def factory(role):
        asked.append((role.module_type, role.tensor_type, role.name))
        if role.name not in names:
            raise KeyError(f"no quantizer configured for layer {role.name!r}")
        fp8 = DType.kFloat8E5M2 if role.tensor_type == "grad_output" else DType.kFloat8E4M3
        return te.Float8CurrentScalingQuantizer(fp8, device="cpu")
    return factory


def _run(module, x, dy, recipe, *args):
    x = x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x, *args)
    y.backward(dy)
    return y, x.grad, [p.grad for p in module.parameters()]


def _float64_linear(weights, biases, x, dy, splits):
    """Plain torch in float64: each chunk of rows through its own (weight, bias); returns the
    output and the input's gradient."""
    x = x.double().requires_grad_()
    ws = [w.detach().double() for w in weights]
    bs = [b.detach().double() for b in biases]
    y = torch.cat([torch.nn.functional.linear(xi, w, b) for xi, w, b in zip(x.split(splits), ws, bs)])
    y.backward(dy.double())
    return y, x.grad


@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_custom_recipe_roles_carry_the_module_name(grouped):
    """TE's QuantizerRole.name is the module's name= argument (test_custom_recipe.py's
    test_grouped_linear_module_type_dispatch); a factory keyed by layer name quantizes the layer,
    and the FP8 result matches float64 torch within E4M3 tolerances."""
    gen = torch.Generator().manual_seed(7)
    name = "decoder.layers.0.experts" if grouped else "decoder.layers.0.proj"
    if grouped:
        module, splits = te.GroupedLinear(2, 64, 48, name=name, params_dtype=torch.float32), [16, 16]
        weights, biases = [module.weight0, module.weight1], [module.bias0, module.bias1]
    else:
        module, splits = te.Linear(64, 48, name=name, params_dtype=torch.float32), [32]
        weights, biases = [module.weight], [module.bias]
    with torch.no_grad():
        for b in biases:
            b.normal_(generator=gen)
    x, dy = torch.randn(32, 64, generator=gen), torch.randn(32, 48, generator=gen)
    asked = []
    got = _run(module, x, dy, CustomRecipe(qfactory=_factory_by_layer({name}, asked)), *([splits] if grouped else []))

    kind = "grouped_linear" if grouped else "linear"
    assert asked == [(kind, t, name) for t in ("input", "weight", "grad_output")] * len(splits)
    ref = _float64_linear(weights, biases, x, dy, splits)
    torch.testing.assert_close(got[0].double(), ref[0], **E4M3)
    torch.testing.assert_close(got[1].double(), ref[1], **E4M3)
    # the weight gradients come from E5M2 gradients: the same as the built-in recipe's, bit for bit
    twin = type(module)(*((2,) if grouped else ()), 64, 48, params_dtype=torch.float32)
    twin.load_state_dict(module.state_dict())
    built_in = _run(twin, x, dy, te.recipe.Float8CurrentScaling(), *([splits] if grouped else []))
    assert all(torch.equal(g, b) for g, b in zip(got[2], built_in[2]))


def test_custom_recipe_roles_of_layernorm_mlp_name_each_gemm_under_the_module():
    """TE names LayerNormMLP's roles "<name>.fc1" / "<name>.fc2" ("fc1" / "fc2" when unnamed)."""
    gen = torch.Generator().manual_seed(11)
    mlp = te.LayerNormMLP(64, 128, name="decoder.layers.3.mlp", params_dtype=torch.float32)
    unnamed = te.LayerNormMLP(64, 128, params_dtype=torch.float32)
    unnamed.load_state_dict(mlp.state_dict())
    x, dy = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)
    asked = []
    names = {"decoder.layers.3.mlp.fc1", "decoder.layers.3.mlp.fc2", "fc1", "fc2"}
    named_out = _run(mlp, x, dy, CustomRecipe(qfactory=_factory_by_layer(names, asked)))
    unnamed_out = _run(unnamed, x, dy, CustomRecipe(qfactory=_factory_by_layer(names, asked)))
    gemm = ("input", "weight", "grad_output")
    assert asked == ([("linear", t, "decoder.layers.3.mlp.fc1") for t in gemm]
                     + [("linear", t, "decoder.layers.3.mlp.fc2") for t in gemm]
                     + [("linear", t, "fc1") for t in gemm] + [("linear", t, "fc2") for t in gemm])
    # the name picks quantizers only: the same quantizers give the same numbers
    assert torch.equal(named_out[0], unnamed_out[0]) and torch.equal(named_out[1], unnamed_out[1])


BF16 = dict(rtol=1.6e-2, atol=1e-5)  # TE's tolerances for bf16 results


def _te_quantizers():
    return {"current": te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, device="cpu"),
            "block1x128": te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True,
                                                  block_scaling_dim=1),
            "block128x128": te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True,
                                                    block_scaling_dim=2),
            "mxfp8": te.MXFP8Quantizer(DType.kFloat8E4M3)}


@pytest.mark.parametrize("kind", ["current", "block1x128", "block128x128", "mxfp8"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_dequantize_passes_gradients_to_the_quantized_input(kind, out_dtype):
    """TE's dequantize() is differentiable (test_quantized_tensor.py's
    test_quantize_dequantize_autograd): a quantize -> dequantize round trip is straight-through,
    so d/dx sum(w * deq(q(x))^2) = 2 * w * deq(q(x)), in x's dtype."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(128, 256, generator=gen).to(torch.bfloat16).requires_grad_()
    w = torch.rand(128, 256, generator=gen) + 0.5
    xq = _te_quantizers()[kind](x)
    y = xq.dequantize(dtype=out_dtype)
    assert y.requires_grad and y.dtype == (out_dtype or torch.bfloat16)
    (w * y.float() ** 2).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    with torch.no_grad():
        ref = 2.0 * w.double() * xq.dequantize(dtype=out_dtype).double()
    torch.testing.assert_close(x.grad.double(), ref, **BF16)


def test_dequantize_without_grad_records_no_graph():
    """Outside grad mode (or for a tensor not requiring grad) dequantize() is a plain value."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    q = _te_quantizers()["current"]
    plain = q(x).dequantize()
    with torch.no_grad():
        detached = q(x.clone().requires_grad_()).dequantize()
    assert plain.grad_fn is None and detached.grad_fn is None
    torch.testing.assert_close(plain, detached, rtol=0, atol=0)
    torch.testing.assert_close(plain, x, **E4M3)
