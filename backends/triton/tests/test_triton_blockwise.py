"""te_triton.blockwise under the Triton interpreter against te_core.reference.cast.quantize_blockwise."""
import pytest
import torch
from triton_fp8_compare import assert_fp8_matches
from te_core.reference import cast as ref
from te_triton import Config, blockwise


def _x(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, so that each block gets its own scale
    return (torch.randn(shape, generator=g) * torch.logspace(-2, 3, shape[0])[:, None]).to(dtype)


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("with_transpose", [False, True])
@pytest.mark.parametrize("shape", [(130, 300), (64, 128)])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_reference(block_2d, with_transpose, shape, pow2, dtype):
    x = _x(shape, 1, dtype)
    got = blockwise.quantize_blockwise(x, torch.float8_e4m3fn, block_2d=block_2d, with_transpose=with_transpose,
                                       force_pow2_scales=pow2, cfg=Config(block_m=16, num_warps=4))
    want = ref.quantize_blockwise(x, torch.float8_e4m3fn, block_2d=block_2d, with_transpose=with_transpose,
                                  force_pow2_scales=pow2)
    for i in (1, 3):
        if want[i] is None:
            assert got[i] is None
            continue
        # 1x128 grids column by column, 128x128 grids row-major, as the contract lays them out
        assert got[i].stride() == want[i].stride() == ((1, want[i].shape[0]) if not block_2d else (want[i].shape[1], 1))
        if pow2:
            assert torch.equal(got[i], want[i])
        else:  # the interpreter's div_rn may differ in the last bit from a true quotient (the GPU's does not)
            torch.testing.assert_close(got[i], want[i], rtol=2.5e-7, atol=0)
    assert_fp8_matches(got[0], want[0])
    if with_transpose:
        assert_fp8_matches(got[2], want[2])


def test_nan_and_zero_blocks_keep_scale_one():
    x = torch.zeros(128, 256)
    x[3, 5] = float("nan")
    _, s, _, _ = blockwise.quantize_blockwise(x, torch.float8_e4m3fn, block_2d=True)
    _, ws, _, _ = ref.quantize_blockwise(x, torch.float8_e4m3fn, block_2d=True)
    assert torch.equal(s, ws) and s.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_1x128_with_transpose_nan_and_inf(dtype):
    """The 16-bit inputs take their amaxes from 16-bit bits: a NaN or an inf in a run still
    gives that run (row-wise and column-wise) scale 1, as the reference does."""
    x = _x((130, 300), 3, dtype)
    x[5, 7], x[9, 200] = float("nan"), float("inf")
    x[100, 150] = float("-inf")
    got = blockwise.quantize_blockwise(x, torch.float8_e4m3fn, with_transpose=True, cfg=Config(block_m=16, num_warps=4))
    want = ref.quantize_blockwise(x, torch.float8_e4m3fn, with_transpose=True)
    for i in (1, 3):
        assert torch.equal(got[i], want[i])
    assert got[1][5, 0] == 1.0 and got[3][7, 0] == 1.0 and got[3][150, 0] == 1.0


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="must be 2-D"):
        blockwise.quantize_blockwise(torch.randn(2, 3, 4), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        blockwise.quantize_blockwise(torch.ones(4, 4, dtype=torch.int8), torch.float8_e4m3fn)


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(130, 300), (3, 128)])
@pytest.mark.parametrize("row_major", [False, True])
def test_dequantize_matches_reference(block_2d, out_dtype, shape, row_major):
    data, scale_inv, _, _ = ref.quantize_blockwise(_x(shape, 2), torch.float8_e5m2, block_2d=block_2d,
                                                   force_pow2_scales=False)
    if row_major:  # a grid in another layout than the casts' is read through its strides
        scale_inv = scale_inv.contiguous()
    got = blockwise.dequantize_blockwise(data, scale_inv, block_2d, out_dtype, Config(block_m=16, num_warps=4))
    want = ref.dequantize_blockwise(data, scale_inv, block_2d, out_dtype)
    assert got.dtype == out_dtype
    if out_dtype == torch.float32:
        assert torch.equal(got, want)  # an exact product: bit for bit
    else:  # the interpreter's float32 -> bfloat16 cast does not always round to nearest (the GPU's does)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)


