"""tex.rmsnorm_fwd and tex.dequantize (te_core.compat.te_norm_cast): Transformer Engine's binding
signatures and results, checked against float64 computations."""
from __future__ import annotations

import pytest
import torch

TOLERANCES = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
              torch.float8_e4m3fn: dict(rtol=0.125, atol=0.0675)}


def _rmsnorm64(x, weight, eps, zero_centered_gamma=False):
    x64 = x.double()
    rsigma = torch.rsqrt(x64.square().mean(dim=-1) + eps)
    gamma = weight.double() + 1 if zero_centered_gamma else weight.double()
    return x64 * rsigma.unsqueeze(-1) * gamma, rsigma


def _megatron_rms_norm_kernel(x, weight, eps):
    """Megatron-LM's _te_rms_norm_kernel (megatron/core/tensor_parallel/inference_layers.py), its TE
    path as written."""
    import transformer_engine.pytorch.cpp_extensions as tex
    from transformer_engine.pytorch.constants import TE_DType

    x_shape = x.shape
    x = x.view(-1, x.size(-1))
    out, _, _ = tex.rmsnorm_fwd(
        x, weight, eps, None, None, TE_DType[x.dtype], 16, False  # sm-margin  # zero centered gamma
    )
    out = out.view(*x_shape[:-1], -1)
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_megatrons_rms_norm_kernel(stand_in, dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 96).to(dtype)
    weight = (torch.rand(96) + 0.5).to(dtype)
    out = _megatron_rms_norm_kernel(x, weight, 1e-5)
    expected, _ = _rmsnorm64(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])


def test_rmsnorm_fwd_returns_te_results(stand_in):
    import transformer_engine_torch as tex

    torch.manual_seed(1)
    x = torch.randn(5, 3, 40, dtype=torch.bfloat16)
    weight = torch.randn(40, dtype=torch.bfloat16) * 0.1
    out, mu, rsigma = tex.rmsnorm_fwd(x, weight, 1e-6, None, None, tex.DType.kFloat32, 0, True)
    expected, rsigma64 = _rmsnorm64(x, weight, 1e-6, zero_centered_gamma=True)
    assert mu is None and out.dtype == torch.float32 and out.shape == x.shape
    # otype float32 from a bfloat16 input: computed in float32 and rounded once (never via bfloat16)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])
    assert rsigma.dtype == torch.float32 and rsigma.shape == (15,)
    torch.testing.assert_close(rsigma.double(), rsigma64.reshape(-1), **TOLERANCES[torch.float32])
    ln_out = torch.empty(5, 3, 40, dtype=torch.float32)
    written, _, _ = tex.rmsnorm_fwd(x, weight, 1e-6, ln_out, None, tex.DType.kFloat32, 0, True)
    assert written is ln_out
    torch.testing.assert_close(ln_out, out, rtol=0, atol=0)


def test_rmsnorm_fwd_quantizes_with_a_quantizer(stand_in):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch import Float8CurrentScalingQuantizer, Float8Tensor

    torch.manual_seed(2)
    x = torch.randn(17, 64)
    weight = torch.rand(64) + 0.5
    quantizer = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device="cpu")
    out, _, _ = tex.rmsnorm_fwd(x, weight, 1e-5, None, quantizer, tex.DType.kBFloat16, 0, False)
    assert isinstance(out, Float8Tensor) and out.dtype == torch.bfloat16 and out.shape == x.shape
    expected, _ = _rmsnorm64(x, weight, 1e-5)
    torch.testing.assert_close(out.dequantize(torch.float32).double(), expected, **TOLERANCES[torch.float8_e4m3fn])


def test_rmsnorm_fwd_refuses_bad_arguments(stand_in):
    import transformer_engine_torch as tex

    x, weight = torch.randn(4, 16), torch.randn(16)
    f32 = tex.DType.kFloat32
    with pytest.raises(ValueError, match="weight must be a high-precision 1-D tensor of input's last dimension"):
        tex.rmsnorm_fwd(x, torch.randn(8), 1e-5, None, None, f32, 0, False)
    with pytest.raises(ValueError, match="otype must be a high-precision DType.*got kFloat8E4M3; pass a quantizer"):
        tex.rmsnorm_fwd(x, weight, 1e-5, None, None, tex.DType.kFloat8E4M3, 0, False)
    with pytest.raises(TypeError, match="quantizer must be None or a quantizer of transformer_engine.pytorch"):
        tex.rmsnorm_fwd(x, weight, 1e-5, None, object(), f32, 0, False)
    with pytest.raises(ValueError, match=r"ln_out must be a plain tensor of input's shape \(4, 16\) in otype"):
        tex.rmsnorm_fwd(x, weight, 1e-5, torch.empty(4, 16, dtype=torch.bfloat16), None, f32, 0, False)
    with pytest.raises(ValueError, match="sm_margin must be an int >= 0"):
        tex.rmsnorm_fwd(x, weight, 1e-5, None, None, f32, -1, False)
    with pytest.raises(TypeError, match="input must be a float32, float16 or bfloat16"):
        tex.rmsnorm_fwd(x.int(), weight, 1e-5, None, None, f32, 0, False)


def test_dequantize(stand_in):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch import Float8CurrentScalingQuantizer

    torch.manual_seed(3)
    x = torch.randn(24, 48) * 3
    q = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device="cpu")(x)
    for otype, dtype in ((tex.DType.kFloat32, torch.float32), (tex.DType.kBFloat16, torch.bfloat16)):
        out = tex.dequantize(q, otype)
        assert out.dtype == dtype and out.shape == x.shape
        exact = q._data.double() * q._scale_inv.double()
        torch.testing.assert_close(out.double(), exact, **TOLERANCES[dtype])
        torch.testing.assert_close(out.double(), x.double(), **TOLERANCES[torch.float8_e4m3fn])
    with pytest.raises(TypeError, match="input must be a quantized tensor.*got a Tensor"):
        tex.dequantize(x, tex.DType.kFloat32)
    with pytest.raises(ValueError, match="otype must be a high-precision DType"):
        tex.dequantize(q, tex.DType.kFloat8E5M2)
