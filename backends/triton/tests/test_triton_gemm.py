"""te_triton.gemm under the Triton interpreter against a float64 product of the FP8 operands."""
import pytest
import torch
from te_triton import Config, gemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SMALL = Config(block_m=16, block_n=16, block_k=32)


def _fp8(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _exact(a, b, sa, sb, bias):
    out = (a.double() @ b.double().t()) * (sa.double() * sb.double())
    return out if bias is None else out + bias.double()


# shapes that are not multiples of the tiles, so the edge masks count
@pytest.mark.parametrize("shape", [(32, 64, 48), (48, 160, 80), (16, 32, 16)])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)])
@pytest.mark.parametrize("out_dtype,bias_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, None),
                                                  (torch.float16, torch.float32)])
@pytest.mark.parametrize("fast", [False, True])
def test_matches_a_float64_product(shape, dtypes, out_dtype, bias_dtype, fast):
    M, K, N = shape
    a, b = _fp8((M, K), dtypes[0], 1, 3.0), _fp8((N, K), dtypes[1], 2)
    g = torch.Generator().manual_seed(3)
    sa, sb = torch.rand(1, generator=g) + 0.25, torch.rand(1, generator=g) + 0.25
    bias = None if bias_dtype is None else torch.randn(N, generator=g).to(bias_dtype)
    got = gemm.gemm_fp8(a, b, sa, sb, out_dtype=out_dtype, bias=bias, fast_accumulation=fast, cfg=SMALL)
    assert got.dtype == out_dtype and got.shape == (M, N) and got.is_contiguous()
    want = _exact(a, b, sa, sb, bias)
    # float32 accumulation of exact FP8 products: the output's own rounding is the error
    tol = dict(rtol=1.3e-6, atol=1e-5) if out_dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(got.double(), want.to(out_dtype).double(), **tol)


def test_scales_multiply_the_product():
    a, b = _fp8((32, 64), E4M3, 4), _fp8((32, 64), E4M3, 5)
    one = torch.ones(1)
    base = gemm.gemm_fp8(a, b, one, one, out_dtype=torch.float32, cfg=SMALL)
    got = gemm.gemm_fp8(a, b, torch.tensor([0.5]), torch.tensor([8.0]), out_dtype=torch.float32, cfg=SMALL)
    torch.testing.assert_close(got, base * 4, rtol=0, atol=0)


@pytest.mark.parametrize("change,match", [
    (dict(a=torch.ones(4, 8, 2)), "2-D with one K"),
    (dict(b=torch.ones(16, 48).to(E4M3)), "2-D with one K"),
    (dict(a=torch.ones(16, 32, dtype=torch.bfloat16)), "operands must be FP8"),
    (dict(a=torch.ones(32, 16).to(E4M3).t()), "contiguous row-major"),
    (dict(sa=torch.ones(2)), "one-element scale_inv"),
    (dict(sb=torch.ones(1, dtype=torch.float64)), "must be float32"),
    (dict(out_dtype=torch.float8_e4m3fn), "out_dtype must be one of"),
    (dict(bias=torch.ones(8)), r"bias must be a contiguous \(16,\) tensor"),
    (dict(b=torch.ones(16, 32, device="meta").to(E4M3)), "must be on a's device cpu"),
    (dict(sb=torch.ones(1, device="meta")), "must be on a's device cpu"),
    (dict(bias=torch.ones(16, device="meta")), "must be on a's device cpu"),
])
def test_calls_it_cannot_take_are_named(change, match):
    args = dict(a=torch.ones(16, 32).to(E4M3), b=torch.ones(16, 32).to(E4M3), sa=torch.ones(1), sb=torch.ones(1),
                out_dtype=torch.bfloat16, bias=None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        gemm.gemm_fp8(args["a"], args["b"], args["sa"], args["sb"], out_dtype=args["out_dtype"], bias=args["bias"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 300), (16, 256), (1, 5)])
def test_add_bias_matches_torchs_add(dtype, shape):
    """In place, torch's broadcast add (the sum in float32, rounded once), on shapes off the tile
    grid: fp16 bit for bit; bf16 within one unit in the last place, as the interpreter rounds
    float32 to bf16 toward zero where the GPU rounds to nearest even (bit for bit there:
    backends/cuda/tests/test_cuda_gemm.py)."""
    g = torch.Generator().manual_seed(7)
    y = (torch.randn(shape, generator=g) * 100).to(dtype)
    bias = torch.randn(shape[1], generator=g).to(dtype)
    want = y.clone().add_(bias)
    got = gemm.add_bias_(y, bias, cfg=Config(block_m=16, block_n=128))
    assert got is y
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert ulps.max() <= (0 if dtype == torch.float16 else 1)


@pytest.mark.parametrize("y,bias,match", [
    (torch.ones(4, 8, dtype=torch.float32), torch.ones(8), "contiguous 2-D bf16 or fp16"),
    (torch.ones(8, 4, dtype=torch.bfloat16).t(), torch.ones(8, dtype=torch.bfloat16), "contiguous 2-D"),
    (torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8), r"bias must be a contiguous \(8,\) tensor of y's dtype"),
    (torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), r"\(8,\)"),
    (torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16, device="meta"),
     "bias is on meta but y is on cpu"),
])
def test_add_bias_names_calls_it_cannot_take(y, bias, match):
    with pytest.raises(ValueError, match=match):
        gemm.add_bias_(y, bias)
