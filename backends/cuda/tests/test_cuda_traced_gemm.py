"""The high-precision GEMM's twin (te_backend_cuda.traced.gemm): the eager op's math, for the
calls it takes, checked on the CPU against a float64 product; what it declines stays the
opaque op; on the GPU it equals the eager cuda op bit for bit (the same cuBLAS calls)."""
import pytest
import torch

from te_backend_cuda import scaled_mm, traced

TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(traced, "DEVICE_TYPE", "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [None, "same", torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_gemm_twin_matches_float64(on_cpu, dtype, bias_dtype, transposed):
    a = torch.randn(48, 64).to(dtype)
    b = torch.randn(64, 32).to(dtype).t() if transposed else torch.randn(32, 64).to(dtype)  # a strided view
    bias = None if bias_dtype is None else torch.randn(32).to(dtype if bias_dtype == "same" else bias_dtype)
    got = traced.gemm(a, b, bias=bias)
    want = a.double() @ b.double().t()
    if bias is not None and bias.dtype != dtype:  # the product is rounded to dtype before a float32 bias
        want = want.to(dtype).double()
    want = want + (0 if bias is None else bias.double())
    assert got.dtype == dtype and got.shape == (48, 32)
    scale = want.abs().max()  # a GEMM's rounding error scales with its terms, not a cancelled element
    torch.testing.assert_close(got.double() / scale, want / scale, **TOL[dtype])


def test_gemm_twin_declines_what_it_does_not_take(on_cpu):
    a, b = torch.randn(16, 32, dtype=torch.bfloat16), torch.randn(8, 32, dtype=torch.bfloat16)
    out = torch.zeros(16, 8, dtype=torch.bfloat16)
    assert traced.gemm(a, b, out=out) is NotImplemented  # written into `out`
    assert traced.gemm(a, b, out=out, accumulate=True) is NotImplemented
    assert traced.gemm(a, b, out_dtype=torch.float32) is NotImplemented  # another output dtype
    assert traced.gemm(a, b.float()) is NotImplemented  # mixed dtypes
    assert traced.gemm(a, b[:, :16]) is NotImplemented  # K mismatch: the opaque op names it
    assert traced.gemm(a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)) is NotImplemented


def test_gemm_twin_declines_other_devices():
    a = torch.randn(16, 32)
    assert traced.gemm(a, a) is NotImplemented  # CPU tensors: the reference runs them


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_twin_equals_eager_op_on_gpu(dtype):
    a = torch.randn(256, 128, device="cuda", dtype=dtype)
    b = torch.randn(128, 96, device="cuda", dtype=dtype).t()
    bias = torch.randn(96, device="cuda", dtype=dtype)
    for kwargs in ({}, {"bias": bias}):
        assert torch.equal(traced.gemm(a, b, **kwargs), scaled_mm.gemm(a, b, **kwargs))
    compiled = torch.compile(lambda a, b, bias: traced.gemm(a, b, bias=bias), fullgraph=True)
    torch.testing.assert_close(compiled(a, b, bias), scaled_mm.gemm(a, b, bias=bias), **TOL[dtype])
