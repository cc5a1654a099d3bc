"""te_triton.cast under the Triton interpreter against te_core.reference.cast.

amax, scales and shapes compare exactly; FP8 data through fp8_compare (interpreter caveat)."""
import pytest
import torch
from triton_fp8_compare import assert_fp8_matches
from te_core.reference import cast as ref
from te_triton import Config, cast

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SMALL = Config(block=256, block_m=16, block_n=32, num_warps=4, max_programs=3)


def _x(shape, dtype, seed, spread=20.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * spread).to(dtype)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (37, 129)), (torch.float32, (3, 5, 7)), (torch.float16, (1000,))])
def test_quantize_fp8(fp8_dtype, dtype, shape):
    x = _x(shape, dtype, 1)
    scale = torch.tensor([7.5])
    data, amax = cast.quantize_fp8(x, scale, fp8_dtype, SMALL)
    want_data, want_amax = ref.quantize_fp8(x, scale, fp8_dtype)
    assert torch.equal(amax, want_amax)
    assert_fp8_matches(data, want_data)


def test_quantize_saturates_and_keeps_nan():
    x = torch.tensor([1e6, -1e6, float("nan"), 3.0, float("inf")])
    data, amax = cast.quantize_fp8(x, torch.tensor([1.0]), torch.float8_e4m3fn, SMALL)
    assert data.float()[:2].tolist() == [448.0, -448.0]
    assert amax.isnan()  # data[2] is NaN on the GPU; the interpreter casts NaN to 384 (bench checks the GPU)


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("shape", [(64, 96), (33, 70), (1, 5)])
def test_cast_transpose(fp8_dtype, shape):
    x = _x(shape, torch.bfloat16, 2)
    scale = torch.tensor([3.0])
    data, data_t, amax = cast.cast_transpose_fp8(x, scale, fp8_dtype, SMALL)
    want, want_t, want_amax = ref.cast_transpose_fp8(x, scale, fp8_dtype)
    assert torch.equal(amax, want_amax)
    assert_fp8_matches(data, want)
    assert torch.equal(data_t.float().nan_to_num(), data.float().t().nan_to_num())  # transpose is exact


@pytest.mark.parametrize("with_transpose", [False, True])
@pytest.mark.parametrize("pow2,eps", [(False, 0.0), (True, 0.0), (False, 100.0)])
def test_quantize_current(with_transpose, pow2, eps):
    x = _x((45, 67), torch.bfloat16, 3)
    got = cast.quantize_fp8_current(x, torch.float8_e4m3fn, with_transpose=with_transpose, force_pow2_scales=pow2,
                                    amax_epsilon=eps, cfg=SMALL, ct_cfg=SMALL)
    want = ref.quantize_fp8_current(x, torch.float8_e4m3fn, with_transpose=with_transpose, force_pow2_scales=pow2,
                                    amax_epsilon=eps)
    assert torch.equal(got[4], want[4])  # amax
    # scales: the interpreter's div_rn may differ in the last bit from a true quotient (the GPU's does not)
    torch.testing.assert_close(got[2], want[2], rtol=2e-7, atol=0)
    torch.testing.assert_close(got[3], want[3], rtol=2e-7, atol=0)
    if pow2:
        assert torch.equal(got[2], want[2])
    assert_fp8_matches(got[0], want[0])
    assert (got[1] is None) == (not with_transpose)


@pytest.mark.parametrize("special,expected_scale", [(0.0, 1.0), (float("nan"), 1.0), (float("inf"), 1.0), (1e-40, 3.4028234663852886e38)])
def test_current_scale_edge_cases(special, expected_scale):
    x = torch.full((4, 4), special)
    _, _, scale, scale_inv, amax = cast.quantize_fp8_current(x, torch.float8_e4m3fn, cfg=SMALL)
    assert scale.item() == expected_scale
    want = ref.quantize_fp8_current(x, torch.float8_e4m3fn)
    assert torch.equal(scale, want[2]) and torch.equal(amax.nan_to_num(), want[4].nan_to_num())


