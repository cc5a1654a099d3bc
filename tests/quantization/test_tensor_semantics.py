"""Quantized tensors behave as the torch tensors they stand for: `.data =` replaces their value,
new_zeros/new_empty own their scales, writes through a select or slice reach the tensor they
view (and only their part of it), float()/half()/bfloat16() give plain copies, a reshape of a
column slice copies, and quantize_ (Transformer Engine's in-place cast) with its noop_flag."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import te_core as te
from te_core.dtype import DType
from te_core.quantization import Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor, QuantizedTensor

from .conftest import randn

E4M3 = DType.kFloat8E4M3


def _current():
    return te.Float8CurrentScalingQuantizer(E4M3)


def _block(dim=2):
    return te.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=dim)


def _mxfp8():
    return te.MXFP8Quantizer(E4M3)


QUANTIZERS = {"current": _current, "block2d": _block, "block1d": lambda: _block(1), "mxfp8": _mxfp8}
KINDS = {"current": Float8Tensor, "block2d": Float8BlockwiseTensor, "block1d": Float8BlockwiseTensor,
         "mxfp8": MXFP8Tensor}


def assert_fp8_close(got, want):
    """Within E4M3's rounding of `want`: half a unit in the last of 3 mantissa bits (2^-4 of the
    value), plus the subnormal spacing below the tensor's scale (amax / 448 * 2^-9)."""
    got, want = got.double(), want.double()
    bound = want.abs() * 2.0 ** -4 + want.abs().amax() * 2.0 ** -17
    excess = (got - want).abs() - bound
    assert excess.max() <= 0, f"off by {(got - want).abs().max():.4g} (up to {excess.max():.4g} past E4M3 rounding)"


def assert_layouts_agree(t):
    """The column-wise copy a backward GEMM reads holds the same value as the row-wise data."""
    if t.has_columnwise:
        assert_fp8_close(t.columnwise_only().dequantize(), t.dequantize())


# ------------------------------------------------------------------ .data = (bug: silently ignored)
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_data_assignment_quantizes_a_plain_tensor(kind, gen):
    q = QUANTIZERS[kind]()
    w = torch.nn.Parameter(q(randn(gen, 128, 128)))
    new = randn(gen, 128, 128, scale=10.0)
    w.data = new
    assert type(w) is KINDS[kind] and w.requires_grad and w.shape == new.shape
    assert torch.equal(w.dequantize(), q(new).dequantize())  # exactly the tensor's own quantizer's cast
    assert_fp8_close(w.dequantize(), new)
    assert_layouts_agree(w)


def test_data_assignment_takes_the_new_shape_dtype_and_quantizer_of_a_tensor_of_its_kind(gen):
    q = _current()
    w = torch.nn.Parameter(q(randn(gen, 16, 16)))
    new = randn(gen, 8, 32, scale=3.0, dtype=torch.bfloat16)
    w.data = new
    assert (w.shape, w.dtype) == ((8, 32), torch.bfloat16)
    assert_fp8_close(w.dequantize(torch.float64), new.double())
    other = _current()(randn(gen, 4, 4, scale=5.0))
    w.data = other  # shares other's data, as plain tensors do
    assert w._data is other._data and w._scale_inv is other._scale_inv and w.quantizer is other.quantizer
    assert (w.shape, w.dtype) == ((4, 4), torch.float32) and torch.equal(w.dequantize(), other.dequantize())
    assert w.requires_grad and isinstance(w, torch.nn.Parameter)


def test_data_assignment_refuses_what_cannot_be_quantized(gen):
    w = _current()(randn(gen, 4, 4))
    with pytest.raises(TypeError, match="floating-point"):
        w.data = torch.ones(4, 4, dtype=torch.int64)


RECIPES = {"delayed": te.recipe.DelayedScaling, "current": te.recipe.Float8CurrentScaling,
           "block": te.recipe.Float8BlockScaling, "mxfp8": te.recipe.MXFP8BlockScaling}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_linear_fp8_weight_data_assignment_reaches_the_forward(recipe, gen):
    with te.quantized_model_init(enabled=True, recipe=RECIPES[recipe]()):
        layer = te.Linear(128, 128, params_dtype=torch.float32)
    weight = layer.weight
    new = randn(gen, 128, 128)  # far larger than the initial weights: a delayed scale would saturate it
    weight.data = new
    assert layer.weight is weight and isinstance(weight, QuantizedTensor) and weight.requires_grad
    assert_fp8_close(weight.dequantize(), new)
    assert_layouts_agree(weight)
    x = randn(gen, 32, 128)
    with torch.no_grad():
        y = layer(x).double()
    want = x.double() @ weight.dequantize().double().t() + layer.bias.double()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------ new_zeros / new_empty (bug: shared scale_inv)
