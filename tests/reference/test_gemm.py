"""Reference GEMMs against float64 matmuls of the (independently dequantized) operands."""
import pytest
import torch

from te_core.reference import cast, gemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP32 = dict(rtol=1.3e-6, atol=1e-5)


def expand_blocks(scale_inv, rows, cols, rows_block, cols_block):
    """Every element's scale_inv, by indexing: element (i, j) reads block (i // rb, j // cb)."""
    r = torch.arange(rows) // rows_block
    c = torch.arange(cols) // cols_block
    return scale_inv.double()[r][:, c]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_float64(dtype):
    a, b = torch.randn(33, 47, dtype=dtype), torch.randn(29, 47, dtype=dtype)
    bias = torch.randn(29, dtype=dtype)
    y = gemm.gemm(a, b, bias=bias)
    assert y.dtype == dtype and y.shape == (33, 29)
    want = a.double() @ b.double().t() + bias.double()
    tol = FP32 if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(y.double(), want.to(dtype).double(), **tol)


def test_gemm_out_and_accumulate():
    a, b = torch.randn(8, 20), torch.randn(12, 20)
    out = torch.randn(8, 12)
    before = out.clone()
    res = gemm.gemm(a, b, out=out, accumulate=True)
    assert res is out
    torch.testing.assert_close(out.double(), before.double() + a.double() @ b.double().t(), **FP32)
    gemm.gemm(a, b, out=out)
    torch.testing.assert_close(out.double(), a.double() @ b.double().t(), **FP32)
    y = gemm.gemm(a.bfloat16(), b.bfloat16(), out_dtype=torch.float32)
    assert y.dtype == torch.float32


def test_gemm_bad_inputs():
    with pytest.raises(ValueError, match=r"a \(4, 5\) and b \(3, 6\) disagree on K"):
        gemm.gemm(torch.randn(4, 5), torch.randn(3, 6))
    with pytest.raises(ValueError, match=r"accumulate=True needs `out`"):
        gemm.gemm(torch.randn(4, 5), torch.randn(3, 5), accumulate=True)
    with pytest.raises(ValueError, match=r"bias has 4 elements.*expected N=3"):
        gemm.gemm(torch.randn(4, 5), torch.randn(3, 5), bias=torch.randn(4))
    with pytest.raises(ValueError, match=r"out has shape \(3, 3\); the product is \(4, 3\)"):
        gemm.gemm(torch.randn(4, 5), torch.randn(3, 5), out=torch.empty(3, 3))
    with pytest.raises(ValueError, match=r"b must be 2-D"):
        gemm.gemm(torch.randn(4, 5), torch.randn(5))


def quantized_operands(scaling, m, n, k):
    """(a, b, a_scale_inv, b_scale_inv, a64, b64): FP8 operands and their exact float64 values."""
    x, w = torch.randn(m, k) * 3, torch.randn(n, k) * 0.2
    if scaling == "tensorwise":
        a, _, _, a_si, _ = cast.quantize_fp8_current(x, E4M3)
        b, _, _, b_si, _ = cast.quantize_fp8_current(w, E5M2)
        return a, b, a_si, b_si, a.double() * a_si.double(), b.double() * b_si.double()
    if scaling == "rowwise":
        a_si, b_si = torch.rand(m, 1) + 0.5, torch.rand(n, 1) * 0.01 + 0.001
        a, b = (x / a_si).to(E4M3), (w / b_si).to(E4M3)
        return a, b, a_si, b_si, a.double() * a_si.double(), b.double() * b_si.double()
    if scaling == "mxfp8":
        a, a_s, _, _ = cast.quantize_mxfp8(x, E4M3)
        b, b_s, _, _ = cast.quantize_mxfp8(w, E4M3)
        pa = torch.pow(2.0, a_s.double() - 127).repeat_interleave(32, dim=1)
        pb = torch.pow(2.0, b_s.double() - 127).repeat_interleave(32, dim=1)
        return a, b, a_s, b_s, a.double() * pa, b.double() * pb
    b_2d = scaling == "block_1x128_128x128"
    a, a_si, _, _ = cast.quantize_blockwise(x, E4M3)
    b, b_si, _, _ = cast.quantize_blockwise(w, E4M3, block_2d=b_2d)
    a64 = a.double() * expand_blocks(a_si, m, k, 1, 128)
    b64 = b.double() * expand_blocks(b_si, n, k, 128 if b_2d else 1, 128)
    return a, b, a_si, b_si, a64, b64


