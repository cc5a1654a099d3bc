"""Behaviour that Transformer Engine's own fusible-operation tests (tests/pytorch/test_fusible_ops.py)
rely on, checked against float64 torch with TE's tolerances. Reference backend, CPU."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.modules import fusible_ops as te_ops
from te_core.recipe import DelayedScaling

FP32 = dict(rtol=1.3e-6, atol=1e-5)
BF16 = dict(rtol=1.6e-2, atol=1e-5)


def _fp8_values(shape, dtype):
    """Fresh random values that E4M3 holds exactly at scale 1 (as TE's tests make them): some in its
    subnormal range, which a scale of 448 / amax would round again."""
    return torch.rand(shape).to(torch.float8_e4m3fn).to(dtype)


def _fp8_linear(kind: str, dtype):
    with te.quantized_model_init(enabled=True, recipe=DelayedScaling()):
        if kind == "ops.Linear":
            return te_ops.Linear(64, 32, bias=False, device="cpu", dtype=dtype)
        return te.Linear(64, 32, bias=False, params_dtype=dtype)


@pytest.mark.parametrize("kind", ["ops.Linear", "te.Linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_values_copied_into_a_fresh_delayed_scaling_weight_stay_exact(kind, dtype):
    """TE's tests copy FP8-representable values into a weight made under quantized_model_init and
    compare a high-precision forward with plain torch at the dtype's tolerance: the copy must keep
    those values exactly (TE casts them with its initial scale of 1)."""
    torch.manual_seed(1)
    op = _fp8_linear(kind, dtype)
    w = _fp8_values((32, 64), dtype)
    with torch.no_grad():
        op.weight.copy_(w)
    assert torch.equal(op.weight.dequantize(), w)
    x = torch.rand(16, 64, dtype=dtype)
    y_ref = torch.nn.functional.linear(x.double(), w.double())
    torch.testing.assert_close(op(x).double(), y_ref, **(FP32 if dtype == torch.float32 else BF16))


def test_values_fp8_cannot_hold_still_take_their_own_amax_scale():
    """Values no power-of-two scale keeps exactly are cast by their own amax, as before."""
    torch.manual_seed(2)
    op = _fp8_linear("ops.Linear", torch.float32)
    w = torch.randn(32, 64) * 3.0
    with torch.no_grad():
        op.weight.copy_(w)
    torch.testing.assert_close(op.weight.dequantize(), w, rtol=0.125, atol=0.0675)
    assert torch.allclose(op.weight._scale_inv, w.abs().max() / 448.0, rtol=1e-6)


@pytest.mark.parametrize("view", ["detach", "t", "index", "view"])
def test_views_of_an_fp8_weight_under_inference_mode(view):
    """TE's inference loops read a quantized weight through detach() inside torch.inference_mode;
    as for a plain parameter, the view works and is no inference tensor."""
    torch.manual_seed(3)
    op = _fp8_linear("ops.Linear", torch.float32)
    w = torch.randn(32, 64)
    with torch.no_grad():
        op.weight.copy_(w)
    expected = op.weight.dequantize().double()
    take = {"detach": lambda t: t.detach(), "t": lambda t: t.t().t(), "index": lambda t: t[:],
            "view": lambda t: t.view(32, 64)}[view]
    plain = torch.nn.Parameter(w.clone())
    with torch.inference_mode():
        out = take(op.weight)
        assert out.is_inference() == take(plain).is_inference()
        got = out.dequantize() if isinstance(out, te.QuantizedTensor) else out
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("op_cls", ["ScaledSwiGLU", "ScaledSiTUGLU", "ScaledClampedQGeGLU"])
def test_scaled_glus_refuse_activation_recompute_with_tes_words(op_cls):
    """TE's message: '<op> does not support activation recomputation'; tests match on it."""
    cls = getattr(te_ops, op_cls)
    assert cls().activation_recompute_in_mlp is False
    with pytest.raises(ValueError, match="does not support activation recomputation"):
        cls(activation_recompute_in_mlp=True)
