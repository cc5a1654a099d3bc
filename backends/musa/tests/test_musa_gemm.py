"""gemm_fp8 and gemm: the Python around torch._scaled_mm / F.linear, run on CPU torch (whose
_scaled_mm takes the same arguments) against float64, and the supports() decisions."""
from __future__ import annotations

import pytest
import torch

from te_backend_musa.ops import gemm as musa_gemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_TOL = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5)}


def _cpu_scaled_mm() -> bool:
    a = torch.ones(16, 16).to(E4M3)
    try:
        return torch._scaled_mm(a, a.t(), torch.ones(()), torch.ones(()), out_dtype=torch.float32) is not None
    except RuntimeError:  # torch 2.7 has no CPU kernel (NotImplementedError)
        return False


ON_CPU_SCALED_MM = pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU _scaled_mm to stand in for "
                                      "torch_musa's (torch 2.7)")


def _operands(m, n, k, a_dtype=E4M3, b_dtype=E4M3, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 4).to(a_dtype)
    b = (torch.randn(n, k, generator=g) * 4).to(b_dtype)
    return a, b, g


def _expected(a, b, sa, sb, bias=None):
    y = (a.double() * sa.double()) @ (b.double() * sb.double()).T
    return y if bias is None else y + bias.double()


def _close(got, want, dtype):
    rtol, atol = FP8_TOL[dtype]
    # One rounding of a float32 accumulation: allow the output dtype's rounding of |y|.
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=rtol, atol=atol + want.abs().max().item() * 1e-6)