@pytest.mark.parametrize("op", ["new_zeros", "new_empty"])
@pytest.mark.parametrize("kind", ["current", "block2d"])
def test_new_tensors_own_their_scales(kind, op, gen):
    w = QUANTIZERS[kind]()(randn(gen, 128, 128))
    before = w.dequantize().clone()
    z = getattr(w, op)((128, 256))
    src = randn(gen, 128, 256, scale=100.0)
    z.copy_(src)
    assert torch.equal(w.dequantize(), before)
    assert_fp8_close(z.dequantize(), src)


# ------------------------------------------------------------------ writes through views (bug: dropped)
def _apply_writes(t):
    t[1] = 0.75
    t[:, 3] = -0.5
    t.select(0, 2).mul_(0.0)
    t[5][7] = 3.0
    t[128:256][6].add_(1.0)  # (a block tensor's rows are cut at its 128-row tiles)
    t[9, 4:12] = 2.0


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_writes_through_select_and_slice_reach_the_tensor(kind, gen):
    w = QUANTIZERS[kind]()(randn(gen, 256, 128))
    want = w.dequantize().double()
    row = w[4]
    assert row.shape == (128,) and torch.equal(row.dequantize(), w.dequantize()[4])
    _apply_writes(w)
    _apply_writes(want)
    assert_fp8_close(w.dequantize(), want)
    assert_layouts_agree(w)


def test_float8_select_is_an_fp8_view(gen):
    w = _current()(randn(gen, 16, 32))
    row, col = w[3], w[:, 5]
    assert type(row) is Float8Tensor and row._data.data_ptr() == w._data[3].data_ptr()
    assert torch.equal(row.dequantize(), w.dequantize()[3]) and torch.equal(col.dequantize(), w.dequantize()[:, 5])
    assert w[3, 5].dequantize().item() == w.dequantize()[3, 5].item()


def test_float8_slice_write_keeps_the_rest_of_the_tensor(gen):
    """A slice shares the tensor's one scale: requantizing only the slice rescaled every other
    row's bytes."""
    w = _current()(randn(gen, 64, 32))
    want = w.dequantize().double()
    w[0:4].mul_(50.0)
    want[0:4] *= 50.0
    w.view(-1)[40:50].zero_()
    want.view(-1)[40:50] = 0.0
    torch._foreach_mul_([w[8:12], w[20:24]], 3.0)  # two views of one tensor in one op
    want[8:12] *= 3.0
    want[20:24] *= 3.0
    assert_fp8_close(w.dequantize(), want)
    assert_layouts_agree(w)


def test_float8_copy_between_rows_keeps_the_columnwise_copy(gen):
    q = te.Float8CurrentScalingQuantizer(E4M3, rowwise=True, columnwise=True)
    w = q(randn(gen, 32, 64))
    assert w.has_columnwise
    w[1] = w[2]  # equal scales: the bytes are copied
    value = w.dequantize()
    assert torch.equal(value[1], value[2])
    assert torch.equal(w.columnwise_only().dequantize(), value)


@pytest.mark.parametrize("dim", [1, 2])
def test_block_row_copy_keeps_the_columnwise_copy(dim, gen):
    w = _block(dim)(randn(gen, 256, 128))
    want = w.dequantize().double()
    w[0:128] = w[128:256]
    want[0:128] = want[128:256]
    assert_fp8_close(w.dequantize(), want)
    assert_layouts_agree(w)


def test_a_view_of_replaced_data_no_longer_writes_the_tensor(gen):
    """After `w.data = x`, an older view holds w's former bytes, as a view of a plain tensor
    holds its former storage: a write through it leaves w alone."""
    q = _current()
    w = q(randn(gen, 16, 16))
    old = w[0:4]
    before = old.dequantize().clone()
    new = randn(gen, 16, 16)
    w.data = new
    old.mul_(2.0)
    assert torch.equal(w.dequantize(), q(new).dequantize())
    assert_fp8_close(old.dequantize(), before * 2.0)


def test_detached_view_still_writes_the_tensor(gen):
    w = _current()(randn(gen, 16, 16))
    want = w.dequantize().double()
    w[2:6].detach().fill_(0.25)
    want[2:6] = 0.25
    assert_fp8_close(w.dequantize(), want)


def test_views_copy_and_pickle_as_independent_tensors(gen):
    w = _current()(randn(gen, 16, 16))
    value = w.dequantize().clone()
    for twin in (copy.deepcopy(w[2:6]), pickle.loads(pickle.dumps(w[2:6])), w[2:6].clone()):
        assert torch.equal(twin.dequantize(), value[2:6])
        twin.mul_(100.0)
    assert torch.equal(w.dequantize(), value)


