"""te_triton.mxfp8 under the Triton interpreter against te_core.reference.cast.quantize_mxfp8."""
import pytest
import torch
from triton_fp8_compare import assert_fp8_matches
from te_core.reference import cast as ref
from te_triton import Config, mxfp8

# products past float32 range (inf, as the reference gives) make numpy warn inside the interpreter
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _x(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    # rows and columns of very different magnitudes, so that each 1x32 block (and 32x1 block of
    # the transpose) gets its own scale, some of them far from 1 either way
    rows = torch.logspace(-30, 12, shape[0])[:, None]
    cols = torch.logspace(-3, 3, shape[1])[None, :]
    return (torch.randn(shape, generator=g) * rows * cols).to(dtype)


def _assert_dequantized(got, want, rtol=0.0):
    """Equal (bit for bit unless rtol), except below 2^-126, where the interpreter flushes float32
    subnormals to zero and converts them to bfloat16 its own way (the GPU keeps them): there any
    two values below 2^-126 pass."""
    flushed = (want.abs() < 2.0 ** -126) & (got.abs() < 2.0 ** -126)
    torch.testing.assert_close(torch.where(flushed, want, got), want, rtol=rtol, atol=0, equal_nan=True)


def _check(got, want, with_transpose):
    for i in (1, 3):
        if want[i] is None:
            assert got[i] is None
            continue
        assert got[i].dtype == torch.uint8 and torch.equal(got[i], want[i]), (got[i] != want[i]).nonzero()[:5]
    assert_fp8_matches(got[0], want[0])
    if with_transpose:
        assert_fp8_matches(got[2], want[2])


@pytest.mark.parametrize("with_transpose", [False, True])
@pytest.mark.parametrize("shape", [(96, 160), (64, 64)])  # 96 and 160: tiles cut at the edges
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_matches_reference(with_transpose, shape, dtype, fp8_dtype):
    x = _x(shape, 1, dtype)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    got = mxfp8.quantize_mxfp8(x, fp8_dtype, with_transpose=with_transpose, cfg=Config(block_m=64, block_n=64))
    want = ref.quantize_mxfp8(x, fp8_dtype, with_transpose=with_transpose)
    _check(got, want, with_transpose)
    # torch.compile assumes the reference's layouts (its fake implementation) for the kernel's outputs
    assert [None if t is None else t.stride() for t in got] == [None if t is None else t.stride() for t in want]


def test_special_blocks_match_reference():
    """Zero blocks (exponent -127), NaN blocks (E8M0 255, NaN kept in the data), inf blocks (254,
    saturated), subnormal-only blocks, and blocks whose amax sits just above and below the
    format's max mantissa (the exponent's rounding edge), row-wise and column-wise."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    x[0] = 0.0  # a zero row: 4 zero blocks
    x[1, 3] = float("nan")
    x[2, 40] = float("inf")
    x[3, 70] = float("-inf")
    x[4, :32] = 1e-40  # float32 subnormals
    x[5, :32] = 448.0 * 2.0 ** 10  # amax exactly at fmax * 2^10: e = 10, nothing saturates
    x[6, :32] = torch.nextafter(torch.tensor(448.0 * 2.0 ** 10), torch.tensor(float("inf")))  # just above: e = 11
    x[7, :32] = 1.75 * 2.0 ** -120
    got = mxfp8.quantize_mxfp8(x, torch.float8_e4m3fn, with_transpose=True, cfg=Config(block_m=32, block_n=64))
    want = ref.quantize_mxfp8(x, torch.float8_e4m3fn, with_transpose=True)
    # the data where x is NaN is NaN on the GPU; the interpreter casts NaN to 384
    nan = x.isnan()
    for i, where in ((0, nan), (2, nan.t())):
        bytes_ = got[i].view(torch.uint8)
        bytes_[where] = want[i].view(torch.uint8)[where]
    _check(got, want, True)
    assert got[1][1, 0] == 255 and got[1][2, 1] == 254 and got[1][0].tolist() == [0, 0, 0, 0]
    assert got[1][5, 0] == 127 + 10 and got[1][6, 0] == 127 + 11


def test_rejects_what_it_cannot_cast():
    with pytest.raises(ValueError, match="multiples of 32"):
        mxfp8.quantize_mxfp8(torch.randn(32, 48), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="K and M to be multiples of 32"):
        mxfp8.quantize_mxfp8(torch.randn(48, 64), torch.float8_e4m3fn, with_transpose=True)
    with pytest.raises(ValueError, match="block_m and cfg.block_n"):
        mxfp8.quantize_mxfp8(torch.randn(32, 64), torch.float8_e4m3fn, cfg=Config(block_m=16, block_n=64))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        mxfp8.quantize_mxfp8(torch.randn(32, 64).double(), torch.float8_e4m3fn)
    data, scales, _, _ = mxfp8.quantize_mxfp8(torch.randn(32, 64), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block_m and cfg.block_n"):
        mxfp8.dequantize_mxfp8(data, scales, torch.float32, cfg=Config(block_m=32, block_n=48))
    with pytest.raises(ValueError, match="contiguous 2-D tensor"):
        mxfp8.dequantize_mxfp8(data.t(), scales, torch.float32)
    with pytest.raises(ValueError, match="uint8 scales of shape"):
        mxfp8.dequantize_mxfp8(data, scales.float(), torch.float32)


def test_dequantize_refuses_data_that_is_not_fp8_and_other_out_dtypes():
    """Unchecked, the codes as raw uint8 bytes (or float data) would be read as numbers, not decoded;
    an integer or FP8 out_dtype would take a truncating cast."""
    data, scales, _, _ = mxfp8.quantize_mxfp8(torch.randn(32, 64), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="data must be float8_e4m3fn or float8_e5m2, got torch.uint8"):
        mxfp8.dequantize_mxfp8(data.view(torch.uint8), scales, torch.float32)
    with pytest.raises(TypeError, match="data must be float8_e4m3fn or float8_e5m2, got torch.float32"):
        mxfp8.dequantize_mxfp8(data.float(), scales, torch.float32)
    with pytest.raises(TypeError, match="out_dtype must be float32, bfloat16 or float16, got torch.int8"):
        mxfp8.dequantize_mxfp8(data, scales, torch.int8)
    with pytest.raises(ValueError, match="scales is on meta but data is on cpu"):
        mxfp8.dequantize_mxfp8(data, scales.to("meta"), torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_dequantize_matches_reference(out_dtype, fp8_dtype):
    """Every E8M0 scale from 0 (2^-127, subnormal) to 254, and 255 (NaN), on FP8 data with every byte."""
    g = torch.Generator().manual_seed(4)
    data = torch.randint(0, 256, (32, 256), dtype=torch.uint8, generator=g)
    # NaN and inf bytes read as finite numbers in the interpreter (the GPU reads them right)
    data[~data.view(fp8_dtype).float().isfinite()] = 0
    data = data.view(fp8_dtype)
    scales = torch.arange(256, dtype=torch.int32).reshape(32, 8).to(torch.uint8)
    got = mxfp8.dequantize_mxfp8(data, scales, out_dtype, cfg=Config(block_m=32, block_n=128))
    want = ref.dequantize_mxfp8(data, scales, out_dtype)
    if out_dtype == torch.float32:
        _assert_dequantized(got, want)
    else:  # the interpreter's float32 -> bfloat16 conversion may round the other way (the GPU's rounds to nearest even)
        _assert_dequantized(got.float(), want.float(), rtol=2.0 ** -8)
    assert got[-1, -32:].isnan().all()  # scale 255
    with pytest.raises(ValueError, match="scales of shape"):
        mxfp8.dequantize_mxfp8(data, scales[:, :2], out_dtype)


@pytest.mark.parametrize("with_transpose", [False, True])
def test_dequantize_reads_what_quantize_wrote(with_transpose):
    """dequantize_mxfp8 of quantize_mxfp8's bytes and scales (both layouts) equals the
    reference's dequantization of the same bytes."""
    x = _x((64, 96), 5, torch.float32)
    data, scales, data_t, scales_t = mxfp8.quantize_mxfp8(x, torch.float8_e4m3fn, with_transpose=with_transpose)
    pairs = [(data, scales)] + ([(data_t, scales_t)] if with_transpose else [])
    for d, s in pairs:
        _assert_dequantized(mxfp8.dequantize_mxfp8(d, s, torch.float32), ref.dequantize_mxfp8(d, s, torch.float32))