@pytest.mark.parametrize(
    "scaling,k",
    [("tensorwise", 200), ("rowwise", 72), ("block_1x128_128x128", 200), ("block_1x128_1x128", 300), ("mxfp8", 96)],
)
def test_gemm_fp8_modes(scaling, k):
    m, n = 40, 136
    a, b, a_si, b_si, a64, b64 = quantized_operands(scaling, m, n, k)
    bias = torch.randn(n)
    y = gemm.gemm_fp8(a, b, a_si, b_si, out_dtype=torch.float32, scaling=scaling, bias=bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    want = a64 @ b64.t() + bias.double()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    y16 = gemm.gemm_fp8(a, b, a_si, b_si, out_dtype=torch.bfloat16, scaling=scaling)
    assert y16.dtype == torch.bfloat16
    torch.testing.assert_close(y16.double(), (a64 @ b64.t()), rtol=1.6e-2, atol=1e-3)


def test_gemm_fp8_accumulate_into_out():
    a, b, a_si, b_si, a64, b64 = quantized_operands("tensorwise", 16, 24, 64)
    out = torch.randn(16, 24)
    before = out.double().clone()
    gemm.gemm_fp8(a, b, a_si, b_si, out_dtype=torch.float32, out=out, accumulate=True)
    torch.testing.assert_close(out.double(), before + a64 @ b64.t(), rtol=1e-5, atol=1e-4)


def test_gemm_fp8_bad_inputs():
    a, b, a_si, b_si, _, _ = quantized_operands("block_1x128_128x128", 8, 130, 200)
    with pytest.raises(ValueError, match=r"scaling='block_1x128_128x128': b_scale_inv.*must have shape \(2, 2\), got \(130, 2\)"):
        gemm.gemm_fp8(a, b, a_si, torch.ones(130, 2), out_dtype=torch.float32, scaling="block_1x128_128x128")
    with pytest.raises(ValueError, match=r"scaling='rowwise': a_scale_inv.*must have shape \(8, 1\), got \(1,\)"):
        gemm.gemm_fp8(a, b, torch.ones(1), torch.ones(130, 1), out_dtype=torch.float32, scaling="rowwise")
    with pytest.raises(ValueError, match=r"scaling='tensorwise'.*must have shape \(1,\), got \(8, 2\)"):
        gemm.gemm_fp8(a, b, a_si, torch.ones(1), out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"scaling='fancy' is not supported; allowed values: 'tensorwise', 'rowwise'"):
        gemm.gemm_fp8(a, b, a_si, b_si, out_dtype=torch.float32, scaling="fancy")
    with pytest.raises(ValueError, match=r"E5M2 x E5M2"):
        gemm.gemm_fp8(a.to(E5M2), b.to(E5M2), torch.ones(1), torch.ones(1), out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"a.dtype=torch.float32 is not an FP8 dtype"):
        gemm.gemm_fp8(a.float(), b, torch.ones(1), torch.ones(1), out_dtype=torch.float32)
    a32, b32 = torch.randn(8, 64).to(E4M3), torch.randn(4, 64).to(E4M3)
    with pytest.raises(ValueError, match=r"scaling='mxfp8': a_scale_inv must be uint8 E8M0"):
        gemm.gemm_fp8(a32, b32, torch.ones(8, 2), torch.ones(4, 2), out_dtype=torch.float32, scaling="mxfp8")
