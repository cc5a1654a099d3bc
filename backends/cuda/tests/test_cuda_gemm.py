"""cuBLASLt GEMM glue that runs without a GPU: decline reasons, scale layouts for
torch._scaled_mm, the probes' emulation against the reference, the high-precision gemm, and
which calls go to te_triton's small GEMM instead; on a GPU, the bias of a block-scaled GEMM
(cuBLASLt's epilogue)."""
import pytest
import torch
from te_backend_cuda import configs, scaled_mm
from te_core.backend.types import BLOCK_1x128_1x128, BLOCK_1x128_128x128, MXFP8, ROWWISE, TENSORWISE
from te_core.reference import gemm as ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(autouse=True)
def _cublaslt_for_every_size(monkeypatch):
    """These tests check the cuBLASLt glue with small operands, which would otherwise go to
    te_triton's GEMM (test_small_tensorwise_gemms_go_to_triton checks that routing)."""
    monkeypatch.setattr(configs, "SMALL_GEMM_MAX_MNK", 0)


def _fp8(shape, dtype=E4M3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(dtype)


def _scales(mode, M, N, K, seed=1):
    g = torch.Generator().manual_seed(seed)
    kb, nb = -(-K // 128), -(-N // 128)
    shapes = {TENSORWISE: ((1,), (1,)), ROWWISE: ((M, 1), (N, 1)), BLOCK_1x128_128x128: ((M, kb), (nb, kb)),
              BLOCK_1x128_1x128: ((M, kb), (N, kb))}[mode]
    return tuple(torch.rand(s, generator=g) + 0.5 for s in shapes)


@pytest.mark.parametrize("mode", [TENSORWISE, ROWWISE, BLOCK_1x128_128x128, BLOCK_1x128_1x128])
def test_emulation_matches_reference(mode):
    M, N, K = 48, 160, 384
    a, b = _fp8((M, K)), _fp8((N, K), seed=2)
    sa, sb = _scales(mode, M, N, K)
    want = ref.gemm_fp8(a, b, sa, sb, out_dtype=torch.float32, scaling=mode)
    torch.testing.assert_close(scaled_mm.emulate(a, b, sa, sb, mode), want, rtol=1.3e-6, atol=1e-3)


def test_scale_layouts_for_scaled_mm():
    M, N, K = 256, 384, 1024
    a, b = _fp8((M, K)), _fp8((N, K))
    sa, sb = scaled_mm._scale_args(a, b, *_scales(BLOCK_1x128_128x128, M, N, K), BLOCK_1x128_128x128)
    assert sa.shape == (M, K // 128) and sa.stride() == (1, M)  # 1x128: outer-dim-major
    assert sb.shape == (K // 128, N // 128) and sb.stride() == (1, K // 128)  # 128x128: K-major
    sa, sb = scaled_mm._scale_args(a, b, *_scales(BLOCK_1x128_1x128, M, N, K), BLOCK_1x128_1x128)
    assert sb.shape == (K // 128, N) and sb.is_contiguous()
    sa, sb = scaled_mm._scale_args(a, b, *_scales(ROWWISE, M, N, K), ROWWISE)
    assert sa.shape == (M, 1) and sb.shape == (1, N)


@pytest.mark.parametrize("mode", [BLOCK_1x128_128x128, BLOCK_1x128_1x128])
def test_column_by_column_1x128_scales_go_to_scaled_mm_without_a_copy(mode):
    """1x128 grids laid out column by column, as the casts give them, are passed as they are; the
    same values laid out row by row are copied into that layout. Either way the same values."""
    M, N, K = 256, 384, 1024
    a, b = _fp8((M, K)), _fp8((N, K))
    a_si, b_si = _scales(mode, M, N, K)
    ready_a = a_si.t().contiguous().t()
    ready_b = b_si.t().contiguous().t() if mode == BLOCK_1x128_1x128 else b_si
    sa, sb = scaled_mm._scale_args(a, b, ready_a, ready_b, mode)
    want_a, want_b = scaled_mm._scale_args(a, b, a_si, b_si, mode)
    assert sa.data_ptr() == ready_a.data_ptr() and torch.equal(sa, want_a) and sa.stride() == want_a.stride()
    assert torch.equal(sb, want_b) and sb.stride() == want_b.stride()
    if mode == BLOCK_1x128_1x128:
        assert sb.data_ptr() == ready_b.data_ptr()
    # a slice of rows of such a grid (a view of some rows' blocks) is no longer column by column
    sliced = ready_a[16:]
    sa, _ = scaled_mm._scale_args(a[16:], b, sliced, ready_b, mode)
    assert torch.equal(sa, a_si[16:]) and sa.stride() == (1, M - 16)


@pytest.mark.parametrize("a_dtype,b_dtype,shape,out_dtype,mode,expect", [
    (E5M2, E5M2, (32, 32, 32), torch.bfloat16, TENSORWISE, "E5M2 x E5M2"),
    (E4M3, E4M3, (30, 32, 32), torch.bfloat16, TENSORWISE, "multiples of 16"),
    (E4M3, E4M3, (32, 32, 32), torch.int32, TENSORWISE, "out_dtype"),
    (E4M3, E4M3, (32, 32, 32), torch.bfloat16, MXFP8, "swizzled"),
    (E4M3, E4M3, (32, 32, 144), torch.bfloat16, BLOCK_1x128_1x128, "multiple of 128"),
    (E4M3, E4M3, (32, 32, 256), torch.bfloat16, BLOCK_1x128_128x128, "multiple of 4"),
    (E4M3, E5M2, (32, 32, 512), torch.bfloat16, BLOCK_1x128_128x128, None),
])
def test_decline_reasons(a_dtype, b_dtype, shape, out_dtype, mode, expect):
    M, N, K = shape
    why = scaled_mm.fp8_gemm_decline_reason(_fp8((M, K), a_dtype), _fp8((N, K), b_dtype), out_dtype, mode)
    assert (why is None) if expect is None else (expect in why)


def test_decline_non_contiguous():
    a = _fp8((64, 32)).t()
    assert "contiguous" in scaled_mm.fp8_gemm_decline_reason(a, _fp8((16, 64)), torch.bfloat16, TENSORWISE)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
def test_high_precision_gemm(with_bias, accumulate):
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(17, 33, generator=g), torch.randn(9, 33, generator=g)
    bias = torch.randn(9, generator=g) if with_bias else None
    out, want_out = torch.randn(17, 9, generator=g), None
    want_out = out.clone()
    got = scaled_mm.gemm(a, b, bias=bias, out=out, accumulate=accumulate)
    want = ref.gemm(a, b, bias=bias, out=want_out, accumulate=accumulate)
    assert got is out
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)


def test_high_precision_gemm_out_dtype():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(8, 16, generator=g).bfloat16(), torch.randn(4, 16, generator=g).bfloat16()
    got = scaled_mm.gemm(a, b, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref.gemm(a, b, out_dtype=torch.float32), rtol=1.6e-2, atol=1e-5)


def _cpu_scaled_mm() -> bool:
    """Whether this torch has a CPU _scaled_mm at all (torch 2.7's has none)."""
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(()), torch.ones(()), out_dtype=torch.float32)
    except RuntimeError:  # NotImplementedError: no CPU kernel
        return False
    return True


NEEDS_CPU_SCALED_MM = pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU _scaled_mm (torch 2.7)")


def _cpu_scaled_mm_has_rowwise() -> bool:
    """torch 2.13's CPU _scaled_mm takes row-wise scales; 2.11's asserts per-tensor only."""
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("mode", [TENSORWISE, pytest.param(ROWWISE, marks=pytest.mark.skipif(
    not _cpu_scaled_mm_has_rowwise(), reason="this torch's CPU _scaled_mm has per-tensor scales only"))])
@pytest.mark.parametrize("out_kind", ["new", "out", "accumulate"])
@pytest.mark.parametrize("out_dtype,bias_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                  (torch.bfloat16, None)])
@NEEDS_CPU_SCALED_MM
def test_gemm_fp8_glue_on_cpu_scaled_mm(mode, out_kind, out_dtype, bias_dtype):
    """torch's CPU _scaled_mm runs tensor-wise and row-wise scales: enough to test the glue
    (operand layout, scales, fused or separate bias, out / accumulate) against the reference."""
    M, N, K = 32, 48, 64
    a, b = _fp8((M, K), seed=5), _fp8((N, K), E5M2, seed=6)
    sa, sb = _scales(mode, M, N, K, seed=7)
    g = torch.Generator().manual_seed(8)
    bias = None if bias_dtype is None else torch.randn(N, generator=g).to(bias_dtype)
    out = want_out = None
    if out_kind != "new":
        out = torch.randn(M, N, generator=g).to(out_dtype)
        want_out = out.clone()
    kw = dict(out_dtype=out_dtype, scaling=mode, bias=bias, accumulate=out_kind == "accumulate")
    got = scaled_mm.gemm_fp8(a, b, sa, sb, out=out, **kw)
    want = ref.gemm_fp8(a, b, sa, sb, out=want_out, **kw)
    assert got.dtype == out_dtype and (out is None or got is out)
    tol = dict(rtol=1.6e-2, atol=1e-2) if out_dtype == torch.bfloat16 else dict(rtol=1.3e-6, atol=1e-3)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("mode,fast", [(TENSORWISE, True), (ROWWISE, True), (BLOCK_1x128_128x128, False)])
def test_fast_accumulation_reaches_scaled_mm_for_tensor_and_row_scales(monkeypatch, mode, fast):
    """fast_accumulation=True becomes use_fast_accum for tensor-wise and row-wise scales only;
    block scales keep float32 accumulation (as Transformer Engine's block recipe)."""
    seen = []

    def fake_scaled_mm(a, b, sa, sb, **kwargs):
        seen.append(kwargs["use_fast_accum"])
        return torch.zeros(a.shape[0], b.shape[1], dtype=kwargs["out_dtype"])

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    M, N, K = 32, 128, 256
    a, b = _fp8((M, K), seed=1), _fp8((N, K), seed=2)
    sa, sb = _scales(mode, M, N, K, seed=3)
    for flag in (False, True):
        scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=torch.bfloat16, scaling=mode, fast_accumulation=flag)
    assert seen == [False, fast]


def test_tensorwise_scales_are_passed_16_byte_aligned():
    """A module's per-slot scale_inv is a 1-element slice of a vector; cuBLASLt can refuse one
    at an unaligned address, so the backend hands it an aligned copy of the value."""
    from te_backend_cuda import scaled_mm

    g = torch.Generator().manual_seed(3)
    vector = torch.rand(8, generator=g) + 0.5
    a = torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn)
    for column in range(4):
        sa, sb = scaled_mm._scale_args(a, b, vector[column : column + 1], vector[3:4], "tensorwise")
        assert sa.data_ptr() % 16 == 0 and sb.data_ptr() % 16 == 0
        assert sa.item() == vector[column].item() and sb.item() == vector[3].item()


def test_casts_decline_an_amax_out_the_kernels_cannot_take():
    from te_backend_cuda.ops import activation, cast

    x, scale = torch.randn(4, 8), torch.tensor([1.0])
    assert cast.cast_ok(x, scale, torch.float8_e4m3fn, amax_out=torch.zeros(2)) == (
        False, "amax_out is not a 1-element float32 tensor")
    assert activation.dbias_ct_ok(x, scale, torch.float8_e4m3fn, amax_out=torch.zeros(1, device="meta")) == (
        False, "amax_out is not on x's device")
    ok, why = cast.cast_ok(x, scale, torch.float8_e4m3fn, amax_out=torch.zeros(1))
    assert not ok and why == "x is not on a CUDA device"  # the amax_out itself was acceptable


def test_tensorwise_scales_keep_their_shape_and_must_have_one_element():
    """A (1,) scale goes to torch._scaled_mm as it is (no reshape per GEMM); more elements
    under tensor-wise scaling are an error, not a row-wise product."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn)
    one = torch.tensor([0.5])
    sa, sb = scaled_mm._scale_args(a, b, one, one, TENSORWISE)
    assert sa is one and sb is one
    with pytest.raises(ValueError, match="one-element scale_inv"):
        scaled_mm._scale_args(a, b, torch.ones(16, 1), one, TENSORWISE)


@pytest.mark.parametrize("mode,out_kind,mnk,expect", [
    (TENSORWISE, "new", (32, 64, 48), True),
    (TENSORWISE, "new", (64, 64, 64), True),  # exactly at the limit
    (TENSORWISE, "new", (64, 64, 80), False),  # past it
    (TENSORWISE, "new", (16, 256, 16), True),  # K at its limit (monkeypatched to 256 below)
    (TENSORWISE, "new", (16, 272, 16), False),  # a long K, small M and N: cuBLASLt can split K
    (TENSORWISE, "out", (32, 64, 48), False),  # into a caller's buffer: cuBLASLt writes it in place
    (TENSORWISE, "accumulate", (32, 64, 48), False),
    pytest.param(ROWWISE, "new", (32, 64, 48), False, marks=pytest.mark.skipif(
        not _cpu_scaled_mm_has_rowwise(), reason="this torch's CPU _scaled_mm has per-tensor scales only")),
])
@NEEDS_CPU_SCALED_MM
def test_small_tensorwise_gemms_go_to_triton(monkeypatch, mode, out_kind, mnk, expect):
    monkeypatch.setattr(configs, "SMALL_GEMM_MAX_MNK", 64 ** 3)
    monkeypatch.setattr(configs, "SMALL_GEMM_MAX_K", 256)
    monkeypatch.setattr(configs, "for_tensor", lambda x: configs.tuning((9, 0), 132))
    taken = []

    def fake_triton(a, b, sa, sb, *, out_dtype, bias, fast_accumulation, cfg):
        taken.append((bias, fast_accumulation, cfg))
        return torch.zeros(a.shape[0], b.shape[0], dtype=out_dtype)

    monkeypatch.setattr(scaled_mm.triton_gemm, "gemm_fp8", fake_triton)
    M, K, N = mnk
    a, b = _fp8((M, K), seed=1), _fp8((N, K), seed=2)
    sa, sb = _scales(mode, M, N, K, seed=3)
    bias = torch.randn(N).to(torch.bfloat16)
    out = None if out_kind == "new" else torch.zeros(M, N, dtype=torch.bfloat16)
    got = scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=torch.bfloat16, scaling=mode, bias=bias, out=out,
                             accumulate=out_kind == "accumulate", fast_accumulation=True)
    assert bool(taken) == expect
    if expect:
        assert taken[0][0] is bias and taken[0][1] is True and taken[0][2] == configs.tuning((9, 0), 132).small_gemm
    else:  # cuBLASLt's result (torch's CPU _scaled_mm here), not the fake's zeros
        want = ref.gemm_fp8(a, b, sa, sb, out_dtype=torch.bfloat16, scaling=mode, bias=bias)
        if out_kind == "accumulate":
            want = want.float().to(torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def _block_operands(mode, M, K, N, seed):
    """FP8 operands of a block-scaled GEMM on the GPU with their scales, laid out as the casts
    write them (1x128 grids column by column)."""
    g = torch.Generator().manual_seed(seed)
    a, b = _fp8((M, K), seed=seed + 1).cuda(), _fp8((N, K), seed=seed + 2).cuda()
    sa_shape, sb_shape = scaled_mm.block_scale_shapes(a, b, mode)
    sa = (torch.rand(sa_shape[::-1], generator=g) + 0.5).t().cuda()
    sb = torch.rand(sb_shape, generator=g) + 0.5
    sb = (sb if mode == BLOCK_1x128_128x128 else sb.t().contiguous().t()).cuda()
    return a, b, sa, sb, g


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [BLOCK_1x128_128x128, BLOCK_1x128_1x128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(272, 512, 400), (128, 128, 128), (2048, 1024, 3072), (4096, 4096, 12288)])
def test_block_scaled_gemm_bias_goes_to_the_epilogue_on_the_gpu(monkeypatch, mode, dtype, M, K, N):
    """The bias of a block-scaled GEMM goes to cuBLASLt's epilogue (no separate add), on shapes on
    and off the 128 tiles: within the output format's tolerance of the float32 reference, and no
    less accurate than the GEMM without a bias followed by the add (which rounds twice)."""
    a, b, sa, sb, g = _block_operands(mode, M, K, N, seed=3)
    bias = (torch.randn(N, generator=g) * 8).to(dtype).cuda()
    want = ref.gemm_fp8(a, b, sa, sb, out_dtype=torch.float32, scaling=mode, bias=bias.float())
    separate = scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=dtype, scaling=mode).float().add_(bias.float()).to(dtype)

    def no_separate_add(*args, **kwargs):
        raise AssertionError("the bias went to a separate add")

    monkeypatch.setattr(scaled_mm.triton_gemm, "add_bias_", no_separate_add)
    got = scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=dtype, scaling=mode, bias=bias)
    assert got.dtype == dtype and got.shape == (M, N)
    # atol: one ulp of the output format at the output's largest magnitude (a sum of K products
    # that cancels keeps the float32 accumulation's absolute error, not a relative one)
    ulp = torch.finfo(dtype).eps * want.abs().max().item()
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-3, atol=ulp)
    assert (got.float() - want).abs().mean() <= (separate.float() - want).abs().mean() * 1.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_bias_the_epilogue_cannot_take_is_torchs_add_on_the_gpu(dtype):
    """Where the bias cannot go to the epilogue (row-wise scales), te_triton's add_bias_ adds it:
    the bytes of torch's add_, on an output shape off its tiles."""
    g = torch.Generator().manual_seed(5)
    result = torch.randn(272, 400, generator=g).to(dtype).cuda()
    bias = torch.randn(400, generator=g).to(dtype).cuda()
    want = result.clone().add_(bias)
    got = scaled_mm._add_bias(result, bias)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", [BLOCK_1x128_128x128, BLOCK_1x128_1x128])
def test_block_scaled_gemm_float32_output_adds_the_bias_after(mode):
    """A float32 output takes no epilogue bias (cuBLASLt's bias is the output's dtype): the bias,
    in bf16, is added to the float32 result."""
    M, K, N = 272, 512, 400
    a, b, sa, sb, g = _block_operands(mode, M, K, N, seed=4)
    bias = torch.randn(N, generator=g).to(torch.bfloat16).cuda()
    got = scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=torch.float32, scaling=mode, bias=bias)
    want = scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=torch.float32, scaling=mode) + bias.float()
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