@pytest.mark.parametrize("with_transpose", [False, True])
def test_quantize_current_writes_scales_into_given_tensors(with_transpose):
    """scale_out / scale_inv_out (the cuda backend's pooled slots) receive the scale and its
    inverse from the cast pass and are what the call returns."""
    x = _x((40, 24), torch.float32, 5)
    scale_out, scale_inv_out = torch.full((1,), -1.0), torch.full((1,), -1.0)
    got = cast.quantize_fp8_current(x, torch.float8_e5m2, with_transpose=with_transpose, cfg=SMALL, ct_cfg=SMALL,
                                    scale_out=scale_out, scale_inv_out=scale_inv_out)
    want = ref.quantize_fp8_current(x, torch.float8_e5m2, with_transpose=with_transpose)
    assert got[2] is scale_out and got[3] is scale_inv_out
    torch.testing.assert_close(got[2], want[2], rtol=2e-7, atol=0)
    torch.testing.assert_close(got[3], want[3], rtol=2e-7, atol=0)
    assert_fp8_matches(got[0], want[0])


@pytest.mark.parametrize("with_transpose", [False, True])
def test_quantize_current_of_an_empty_tensor_has_scale_one(with_transpose):
    x = torch.empty(0, 16)
    data, data_t, scale, scale_inv, amax = cast.quantize_fp8_current(
        x, torch.float8_e4m3fn, with_transpose=with_transpose, cfg=SMALL, ct_cfg=SMALL)
    assert scale.tolist() == [1.0] and scale_inv.tolist() == [1.0] and amax.item() == 0.0
    assert data.shape == (0, 16) and (data_t is None or data_t.shape == (16, 0))


@pytest.mark.parametrize("one_group_numel", [0, 1 << 18])  # partial sums always; one group for small tensors
@pytest.mark.parametrize("max_programs", [0, 3, 7, 64])
def test_dbias_cast_transpose_partials(max_programs, one_group_numel, monkeypatch):
    """Row groups per column strip (1, a few, one per tile) all sum to the float64 column sums."""
    from te_triton import dbias as dbias_ct

    monkeypatch.setattr(dbias_ct, "ONE_GROUP_NUMEL", one_group_numel)
    x = _x((50, 40), torch.float32, 4)
    cfg = Config(block_m=8, block_n=16, num_warps=1, max_programs=max_programs)
    data, data_t, dbias, amax = dbias_ct.dbias_cast_transpose(x, torch.tensor([1.0]), torch.float8_e4m3fn, cfg)
    torch.testing.assert_close(dbias, x.double().sum(0).float(), rtol=1.3e-6, atol=1e-4)
    assert amax.item() == x.abs().max().item()
    want, want_t, _ = ref.cast_transpose_fp8(x, torch.tensor([1.0]), torch.float8_e4m3fn)
    assert_fp8_matches(data, want)
    assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).t())


@pytest.mark.parametrize("one_group_numel", [0, 1 << 18])
def test_dbias_in_bf16_is_the_rounded_float32_sum(one_group_numel, monkeypatch):
    """One group stores the float32 column sums in bf16 from the kernel; partial sums are
    reduced and cast after it: the same bf16 values either way."""
    from te_triton import dbias as dbias_ct

    monkeypatch.setattr(dbias_ct, "ONE_GROUP_NUMEL", one_group_numel)
    x = _x((64, 48), torch.bfloat16, 7)
    cfg = Config(block_m=16, block_n=16, num_warps=1, max_programs=64)
    dbias = dbias_ct.dbias_cast_transpose(x, torch.tensor([1.0]), torch.float8_e4m3fn, cfg)[2]
    assert dbias.dtype == torch.bfloat16 and dbias.shape == (48,)
    torch.testing.assert_close(dbias, x.double().sum(0).to(torch.bfloat16), rtol=1.6e-2, atol=1e-5)


