"""IdentityQuantizer and HybridQuantizer in CustomRecipe factories: slots kept in high precision,
and one quantizer per GEMM direction, run by te-core's modules as Transformer Engine runs them."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core import ops
from te_core.dtype import DType
from te_core.recipe import CustomRecipe

from .conftest import randn

BF16 = dict(rtol=1.6e-2, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)
MODULES = [te.Linear, te.LayerNormLinear, te.LayerNormMLP]


def fp8(role):
    """Current scaling: E5M2 for gradients, E4M3 for the rest (TE's test factory)."""
    grad = role.tensor_type == "grad_output"
    return te.Float8CurrentScalingQuantizer(DType.kFloat8E5M2 if grad else DType.kFloat8E4M3, device="cpu")


def identity(role):
    return te.IdentityQuantizer()


def fp8_forward_identity_backward(source):
    def factory(role):
        if role.tensor_type == "grad_output":
            return te.IdentityQuantizer()
        return te.HybridQuantizer(rowwise_quantizer=fp8(role), columnwise_quantizer=te.IdentityQuantizer(),
                                  columnwise_source=source)
    return factory


def twins(cls, *args, n=2):
    first = cls(*args, params_dtype=torch.bfloat16)
    rest = [cls(*args, params_dtype=torch.bfloat16) for _ in range(n - 1)]
    for module in rest:
        module.load_state_dict(first.state_dict())
    return [first, *rest]


def run(module, x, dy, recipe=None):
    x = x.clone().requires_grad_()
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x)
    y.backward(dy)
    return y, x.grad, [p.grad for p in module.parameters()]


def assert_bitwise(ref, got):
    (y0, dx0, dw0), (y1, dx1, dw1) = ref, got
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    torch.testing.assert_close(dx1, dx0, rtol=0, atol=0)
    assert len(dw0) == len(dw1)
    for a, b in zip(dw0, dw1):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("cls", MODULES)
def test_identity_in_every_slot_is_the_layer_without_autocast(gen, cls):
    a, b = twins(cls, 64, 96)
    x, dy = randn(gen, 2, 24, 64, dtype=torch.bfloat16), randn(gen, 2, 24, 64 if cls is te.LayerNormMLP else 96,
                                                               dtype=torch.bfloat16)
    assert_bitwise(run(a, x, dy), run(b, x, dy, CustomRecipe(qfactory=identity)))


@pytest.mark.parametrize("source, override", [("original", "high_precision"), ("rowwise_dequantized", "dequantized")])
@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear])
def test_identity_backward_is_the_backward_override(gen, cls, source, override):
    """FP8 forward, high-precision backward expressed per direction equals TE's global knob."""
    a, b = twins(cls, 64, 96)
    x, dy = randn(gen, 48, 64, scale=3.0, dtype=torch.bfloat16), randn(gen, 48, 96, dtype=torch.bfloat16)
    ref = run(a, x, dy, CustomRecipe(qfactory=fp8, backward_override=override))
    assert_bitwise(ref, run(b, x, dy, CustomRecipe(qfactory=fp8_forward_identity_backward(source))))


def test_identity_output_gradient_runs_the_backward_on_dequantized_fp8_operands(gen):
    """grad_output identity, input and weight FP8: the forward is the FP8 one; dgrad and wgrad run in
    high precision on dy and the forward's FP8 operands dequantized."""
    a, b = twins(te.Linear, 64, 96, n=2)
    x, dy = randn(gen, 48, 64, scale=2.0, dtype=torch.bfloat16), randn(gen, 48, 96, dtype=torch.bfloat16)
    factory = lambda role: te.IdentityQuantizer() if role.tensor_type == "grad_output" else fp8(role)  # noqa: E731
    y, dx, (dw, db) = run(b, x, dy, CustomRecipe(qfactory=factory))
    torch.testing.assert_close(y, run(a, x, dy, CustomRecipe(qfactory=fp8))[0], rtol=0, atol=0)
    e4m3 = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, device="cpu")
    x_q, w_q = e4m3(x).dequantize().double(), e4m3(b.weight.detach()).dequantize().double()
    torch.testing.assert_close(dx, (dy.double() @ w_q).to(dx.dtype), **BF16)
    torch.testing.assert_close(dw, (dy.double().t() @ x_q).to(dw.dtype), **BF16)
    torch.testing.assert_close(db, dy.double().sum(0).to(db.dtype), **BF16)


@pytest.fixture
def gemm_kinds(monkeypatch):
    """(kind, N) of every GEMM run: "fp8" or "hp", and the product's column count."""
    seen = []
    for name, kind in (("gemm_fp8", "fp8"), ("gemm", "hp")):
        op = getattr(ops, name)

        def spy(a, b, *args, _op=op, _kind=kind, **kwargs):
            seen.append((_kind, b.shape[0]))
            return _op(a, b, *args, **kwargs)
        monkeypatch.setattr(ops, name, spy)
    return seen


def test_identity_for_one_gemm_of_layernorm_mlp(gen, gemm_kinds):
    """fc2's roles identity, fc1's FP8: fc2's three GEMMs run in high precision, fc1's in FP8."""
    hidden, ffn = 64, 128
    a, b = twins(te.LayerNormMLP, hidden, ffn)
    x, dy = randn(gen, 32, hidden, dtype=torch.bfloat16), randn(gen, 32, hidden, dtype=torch.bfloat16)
    factory = lambda role: te.IdentityQuantizer() if role.name.endswith("fc2") else fp8(role)  # noqa: E731
    y, dx, _ = run(b, x, dy, CustomRecipe(qfactory=factory))
    # N: fc1's fprop ffn, dgrad and wgrad hidden (its K); fc2's fprop hidden, dgrad and wgrad ffn
    assert sorted(gemm_kinds) == sorted([("fp8", ffn), ("fp8", hidden), ("fp8", hidden),
                                         ("hp", hidden), ("hp", ffn), ("hp", ffn)])
    y_ref, dx_ref, _ = run(a, x, dy)
    torch.testing.assert_close(y, y_ref, **E4M3)
    torch.testing.assert_close(dx, dx_ref, **E4M3)


