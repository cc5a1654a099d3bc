"""te_core.quantization.factory_zoo, Transformer Engine's custom_recipes.quantizer_factory_zoo: the
MXFP8 / high-precision mixes run as TE defines them (the forward of one, the backward of the
other); the factories whose roles TE makes NVFP4 refuse those roles with what to use instead."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.quantization.factories import mxfp8_factory
from te_core.quantization.factory_zoo import (
    high_precision_fwd_mxfp8_bwd_factory,
    mxfp8_fwd_high_precision_bwd_factory,
    mxfp8_fwd_nvfp4_bwd_factory,
    nvfp4_1d_weight_factory,
    nvfp4_linear_fp8_dpa_factory,
    nvfp4_row_scaled_fwd_high_precision_bwd_factory,
    nvfp4_row_scaled_fwd_mxfp8_bwd_factory,
)
from te_core.recipe import CustomRecipe, MXFP8BlockScaling

from .conftest import randn
from .test_quantizer_factories import assert_bitwise, run, twins

FP32 = dict(rtol=1.3e-6, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)


def layer_and_data(gen, cls):
    a, b = twins(cls, 128, 256)
    x, dy = randn(gen, 64, 128, scale=2.0), randn(gen, 64, 128 if cls is te.LayerNormMLP else 256)
    return a, b, x, dy


def row(t):
    """t's MXFP8 values as a GEMM reads them row-wise (32-element blocks along the last dimension)."""
    return mxfp8_factory(None)(t).dequantize().double()


def col(t):
    """t's MXFP8 values as a backward GEMM reads them column-wise (32-element blocks along the first)."""
    return row(t.T.contiguous()).T


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormMLP])
def test_mxfp8_fwd_high_precision_bwd_is_mxfp8_with_a_dequantized_backward(gen, cls):
    """TE: this factory is MXFP8BlockScaling(backward_override="dequantized") for linear layers,
    bit for bit, so its forward is MXFP8BlockScaling()'s, bit for bit."""
    a, b, x, dy = layer_and_data(gen, cls)
    got = run(b, x, dy, CustomRecipe(qfactory=mxfp8_fwd_high_precision_bwd_factory))
    assert_bitwise(run(a, x, dy, MXFP8BlockScaling(backward_override="dequantized")), got)
    with te.autocast(recipe=MXFP8BlockScaling()), torch.no_grad():
        assert torch.equal(got[0], a(x))
    with torch.no_grad():
        assert not torch.equal(got[0], a(x))


def test_mxfp8_fwd_high_precision_bwd_linear_is_the_float64_gemms(gen):
    """Forward: x W^T + b on the MXFP8 values; backward: high-precision GEMMs of the unquantized
    gradient with those same MXFP8 values (not the original x and W)."""
    layer = te.Linear(256, 128, params_dtype=torch.float32)
    x, dy = randn(gen, 64, 256, scale=2.0), randn(gen, 64, 128)
    y, dx, (dw, db) = run(layer, x, dy, CustomRecipe(qfactory=mxfp8_fwd_high_precision_bwd_factory))
    x8, w8 = row(x), row(layer.weight.detach())
    torch.testing.assert_close(y.double(), x8 @ w8.T + layer.bias.double(), **FP32)
    torch.testing.assert_close(dx.double(), dy.double() @ w8, **FP32)
    torch.testing.assert_close(dw.double(), dy.double().T @ x8, **FP32)
    torch.testing.assert_close(db.double(), dy.double().sum(0), **FP32)
    assert not torch.allclose(dx.double(), dy.double() @ layer.weight.detach().double(), **FP32)


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormMLP])
def test_high_precision_fwd_mxfp8_bwd_has_the_unquantized_forward(gen, cls):
    """The forward GEMMs read every operand in high precision: the output is the layer's outside
    te.autocast, bit for bit; the gradients are MXFP8 (not the unquantized ones, near them)."""
    a, b, x, dy = layer_and_data(gen, cls)
    ref = run(a, x, dy, None)
    got = run(b, x, dy, CustomRecipe(qfactory=high_precision_fwd_mxfp8_bwd_factory))
    assert torch.equal(got[0], ref[0])
    assert not torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[1], ref[1], **E4M3)


def test_high_precision_fwd_mxfp8_bwd_linear_backward_is_mxfp8s(gen):
    """A te.Linear's backward is MXFP8BlockScaling()'s, bit for bit (same MXFP8 casts of dy and of
    the original x and W), and the float64 GEMMs of those column-wise / row-wise casts."""
    a, b, x, dy = layer_and_data(gen, te.Linear)
    y, dx, (dw, db) = run(b, x, dy, CustomRecipe(qfactory=high_precision_fwd_mxfp8_bwd_factory))
    _, dx_mx, (dw_mx, db_mx) = run(a, x, dy, MXFP8BlockScaling())
    assert torch.equal(dx, dx_mx) and torch.equal(dw, dw_mx) and torch.equal(db, db_mx)
    w = b.weight.detach()
    torch.testing.assert_close(y.double(), x.double() @ w.double().T + b.bias.double(), **FP32)
    torch.testing.assert_close(dx.double(), row(dy) @ col(w), **FP32)
    torch.testing.assert_close(dw.double(), col(dy).T @ col(x), **FP32)


LINEAR_ROLES = [te.QuantizerRole(m, t, "fc1") for m in ("linear", "grouped_linear")
                for t in ("input", "weight", "grad_output")]


def is_mxfp8(q):
    return type(q) is te.MXFP8Quantizer and q.fp8_dtype == torch.float8_e4m3fn