def test_empty_gradient_has_zero_dbias():
    from te_triton import dbias as dbias_ct

    dbias = dbias_ct.dbias_cast_transpose(torch.empty(0, 32), torch.tensor([1.0]), torch.float8_e4m3fn, SMALL)[2]
    assert torch.equal(dbias, torch.zeros(32))


def test_bad_inputs_name_the_problem():
    x = torch.randn(8, 8)
    with pytest.raises(ValueError, match="fp8_dtype must be"):
        cast.quantize_fp8(x, torch.tensor([1.0]), torch.float16, SMALL)
    with pytest.raises(ValueError, match="must be contiguous"):
        cast.quantize_fp8(x.t(), torch.tensor([1.0]), torch.float8_e4m3fn, SMALL)
    with pytest.raises(ValueError, match="1-element float32"):
        cast.quantize_fp8(x, torch.tensor([1.0, 2.0]), torch.float8_e4m3fn, SMALL)
    with pytest.raises(ValueError, match="must be 2-D"):
        cast.cast_transpose_fp8(torch.randn(2, 3, 4), torch.tensor([1.0]), torch.float8_e4m3fn, SMALL)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        cast.quantize_fp8(torch.ones(4, dtype=torch.int32), torch.tensor([1.0]), torch.float8_e4m3fn, SMALL)


