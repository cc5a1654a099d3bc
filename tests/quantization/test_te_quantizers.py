"""Transformer Engine's quantizer classes (te.Float8Quantizer, ...) and te.DType: TE's
constructors, bit-identical casts to te-core's own quantizers, TE's methods, clear errors."""
from __future__ import annotations

import inspect

import pytest
import torch

import te_core as te
from te_core.dtype import DType, fp8_torch_dtype
from te_core.quantization import Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor, Role, ScalingGroup, gemm_slots
from te_core.quantization import quantizers as core
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

from .conftest import randn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOLERANCE = {E4M3: dict(rtol=0.125, atol=0.0675), E5M2: dict(rtol=0.25, atol=0.125)}


def bits(t):
    return None if t is None else t.view(torch.uint8)


def assert_same_payload(a, b):
    """Equal bit for bit: every payload tensor (data, scales, column-wise copies)."""
    assert type(a) is type(b)
    pa, pb = a._payload(), b._payload()
    assert pa.keys() == pb.keys()
    for name in pa:
        x, y = pa[name], pb[name]
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype, name
            assert torch.equal(bits(x) if x.is_floating_point() and x.element_size() == 1 else x,
                               bits(y) if y.is_floating_point() and y.element_size() == 1 else y), name


# ------------------------------------------------------------------ DType
def test_dtype_members_and_values_are_transformer_engines():
    # transformer_engine.h's values, for the members TE's Python binding exposes
    assert {m.name: m.value for m in DType} == {
        "kByte": 0, "kInt32": 2, "kFloat32": 4, "kFloat16": 5, "kBFloat16": 6, "kFloat8E4M3": 7,
        "kFloat8E5M2": 8, "kFloat4E2M1": 10}
    assert te.DType is DType and int(DType.kFloat8E4M3) == 7


@pytest.mark.parametrize("member, dtype", [
    (DType.kByte, torch.uint8), (DType.kInt32, torch.int32), (DType.kFloat32, torch.float32),
    (DType.kFloat16, torch.float16), (DType.kBFloat16, torch.bfloat16), (DType.kFloat8E4M3, E4M3),
    (DType.kFloat8E5M2, E5M2)])
def test_dtype_maps_to_and_from_torch(member, dtype):
    assert member.torch_dtype is dtype
    assert DType.cast(dtype) is member and DType.cast(member) is member and DType.cast(member.value) is member


def test_dtype_errors_say_what_is_accepted():
    with pytest.raises(NotImplementedError, match="FP4"):
        DType.kFloat4E2M1.torch_dtype
    with pytest.raises(ValueError, match="torch.float64 has no Transformer Engine DType"):
        DType.cast(torch.float64)
    with pytest.raises(ValueError, match="3 is not a DType value"):
        DType.cast(3)
    with pytest.raises(TypeError, match="expected a DType"):
        DType.cast("kFloat8E4M3")
    with pytest.raises(ValueError, match="fp8_dtype=<DType.kBFloat16: 6> is not an FP8 type"):
        fp8_torch_dtype(DType.kBFloat16, owner="X")
    with pytest.raises(TypeError, match="X: fp8_dtype must be one of DType.kFloat8E4M3"):
        fp8_torch_dtype(7, owner="X")
    with pytest.raises(NotImplementedError, match="X: fp8_dtype=DType.kFloat4E2M1"):
        fp8_torch_dtype(DType.kFloat4E2M1, owner="X")


def test_te_cores_own_quantizers_take_a_dtype_too(gen):
    x = randn(gen, 32, 64, scale=3.0)
    by_enum = core.Float8CurrentScalingQuantizer(Role.INPUT, DType.kFloat8E5M2).quantize(x)
    by_torch = core.Float8CurrentScalingQuantizer(Role.INPUT, E5M2).quantize(x)
    assert by_enum.fp8_dtype is E5M2
    assert_same_payload(by_enum, by_torch)
    with pytest.raises(ValueError, match="MXFP8Quantizer: fp8_dtype=torch.bfloat16 is not an FP8 type"):
        core.MXFP8Quantizer(Role.INPUT, torch.bfloat16)


