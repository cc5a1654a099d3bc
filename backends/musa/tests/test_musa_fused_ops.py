"""rmsnorm, swiglu and rope: the backend's Python around muDNN kernels, with the kernels replaced
by CPU stand-ins (musa_kernel_fakes), checked against float64 math written from the contract."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import musa_kernel_fakes as fakes
from te_backend_musa.ops import activation, norm, rope

TOL = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}
E4M3 = torch.float8_e4m3fn


@pytest.fixture
def kernels(monkeypatch, fake_musa):
    fake_musa(arch=(3, 1))
    monkeypatch.setattr(norm, "_forward_kernel", lambda: fakes.rmsnorm_forward)
    monkeypatch.setattr(norm, "_backward_kernel", lambda: fakes.rmsnorm_backward)
    monkeypatch.setattr(F, "swish_glu", fakes.swish_glu, raising=False)
    monkeypatch.setattr(F, "rope", fakes.rope, raising=False)


def _close(got, want, dtype, scale=1.0):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=atol * scale)


# -- RMSNorm -----------------------------------------------------------------------------------
def _rmsnorm64(x, w, eps, zero_centered):
    x, g = x.double(), w.double() + (1 if zero_centered else 0)
    rstd = torch.rsqrt(x.pow(2).mean(-1) + eps)
    return x * rstd[..., None] * g, rstd


@pytest.mark.parametrize("dtype, zero_centered", [
    (torch.float32, False), (torch.float32, True), (torch.bfloat16, False)  # bf16 + zero-centered declines
])
@pytest.mark.parametrize("shape", [(6, 42, 123), (5, 64)])
def test_rmsnorm_fwd_bwd(kernels, dtype, zero_centered, shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.5).to(dtype)
    y, rstd, amax = norm.rmsnorm_fwd(x, w, 1e-5, zero_centered_gamma=zero_centered)
    want, want_rstd = _rmsnorm64(x, w, 1e-5, zero_centered)
    assert y.dtype == dtype and amax is None and rstd.dtype == torch.float32 and rstd.shape == shape[:-1]
    _close(y, want, dtype, scale=10)
    _close(rstd, want_rstd, torch.float32)

    dy = torch.randn(shape, generator=g).to(dtype)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    _rmsnorm64(xr, wr, 1e-5, zero_centered)[0].backward(dy.double())
    dx, dw = norm.rmsnorm_bwd(dy, x, rstd, w, zero_centered_gamma=zero_centered)
    assert dx.dtype == dtype and dw.dtype == w.dtype
    _close(dx, xr.grad, dtype, scale=100)
    _close(dw, wr.grad, dtype, scale=100)


def test_rmsnorm_fp8_output_is_norm_then_cast(kernels):
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 96, generator=g), torch.randn(96, generator=g)
    scale = torch.tensor([300.0])
    data, rstd, amax = norm.rmsnorm_fwd(x, w, 1e-6, fp8_scale=scale, fp8_dtype=E4M3)
    y, _, _ = norm.rmsnorm_fwd(x, w, 1e-6)
    assert data.dtype == E4M3 and amax.shape == () and amax.dtype == torch.float32
    assert amax.item() == y.abs().max().item()
    expected = (y * 300.0).clamp(-448, 448).to(E4M3)
    assert (y.abs() * 300 > 448).any()  # some values saturate
    assert torch.equal(data.view(torch.uint8), expected.view(torch.uint8))


def test_rmsnorm_supports(kernels):
    x = torch.randn(4, 8).bfloat16()
    assert norm.rmsnorm_fwd_supports(x, torch.ones(8).bfloat16(), 1e-5) == (True, "")
    ok, why = norm.rmsnorm_fwd_supports(x, torch.ones(8), 1e-5)
    assert not ok and "weight torch.float32 differs from x torch.bfloat16" in why
    ok, why = norm.rmsnorm_fwd_supports(x.double(), torch.ones(8).double(), 1e-5)
    assert not ok and "float32, float16 or bfloat16" in why
    ok, why = norm.rmsnorm_bwd_supports(x.float(), x, torch.ones(4), torch.ones(8).bfloat16())
    assert not ok and "dy torch.float32 differs" in why
    ok, why = norm.rmsnorm_bwd_supports(x, x, torch.ones(4), torch.ones(8).bfloat16(), zero_centered_gamma=True)
    assert not ok and "rounding 1 + weight to 16 bits" in why
    assert norm.rmsnorm_fwd_supports(x.float(), torch.ones(8), 1e-5, zero_centered_gamma=True) == (True, "")


# -- SwiGLU ------------------------------------------------------------------------------------
def _swiglu64(x):
    a, b = x.double().chunk(2, dim=-1)
    return a * torch.sigmoid(a) * b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_fwd_bwd(kernels, dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 42, 2 * 61, generator=g).to(dtype)
    y, amax = activation.activation_fwd(x, "swiglu")
    assert amax is None and y.shape == (6, 42, 61) and y.dtype == dtype
    _close(y, _swiglu64(x), dtype, scale=10)
    dy = torch.randn(6, 42, 61, generator=g).to(dtype)
    xr = x.double().requires_grad_()
    _swiglu64(xr).backward(dy.double())
    dx = activation.activation_bwd(dy, x, "swiglu")
    assert dx.shape == x.shape and dx.dtype == dtype and not x.requires_grad
    _close(dx, xr.grad, dtype, scale=10)


def test_swiglu_fp8_output(kernels):
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    data, amax = activation.activation_fwd(x, "swiglu", fp8_scale=torch.tensor([3.0]), fp8_dtype=E4M3)
    y = _swiglu64(x).float()
    assert torch.equal(data.view(torch.uint8), (y * 3.0).clamp(-448, 448).to(E4M3).view(torch.uint8))
    torch.testing.assert_close(amax, y.abs().max())


def test_swiglu_supports(kernels, fake_musa):
    x = torch.randn(4, 8)
    assert activation.activation_fwd_supports(x, "swiglu") == (True, "")
    ok, why = activation.activation_fwd_supports(x, "gelu")
    assert not ok and "activation 'gelu' has no muDNN kernel" in why
    ok, why = activation.activation_fwd_supports(torch.randn(4, 7), "swiglu")
    assert not ok and "even last dimension" in why
    fake_musa(arch=(2, 1))
    ok, why = activation.activation_bwd_supports(x, x, "swiglu")
    assert not ok and "only on arch >= 2.2, device is mp_21" in why


# -- RoPE --------------------------------------------------------------------------------------
def _rope64(x, freqs, fmt, interleaved):
    xs = (x if fmt == "sbhd" else x.transpose(0, 1)).double()
    s, r = xs.shape[0], freqs.shape[-1]
    f = freqs[:s].double()
    part, rest = xs[..., :r], xs[..., r:]
    if interleaved:
        ang_e, ang_o = f[..., 0::2], f[..., 1::2]  # channel d reads angle d, as TE
        even, odd = part[..., 0::2], part[..., 1::2]
        out = torch.stack((even * ang_e.cos() - odd * ang_e.sin(), odd * ang_o.cos() + even * ang_o.sin()), -1).flatten(-2)
    else:
        x1, x2 = part[..., : r // 2], part[..., r // 2 :]
        out = part * f.cos() + torch.cat((-x2, x1), -1) * f.sin()
    y = torch.cat((out, rest), -1)
    return y if fmt == "sbhd" else y.transpose(0, 1)


def _freqs(s, r, interleaved, g):
    half = torch.rand(s + 3, 1, 1, r // 2, generator=g) * 6
    # interleaved: TE's layout [f0, f0, f1, f1, ...] (each pair's channels share the angle)
    return torch.stack((half, half), -1).flatten(-2) if interleaved else torch.cat((half, half), -1)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [32, 20])
def test_rope_fwd_bwd(kernels, fmt, interleaved, rot):
    g = torch.Generator().manual_seed(6)
    s, b = 7, 3
    shape = (s, b, 5, 32) if fmt == "sbhd" else (b, s, 5, 32)
    x = torch.randn(shape, generator=g).bfloat16()
    freqs = _freqs(s, rot, interleaved, g)
    y = rope.rope_fwd(x, freqs, tensor_format=fmt, interleaved=interleaved)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    _close(y, _rope64(x, freqs, fmt, interleaved), torch.bfloat16, scale=10)
    assert torch.equal(y[..., rot:], x[..., rot:])
    dy = torch.randn(shape, generator=g).bfloat16()
    xr = x.double().requires_grad_()
    _rope64(xr, freqs, fmt, interleaved).backward(dy.double())
    dx = rope.rope_bwd(dy, freqs, tensor_format=fmt, interleaved=interleaved)
    _close(dx, xr.grad, torch.bfloat16, scale=10)
    # angles of any values, not only pairs built alike: the backward is still the exact transpose
    other = torch.rand(s + 3, 1, 1, rot, generator=g) * 6
    xr = x.double().requires_grad_()
    _rope64(xr, other, fmt, interleaved).backward(dy.double())
    _close(rope.rope_bwd(dy, other, tensor_format=fmt, interleaved=interleaved), xr.grad, torch.bfloat16, scale=10)


def test_rope_supports(kernels, fake_musa):
    x, f = torch.randn(4, 2, 3, 16), torch.randn(4, 1, 1, 16)
    assert rope.rope_supports(x, f) == (True, "")
    ok, why = rope.rope_supports(x, f, tensor_format="thd")
    assert not ok and "tensor_format 'thd'" in why
    ok, why = rope.rope_supports(x, torch.randn(3, 1, 1, 16))
    assert not ok and "is not (s >= 4, 1, 1, r)" in why
    ok, why = rope.rope_supports(x, torch.randn(4, 1, 1, 18))
    assert not ok and "must be even and in (0, 16]" in why
    fake_musa(arch=(2, 1))
    ok, why = rope.rope_supports(x, f)
    assert not ok and "device is mp_21" in why


def test_against_reference_backend(kernels):
    """Where te_core's reference implementations exist, the backend agrees with them."""
    impls = pytest.importorskip("te_core.reference.plugin").implementations
    try:
        ref = impls()
    except ImportError as exc:
        pytest.skip(f"reference backend incomplete: {exc}")
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(6, 42, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    for got, want in zip(norm.rmsnorm_fwd(x, w, 1e-5)[:2], ref["rmsnorm_fwd"](x, w, 1e-5)[:2]):
        _close(got, want, torch.bfloat16, scale=10)
    _close(activation.activation_fwd(x, "swiglu")[0], ref["activation_fwd"](x, "swiglu")[0], torch.bfloat16, scale=10)
    xr, fr = torch.randn(7, 2, 3, 32, generator=g), torch.rand(7, 1, 1, 32, generator=g)
    for inter in (False, True):
        _close(rope.rope_fwd(xr, fr, interleaved=inter), ref["rope_fwd"](xr, fr, interleaved=inter), torch.float32)


def _fused_cases():
    from te_core.testing.cases import CASES

    return [c for c in CASES if c.op in FUSED]


FUSED = {"rmsnorm_fwd": (norm.rmsnorm_fwd, norm.rmsnorm_fwd_supports),
         "rmsnorm_bwd": (norm.rmsnorm_bwd, norm.rmsnorm_bwd_supports),
         "activation_fwd": (activation.activation_fwd, activation.activation_fwd_supports),
         "activation_bwd": (activation.activation_bwd, activation.activation_bwd_supports),
         "rope_fwd": (rope.rope_fwd, rope.rope_supports), "rope_bwd": (rope.rope_bwd, rope.rope_supports)}


@pytest.mark.parametrize("case", _fused_cases(), ids=[c.id for c in _fused_cases()])
def test_conformance_cases_the_fused_ops_take(kernels, case):
    """The conformance kit's cases, on the Python around the muDNN kernels (their CPU stand-ins):
    every case supports() accepts matches the reference at the kit's tolerances. An FP8 output
    computed in 16 bits and cast again rounds twice, which this catches."""
    from te_core.reference.plugin import implementations
    from te_core.testing.runner import run_case

    fn, supports = FUSED[case.op]
    args, kwargs = case.inputs()
    ok, why = supports(*args, **kwargs)
    if not ok:
        pytest.skip(f"declined by supports(): {why}")
    run_case(case, fn, implementations()[case.op], torch.device("cpu"))