@pytest.mark.parametrize("start", [0.25, 1e30, float("nan")])
def test_amax_out_is_maxed_in_place(start):
    """With amax_out (a slot of an amax history row) the kernels max straight into it and return
    it; NaN already there or in x wins, as torch.maximum would give."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(24, 40, generator=g) * 3
    x[5, 7] = 9.5
    for launch in (lambda out: cast.quantize_fp8(x, torch.tensor([2.0]), torch.float8_e4m3fn, SMALL, amax_out=out)[1],
                   lambda out: cast.cast_transpose_fp8(x, torch.tensor([2.0]), torch.float8_e4m3fn, SMALL,
                                                       amax_out=out)[2]):
        history = torch.zeros(3, 2)
        history[0, 1] = start
        slot = history[0, 1:2]
        returned = launch(slot)
        assert returned is slot
        want = torch.maximum(torch.tensor([start]), torch.tensor([9.5]))
        torch.testing.assert_close(history[0, 1:2], want, rtol=0, atol=0, equal_nan=True)
        assert history[0, 0] == 0 and history[1:].eq(0).all()


@pytest.mark.parametrize("with_transpose", [False, True])
def test_current_scaling_maxes_into_amax_out(with_transpose):
    """A backend hands current scaling a zero it keeps (te-backend-cuda's pooled slots): the amax
    lands there, once (the cast pass maxes the same value into it), and the scale follows it."""
    x = _x((30, 48), torch.bfloat16, 12)
    x[3, 4] = -75.0
    zero = torch.zeros(4)[2]  # a 0-dim slot inside a larger buffer, as the pool hands out
    got = cast.quantize_fp8_current(x, torch.float8_e4m3fn, with_transpose=with_transpose, cfg=SMALL, ct_cfg=SMALL,
                                    amax_out=zero)
    assert got[4] is zero and zero.item() == 75.0
    want = ref.quantize_fp8_current(x, torch.float8_e4m3fn, with_transpose=with_transpose)
    torch.testing.assert_close(got[2], want[2], rtol=2e-7, atol=0)
    assert_fp8_matches(got[0], want[0])
    assert cast.amax(x, SMALL, amax_out=torch.full((1,), 80.0)).item() == 80.0  # maxed, not overwritten


def test_fused_fp8_outputs_max_into_amax_out():
    """The norm and activation kernels with FP8 output max their amax into amax_out too."""
    from te_triton import activation, norm

    g = torch.Generator().manual_seed(12)
    x = torch.randn(16, 64, generator=g) * 2
    w = torch.rand(64, generator=g) + 0.5
    history = torch.zeros(2, 3)
    slot = history[0, 2:3]
    _, _, _, amax = norm.norm_fwd(x, w, None, 1e-5, rms=True, fp8_scale=torch.tensor([1.0]),
                                  fp8_dtype=torch.float8_e4m3fn, amax_out=slot)
    want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w).abs().max()
    assert amax is slot
    torch.testing.assert_close(slot, want.reshape(1), rtol=1e-5, atol=0)
    _, amax = activation.activation_fwd(x, "relu", fp8_scale=torch.tensor([1.0]), fp8_dtype=torch.float8_e4m3fn,
                                        amax_out=slot)
    assert amax is slot  # relu's max is below the norm's here, so the slot keeps the larger
    torch.testing.assert_close(slot, torch.maximum(want, x.relu().max()).reshape(1), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="amax_out records the amax of an FP8 output"):
        activation.activation_fwd(x, "relu", amax_out=slot)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(64, 48), (33, 130), (1, 7)])
def test_transpose_fp8_is_bit_exact(fp8_dtype, shape):
    g = torch.Generator().manual_seed(shape[0])
    data = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(fp8_dtype)
    got = cast.transpose_fp8(data, Config(block_m=16, block_n=32, num_warps=1))
    assert got.dtype == fp8_dtype and got.shape == shape[::-1] and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), data.view(torch.uint8).t())


def test_transpose_fp8_names_bad_input():
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        cast.transpose_fp8(torch.randn(4, 4))
    with pytest.raises(ValueError, match="contiguous 2-D"):
        cast.transpose_fp8(torch.zeros(4, 6).to(torch.float8_e4m3fn).t())


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_fp8_is_exact(fp8_dtype, out_dtype):
    g = torch.Generator().manual_seed(3)
    data = (torch.randn(5, 7, 9, generator=g) * 100).clamp(-448, 448).to(fp8_dtype)
    scale_inv = torch.tensor([0.0371])
    got = cast.dequantize_fp8(data, scale_inv, out_dtype, Config(block=64, num_warps=1, max_programs=3))
    assert got.dtype == out_dtype and got.shape == data.shape
    want = ref.dequantize_fp8(data, scale_inv, out_dtype)
    if out_dtype == torch.float32:
        assert torch.equal(got, want)  # an exact product: bit for bit
    else:  # the interpreter's float32 -> 16-bit casts do not always round to nearest (the GPU's do)
        torch.testing.assert_close(got, want, rtol=1.6e-2 if out_dtype == torch.bfloat16 else 1e-3, atol=1e-5)


def test_dequantize_fp8_names_bad_input():
    data = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_inv must be a 1-element float32 tensor"):
        cast.dequantize_fp8(data, torch.ones(2), torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        cast.dequantize_fp8(torch.zeros(4, 6).to(torch.float8_e4m3fn).t(), torch.ones(1), torch.float32)
    with pytest.raises(TypeError, match="data must be float8"):
        cast.dequantize_fp8(torch.zeros(4), torch.ones(1), torch.float32)


def test_dequantize_fp8_refuses_a_scale_inv_on_another_device():
    data = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_inv is on meta but the input is on cpu"):
        cast.dequantize_fp8(data, torch.ones(1, device="meta"), torch.float32)


@pytest.mark.parametrize("slot,match", [
    (torch.zeros(1, dtype=torch.float16), r"amax_out must be a 1-element float32 tensor, got torch.float16 \(1,\)"),
    (torch.zeros(1, dtype=torch.float64), "amax_out must be a 1-element float32 tensor"),
    (torch.zeros(0), r"amax_out must be a 1-element float32 tensor, got torch.float32 \(0,\)"),
    (torch.zeros(2), "amax_out must be a 1-element float32 tensor"),
    (torch.zeros(1, device="meta"), "amax_out is on meta but the input is on cpu"),
], ids=["float16", "float64", "empty", "two-elements", "other-device"])
def test_amax_out_the_kernels_cannot_max_into_is_refused(slot, match):
    """The kernels max an int32 into amax_out's address: a 16-bit slot took 4 bytes (its
    neighbour's too), a float64 one half its bytes, an empty one a null pointer (a crash)."""
    x = _x((8, 16), torch.float32, 1)
    for call in (lambda: cast.quantize_fp8(x, torch.ones(1), torch.float8_e4m3fn, SMALL, amax_out=slot),
                 lambda: cast.amax(x, SMALL, amax_out=slot),
                 lambda: cast.cast_transpose_fp8(x, torch.ones(1), torch.float8_e4m3fn, SMALL, amax_out=slot),
                 lambda: cast.quantize_fp8_current(x, torch.float8_e4m3fn, cfg=SMALL, amax_out=slot)):
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("scale,match", [
    (None, "scale must be a 1-element float32 tensor, got NoneType"),
    (2.0, "scale must be a 1-element float32 tensor, got float"),
    (torch.ones(1, device="meta"), "scale is on meta but the input is on cpu"),
], ids=["none", "python-float", "other-device"])
def test_scale_missing_or_on_another_device_is_refused(scale, match):
    x = _x((8, 16), torch.float32, 1)
    with pytest.raises(ValueError, match=match):
        cast.quantize_fp8(x, scale, torch.float8_e4m3fn, SMALL)
    with pytest.raises(ValueError, match=match):
        cast.cast_transpose_fp8(x, scale, torch.float8_e4m3fn, SMALL)


@pytest.mark.parametrize("name", ["scale_out", "scale_inv_out"])
@pytest.mark.parametrize("slot,match", [
    (torch.zeros(1, dtype=torch.int32), "must be a 1-element float32 tensor, got torch.int32"),
    (torch.zeros(1, dtype=torch.float16), "must be a 1-element float32 tensor, got torch.float16"),
    (torch.zeros(0), r"must be a 1-element float32 tensor, got torch.float32 \(0,\)"),
    (torch.zeros(2), r"must be a 1-element float32 tensor, got torch.float32 \(2,\)"),
    (torch.zeros(1, device="meta"), "is on meta but the input is on cpu"),
], ids=["int32", "float16", "empty", "two-elements", "other-device"])
def test_current_scaling_slots_of_another_dtype_size_or_device_are_refused(name, slot, match):
    """The cast pass stores one float32 scale and its inverse there: an int32 slot kept a
    truncated scale beside data cast with the exact one, an empty one was a null pointer."""
    from te_triton import dbias as dbias_ct

    x = _x((8, 16), torch.float32, 1)
    amax_out = torch.zeros(1)
    with pytest.raises(ValueError, match=f"{name} {match}"):
        cast.quantize_fp8_current(x, torch.float8_e4m3fn, cfg=SMALL, amax_out=amax_out, **{name: slot})
    assert amax_out.item() == 0  # refused before the amax pass
    with pytest.raises(ValueError, match=f"{name} {match}"):
        dbias_ct.dbias_cast_transpose_current([x], torch.float8_e4m3fn, amax_cfg=SMALL, **{name: slot})


def test_only_bf16_cast_transposes_leave_saturation_to_the_hardware():
    """Config.hw_saturate drops the clamp for bf16 input only (transpose_clamps says why)."""
    from te_triton import Config
    from te_triton.cast import transpose_clamps

    hw, plain = Config(hw_saturate=True), Config()
    assert not transpose_clamps(hw, torch.empty(2, 2, dtype=torch.bfloat16))
    assert transpose_clamps(hw, torch.empty(2, 2, dtype=torch.float32))
    assert transpose_clamps(hw, torch.empty(2, 2, dtype=torch.float16))
    assert all(transpose_clamps(plain, torch.empty(2, 2, dtype=d)) for d in (torch.bfloat16, torch.float32))
