"""A view op on a quantized tensor (Float8Tensor, Float8BlockwiseTensor, MXFP8Tensor) keeps torch's
semantics: where torch gives a view, an in-place write through the result reaches the tensor;
where torch raises (view() of a column slice), it raises; where torch copies (reshape of a column
slice, indexing with a tensor), the tensor stays. A dequantized copy where torch gives a view
(t(), transpose, expand, unsqueeze... and view() of a column slice) read right but silently
dropped the write. Each case is checked against a float64 model: the same ops on the dequantized
value as a plain tensor."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.dtype import DType
from te_core.quantization import Float8Tensor
from te_core.quantization.dequantized_view import DequantizedView
from te_core.quantization.quantizers import Float8Quantizer
from te_core.quantization.roles import Role
from te_core.quantization.scaling import ScalingGroup
from te_core.recipe import DelayedScaling

from .conftest import randn

E4M3 = DType.kFloat8E4M3
ROWS, COLS = 256, 128  # (two 128-row tiles: a block tensor's row cuts stay block tensors)


def _delayed() -> Float8Quantizer:
    """A delayed quantizer, whose casts of one step share (are lent) one scale_inv snapshot."""
    group = ScalingGroup(["a", "b"], torch.float8_e4m3fn, DelayedScaling(amax_history_len=1), torch.device("cpu"))
    group.scale.fill_(448.0 / 8)
    return Float8Quantizer(Role.INPUT, group, 1)


QUANTIZERS = {
    "delayed": lambda: (lambda x, q=_delayed(): q.quantize(x, columnwise=True)),
    "current": lambda: te.Float8CurrentScalingQuantizer(E4M3, rowwise=True, columnwise=True),
    "block2d": lambda: te.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=2),
    "block1d": lambda: te.Float8BlockQuantizer(E4M3, rowwise=True, columnwise=True, block_scaling_dim=1),
    "mxfp8": lambda: te.MXFP8Quantizer(E4M3),
}
INDEX = torch.tensor([3, 7, 200])
VIEWS = {
    "slice_rows": lambda t: t[128:256],
    "slice_rows_in_tile": lambda t: t[5:9],
    "slice_step": lambda t: t[::2],
    "slice_cols": lambda t: t[:, 2:5],
    "select_row": lambda t: t[3],
    "select_col": lambda t: t[:, 3],
    "select_then_slice": lambda t: t[3][10:20],
    "narrow": lambda t: t.narrow(1, 4, 40),
    "t": lambda t: t.t(),
    "transpose": lambda t: t.transpose(0, 1),
    "permute": lambda t: t.permute(1, 0),
    "t_then_slice": lambda t: t.t()[1:3],
    "t_t": lambda t: t.t().t(),
    "view": lambda t: t.view(128, 256),
    "view_flat": lambda t: t.view(-1),
    "reshape": lambda t: t.reshape(64, 512),
    "flatten": lambda t: t.flatten(),
    "unflatten": lambda t: t.unflatten(1, (4, 32)),
    "unsqueeze": lambda t: t.unsqueeze(0),
    "squeeze": lambda t: t[3:4].squeeze(0),
    "diagonal": lambda t: t.diagonal(),
    "as_strided": lambda t: t.as_strided((10, 10), (COLS, 1), 5),
    "expand": lambda t: t[0:1].expand(4, COLS),
    "index_tensor": lambda t: t[INDEX],
    "split": lambda t: t.split(128)[1],
    "chunk": lambda t: t.chunk(4)[2],
    "unbind": lambda t: t.unbind(0)[9],
    "rows_then_view": lambda t: t[128:256].view(-1),
    # torch refuses these views (the strides allow none), and copies for reshape / contiguous
    "col_slice_view": lambda t: t[:, 2:5].view(-1),
    "col_slice_detached_view": lambda t: t[:, 2:5].detach().view(-1),
    "t_view": lambda t: t.t().view(-1),
    "col_slice_reshape": lambda t: t[:, 2:5].reshape(-1),
    "col_slice_flatten": lambda t: t[:, 2:5].flatten(),
    "t_reshape": lambda t: t.t().reshape(-1),
    "t_contiguous": lambda t: t.t().contiguous(),
}


def _values(gen, shape, dtype):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


WRITES = {
    "copy_": lambda v, gen: v.copy_(_values(gen, v.shape, v.dtype)),
    "add_": lambda v, gen: v.add_(_values(gen, v.shape, v.dtype)),
    "fill_": lambda v, gen: v.fill_(0.75),
    "zero_": lambda v, gen: v.zero_(),
    "index_put_": lambda v, gen: v.index_put_((torch.tensor([0, 1]),), torch.tensor(-1.5, dtype=v.dtype)),
    "masked_fill_": lambda v, gen: v.masked_fill_(torch.arange(v.numel()).reshape(v.shape) % 3 == 0, 2.0),
}


def _torch_outcome(model: torch.Tensor, view: str, write: str):
    """What torch does on the float64 model: ("raise", error) or ("view" | "copy", None), the
    model written where the result is a view."""
    try:
        result = VIEWS[view](model)
        aliased = result._base is not None
        WRITES[write](result, torch.Generator().manual_seed(1))
    except (RuntimeError, IndexError) as error:
        return "raise", error
    return ("view" if aliased else "copy"), None


@pytest.mark.filterwarnings("ignore:Use of (index_put_|masked_fill_) on expanded tensors")
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_a_view_writes_through_raises_or_copies_as_torch(kind, view, gen):
    for write in WRITES:
        t = QUANTIZERS[kind]()(randn(gen, ROWS, COLS))
        before = t.dequantize().double().clone()
        model = before.clone()
        outcome, error = _torch_outcome(model, view, write)
        if outcome == "raise":
            with pytest.raises(type(error)):
                WRITES[write](VIEWS[view](t), torch.Generator().manual_seed(1))
            assert torch.equal(t.dequantize().double(), before), (write, "a refused write changed the tensor")
            continue
        result = VIEWS[view](t)
        if view == "expand" and write not in ("fill_", "zero_"):
            # torch (with a deprecation warning) writes the shared elements one after another: no
            # requantized order for that; a fill gives them all one value (test_expand_fill)
            with pytest.raises(RuntimeError, match="expanded .* write into that tensor"):
                WRITES[write](result, torch.Generator().manual_seed(1))
            assert torch.equal(t.dequantize().double(), before)
            continue
        assert result.is_contiguous() == VIEWS[view](before).is_contiguous(), write
        WRITES[write](result, torch.Generator().manual_seed(1))
        got = t.dequantize().double()
        if outcome == "copy":
            assert torch.equal(got, before), (write, "a write into a copy reached the tensor")
            continue
        assert not torch.equal(got, before), (write, "the write through the view was lost")
        scale = before.abs().max()  # (E4M3's tolerances, relative to the tensor's range)
        torch.testing.assert_close(got / scale, model / scale, rtol=0.125, atol=0.0675, msg=lambda m: f"{write}: {m}")


@pytest.mark.parametrize("kind", list(QUANTIZERS))
def test_view_of_a_column_slice_raises_as_torch_and_reshape_copies(kind, gen):
    """The known case: `w[:, 2:5].view(-1)` returned a copy, which dropped a write through it."""
    t = QUANTIZERS[kind]()(randn(gen, ROWS, COLS))
    value = t.dequantize().clone()
    part = t[:, 2:5]
    assert not part.is_contiguous() and part.stride() == value[:, 2:5].stride()
    with pytest.raises(RuntimeError, match=r"view size is not compatible .* Use \.reshape"):
        part.view(-1)
    flat = part.reshape(-1)
    assert torch.equal(flat.dequantize() if hasattr(flat, "dequantize") else flat, value[:, 2:5].reshape(-1))
    flat.mul_(100.0)  # a copy, as torch's reshape of a column slice: the tensor stays
    assert torch.equal(t.dequantize(), value)


def test_float8_views_share_the_fp8_bytes(gen):
    """t(), transpose, expand, unsqueeze of a Float8Tensor are Float8Tensors viewing its bytes
    (one scale for the whole tensor: any element-wise view of the bytes is that view of the value)."""
    w = QUANTIZERS["current"]()(randn(gen, 64, 32))
    for view in (w.t(), w.transpose(0, 1), w.unsqueeze(1), w[0:1].expand(3, 32), w.t()[2:5], w[:, 3:9]):
        assert type(view) is Float8Tensor and view._data.untyped_storage().data_ptr() == w._data.data_ptr()
        assert view.stride() == view._data.stride()
    assert type(w.view(torch.float32)) is DequantizedView  # (its own dtype: an alias)
    with pytest.raises(NotImplementedError, match=r"dequantize\(\) it first"):
        w.view(torch.int32)


def test_a_write_through_a_view_of_a_delayed_cast_leaves_the_steps_other_casts(gen):
    """The step's casts share one lent scale_inv: the viewed tensor takes a scale of its own
    before its view writes (requantized with the quantizer's delayed scale), and the other cast
    keeps its value bit for bit."""
    q = _delayed()
    a, b = q.quantize(randn(gen, 32, 16)), q.quantize(randn(gen, 32, 16))
    assert a._scale_inv is b._scale_inv
    b_before = b.dequantize().clone()
    want = a.dequantize().double().clone()
    a.t()[3].mul_(-0.5)
    want.t()[3] *= -0.5
    assert torch.equal(b.dequantize(), b_before)
    scale = want.abs().max()
    torch.testing.assert_close(a.dequantize().double() / scale, want / scale, rtol=0.125, atol=0.0675)


def test_a_float8_view_dequantizes_from_dense_bytes(monkeypatch, gen):
    """A view's FP8 bytes are strided (w.t(), a column slice); backends' dequantize kernels read
    dense rows (the cuda backend's declines strided data, falling back with a warning), so the
    bytes go to the op dense, and the values are the view's."""
    from te_core.quantization import float8_tensor

    w = te.Float8CurrentScalingQuantizer(E4M3, rowwise=True, columnwise=False)(randn(gen, ROWS, COLS))
    real = float8_tensor.ops.dequantize_fp8

    def dense_only(data, scale_inv, out_dtype):
        assert data.is_contiguous(), "dequantize_fp8 given strided FP8 bytes"
        return real(data, scale_inv, out_dtype)

    monkeypatch.setattr(float8_tensor.ops, "dequantize_fp8", dense_only)
    whole = w.dequantize()
    assert torch.equal(w.t().dequantize(), whole.t())
    assert torch.equal(w[:, 2:5].dequantize(), whole[:, 2:5])


def test_a_views_twin_in_another_nominal_dtype_keeps_its_layout(gen):
    """with_nominal_dtype of a view (w.t()) shares its FP8 bytes and reports their strides, so torch's
    view rules hold for the twin as for the view: view(-1) raises, and the values are the view's."""
    w = te.Float8CurrentScalingQuantizer(E4M3, rowwise=True, columnwise=False)(randn(gen, ROWS, COLS))
    v = w.t()
    twin = v.with_nominal_dtype(torch.bfloat16)
    assert twin.stride() == v.stride() and not twin.is_contiguous()
    assert torch.equal(twin.dequantize(), v.dequantize().to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        twin.view(-1)
