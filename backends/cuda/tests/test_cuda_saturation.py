"""On the GPU: the FP8-output kernels, which leave saturation to the hardware convert
(Config.hw_saturate), saturate out-of-range values to the format's max and keep NaN, byte for
byte as the reference does, for both FP8 formats."""
import pytest
import torch
from te_core.reference.plugin import implementations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def _ops():
    """The kernels themselves (fn), after checking that supports() takes these inputs."""
    from te_backend_cuda import ops

    impls = ops.native_ops()

    def call(name, *args, **kwargs):
        ok, why = impls[name].supports(*args, **kwargs)
        assert ok, f"{name} declined: {why}"
        return impls[name].fn(*args, **kwargs)

    return {name: (lambda *a, _n=name, **k: call(_n, *a, **k)) for name in impls}


def _input(dtype, fp8_dtype, M=96, N=256, seed=0):
    """Normal values, a stripe far beyond the FP8 max at scale 1, and one NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, N, generator=g)
    x[::7, ::5] *= 4 * FMAX[fp8_dtype] if dtype == torch.float32 else min(4 * FMAX[fp8_dtype], 60000.0)
    x[3, 17] = float("nan")
    return x.to(dtype)


def _saturated_within_a_step(got, want, fmax, what):
    """Norm and activation outputs come out of float32 math whose last bits differ from the
    reference's (reduction order, exp2), so a value may round to the neighbouring FP8 code; the
    saturated ones must be exactly +-fmax and NaN must stay NaN."""
    got, want = got.cpu(), want.cpu()
    nan = got.float().isnan()
    assert torch.equal(nan, want.float().isnan()), f"{what}: NaN at different places"
    sat = want.float().abs() == fmax
    assert sat.any(), f"{what}: the input does not reach the FP8 max (the test needs saturated values)"
    assert torch.equal(got.float()[sat], want.float()[sat]), f"{what}: saturated values differ"
    steps = (got.view(torch.uint8)[~nan].int() - want.view(torch.uint8)[~nan].int()).abs()
    assert steps.max().item() <= 1, f"{what}: {int((steps > 1).sum())} values more than one FP8 step off"


def _same_bytes(got, want, what):
    """Byte for byte, except that any NaN encoding matches any other (the GPU's convert writes
    the canonical NaN; torch's CPU cast keeps the sign of the NaN it is given)."""
    got, want = got.cpu(), want.cpu()
    nan = got.float().isnan()
    assert torch.equal(nan, want.float().isnan()), f"{what}: NaN at different places"
    gb, wb = got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]
    bad = (gb != wb).sum().item()
    assert bad == 0, f"{what}: {bad} bytes differ from the reference (first at {(gb != wb).nonzero()[:3].tolist()})"


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_outputs_saturate_and_keep_nan(fp8_dtype, dtype):
    ops, ref = _ops(), implementations()
    x = _input(dtype, fp8_dtype)
    s = torch.ones(1)
    for name, args in [("quantize_fp8", (x, s, fp8_dtype)), ("cast_transpose_fp8", (x, s, fp8_dtype)),
                       ("dbias_cast_transpose", (x, s, fp8_dtype))]:
        want = ref[name](*args)
        got = ops[name](*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
        _same_bytes(got[0], want[0], f"{name} data")
        if name != "quantize_fp8":
            _same_bytes(got[1], want[1], f"{name} data_t")
        assert (got[0].float().abs() <= FMAX[fp8_dtype]).logical_or(got[0].float().isnan()).all()
    w, b = torch.randn(256).to(dtype), torch.randn(256).to(dtype)
    big = torch.full((1,), 4 * FMAX[fp8_dtype])  # scale the normalized output far past the max
    for name, args in [("layernorm_fwd", (x, w, b, 1e-5)), ("rmsnorm_fwd", (x, w, 1e-5))]:
        kw = dict(fp8_scale=big, fp8_dtype=fp8_dtype)
        want = ref[name](*args, **kw)[0]
        got = ops[name](*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args),
                        fp8_scale=big.cuda(), fp8_dtype=fp8_dtype)[0]
        _saturated_within_a_step(got, want, FMAX[fp8_dtype], name)
    for kind in ("gelu", "swiglu"):
        want = ref["activation_fwd"](x, kind, fp8_scale=big, fp8_dtype=fp8_dtype)[0]
        got = ops["activation_fwd"](x.cuda(), kind, fp8_scale=big.cuda(), fp8_dtype=fp8_dtype)[0]
        _saturated_within_a_step(got, want, FMAX[fp8_dtype], f"activation_fwd {kind}")


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_2d,with_transpose", [(False, False), (False, True), (True, False), (True, True)])
def test_block_casts_saturate_and_keep_nan(fp8_dtype, dtype, block_2d, with_transpose):
    """Block scales come from each block's own amax, so only a block holding inf (scale 1) has
    finite values past the FP8 max: they saturate, the inf to the max as well, NaN stays NaN."""
    ops, ref = _ops(), implementations()
    x = _input(dtype, fp8_dtype, M=200, N=384).float()
    x[130, 200] = float("inf")  # the blocks around it keep their big finite values at scale 1
    x[5, 300] = float("-inf")
    x = x.to(dtype)
    args, kw = (x, fp8_dtype), dict(block_2d=block_2d, with_transpose=with_transpose)
    _same_self_scaled_cast(ops["quantize_blockwise"](x.cuda(), fp8_dtype, **kw), ref["quantize_blockwise"](*args, **kw),
                           fp8_dtype, "quantize_blockwise")


def _same_self_scaled_cast(got, want, fp8_dtype, name):
    """(data, scales, data_t, scales_t) of a cast whose scales come from its blocks: the data
    byte for byte (saturated values among them), the scales equal; None where not asked for."""
    for i, what in ((0, "data"), (2, "data_t")):
        if want[i] is not None:
            assert (want[i].float().abs() == FMAX[fp8_dtype]).any(), f"{what}: the test needs saturated values"
            _same_bytes(got[i], want[i], f"{name} {what}")
    for i, what in ((1, "scales"), (3, "scales_t")):
        if want[i] is not None:
            assert torch.equal(got[i].cpu(), want[i]), f"{name} {what} differ"


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_transpose", [False, True])
def test_mxfp8_casts_saturate_and_keep_nan(fp8_dtype, dtype, with_transpose):
    """MXFP8's power-of-two scales keep finite blocks within the FP8 max; a block holding inf
    gets the largest exponent, and its inf saturates to the max; NaN stays NaN."""
    ops, ref = _ops(), implementations()
    x = _input(dtype, fp8_dtype, M=192, N=256).float()
    x[130, 200] = float("inf")
    x[5, 100] = float("-inf")
    x = x.to(dtype)
    _same_self_scaled_cast(ops["quantize_mxfp8"](x.cuda(), fp8_dtype, with_transpose=with_transpose),
                           ref["quantize_mxfp8"](x, fp8_dtype, with_transpose=with_transpose), fp8_dtype, "quantize_mxfp8")