def hybrid(q, rowwise, columnwise, source):
    return (type(q) is te.HybridQuantizer and rowwise(q.rowwise_quantizer)
            and columnwise(q.columnwise_quantizer) and q.columnwise_source == source)


def is_identity(q):
    return type(q) is te.IdentityQuantizer


@pytest.mark.parametrize("role", LINEAR_ROLES, ids=str)
def test_the_backed_factories_choose_per_role_as_transformer_engines(role):
    grad = role.tensor_type == "grad_output"
    q = mxfp8_fwd_high_precision_bwd_factory(role)
    assert is_identity(q) if grad else hybrid(q, is_mxfp8, is_identity, "rowwise_dequantized")
    q = high_precision_fwd_mxfp8_bwd_factory(role)
    assert is_mxfp8(q) if grad else hybrid(q, is_identity, is_mxfp8, "original")
    # TE's row-scaled NVFP4 / MXFP8 factory is MXFP8 for everything but GroupedLinear's forward operands
    if role.module_type == "linear" or grad:
        assert is_mxfp8(nvfp4_row_scaled_fwd_mxfp8_bwd_factory(role))
    if grad:
        assert is_identity(nvfp4_row_scaled_fwd_high_precision_bwd_factory(role))


def test_roles_outside_linear_layers_get_transformer_engines_choices():
    """No role, or an attention role: MXFP8 (or TE's Hybrid for the high-precision forward);
    nvfp4_linear_fp8_dpa_factory's per-tensor FP8 attention roles, E5M2 in the backward."""
    for role in (None, te.QuantizerRole("dpa", "qkv")):
        assert is_mxfp8(mxfp8_fwd_high_precision_bwd_factory(role))
        assert is_mxfp8(mxfp8_fwd_nvfp4_bwd_factory(role))
        assert hybrid(high_precision_fwd_mxfp8_bwd_factory(role), is_identity, is_mxfp8, "original")
    for role, dtype in ((te.QuantizerRole("dpa", "qkv"), torch.float8_e4m3fn),
                        (te.QuantizerRole("dpa", "do"), torch.float8_e5m2),
                        (te.QuantizerRole("", "", "layer.dpa_output"), torch.float8_e4m3fn),
                        (te.QuantizerRole("", "", "layer.dpa_grad_input"), torch.float8_e5m2)):
        q = nvfp4_linear_fp8_dpa_factory(role)
        assert type(q) is te.Float8CurrentScalingQuantizer and q.fp8_dtype == dtype


def test_nvfp4_row_scaled_fwd_mxfp8_bwd_on_a_linear_is_mxfp8(gen):
    """TE's choice for a plain Linear under this factory is MXFP8 for every role: the results are
    MXFP8BlockScaling()'s, bit for bit (no NVFP4 is asked for)."""
    a, b, x, dy = layer_and_data(gen, te.Linear)
    assert_bitwise(run(a, x, dy, MXFP8BlockScaling()),
                   run(b, x, dy, CustomRecipe(qfactory=nvfp4_row_scaled_fwd_mxfp8_bwd_factory)))


NVFP4_USE = "NVFP4 .* which te-core does not support yet.* Use "
REFUSED = [
    (mxfp8_fwd_nvfp4_bwd_factory, ["input", "weight", "grad_output"],
     NVFP4_USE + "mxfp8_factory .* or mxfp8_fwd_high_precision_bwd_factory"),
    (nvfp4_1d_weight_factory, ["input", "weight", "grad_output"],
     NVFP4_USE + "mxfp8_factory .* or float8_block_scaling_factory"),
    (nvfp4_row_scaled_fwd_high_precision_bwd_factory, ["input", "weight"],
     NVFP4_USE + "mxfp8_fwd_high_precision_bwd_factory"),
    (nvfp4_linear_fp8_dpa_factory, ["input", "weight", "grad_output"],
     NVFP4_USE + "mxfp8_factory or current_scaling_factory"),
]


@pytest.mark.parametrize("factory, tensor_types, match", REFUSED, ids=lambda v: getattr(v, "__name__", ""))
def test_the_nvfp4_factories_refuse_with_what_to_use_instead(gen, factory, tensor_types, match):
    for module_type in ("linear", "grouped_linear"):
        for tensor_type in tensor_types:
            with pytest.raises(NotImplementedError, match=f"{factory.__name__}: .*{match}"):
                factory(te.QuantizerRole(module_type, tensor_type))
    with pytest.raises(NotImplementedError, match=match), te.autocast(recipe=CustomRecipe(qfactory=factory)):
        te.Linear(64, 32)(randn(gen, 16, 64))


def test_the_nvfp4_roles_of_the_partly_backed_factories_are_refused(gen):
    for tensor_type in ("input", "weight"):
        with pytest.raises(NotImplementedError, match=NVFP4_USE + "mxfp8_factory"):
            nvfp4_row_scaled_fwd_mxfp8_bwd_factory(te.QuantizerRole("grouped_linear", tensor_type))
    with pytest.raises(NotImplementedError, match="DelayedScalingRequest"):
        nvfp4_linear_fp8_dpa_factory(te.QuantizerRole("dpa", "s"))
    for factory in (nvfp4_1d_weight_factory, nvfp4_row_scaled_fwd_high_precision_bwd_factory):
        with pytest.raises(NotImplementedError, match="NVFP4"):
            factory(None)
    with pytest.raises(TypeError, match="mxfp8_fwd_high_precision_bwd_factory: role must be a QuantizerRole"):
        mxfp8_fwd_high_precision_bwd_factory("linear_input")