# ------------------------------------------------------------------ TE's signatures
# Transformer Engine 2.20's constructors (transformer_engine/pytorch/tensor/*_tensor.py)
TE_SIGNATURES = {
    te.Float8Quantizer: ["scale", "amax", "fp8_dtype", "*rowwise=True", "*columnwise=True"],
    te.Float8CurrentScalingQuantizer: [
        "fp8_dtype", "device", "*rowwise=True", "*columnwise=True", "*use_existing_amax=False",
        "*with_amax_reduction=False", "*amax_reduction_group=None", "*force_pow_2_scales=False",
        "*amax_epsilon=0.0", "*scale=None", "*amax=None"],
    te.Float8BlockQuantizer: ["fp8_dtype", "*rowwise", "*columnwise", "*amax_epsilon=0.0",
                              "*force_pow_2_scales=True", "*block_scaling_dim=2"],
    te.MXFP8Quantizer: ["fp8_dtype", "*rowwise=True", "*columnwise=True", "*with_2d_quantization=False"],
}


@pytest.mark.parametrize("cls", list(TE_SIGNATURES), ids=lambda c: c.__name__)
def test_constructors_have_transformer_engines_signature(cls):
    got = []
    for p in list(inspect.signature(cls).parameters.values()):
        text = ("*" if p.kind is p.KEYWORD_ONLY else "") + p.name
        if p.default is not p.empty and not (cls is te.Float8CurrentScalingQuantizer and p.name == "device"):
            text += f"={p.default!r}"
        got.append(text)
    assert got == TE_SIGNATURES[cls]


# ------------------------------------------------------------------ bit-identical to te-core's quantizers
@pytest.mark.parametrize("dtype", [DType.kFloat8E4M3, DType.kFloat8E5M2])
@pytest.mark.parametrize("shape", [(48, 80), (3, 16, 80)])
def test_current_scaling_matches_te_cores_cast(gen, dtype, shape):
    x = randn(gen, *shape, scale=7.0, dtype=torch.bfloat16)
    for pow2, eps in ((False, 0.0), (True, 0.5)):
        q = te.Float8CurrentScalingQuantizer(dtype, device="cpu", force_pow_2_scales=pow2, amax_epsilon=eps)
        recipe = Float8CurrentScaling(fp8_format=te.recipe.Format.HYBRID, use_power_2_scales=pow2)
        own = recipe.quantizer_for(Role.INPUT if dtype is DType.kFloat8E4M3 else Role.GRAD_OUTPUT)
        own.amax_epsilon = eps
        got = q(x)
        assert isinstance(got, Float8Tensor) and got.shape == x.shape and got.dtype == x.dtype
        assert got.quantizer is q and q.dtype is dtype and got.fp8_dtype is dtype.torch_dtype
        assert_same_payload(got, own.quantize(x, columnwise=True))
        torch.testing.assert_close(got.dequantize().double(), x.double(), **TOLERANCE[dtype.torch_dtype])


@pytest.mark.parametrize("columnwise", [False, True])
def test_delayed_scaling_matches_te_cores_cast_and_records_amax(gen, columnwise):
    x = randn(gen, 40, 64, scale=5.0)
    scale = 2.0 ** torch.randint(-3, 4, (1,), generator=gen).float()
    group = ScalingGroup(["input"], E4M3, DelayedScaling(), torch.device("cpu"))
    group.scale.copy_(scale)
    own = core.Float8Quantizer(Role.INPUT, group, 0).quantize(x, columnwise=columnwise)
    amax = torch.tensor([0.25])
    q = te.Float8Quantizer(scale.clone(), amax, DType.kFloat8E4M3, columnwise=columnwise)
    got = q(x)
    assert_same_payload(got, own)
    assert amax.item() == x.abs().max().item()  # maxed into the caller's amax
    small = te.Float8Quantizer(scale.clone(), torch.tensor([1e9]), E4M3)
    small(x)
    assert small.amax.item() == 1e9  # a max, not an overwrite
    small.calibrate(x)
    assert small.amax.item() == x.abs().max().item()  # TE's calibrate overwrites


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("shape", [(256, 384), (2, 130, 200)])
def test_block_scaling_matches_te_cores_cast(gen, dim, shape):
    x = randn(gen, *shape, scale=4.0)
    q = te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim)
    recipe = Float8BlockScaling(w_block_scaling_dim=dim)
    own = recipe.make_state(gemm_slots(), torch.device("cpu")).quantizer("weight")
    got = q(x)
    assert isinstance(got, Float8BlockwiseTensor) and got.shape == x.shape
    assert q.block_scaling_dim == dim and q.block_len == 128 and q.force_pow_2_scales is True
    want = own.quantize(x, columnwise=True)
    for name, value in want._payload().items():
        assert torch.equal(bits(getattr(got, name)), bits(value)) if value.element_size() == 1 else \
            torch.equal(getattr(got, name), value), name
    torch.testing.assert_close(got.dequantize().double(), x.double(), **TOLERANCE[E4M3])