def test_hybrid_of_two_formats_takes_each_direction_from_its_quantizer(gen):
    """Forward current scaling, backward MXFP8: the output is the current-scaling layer's, the
    gradients the MXFP8 layer's (same dy), bit for bit."""
    a, b, c = twins(te.Linear, 64, 96, n=3)
    x, dy = randn(gen, 64, 64, scale=2.0, dtype=torch.bfloat16), randn(gen, 64, 96, dtype=torch.bfloat16)

    def mxfp8(role):
        return te.MXFP8Quantizer(DType.kFloat8E5M2 if role.tensor_type == "grad_output" else DType.kFloat8E4M3)

    def hybrid(role):
        if role.tensor_type == "grad_output":
            return mxfp8(role)
        return te.HybridQuantizer(rowwise_quantizer=fp8(role), columnwise_quantizer=mxfp8(role))

    y, dx, dw = run(c, x, dy, CustomRecipe(qfactory=hybrid))
    torch.testing.assert_close(y, run(a, x, dy, CustomRecipe(qfactory=fp8))[0], rtol=0, atol=0)
    _, dx_mx, dw_mx = run(b, x, dy, CustomRecipe(qfactory=mxfp8))
    assert_bitwise((y, dx_mx, dw_mx), (y, dx, dw))


def test_identity_quantizer_called_by_hand(gen):
    x = randn(gen, 6, 10, dtype=torch.bfloat16).requires_grad_()
    t = te.IdentityQuantizer()(x)
    assert isinstance(t, te.IdentityTensor) and t.dtype == torch.bfloat16
    torch.testing.assert_close(t.dequantize(), x.detach(), rtol=0, atol=0)
    (t * 3).sum().backward()  # the gradient reaches x unchanged, as through TE's quantizers
    torch.testing.assert_close(x.grad, torch.full_like(x, 3), rtol=0, atol=0)
    wide = te.IdentityQuantizer(dtype=torch.float32)(x.detach())
    assert wide.dequantize().dtype == torch.float32
    torch.testing.assert_close(wide.dequantize(), x.detach().float(), rtol=0, atol=0)
    dst = te.IdentityQuantizer().make_empty((6, 10), dtype=torch.bfloat16, device="cpu")
    src = randn(gen, 6, 10, dtype=torch.bfloat16)
    te.IdentityQuantizer().update_quantized(src, dst)
    torch.testing.assert_close(dst.dequantize(), src, rtol=0, atol=0)
    te.IdentityQuantizer().update_quantized(src * 2, dst, noop_flag=torch.ones(1))  # skipped
    torch.testing.assert_close(dst.dequantize(), src, rtol=0, atol=0)


def test_hybrid_quantizer_called_by_hand(gen):
    x = randn(gen, 32, 64, scale=4.0, dtype=torch.bfloat16)
    row = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, device="cpu")
    t = te.HybridQuantizer(rowwise_quantizer=row, columnwise_quantizer=te.IdentityQuantizer())(x)
    assert isinstance(t, te.HybridQuantizedTensor) and isinstance(t.columnwise_sub_storage, te.IdentityTensor)
    assert (row.rowwise_usage, row.columnwise_usage) == (True, False)
    e4m3 = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, device="cpu")(x).dequantize()
    torch.testing.assert_close(t.dequantize(), e4m3, rtol=0, atol=0)
    torch.testing.assert_close(t.dequantize(), x, **E4M3)
    torch.testing.assert_close(t.columnwise_sub_storage.dequantize(), x, rtol=0, atol=0)


def test_bad_arguments_say_what_to_do():
    cs = lambda: te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3)  # noqa: E731
    with pytest.raises(TypeError, match="rowwise_quantizer must be one of"):
        te.HybridQuantizer(rowwise_quantizer="fp8", columnwise_quantizer=cs())
    with pytest.raises(TypeError, match="columnwise_quantizer must be one of"):
        te.HybridQuantizer(rowwise_quantizer=cs(), columnwise_quantizer=te.HybridQuantizer(
            rowwise_quantizer=cs(), columnwise_quantizer=cs()))
    q = cs()
    with pytest.raises(ValueError, match="one object; pass two"):
        te.HybridQuantizer(rowwise_quantizer=q, columnwise_quantizer=q)
    with pytest.raises(ValueError, match="columnwise_source must be one of"):
        te.HybridQuantizer(rowwise_quantizer=cs(), columnwise_quantizer=cs(), columnwise_source="dequantized")
    with pytest.raises(TypeError, match="dtype must be None"):
        te.IdentityQuantizer(dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="rowwise must be True or False"):
        te.IdentityQuantizer(rowwise=1)
    with pytest.raises(TypeError, match="te.IdentityQuantizer, te.HybridQuantizer"):
        run(te.Linear(32, 32), torch.randn(16, 32), torch.randn(16, 32), CustomRecipe(qfactory=lambda role: object()))
    recipe = CustomRecipe(qfactory=fp8_forward_identity_backward("original"), backward_override="high_precision")
    with pytest.raises(ValueError, match="Drop backward_override"):
        run(te.Linear(32, 32), torch.randn(16, 32), torch.randn(16, 32), recipe)
