"""cache_quantized_input=True of the fusible activations (te_core.modules.fusible_ops), as in
Transformer Engine: the input is saved for the backward as E4M3 with a current (per-tensor) scale,
row-wise only, whatever te.autocast says; the output does not change, and the gradient is the
derivative at the dequantized FP8 input. Checked on the reference backend: the bytes autograd
saves (through saved-tensor hooks) against an E4M3 rounding computed here, and every gradient
against float64 at that rounded input."""
from __future__ import annotations

import math

import pytest
import torch

import te_core as te
from te_core.modules import fusible_ops as ops
from te_core.quantization import QuantizedTensor
from te_core.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling

FP32 = dict(rtol=1.3e-6, atol=1e-5)
BF16 = dict(rtol=1.6e-2, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)
TOLS = {torch.float32: FP32, torch.bfloat16: BF16}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
E4M3_MAX = 448.0

# the saved bytes are compared with the reference backend's cast, bit for bit
pytestmark = pytest.mark.reference_only


def _halves(x):
    return x.chunk(2, dim=-1)


def _gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return torch.relu(x) ** 2


def _gated(act):
    return lambda x: act(_halves(x)[0]) * _halves(x)[1]


def _clamped_swiglu(x, limit=7.0, alpha=1.702, offset=1.0):
    a, b = _halves(x)
    a, b = a.clamp(max=limit), b.clamp(-limit, limit)
    return a * torch.sigmoid(alpha * a) * (b + offset)


def _situglu(x, beta1=4.0, beta2=25.0):
    a, b = _halves(x)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * beta2 * torch.tanh(b / beta2)


def _deinterleaved(x, block):
    """Interleaved blocks of `block` gate and `block` linear columns, gate columns first."""
    return x.reshape(*x.shape[:-1], -1, 2, block).transpose(-3, -2).reshape(x.shape)


# name -> (the operation with cache_quantized_input=cache, its float64 formula in the input's layout)
CASES = {
    "GELU": (lambda cache: ops.GELU(cache_quantized_input=cache), _gelu),
    "ReLU": (lambda cache: ops.ReLU(cache_quantized_input=cache), torch.relu),
    "SiLU": (lambda cache: ops.SiLU(cache_quantized_input=cache), torch.nn.functional.silu),
    "QGELU": (lambda cache: ops.QGELU(cache_quantized_input=cache), _qgelu),
    "SReLU": (lambda cache: ops.SReLU(cache_quantized_input=cache), _srelu),
    "GLU": (lambda cache: ops.GLU(cache_quantized_input=cache), _gated(torch.sigmoid)),
    "GEGLU": (lambda cache: ops.GEGLU(cache_quantized_input=cache), _gated(_gelu)),
    "ReGLU": (lambda cache: ops.ReGLU(cache_quantized_input=cache), _gated(torch.relu)),
    "QGEGLU": (lambda cache: ops.QGEGLU(cache_quantized_input=cache), _gated(_qgelu)),
    "SReGLU": (lambda cache: ops.SReGLU(cache_quantized_input=cache), _gated(_srelu)),
    "SwiGLU": (lambda cache: ops.SwiGLU(cache_quantized_input=cache), _gated(torch.nn.functional.silu)),
    "SwiGLU-interleaved": (lambda cache: ops.SwiGLU(cache_quantized_input=cache, glu_interleave_size=3),
                           lambda x: _gated(torch.nn.functional.silu)(_deinterleaved(x, 3))),
    "ClampedSwiGLU": (lambda cache: ops.ClampedSwiGLU(cache_quantized_input=cache, limit=1.5),
                      lambda x: _clamped_swiglu(x, limit=1.5)),
    "SiTUGLU": (lambda cache: ops.SiTUGLU(cache_quantized_input=cache, beta1=1.5, beta2=2.0),
                lambda x: _situglu(x, 1.5, 2.0)),
}
# derivatives that are piecewise constant: the FP8 rounding leaves their gradient unchanged
STEP_DERIVATIVE = {"ReLU"}


