"""Reference FP8 casts: bit-exact against torch's own FP8 conversion of the clamped scaled value."""
import math

import pytest
import torch

from te_core.reference import cast

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
TOLS = {E4M3: dict(rtol=0.125, atol=0.0675), E5M2: dict(rtol=0.25, atol=0.125)}
HP = [torch.float32, torch.bfloat16, torch.float16]


def expected_cast(x, scale, dtype):
    """What the spec says, written out: float32 product, clamp to the format's max, torch's cast."""
    fmax = FMAX[dtype]
    return torch.clamp(x.float() * scale, -fmax, fmax).to(dtype)


def bits(t):
    return t.view(torch.uint8)


def pow2_below(v: float) -> float:
    m, e = math.frexp(v)
    return math.ldexp(1.0, e - 1)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("hp", HP)
@pytest.mark.parametrize("shape", [(3, 5, 37), (1,), ()])
def test_quantize_fp8_bit_exact(dtype, hp, shape):
    x = (torch.randn(shape) * 300).to(hp)
    scale = torch.tensor([1.7], dtype=torch.float32)
    data, amax = cast.quantize_fp8(x, scale, dtype)
    assert data.dtype == dtype and data.shape == x.shape
    assert torch.equal(bits(data), bits(expected_cast(x, 1.7, dtype)))
    assert amax.dim() == 0 and amax.dtype == torch.float32
    assert amax.item() == x.float().abs().max().item()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_saturation_and_nan(dtype):
    fmax = FMAX[dtype]
    x = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), float("nan"), 0.5])
    data, amax = cast.quantize_fp8(x, torch.ones(1), dtype)
    out = data.float()
    assert out[:4].tolist() == [fmax, -fmax, fmax, -fmax]
    assert torch.isnan(out[4]) and out[5].item() == 0.5
    assert torch.isnan(amax)


def test_cast_transpose_matches_cast():
    x = torch.randn(33, 70) * 10
    data, data_t, amax = cast.cast_transpose_fp8(x, torch.tensor([3.0]), E4M3)
    assert torch.equal(bits(data), bits(expected_cast(x, 3.0, E4M3)))
    assert data_t.shape == (70, 33) and data_t.is_contiguous()
    assert torch.equal(bits(data_t), bits(data.t()))
    assert amax.item() == x.abs().max().item()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
def test_quantize_fp8_current(dtype, pow2):
    x = torch.randn(37, 45, dtype=torch.bfloat16) * 7
    data, data_t, scale, scale_inv, amax = cast.quantize_fp8_current(
        x, dtype, with_transpose=True, force_pow2_scales=pow2
    )
    want = (torch.tensor(FMAX[dtype]) / x.float().abs().max()).item()
    if pow2:
        want = pow2_below(want)
    assert scale.shape == (1,) and scale.item() == want
    assert scale_inv.item() == (1.0 / scale).item()
    assert torch.equal(bits(data), bits(expected_cast(x, scale, dtype)))
    assert torch.equal(bits(data_t), bits(data.t()))
    back = cast.dequantize_fp8(data, scale_inv, torch.float32)
    torch.testing.assert_close(back, x.float(), **TOLS[dtype])


def test_quantize_fp8_current_special_amax():
    def scale_of(x, **kw):
        return cast.quantize_fp8_current(x, E4M3, **kw)[2].item()

    assert scale_of(torch.zeros(4, 5)) == 1.0
    assert scale_of(torch.tensor([1.0, float("inf")])) == 1.0
    assert scale_of(torch.tensor([1.0, float("nan")])) == 1.0
    assert scale_of(torch.tensor([1e-42, 0.0])) == torch.finfo(torch.float32).max
    assert scale_of(torch.tensor([1e-42, 0.0]), force_pow2_scales=True) == 2.0**127
    assert scale_of(torch.full((3,), 1e-3), amax_epsilon=0.5) == (torch.tensor(448.0) / 0.5).item()
    data = cast.quantize_fp8_current(torch.tensor([1.0, float("inf"), float("nan")]), E4M3)[0].float()
    assert data[1].item() == 448.0 and torch.isnan(data[2])  # saturation stays visible
    assert cast.quantize_fp8_current(torch.randn(5), E4M3)[1] is None