def test_quantizer_options_set_after_construction_take_effect(gen):
    """TE's quantizers keep block_scaling_dim and force_pow_2_scales as plain attributes that
    factories set after building one; a cast then equals one built with the value."""
    x = randn(gen, 2, 130, 200, scale=4.0)
    for dim in (1, 2):
        q = te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=3 - dim)
        q.block_scaling_dim = dim
        built = te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim)
        assert q.block_scaling_dim == dim
        assert_same_payload(q(x), built(x))
        torch.testing.assert_close(q(x).dequantize().double(), x.double(), **TOLERANCE[E4M3])
    for pow2 in (True, False):
        for make in (lambda p: te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", force_pow_2_scales=p),
                     lambda p: te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True,
                                                       force_pow_2_scales=p)):
            q = make(not pow2)
            q.force_pow_2_scales = pow2
            assert q.force_pow_2_scales is pow2
            assert_same_payload(q(x), make(pow2)(x))
    x = randn(gen, 64, 96, scale=3.0)  # amax not a power of two: the two scales differ
    q = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    before = q(x)._scale_inv.clone()
    q.force_pow_2_scales = True
    after = q(x)._scale_inv
    assert not torch.equal(before, after) and torch.equal(torch.exp2(torch.log2(after).round()), after)
    with pytest.raises(ValueError, match="block_scaling_dim must be 1 .* got 3"):
        te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True).block_scaling_dim = 3
    with pytest.raises(TypeError, match="force_pow_2_scales must be True or False, got 1"):
        q.force_pow_2_scales = 1


def test_mxfp8_matches_te_cores_cast(gen):
    x = randn(gen, 2, 64, 96, scale=9.0)
    q = te.MXFP8Quantizer(DType.kFloat8E4M3)
    own = MXFP8BlockScaling().quantizer_for(Role.INPUT)
    got = q(x)
    assert isinstance(got, MXFP8Tensor) and got.shape == x.shape
    want = own.quantize(x, columnwise=True)
    for name, value in want._payload().items():
        assert torch.equal(getattr(got, name).view(torch.uint8), value.view(torch.uint8)), name
    torch.testing.assert_close(got.dequantize().double(), x.double(), **TOLERANCE[E4M3])


# ------------------------------------------------------------------ usage, make_empty, in-place updates
def test_usage_flags_choose_the_layouts(gen):
    x = randn(gen, 32, 48, scale=2.0)
    q = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", columnwise=False)
    assert q(x)._transpose is None and q.get_usages() == {"rowwise": True, "columnwise": False}
    q.set_usage(rowwise=False, columnwise=True)
    only = q(x)
    assert only._data is None and only._transpose is not None
    torch.testing.assert_close(only.dequantize(), q.copy().quantize(x, columnwise=False).dequantize(), rtol=0, atol=0)
    q.set_usage(columnwise=False)
    with pytest.raises(ValueError, match="rowwise and columnwise usage are both False"):
        q(x)
    with pytest.raises(TypeError, match="rowwise must be True or False"):
        q.set_usage(rowwise=1)


@pytest.mark.parametrize("fmt", [DType.kFloat8E4M3, DType.kFloat8E5M2])
def test_float8_tensor_answers_transformer_engines_attribute_names(gen, fmt):
    """TE code reads a Float8Tensor's _fp8_dtype (its DType) and _transpose_invalid (no
    column-wise copy held), and sets _transpose_invalid after writing _data in place: the copy
    is dropped and remade from the new row-wise data."""
    q = te.Float8CurrentScalingQuantizer(fmt, "cpu", rowwise=True, columnwise=False)
    t = q(randn(gen, 32, 64, scale=2.0))
    assert t._fp8_dtype is fmt and t._transpose_invalid
    stale = t.columnwise().data.clone()
    assert not t._transpose_invalid
    t._data.copy_(q(randn(gen, 32, 64, scale=2.0))._data)
    t._transpose_invalid = True
    assert t._transpose_invalid
    fresh = t.columnwise().data
    assert bits(fresh).equal(bits(t._data.t().contiguous())) and not bits(fresh).equal(bits(stale))


