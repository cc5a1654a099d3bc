"""The plain-torch twins torch.compile traces (te_backend_cuda.traced): their math against the
reference on the CPU, each twin against the eager op on the GPU (FP8 bytes and amaxes equal),
and under torch.compile on the GPU."""
import pytest
import torch

from te_backend_cuda import traced
from te_core.reference import activation as ref_act
from te_core.reference import cast as ref_cast

F8 = (torch.float8_e4m3fn, torch.float8_e5m2)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _x(device="cpu", dtype=torch.bfloat16, shape=(96, 160)):
    x = torch.randn(*shape, device=device) * 3
    x[0, :4] = torch.tensor([1e6, -1e6, 0.0, -0.0])  # saturation both ways, signed zero
    return x.to(dtype)


def _bytes_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", F8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_math_matches_reference(fp8_dtype, dtype):
    x = _x(dtype=dtype)
    scale = torch.tensor([0.37])
    data, amax = ref_cast.quantize_fp8(x, scale, fp8_dtype)
    _bytes_equal(traced._cast(x, scale, fp8_dtype), data)
    assert traced._amax(x).item() == amax.item()


def test_amax_keeps_nan():
    x = _x()
    x[3, 3] = float("nan")
    assert torch.isnan(traced._amax(x))


@pytest.mark.parametrize("eps,pow2", [(0.0, False), (0.0, True), (4.0, False)])
@pytest.mark.parametrize("amax", [3.7, 0.0, float("inf"), float("nan"), 1e-40])
def test_current_scale_rules_match_reference(amax, eps, pow2):
    fmax = 448.0
    got = traced._current_scale(torch.tensor([amax]), fmax, eps, pow2)
    want = ref_cast.scale_from_amax(torch.tensor([amax]), fmax, eps, pow2)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got, want)


def test_twins_decline_what_they_do_not_take():
    x = _x()  # on the CPU: the eager op's supports() sends it to the reference
    assert traced.quantize_fp8(x, torch.ones(1), torch.float8_e4m3fn) is NotImplemented
    assert traced.gemm_fp8(x, x, torch.ones(1), torch.ones(1), out_dtype=torch.bfloat16) is NotImplemented
    if torch.cuda.is_available():  # a history slot keeps the opaque op
        xc = x.cuda()
        slot = torch.zeros(1, device="cuda")
        assert traced.quantize_fp8(xc, torch.ones(1, device="cuda"), torch.float8_e4m3fn,
                                   amax_out=slot) is NotImplemented


@GPU
@pytest.mark.parametrize("fp8_dtype", F8)
def test_twins_equal_eager_ops_on_gpu(fp8_dtype):
    from te_backend_cuda import ops

    x = _x("cuda", shape=(256, 384))
    scale = torch.tensor([0.37], device="cuda")
    want = ops.cast_transpose_fp8(x, scale, fp8_dtype)
    got = traced.cast_transpose_fp8(x, scale, fp8_dtype)
    _bytes_equal(got[0], want[0])
    _bytes_equal(got[1], want[1])
    assert torch.equal(got[2].reshape(()), want[2].reshape(()))
    want = ops.dbias_cast_transpose(x, scale, fp8_dtype)
    got = traced.dbias_cast_transpose(x, scale, fp8_dtype)
    _bytes_equal(got[0], want[0])
    torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=1e-5)  # rows summed in another order
    want = ops.quantize_fp8_current(x, fp8_dtype, with_transpose=True)
    got = traced.quantize_fp8_current(x, fp8_dtype, with_transpose=True)
    for g, w in zip(got, want):  # data, data_t, scale, scale_inv, amax
        assert torch.equal(g.flatten().view(torch.uint8), w.flatten().view(torch.uint8))


@GPU
def test_compiled_twins_equal_eager_ops():
    from te_backend_cuda import ops, scaled_mm

    x = _x("cuda", shape=(256, 384))
    w = _x("cuda", shape=(512, 384))
    scale = torch.tensor([0.37], device="cuda")

    def step(x, w):
        xq, _, _ = traced.cast_transpose_fp8(x, scale, torch.float8_e4m3fn)
        wq, _, _ = traced.cast_transpose_fp8(w, scale, torch.float8_e4m3fn)
        return traced.gemm_fp8(xq, wq, 1 / scale, 1 / scale, out_dtype=torch.bfloat16, fast_accumulation=True)

    xq = ops.cast_transpose_fp8(x, scale, torch.float8_e4m3fn)[0]
    wq = ops.cast_transpose_fp8(w, scale, torch.float8_e4m3fn)[0]
    want = scaled_mm.gemm_fp8(xq, wq, 1 / scale, 1 / scale, out_dtype=torch.bfloat16, fast_accumulation=True)
    got = torch.compile(step, fullgraph=True)(x, w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