def block_reference(x, dtype, rows_block, pow2=True, eps=0.0):
    """Each block on its own: the expected data (float) and scale_inv, built block by block."""
    m, k = x.shape
    data = torch.empty(m, k)
    scale_inv = torch.empty(math.ceil(m / rows_block), math.ceil(k / 128))
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            rows, cols = slice(bi * rows_block, (bi + 1) * rows_block), slice(bj * 128, (bj + 1) * 128)
            blk = x[rows, cols].float()
            amax = max(blk.abs().max().item(), eps)
            s = 1.0 if amax == 0 else (torch.tensor(FMAX[dtype]) / torch.tensor(amax)).item()
            s = pow2_below(s) if pow2 else s
            data[rows, cols] = expected_cast(blk, s, dtype).float()
            scale_inv[bi, bj] = (1.0 / torch.tensor(s)).item()
    return data, scale_inv


@pytest.mark.parametrize("shape", [(3, 200), (130, 256)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [True, False])
def test_quantize_blockwise_1d(shape, dtype, pow2):
    x = torch.randn(shape) * torch.logspace(-2, 2, shape[1])  # blocks with very different ranges
    data, scale_inv, data_t, scale_inv_t = cast.quantize_blockwise(
        x, dtype, with_transpose=True, force_pow2_scales=pow2
    )
    want, want_s = block_reference(x, dtype, 1, pow2)
    assert scale_inv.shape == (shape[0], math.ceil(shape[1] / 128))
    assert torch.equal(scale_inv, want_s) and torch.equal(data.float(), want)
    want_t, want_st = block_reference(x.t(), dtype, 1, pow2)
    assert scale_inv_t.shape == (shape[1], math.ceil(shape[0] / 128))
    assert torch.equal(scale_inv_t, want_st) and torch.equal(data_t.float(), want_t)
    back = cast.dequantize_blockwise(data, scale_inv, False, torch.float32)
    torch.testing.assert_close(back, x, **TOLS[dtype])


@pytest.mark.parametrize("shape", [(130, 200), (5, 37)])
def test_quantize_blockwise_2d(shape):
    x = torch.randn(shape) * 5
    x[:3, :3] = 1000.0  # one tile with a large amax
    data, scale_inv, data_t, scale_inv_t = cast.quantize_blockwise(
        x, E4M3, block_2d=True, with_transpose=True, amax_epsilon=1e-3
    )
    want, want_s = block_reference(x, E4M3, 128, eps=1e-3)
    assert torch.equal(scale_inv, want_s) and torch.equal(data.float(), want)
    assert torch.equal(bits(data_t), bits(data.t())) and torch.equal(scale_inv_t, scale_inv.t())
    back = cast.dequantize_blockwise(data, scale_inv, True, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    torch.testing.assert_close(back.float(), x, rtol=0.125, atol=0.0675 * 1000 / 448 * 2)


def test_blockwise_no_transpose_and_bad_scale_shape():
    data, scale_inv, data_t, scale_inv_t = cast.quantize_blockwise(torch.randn(4, 130), E4M3)
    assert data_t is None and scale_inv_t is None
    with pytest.raises(ValueError, match=r"scale_inv has shape \(4, 1\).*need \(4, 2\)"):
        cast.dequantize_blockwise(data, scale_inv[:, :1], False, torch.float32)


def mx_exponent(amax):
    """Smallest e in [-127, 127] with amax / 2^e <= fmax, by trying every candidate (float64 is exact here)."""
    e = torch.arange(-127, 128, dtype=torch.float64)
    ok = amax.double().unsqueeze(-1) <= 448.0 * torch.pow(2.0, e)
    first = torch.where(ok.any(-1), ok.float().argmax(-1), torch.full_like(amax, 254, dtype=torch.int64))
    return (first - 127).to(torch.int64)


@pytest.mark.parametrize("shape", [(32, 64), (64, 96)])
def test_quantize_mxfp8(shape):
    x = torch.randn(shape) * torch.logspace(-30, 30, shape[1])
    x[0, :32] = 0.0
    x[1, :32] = 448.0
    x[1, 32:64] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))
    x[2, :32] = 224.0
    data, scales, data_t, scales_t = cast.quantize_mxfp8(x, E4M3, with_transpose=True)
    amax = x.abs().reshape(shape[0], -1, 32).amax(-1)
    e = mx_exponent(amax)
    assert scales.dtype == torch.uint8 and torch.equal(scales.long(), e + 127)
    assert scales[0, 0].item() == 0 and scales[1, 0].item() == 127
    assert scales[1, 1].item() == 128 and scales[2, 0].item() == 126
    pow2 = torch.pow(2.0, -e.double()).float().repeat_interleave(32, dim=1)
    assert torch.equal(bits(data), bits((x * pow2).to(E4M3)))  # never saturates
    amax_t = x.t().abs().reshape(shape[1], -1, 32).amax(-1)
    assert torch.equal(scales_t.long(), mx_exponent(amax_t) + 127)
    y = torch.randn(shape) * 10.0 ** torch.randint(-20, 20, (shape[0], shape[1] // 32, 1)).float().repeat_interleave(
        32, dim=1
    ).squeeze(-1)
    data, scales, _, _ = cast.quantize_mxfp8(y, E4M3)
    back = cast.dequantize_mxfp8(data, scales, torch.float32)
    torch.testing.assert_close(back, y, rtol=0.125, atol=0.0)


@pytest.mark.parametrize("strided", [False, True])
def test_transposed_copies_are_contiguous(strided):
    """The contract's *_t outputs are contiguous (K, M) tensors, and so is an MXFP8 cast's data
    whatever x's strides. torch.compile takes a backend's output layouts from the reference (its
    fake implementation): a kernel writing contiguous outputs where the reference returned a
    strided view failed inductor's stride assertion."""
    x = torch.randn(96, 64) if strided else torch.randn(64, 96)
    x = x.t() if strided else x  # (64, 96) either way
    for out in (cast.cast_transpose_fp8(x.contiguous(), torch.tensor([1.0]), E4M3),
                cast.quantize_fp8_current(x.contiguous(), E4M3, with_transpose=True),
                cast.quantize_mxfp8(x, E4M3, with_transpose=True)):
        assert all(t.is_contiguous() for t in out if isinstance(t, torch.Tensor) and t.dim() == 2)
    data, scales, data_t, scales_t = cast.quantize_mxfp8(x, E4M3, with_transpose=True)
    assert data_t.shape == (96, 64) and scales_t.shape == (96, 2) and data.shape == (64, 96)


def test_mxfp8_extremes_and_errors():
    x = torch.tensor([[1e-44] * 32, [3e38] * 32, [float("inf")] + [1.0] * 31, [float("nan")] + [1.0] * 31])
    data, scales, _, _ = cast.quantize_mxfp8(x, E5M2)
    assert scales[:, 0].tolist() == [0, 127 + 113, 254, 255]
    assert data[2, 0].float().item() == 57344.0 and torch.isnan(data[3, 0].float())
    back = cast.dequantize_mxfp8(data, scales, torch.float32)
    assert torch.isnan(back[3]).all() and back[2, 0].item() == float("inf")  # E8M0 255 is NaN
    with pytest.raises(ValueError, match=r"needs K \(x.shape\[1\]\) to be a multiple of 32, got 40"):
        cast.quantize_mxfp8(torch.randn(32, 40), E4M3)
    with pytest.raises(ValueError, match=r"needs M \(x.shape\[0\].*multiple of 32, got 40"):
        cast.quantize_mxfp8(torch.randn(40, 64), E4M3, with_transpose=True)
    with pytest.raises(ValueError, match=r"scales must be uint8 E8M0 of shape \(4, 1\)"):
        cast.dequantize_mxfp8(data, scales.float(), torch.float32)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"fp8_dtype=torch.float16 is not an FP8 dtype; allowed values"):
        cast.quantize_fp8(torch.randn(4), torch.ones(1), torch.float16)
    with pytest.raises(TypeError, match=r"x has dtype torch.int32; expected a high-precision float"):
        cast.quantize_fp8(torch.ones(4, dtype=torch.int32), torch.ones(1), E4M3)
    with pytest.raises(ValueError, match=r"scale must be a 1-element tensor, got \(2,\)"):
        cast.quantize_fp8(torch.randn(4), torch.ones(2), E4M3)
    with pytest.raises(ValueError, match=r"x must be 2-D, got shape \(2, 3, 4\)"):
        cast.cast_transpose_fp8(torch.randn(2, 3, 4), torch.ones(1), E4M3)
    with pytest.raises(ValueError, match=r"x must be 2-D"):
        cast.quantize_fp8_current(torch.randn(8), E4M3, with_transpose=True)
    with pytest.raises(ValueError, match=r"data.dtype=torch.float32 is not an FP8 dtype"):
        cast.dequantize_fp8(torch.randn(4), torch.ones(1), torch.float32)