@ON_CPU_SCALED_MM
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_dtype, b_dtype", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)])
def test_tensorwise(out_dtype, a_dtype, b_dtype):
    a, b, g = _operands(32, 48, 64, a_dtype, b_dtype)
    sa, sb = torch.rand(1, generator=g) + 0.5, torch.rand(1, generator=g) + 0.5
    y = musa_gemm.gemm_fp8(a, b, sa, sb, out_dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == (32, 48)
    _close(y, _expected(a, b, sa, sb), out_dtype)


@ON_CPU_SCALED_MM
def test_rowwise_scales_are_reshaped():
    a, b, g = _operands(48, 32, 16)
    sa, sb = torch.rand(48, 1, generator=g) + 0.5, torch.rand(32, 1, generator=g) + 0.5
    scale_a, scale_b = musa_gemm.scaled_mm_scales(sa, sb, "rowwise", 48, 32)
    assert scale_a.shape == (48, 1) and scale_b.shape == (1, 32)
    y = musa_gemm.gemm_fp8(a, b, sa, sb, out_dtype=torch.float32, scaling="rowwise")
    _close(y, _expected(a, b, sa, sb), torch.float32)


@ON_CPU_SCALED_MM
@pytest.mark.parametrize("out_dtype, bias_dtype, plan", [
    (torch.bfloat16, torch.bfloat16, (torch.bfloat16, True)),
    # MUSA takes a float32 bias only with a float32 output: computed in float32, cast once
    (torch.bfloat16, torch.float32, (torch.float32, True)),
    (torch.float32, torch.float32, (torch.float32, True)),
    (torch.float32, torch.bfloat16, (torch.float32, False)),
    (torch.float16, torch.float16, (torch.float16, True)),
])
def test_bias(out_dtype, bias_dtype, plan):
    a, b, g = _operands(16, 64, 32)
    sa, sb = torch.tensor([0.75]), torch.tensor([1.25])
    bias = torch.randn(64, generator=g).to(bias_dtype)
    assert musa_gemm.scaled_mm_plan(bias, out_dtype, accumulate=False) == plan
    y = musa_gemm.gemm_fp8(a, b, sa, sb, out_dtype=out_dtype, bias=bias)
    _close(y, _expected(a, b, sa, sb, bias), out_dtype)


@ON_CPU_SCALED_MM
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_out_and_accumulate(out_dtype):
    a, b, g = _operands(32, 16, 48)
    sa, sb = torch.tensor([0.5]), torch.tensor([2.0])
    base = torch.randn(32, 16, generator=g).to(out_dtype)
    out = base.clone()
    ret = musa_gemm.gemm_fp8(a, b, sa, sb, out_dtype=out_dtype, out=out, accumulate=True)
    assert ret is out
    _close(out, base.double() + _expected(a, b, sa, sb), out_dtype)
    # accumulation is planned in float32 so the sum is rounded once
    assert musa_gemm.scaled_mm_plan(None, out_dtype, accumulate=True) == (torch.float32, False)
    ret = musa_gemm.gemm_fp8(a, b, sa, sb, out_dtype=out_dtype, out=out)
    assert ret is out
    _close(out, _expected(a, b, sa, sb), out_dtype)


@ON_CPU_SCALED_MM
def test_non_contiguous_b_is_made_row_major():
    a, b, g = _operands(16, 32, 48)
    b_view = b.T.contiguous().T  # same values, column-major storage
    sa, sb = torch.tensor([1.0]), torch.tensor([1.0])
    y = musa_gemm.gemm_fp8(a, b_view, sa, sb, out_dtype=torch.float32)
    _close(y, _expected(a, b, sa, sb), torch.float32)


# -- supports ----------------------------------------------------------------------------------
def _call_supports(a, b, **kw):
    sa, sb = torch.ones(1), torch.ones(1)
    kw.setdefault("out_dtype", torch.bfloat16)
    return musa_gemm.gemm_fp8_supports(a, b, sa, sb, **kw)


@pytest.mark.parametrize("arch", [(2, 1), (2, 2)])
def test_supports_declines_old_arch(fake_musa, arch):
    fake_musa(arch=arch)
    a, b, _ = _operands(16, 16, 16)
    ok, why = _call_supports(a, b)
    assert not ok and f"needs arch >= 3.1, device is mp_{arch[0]}{arch[1]}" in why


@pytest.mark.parametrize("mode", ["block_1x128_128x128", "block_1x128_1x128", "mxfp8"])
def test_supports_declines_block_scaling(fake_musa, mode):
    fake_musa()
    a, b, _ = _operands(128, 128, 128)
    ok, why = _call_supports(a, b, scaling=mode)
    assert not ok and "only per-tensor or per-row" in why


def test_supports_declines_e5m2_pair(fake_musa):
    fake_musa()
    a, b, _ = _operands(16, 16, 16, E5M2, E5M2)
    ok, why = _call_supports(a, b)
    assert not ok and "E5M2 x E5M2" in why


@pytest.mark.parametrize("m, n, k", [(17, 16, 16), (16, 24, 16), (16, 16, 40), (6, 42, 123)])
def test_supports_declines_unaligned(fake_musa, m, n, k):
    fake_musa()
    a, b, _ = _operands(m, n, k)
    ok, why = _call_supports(a, b)
    assert not ok and f"M, N, K = {(m, n, k)} must be multiples of 16" in why


def test_supports_declines_fp8_output_and_accepts_valid(fake_musa):
    fake_musa()
    a, b, _ = _operands(32, 16, 48)
    ok, why = _call_supports(a, b, out_dtype=E4M3)
    assert not ok and "only float32, bfloat16 and float16 outputs" in why
    assert _call_supports(a, b, scaling="rowwise") == (True, "")


# -- high-precision gemm -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(torch.float32, (1.3e-6, 1e-5)), (torch.bfloat16, (1.6e-2, 1e-5))])
def test_gemm_against_float64(dtype, tol):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(6, 123, generator=g).to(dtype), torch.randn(42, 123, generator=g).to(dtype)
    bias = torch.randn(42, generator=g).to(dtype)
    want = a.double() @ b.double().T + bias.double()
    torch.testing.assert_close(musa_gemm.gemm(a, b, bias=bias).double(), want, rtol=tol[0], atol=tol[1] * 50)
    out = torch.randn(6, 42, generator=g).to(dtype)
    start = out.double()
    assert musa_gemm.gemm(a, b, out=out, accumulate=True) is out
    torch.testing.assert_close(out.double(), start + a.double() @ b.double().T, rtol=tol[0] * 4, atol=tol[1] * 50)


def test_gemm_supports_decisions():
    a = torch.randn(4, 8).bfloat16()
    assert musa_gemm.gemm_supports(a, a) == (True, "")
    ok, why = musa_gemm.gemm_supports(a, a, out_dtype=torch.float32)
    assert not ok and "output torch.float32 from torch.bfloat16 operands" in why
    ok, why = musa_gemm.gemm_supports(a, a, out=torch.zeros(4, 4), accumulate=True)
    assert not ok and "rounding before a float32 accumulation" in why
    ok, why = musa_gemm.gemm_supports(a, a.float())
    assert not ok and "equal float32/bfloat16/float16 dtypes" in why
    ok, why = musa_gemm.gemm_supports(a, a, bias=torch.zeros(4))
    assert not ok and "bias torch.float32" in why


@ON_CPU_SCALED_MM
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_gemm_fp8_matches_reference_backend(scaling):
    reference = pytest.importorskip("te_core.reference.gemm").gemm_fp8
    a, b, g = _operands(32, 48, 64, E4M3, E5M2, seed=11)
    shape_a, shape_b = ((1,), (1,)) if scaling == "tensorwise" else ((32, 1), (48, 1))
    sa, sb = torch.rand(shape_a, generator=g) + 0.5, torch.rand(shape_b, generator=g) + 0.5
    bias = torch.randn(48, generator=g)
    got = musa_gemm.gemm_fp8(a, b, sa, sb, out_dtype=torch.bfloat16, scaling=scaling, bias=bias)
    want = reference(a, b, sa, sb, out_dtype=torch.bfloat16, scaling=scaling, bias=bias)
    torch.testing.assert_close(got.double(), want.double(), rtol=1.6e-2, atol=1e-5)
