"""Reference LayerNorm / RMSNorm against float64 torch (forward and autograd gradients)."""
import pytest
import torch
import torch.nn.functional as F

from te_core.reference import norm

TOLS = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}
EPS = 1e-5


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.to(dtype).double(), **TOLS[dtype])


def ln64(x, w, b, zero_centered):
    gamma = w + 1 if zero_centered else w
    return F.layer_norm(x, (x.shape[-1],), gamma, b, EPS)


def rms64(x, w, zero_centered):
    gamma = w + 1 if zero_centered else w
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS) * gamma


def leaves(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_layernorm(dtype, zero_centered):
    x = (torch.randn(3, 5, 37) * 2 + 0.5).to(dtype)
    w, b = (torch.randn(37) * 0.3).to(dtype), torch.randn(37).to(dtype)
    dy = torch.randn(3, 5, 37).to(dtype)
    y, mean, rstd, amax = norm.layernorm_fwd(x, w, b, EPS, zero_centered_gamma=zero_centered)
    x64, w64, b64 = leaves(x, w, b)
    y64 = ln64(x64, w64, b64, zero_centered)
    assert y.dtype == dtype and amax is None
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (3, 5)
    close(y, y64, dtype)
    torch.testing.assert_close(mean.double(), x64.mean(-1), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(x64.var(-1, unbiased=False) + EPS), rtol=1.3e-6, atol=1e-5)
    y64.backward(dy.double())
    dx, dw, db = norm.layernorm_bwd(dy, x, mean, rstd, w, zero_centered_gamma=zero_centered)
    assert dx.dtype == dtype and dw.dtype == db.dtype == dtype
    close(dx, x64.grad, dtype)
    close(dw, w64.grad, dtype)
    close(db, b64.grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm(dtype, zero_centered):
    x = (torch.randn(7, 53) * 3).to(dtype)
    w = (torch.randn(53) * 0.3).to(dtype)
    dy = torch.randn(7, 53).to(dtype)
    y, rstd, amax = norm.rmsnorm_fwd(x, w, EPS, zero_centered_gamma=zero_centered)
    x64, w64 = leaves(x, w)
    y64 = rms64(x64, w64, zero_centered)
    assert amax is None and rstd.shape == (7,) and rstd.dtype == torch.float32
    close(y, y64, dtype)
    torch.testing.assert_close(rstd.double(), torch.rsqrt(x64.square().mean(-1) + EPS), rtol=1.3e-6, atol=1e-5)
    y64.backward(dy.double())
    dx, dw = norm.rmsnorm_bwd(dy, x, rstd, w, zero_centered_gamma=zero_centered)
    assert dx.dtype == dw.dtype == dtype
    close(dx, x64.grad, dtype)
    close(dw, w64.grad, dtype)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_output_is_the_cast_of_the_hp_output(fp8_dtype):
    x, w, b = torch.randn(9, 40) * 4, torch.randn(40) * 50, torch.randn(40)
    scale = torch.tensor([3.0])
    fmax = 448.0 if fp8_dtype == torch.float8_e4m3fn else 57344.0
    y_hp, _, _, _ = norm.layernorm_fwd(x, w, b, EPS)
    y8, mean, rstd, amax = norm.layernorm_fwd(x, w, b, EPS, fp8_scale=scale, fp8_dtype=fp8_dtype)
    assert y8.dtype == fp8_dtype
    want = torch.clamp(y_hp * 3.0, -fmax, fmax).to(fp8_dtype)
    assert torch.equal(y8.view(torch.uint8), want.view(torch.uint8))
    assert amax.item() == y_hp.abs().max().item()
    r_hp, _, _ = norm.rmsnorm_fwd(x, w, EPS)
    r8, _, ramax = norm.rmsnorm_fwd(x, w, EPS, fp8_scale=scale, fp8_dtype=fp8_dtype)
    want = torch.clamp(r_hp * 3.0, -fmax, fmax).to(fp8_dtype)
    assert torch.equal(r8.view(torch.uint8), want.view(torch.uint8))
    assert ramax.item() == r_hp.abs().max().item()


def test_bad_inputs():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\); expected \(8,\), the last dimension of x"):
        norm.layernorm_fwd(x, torch.ones(7), torch.zeros(8), EPS)
    with pytest.raises(ValueError, match=r"bias has shape \(8, 1\)"):
        norm.layernorm_fwd(x, torch.ones(8), torch.zeros(8, 1), EPS)
    with pytest.raises(ValueError, match=r"fp8_scale and fp8_dtype go together"):
        norm.rmsnorm_fwd(x, torch.ones(8), EPS, fp8_scale=torch.ones(1))
    with pytest.raises(TypeError, match=r"x has dtype torch.int64"):
        norm.rmsnorm_fwd(torch.ones(4, 8, dtype=torch.long), torch.ones(8), EPS)
    with pytest.raises(ValueError, match=r"dy has shape \(4, 7\); it must match x \(4, 8\)"):
        norm.rmsnorm_bwd(torch.randn(4, 7), x, torch.ones(4), torch.ones(8))
    with pytest.raises(ValueError, match=r"rstd has shape \(5,\); expected x.shape\[:-1\] = \(4,\)"):
        norm.layernorm_bwd(x, x, torch.ones(4), torch.ones(5), torch.ones(8))


def test_bwd_add_sums_in_float32_and_names_a_bad_add():
    g = torch.Generator().manual_seed(11)
    x, dy = torch.randn(6, 16, generator=g).bfloat16(), torch.randn(6, 16, generator=g).bfloat16()
    add = (torch.randn(6, 16, generator=g) * 3).bfloat16()
    w = torch.rand(16, generator=g).bfloat16() + 0.5
    _, mean, rstd, _ = norm.layernorm_fwd(x, w, torch.zeros(16).bfloat16(), EPS)
    xhat = (x.double() - mean.double()[:, None]) * rstd.double()[:, None]
    gy = dy.double() * w.double()
    dx64 = rstd.double()[:, None] * (gy - gy.mean(-1, keepdim=True) - xhat * (gy * xhat).mean(-1, keepdim=True))
    got = norm.layernorm_bwd_add(dy, x, mean, rstd, w, add)[0]
    torch.testing.assert_close(got.double(), dx64 + add.double(), rtol=1.6e-2, atol=1e-5)
    with pytest.raises(ValueError, match=r"add is torch.float32 \(6, 16\); it must match x \(torch.bfloat16 \(6, 16\)\)"):
        norm.layernorm_bwd_add(dy, x, mean, rstd, w, add.float())
    with pytest.raises(ValueError, match=r"add is torch.bfloat16 \(6, 8\); it must match x"):
        norm.rmsnorm_bwd_add(dy, x, rstd, w, add[:, :8])