def test_exact_pow2_covers_the_float32_range():
    e = torch.arange(-149, 128)
    assert cast.exact_pow2(e).tolist() == [2.0 ** int(i) for i in e]


def test_amax_out_maxes_into_the_slot_and_rejects_bad_slots():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 8, generator=g)
    amax = x.abs().max()
    for start, want in ((0.5 * amax.item(), amax.item()), (2 * amax.item(), 2 * amax.item())):
        history = torch.zeros(2, 3)
        history[0, 2] = start
        data, got = cast.cast_transpose_fp8(x, torch.tensor([4.0]), torch.float8_e4m3fn, amax_out=history[0, 2:3])[::2]
        assert got.data_ptr() == history[0, 2:3].data_ptr() and history[0, 2].item() == pytest.approx(want, rel=0)
        assert torch.equal(data.float(), cast.quantize_fp8(x, torch.tensor([4.0]), torch.float8_e4m3fn)[0].float())
    with pytest.raises(ValueError, match=r"amax_out must be a 1-element float32 tensor, got torch.float64 \(1,\)"):
        cast.quantize_fp8(x, torch.tensor([1.0]), torch.float8_e4m3fn, amax_out=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"amax_out must be a 1-element float32 tensor, got torch.float32 \(2,\)"):
        cast.quantize_fp8(x, torch.tensor([1.0]), torch.float8_e4m3fn, amax_out=torch.zeros(2))
    with pytest.raises(ValueError, match="amax_out is on meta but x is on cpu"):
        cast.quantize_fp8(x, torch.tensor([1.0]), torch.float8_e4m3fn, amax_out=torch.zeros(1, device="meta"))


def test_transpose_fp8_is_exact_and_names_bad_input():
    g = torch.Generator().manual_seed(11)
    data = (torch.randn(7, 13, generator=g) * 50).to(torch.float8_e5m2)
    got = cast.transpose_fp8(data)
    assert got.is_contiguous() and torch.equal(got.view(torch.uint8), data.view(torch.uint8).t())
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        cast.transpose_fp8(torch.randn(4, 4))
    with pytest.raises(ValueError, match="must be 2-D"):
        cast.transpose_fp8(torch.zeros(2, 3, 4).to(torch.float8_e4m3fn))