@pytest.mark.parametrize("make", [
    lambda: te.Float8Quantizer(torch.tensor([8.0]), torch.zeros(1), DType.kFloat8E5M2),
    lambda: te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu"),
    lambda: te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1),
    lambda: te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True),
    lambda: te.MXFP8Quantizer(DType.kFloat8E4M3),
], ids=["delayed", "current", "block1d", "block2d", "mxfp8"])
def test_make_empty_then_update_quantized_equals_a_cast(gen, make):
    q = make()
    x = randn(gen, 2, 64, 160, scale=3.0, dtype=torch.bfloat16)
    empty = q.make_empty(x.shape, dtype=torch.bfloat16, device="cpu")
    cast = q(x)
    assert type(empty) is type(cast) and empty.shape == x.shape and empty.dtype == torch.bfloat16
    for name, value in cast._payload().items():  # same layouts as a cast's
        held = getattr(empty, name)
        assert (held is None) == (value is None) and (value is None or held.shape == value.shape), name
    assert q.update_quantized(x, empty) is empty
    assert_same_payload(empty, cast)
    other = randn(gen, 2, 64, 160, scale=1.0, dtype=torch.bfloat16)
    assert q.quantize(other, out=empty) is empty
    assert_same_payload(empty, q(other))
    empty.copy_(x)  # torch's in-place ops requantize with the tensor's quantizer
    assert_same_payload(empty, cast)
    assert q.make_empty((32, 64), requires_grad=True).requires_grad


def test_gradients_pass_straight_through_a_cast(gen):
    x = randn(gen, 16, 32).requires_grad_()
    w = randn(gen, 16, 32)
    y = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")(x)
    assert y.requires_grad
    (y * w).sum().backward()
    assert torch.equal(x.grad, w)


def test_unsupported_options_and_bad_arguments_are_refused():
    with pytest.raises(NotImplementedError, match="with_amax_reduction / amax_reduction_group"):
        te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", with_amax_reduction=True)
    with pytest.raises(NotImplementedError, match="with_2d_quantization=True"):
        te.MXFP8Quantizer(DType.kFloat8E4M3, with_2d_quantization=True)
    with pytest.raises(ValueError, match="block_scaling_dim must be 1"):
        te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=3)
    with pytest.raises(TypeError, match="missing 2 required keyword-only arguments: 'rowwise' and 'columnwise'"):
        te.Float8BlockQuantizer(DType.kFloat8E4M3)
    with pytest.raises(ValueError, match="amax_epsilon must be a finite number >= 0"):
        te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", amax_epsilon=-1.0)
    with pytest.raises(ValueError, match="Float8CurrentScalingQuantizer: fp8_dtype=<DType.kFloat32: 4> is not an FP8"):
        te.Float8CurrentScalingQuantizer(DType.kFloat32, "cpu")
    with pytest.raises(TypeError, match="scale must be a 1-element float32 tensor"):
        te.Float8Quantizer(torch.ones(2), torch.zeros(1), DType.kFloat8E4M3)
    with pytest.warns(DeprecationWarning, match="ignores use_existing_amax, scale and amax"):
        te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu", use_existing_amax=True)
    q = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, "cpu")
    x = torch.randn(8, 16)
    with pytest.raises(NotImplementedError, match="noop_flag"):
        q.update_quantized(x, q(x), noop_flag=torch.zeros(1))
    with pytest.raises(TypeError, match="dst must be a Float8Tensor, got MXFP8Tensor"):
        q.update_quantized(torch.randn(32, 32), te.MXFP8Quantizer(DType.kFloat8E4M3)(torch.randn(32, 32)))
    with pytest.raises(ValueError, match=r"src has shape \(8, 16\), dst \(16, 8\)"):
        q.update_quantized(x, q(x.t().contiguous()))
    with pytest.raises(TypeError, match="expected a high-precision torch.Tensor"):
        q(q(x))