def _input(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.randn(5, 3, 24).to(dtype).requires_grad_()


def _e4m3_rounding(x):
    """(E4M3 bytes, their dequantized value in x's dtype) with Transformer Engine's current
    scaling: scale = 448 / amax in float32, round to nearest even with saturation."""
    x32 = x.detach().float()
    scale = torch.tensor(E4M3_MAX) / x32.abs().amax()
    data = (x32 * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return data, (data.float() * torch.reciprocal(scale)).to(x.dtype)


def _run(op, x, dy):
    """op(x) and x's gradient, with the tensors autograd saved for the backward."""
    x = x.detach().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ops.Sequential(op)(x)
    y.backward(dy)
    return y, x.grad, saved


@DTYPES
@pytest.mark.parametrize("name", list(CASES))
def test_saved_input_is_e4m3_current_scaled_row_wise(name, dtype):
    """The one tensor saved is the FP8 copy: E4M3 bytes equal to the current-scaled rounding of the
    input (1 byte an element, no column-wise copy), where cache_quantized_input=False saves the
    input in its own precision."""
    make, _ = CASES[name]
    x = _input(dtype)
    dy = torch.randn(make(False)(x).shape, dtype=dtype)
    *_, plain = _run(make(False), x, dy)
    assert not any(isinstance(t, QuantizedTensor) for t in plain)  # (SiTUGLU's autograd saves more than x)
    assert sum(t.numel() * t.element_size() for t in plain) >= x.numel() * x.element_size()
    *_, saved = _run(make(True), x, dy)
    assert len(saved) == 1 and isinstance(saved[0], QuantizedTensor), saved
    fp8 = saved[0]
    assert fp8.fp8_dtype == torch.float8_e4m3fn and not fp8.has_columnwise and fp8.dtype == dtype
    data, scale_inv, _ = fp8.rowwise()
    assert data.untyped_storage().nbytes() == x.numel()  # 1 byte an element
    want_data, _ = _e4m3_rounding(x)
    if name == "SwiGLU-interleaved":  # the copy is of the reordered input (the same values)
        want_data = _deinterleaved(want_data.view(torch.uint8), 3).view(torch.float8_e4m3fn)
    assert torch.equal(data.view(torch.uint8), want_data.reshape(data.shape).view(torch.uint8))
    torch.testing.assert_close(scale_inv, x.detach().float().abs().amax().reshape(1) / E4M3_MAX, rtol=1.3e-7, atol=0)


@DTYPES
@pytest.mark.parametrize("name", list(CASES))
def test_gradient_is_the_derivative_at_the_fp8_input(name, dtype):
    """Output bit for bit as without the option; the input's gradient equals float64's derivative at
    the dequantized FP8 input (to the input dtype's tolerance), is within E4M3's tolerance of the
    exact one, and differs from the uncached gradient (where the derivative is not a step)."""
    make, formula = CASES[name]
    x = _input(dtype, seed=1)
    dy = torch.randn(make(False)(x).shape, dtype=dtype)
    y_plain, dx_plain, _ = _run(make(False), x, dy)
    y, dx, _ = _run(make(True), x, dy)
    assert torch.equal(y, y_plain)
    _, x_rounded = _e4m3_rounding(x)
    for leaf_value, tols in ((x_rounded, TOLS[dtype]), (x, E4M3)):
        leaf = leaf_value.detach().double().requires_grad_()
        formula(leaf).backward(dy.double())
        torch.testing.assert_close(dx.double(), leaf.grad, **tols)
    if name not in STEP_DERIVATIVE:
        assert not torch.allclose(dx, dx_plain, **TOLS[dtype]), "the gradient did not read the FP8 copy"


@pytest.mark.parametrize("recipe", [DelayedScaling(fp8_format=Format.HYBRID), Float8CurrentScaling(),
                                    MXFP8BlockScaling(), None], ids=["delayed-hybrid", "current", "mxfp8", "off"])
def test_cache_is_e4m3_current_scaled_whatever_the_recipe(recipe):
    """As Transformer Engine's: the same E4M3 per-tensor copy under every recipe, and without FP8."""
    x = _input(torch.float32, seed=2)
    dy = torch.randn(5, 3, 12)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        _, dx, saved = _run(ops.SwiGLU(cache_quantized_input=True), x, dy)
    data, _, _ = saved[0].rowwise()
    want_data, _ = _e4m3_rounding(x)
    assert saved[0].fp8_dtype == torch.float8_e4m3fn
    assert torch.equal(data.view(torch.uint8), want_data.reshape(data.shape).view(torch.uint8))
    _, dx_off, _ = _run(ops.SwiGLU(cache_quantized_input=True), x, dy)
    assert torch.equal(dx, dx_off)


def test_retain_graph_and_second_backward():
    """The FP8 copy serves a second backward under retain_graph=True; without it, a clear error."""
    x = _input(torch.float32, seed=3)
    y = ops.GEGLU(cache_quantized_input=True)(x)
    dy = torch.randn_like(y)
    (first,) = torch.autograd.grad(y, x, dy, retain_graph=True)
    (second,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(first, second)
    with pytest.raises(RuntimeError, match="second time|retain_graph"):
        torch.autograd.grad(y, x, dy)


@pytest.mark.parametrize("name", ["GELU", "SwiGLU", "ClampedSwiGLU", "SiTUGLU"])
def test_cache_quantized_input_is_a_bool(name):
    assert getattr(ops, name)(cache_quantized_input=True).cache_quantized_input is True
    assert getattr(ops, name)().cache_quantized_input is False
    with pytest.raises(TypeError, match=f"ops.{name}.*cache_quantized_input"):
        getattr(ops, name)(cache_quantized_input="yes")


@pytest.mark.parametrize("name", ["SwiGLU", "SiTUGLU"])
def test_under_torch_compile(name):
    """Traced, the FP8 copy is a plain-tensor operand held for the backward: the same output and
    gradient as eagerly (aot_eager runs the traced graph without re-fusing it)."""
    torch._dynamo.reset()
    make, _ = CASES[name]
    op = make(True)
    x = _input(torch.float32, seed=4)
    dy = torch.randn(5, 3, 12)
    y, dx, _ = _run(op, x, dy)
    x_traced = x.detach().requires_grad_()
    y_traced = torch.compile(op, backend="aot_eager", fullgraph=True)(x_traced)
    y_traced.backward(dy)
    torch._dynamo.reset()
    assert torch.equal(y_traced, y) and torch.equal(x_traced.grad, dx)