def test_dequantize_names_bad_input():
    data = torch.zeros(4, 256).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"shape \(4, 2\) for 1x128 blocks"):
        blockwise.dequantize_blockwise(data, torch.ones(1, 2), False, torch.float32)
    with pytest.raises(TypeError, match="out_dtype must be"):
        blockwise.dequantize_blockwise(data, torch.ones(4, 2), False, torch.int8)
    with pytest.raises(TypeError, match="data must be float8"):
        blockwise.dequantize_blockwise(torch.zeros(4, 256), torch.ones(4, 2), False, torch.float32)
    with pytest.raises(ValueError, match="scale_inv is on meta but data is on cpu"):
        blockwise.dequantize_blockwise(data, torch.ones(4, 2, device="meta"), False, torch.float32)


@pytest.mark.parametrize("widths", [(384,), (256, 128, 128), (128, 72), (200, 40), (128, 0, 128)],
                         ids=["whole", "qkv", "partial-last", "run-across-parts", "empty-part"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [130, 96], ids=["two-row-blocks", "one-row-block"])
def test_dbias_cast_transpose_blockwise_matches_reference(widths, dtype, rows):
    """Each part cast into its columns of the outputs, the column sums from the same read: the
    reference's quantize_blockwise of the joined gradient (1x128 both ways) and its dbias (with
    one row block, written by the kernel in dy's dtype; with more, summed over the blocks)."""
    g = torch.Generator().manual_seed(len(widths))
    parts = [(torch.randn(rows, w, generator=g) * torch.logspace(-2, 2, rows)[:, None]).to(dtype) for w in widths]
    got = blockwise.dbias_cast_transpose_blockwise(parts, torch.float8_e4m3fn, cfg=Config(block_m=16, num_warps=4))
    from te_core.reference import activation as ref_act

    want = ref_act.dbias_cast_transpose_blockwise(parts, torch.float8_e4m3fn)
    assert_fp8_matches(got[0], want[0])
    assert_fp8_matches(got[2], want[2])
    for i in (1, 3):
        assert got[i].stride() == want[i].stride() and torch.equal(got[i], want[i])
    # against float64: float32 accumulation in any order is within rows * 2^-24 * sum|dy| of the
    # exact column sum (the rows cancel, so a relative bound alone would not hold), plus the
    # rounding of the result to dy's dtype
    dy = torch.cat(parts, dim=1).double()
    exact = dy.sum(0)
    rounding = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    if rows <= 128 and dtype == torch.bfloat16:  # rounded by the kernel, which the interpreter's
        rounding = 2.0 ** -7  # float32 -> bfloat16 cast does not always do to nearest (the GPU's does)
    bound = rows * 2.0 ** -24 * dy.abs().sum(0) + rounding * exact.abs() + 1e-30
    assert got[4].dtype == dtype and ((got[4].double() - exact).abs() <= bound).all()


def test_dbias_cast_transpose_blockwise_of_no_rows():
    parts = [torch.empty(0, 256), torch.empty(0, 128)]
    data, s, data_t, st, dbias = blockwise.dbias_cast_transpose_blockwise(parts, torch.float8_e4m3fn)
    assert data.shape == (0, 384) and data_t.shape == (384, 0) and s.shape == (0, 3) and st.shape == (384, 0)
    assert torch.equal(dbias, torch.zeros(384))


def test_dbias_cast_transpose_blockwise_names_parts_that_are_not_column_blocks():
    """Parts of different row counts or dtypes would be read out of bounds: refused, by name."""
    with pytest.raises(ValueError, match=r"parts\[1\] .* is not a column block matching parts\[0\]"):
        blockwise.dbias_cast_transpose_blockwise([torch.randn(8, 128), torch.randn(4, 128)], torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"parts\[1\] \(torch.bfloat16"):
        blockwise.dbias_cast_transpose_blockwise([torch.randn(8, 128), torch.randn(8, 128).bfloat16()],
                                                 torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="non-empty list or tuple"):
        blockwise.dbias_cast_transpose_blockwise([], torch.float8_e4m3fn)