def test_update_quantized_into_a_view_writes_the_tensor(gen):
    q = _current()
    w = q(randn(gen, 32, 32))
    want = w.dequantize().double()
    part = randn(gen, 4, 32, scale=20.0)
    q.update_quantized(part, w[4:8])
    want[4:8] = part.double()
    assert_fp8_close(w.dequantize(), want)


# ------------------------------------------------------------------ float() / half() / bfloat16()
@pytest.mark.parametrize("dtype, cast", [(torch.float32, "float"), (torch.float16, "half"),
                                         (torch.bfloat16, "bfloat16")])
@pytest.mark.parametrize("kind", ["current", "block2d", "mxfp8"])
def test_casts_to_the_nominal_dtype_are_plain_copies(kind, dtype, cast, gen):
    q = QUANTIZERS[kind]()
    w = q(randn(gen, 128, 128).to(dtype))
    assert w.dtype == dtype
    before = w.dequantize().clone()
    master = getattr(w.detach().clone(), cast)()
    assert type(master) is torch.Tensor and master.dtype == dtype
    assert torch.equal(master, before)
    master.add_(1.0)
    assert torch.equal(w.dequantize(), before)
    assert torch.equal(torch.from_numpy(getattr(w, cast)().float().numpy()), before.float())


def test_float_of_a_trainable_weight_passes_the_gradient(gen):
    w = torch.nn.Parameter(_current()(randn(gen, 8, 8)))
    c = randn(gen, 8, 8)
    (w.float() * c).sum().backward()
    assert torch.equal(w.grad, c)


def test_to_and_type_of_the_nominal_dtype_follow_torch(gen):
    """As torch's (and Transformer Engine's): no copy asked for, the tensor itself; a copy asked
    for, a quantized copy with buffers of its own."""
    w = _current()(randn(gen, 16, 16))
    before = w.dequantize().clone()
    assert w.to(torch.float32) is w and w.type(torch.float32) is w
    twin = w.to(torch.float32, copy=True)
    assert type(twin) is Float8Tensor and twin._data is not w._data and torch.equal(twin.dequantize(), before)
    twin.mul_(10.0)
    assert torch.equal(w.dequantize(), before)


# ------------------------------------------------------------------ reshape of a column slice (bug: crashed)
def test_reshape_and_flatten_of_a_column_slice_copy(gen):
    w = _current()(randn(gen, 16, 32))
    value = w.dequantize().clone()
    part = w[:, 0:8]
    for flat in (part.reshape(-1), part.flatten(), torch.flatten(part), part.reshape(4, 32)):
        assert isinstance(flat, Float8Tensor)
        assert torch.equal(flat.dequantize(), value[:, 0:8].reshape(flat.shape))
    copied = part.reshape(-1)
    copied.mul_(100.0)  # a copy, as torch's reshape of a column slice: the tensor stays
    assert torch.equal(w.dequantize(), value)
    assert_fp8_close(copied.dequantize(), value[:, 0:8].reshape(-1) * 100.0)


# ------------------------------------------------------------------ quantize_ (was missing)
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_quantize_casts_into_the_tensor(kind, gen):
    q = QUANTIZERS[kind]()
    w = torch.nn.Parameter(q(randn(gen, 128, 128)))  # a trainable weight, as TE's FusedAdam updates
    new = randn(gen, 128, 128, scale=7.0)
    assert w.quantize_(new) is w
    assert torch.equal(w.dequantize(), q(new).dequantize())
    assert_layouts_agree(w)
    other = _block()(randn(gen, 128, 128, scale=0.5))  # another kind: its value
    w.quantize_(other)
    assert_fp8_close(w.dequantize(), other.dequantize())


def test_quantize_noop_flag_skips_only_at_one(gen):
    """Transformer Engine's cast kernels skip when the flag holds exactly 1.0."""
    q = _current()
    w = q(randn(gen, 16, 16))
    for flag, skipped in ((1.0, True), (0.0, False), (2.0, False)):
        before = w.dequantize().clone()
        new = randn(gen, 16, 16, scale=3.0)
        w.quantize_(new, noop_flag=torch.tensor([flag]))
        if skipped:
            assert torch.equal(w.dequantize(), before)
        else:
            assert torch.equal(w.dequantize(), q(new).dequantize())
    for flag in (torch.zeros(2), torch.zeros(1, dtype=torch.int32)):
        with pytest.raises(ValueError, match="1-element float32"):
            w.quantize_(new, noop_flag=flag)
