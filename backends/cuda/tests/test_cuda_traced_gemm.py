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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", [256, 2048], ids=["small", "past-the-limit"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("fast", [False, True])
def test_fp8_gemm_twin_runs_the_eager_ops_kernel(k, with_bias, fast):
    """A tensor-wise GEMM the eager op gives te_triton's kernel (scaled_mm._small) launches that
    kernel from the compiled code too, with no torch._scaled_mm; one past the limit (K above
    configs.SMALL_GEMM_MAX_K) calls torch._scaled_mm, as eagerly. Either way the compiled result
    is the eager op's, bit for bit."""
    from te_core.backend.types import TENSORWISE
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    a = (torch.randn(128, k, device="cuda") * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(192, k, device="cuda") * 4).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(1, device="cuda") + 0.5, torch.rand(1, device="cuda") + 0.5
    bias = torch.randn(192, device="cuda", dtype=torch.bfloat16) if with_bias else None
    small = scaled_mm._small(a, b, TENSORWISE, None, bias)
    assert small == (k == 256)
    want = scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=torch.bfloat16, bias=bias, fast_accumulation=fast)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, sa, sb, bias: traced.gemm_fp8(
        a, b, sa, sb, out_dtype=torch.bfloat16, bias=bias, fast_accumulation=fast), fullgraph=True)
    got, codes = run_and_get_code(compiled, a, b, sa, sb, bias)
    assert torch.equal(got, want)
    code = "\n".join(codes)
    assert ("_scaled_mm" in code) != small and ("_gemm_kernel" in code) == small


def test_small_gemm_kernel_only_for_static_cuda_sizes():
    """The compiled graph launches te_triton's small GEMM only where the eager op would run it, on a
    CUDA tensor with plain int sizes; a symbolic size (torch.compile(dynamic=True)) or another
    device keeps torch._scaled_mm. (Stand-ins for the operands: only device and shape are read.)"""
    from types import SimpleNamespace

    from te_core.backend.types import TENSORWISE
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if traced._WRAP_TRITON is None:
        pytest.skip("torch.library.wrap_triton is not in this torch")

    def operand(rows, k, device="cuda"):
        return SimpleNamespace(device=SimpleNamespace(type=device), shape=(rows, k))

    k = 256
    assert traced._on_small_kernel(operand(128, k), operand(192, k), TENSORWISE, None, None)
    assert not traced._on_small_kernel(operand(128, k, "cpu"), operand(192, k, "cpu"), TENSORWISE, None, None)
    assert not traced._on_small_kernel(operand(128, 2048), operand(192, 2048), TENSORWISE, None, None)  # K limit
    tokens = ShapeEnv().create_unbacked_symint()
    assert not traced._on_small_kernel(operand(tokens, k), operand(192, k), TENSORWISE, None, None)
    assert not traced._on_small_kernel(operand(192, tokens), operand(128, tokens), TENSORWISE, None, None)


def test_block_gemm_keeps_the_opaque_op_for_a_symbolic_inner_size(monkeypatch):
    """A block-scaled GEMM whose inner size is symbolic (the weight gradient's token count once
    torch.compile makes it dynamic) stays the opaque op: inductor cannot match its scale grid and
    would fail the compile. A symbolic outer size goes on to the scale check. (Stand-ins for the
    operands: only shapes are read before the scale check, which records the call.)"""
    from types import SimpleNamespace

    from te_core.backend.types import BLOCK_1x128_128x128
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    checked = []

    def scale_shapes(a, b, scaling):
        checked.append((a.shape, b.shape))
        return ((-1,), (-1,))  # never the given scales': the twin declines right after

    monkeypatch.setattr(scaled_mm, "block_scale_shapes", scale_shapes)
    tokens = ShapeEnv().create_unbacked_symint()
    scale = SimpleNamespace(shape=(1,))

    def block_gemm(a_shape, b_shape):
        a, b = SimpleNamespace(shape=a_shape), SimpleNamespace(shape=b_shape)
        return traced._block_gemm(a, b, scale, scale, torch.bfloat16, BLOCK_1x128_128x128, None)

    assert block_gemm((256, tokens), (128, tokens)) is NotImplemented and checked == []
    assert block_gemm((tokens, 256), (128, 256)) is NotImplemented and len(checked) == 1
    assert block_gemm((384, 256), (128, 256)) is NotImplemented and len(checked) == 2
