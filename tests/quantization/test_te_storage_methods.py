"""TE's storage methods on te-core's quantized tensors (get_data_tensors, get_usages,
update_usage, prepare_for_saving / restore_from_saved, Float8Tensor._create_transpose): what TE
code (integrations offloading, sharding or saving FP8 tensors) calls on a QuantizedTensor.

A layout made again from the other must be the same bytes and scales as the one the cast made,
and GEMMs must read it as they read the original (float64 references, TE's FP32 tolerances)."""
from __future__ import annotations

import pytest
import torch

from te_core.quantization import dgrad_gemm, fprop_gemm, gemm_slots
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

from .conftest import randn
from .test_te_storage_names import _shares

FP32 = dict(rtol=1.3e-6, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)
RECIPES = {"delayed": DelayedScaling(), "current": Float8CurrentScaling(),
           "1x128": Float8BlockScaling(w_block_scaling_dim=1), "128x128": Float8BlockScaling(),
           "mxfp8": MXFP8BlockScaling()}
PER_TENSOR = ("delayed", "current")
BOTH_WAYS = PER_TENSOR + ("128x128",)  # layouts that can be made from each other exactly
ONE_WAY = ("1x128", "mxfp8")


def _state(kind):
    return RECIPES[kind].make_state(gemm_slots(), torch.device("cpu"))


def _weight(gen, kind, columnwise=True):
    return _state(kind).quantizer("weight").quantize(randn(gen, 128, 256), columnwise=columnwise)


def _layouts(w):
    """(row-wise data, scale, column-wise data, scale) as te-core holds them."""
    if hasattr(w, "_transpose"):
        return w._data, w._scale_inv, w._transpose, w._scale_inv
    return w._data, w._scale_inv, w._data_t, w._scale_inv_t


def _bytes(t):
    return None if t is None else t.view(torch.uint8).clone()


@pytest.mark.parametrize("kind", list(RECIPES))
def test_get_data_tensors_and_usages_name_the_held_layouts(gen, kind):
    w = _weight(gen, kind)
    row, _, col, _ = _layouts(w)
    pair = w.get_data_tensors()
    assert pair[0] is row and pair[1] is col
    assert w.get_data_tensors(columnwise_data=False) is row
    assert w.get_data_tensors(rowwise_data=False) is col
    assert w.get_usages() == {"rowwise": True, "columnwise": True}
    assert _weight(gen, kind, columnwise=False).get_usages() == {"rowwise": True, "columnwise": False}
    with pytest.raises(ValueError, match="both False; ask for at least one"):
        w.get_data_tensors(rowwise_data=False, columnwise_data=False)


@pytest.mark.parametrize("kind", BOTH_WAYS)
def test_update_usage_remakes_each_layout_exactly_from_the_other(gen, kind):
    state = _state(kind)
    source = randn(gen, 128, 256)
    w, twin = (state.quantizer("weight").quantize(source, columnwise=True) for _ in range(2))
    row, row_scale, col, col_scale = (_bytes(t) if t.element_size() == 1 else t.clone() for t in _layouts(w))
    w.update_usage(columnwise_usage=False)
    assert w.get_usages() == {"rowwise": True, "columnwise": False}
    w.update_usage(columnwise_usage=True)
    w.update_usage(rowwise_usage=False)
    assert w.get_usages() == {"rowwise": False, "columnwise": True}
    w.update_usage(rowwise_usage=True)
    assert w.get_usages() == {"rowwise": True, "columnwise": True}
    new_row, new_row_scale, new_col, new_col_scale = _layouts(w)
    assert torch.equal(_bytes(new_row), row) and torch.equal(_bytes(new_col), col)
    assert torch.equal(new_row_scale, row_scale) and torch.equal(new_col_scale, col_scale)

    # the GEMMs read the remade layouts as they read the cast's own (a twin cast of the same
    # values), and those agree with float64 (the FP8 value of each operand, TE's FP8 tolerances:
    # the forward GEMM may accumulate in the tensor cores' precision)
    x = state.quantizer("input").quantize(randn(gen, 32, 256))
    dy = state.quantizer("grad_output").quantize(randn(gen, 32, 128), columnwise=True)
    for gemm, a in ((fprop_gemm, x), (dgrad_gemm, dy)):
        got = gemm(a, w, out_dtype=torch.float32)
        torch.testing.assert_close(got, gemm(a, twin, out_dtype=torch.float32), rtol=0, atol=0)
    w64 = w.dequantize().double()
    torch.testing.assert_close(fprop_gemm(x, w, out_dtype=torch.float32).double(), x.dequantize().double() @ w64.T,
                               **E4M3)


@pytest.mark.parametrize("kind", ONE_WAY)
def test_update_usage_refuses_a_layout_the_other_cannot_make(gen, kind):
    w = _weight(gen, kind)
    w.update_usage(rowwise_usage=False)
    with pytest.raises(ValueError, match="cannot be made from it; quantize again with rowwise=True"):
        w.update_usage(rowwise_usage=True)
    assert w.get_usages() == {"rowwise": False, "columnwise": True}  # (nothing changed)
    rowwise_only = _weight(gen, kind, columnwise=False)
    with pytest.raises(RuntimeError, match="quantize it with columnwise=True"):
        rowwise_only.update_usage(columnwise_usage=True)


@pytest.mark.parametrize("kind", list(RECIPES))
def test_update_usage_refuses_to_hold_nothing_and_bad_flags(gen, kind):
    w = _weight(gen, kind)
    with pytest.raises(ValueError, match="no data; keep at least one"):
        w.update_usage(rowwise_usage=False, columnwise_usage=False)
    with pytest.raises(TypeError, match="rowwise_usage must be True, False or None, got str"):
        w.update_usage(rowwise_usage="no")
    assert w.get_usages() == {"rowwise": True, "columnwise": True}


def test_a_view_keeps_its_bases_bytes(gen):
    w = _weight(gen, "delayed")
    view = w[:64]
    with pytest.raises(ValueError, match="a view whose row-wise bytes are its base tensor's"):
        view.update_usage(rowwise_usage=False, columnwise_usage=True)
    assert view.get_usages() == {"rowwise": True, "columnwise": False}  # (checked before anything was made)


@pytest.mark.parametrize("kind", list(RECIPES))
def test_prepare_for_saving_hands_out_the_storage_and_restore_takes_it_back(gen, kind):
    w = _weight(gen, kind)
    want = w.dequantize().double()
    held = list(_layouts(w))
    tensors, same = w.prepare_for_saving()
    assert same is w
    if kind in PER_TENSOR:  # TE's order: data, transpose, scale_inv
        assert tensors[0] is held[0] and tensors[1] is held[2] and tensors[2] is held[1]
        assert w._data is None and w._transpose is None and w._scale_inv is None
    else:  # rowwise data, columnwise data, rowwise scale_inv, columnwise scale_inv
        assert [t is h for t, h in zip(tensors, (held[0], held[2], held[1], held[3]))] == [True] * 4
        assert w._data is None and w._data_t is None
    extra = torch.ones(3)
    rest = w.restore_from_saved(tensors + [extra])
    assert len(rest) == 1 and rest[0] is extra
    torch.testing.assert_close(w.dequantize().double(), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="pass what prepare_for_saving returned"):
        w.restore_from_saved(tensors[:-1])


@pytest.mark.parametrize("kind", PER_TENSOR)
def test_create_transpose_follows_bytes_written_in_place(gen, kind):
    """Megatron's FSDP writes gathered bytes into `_data`'s storage, then asks for the transpose."""
    state = _state(kind)
    w = state.quantizer("weight").quantize(randn(gen, 128, 256), columnwise=True)
    fresh = state.quantizer("weight").quantize(randn(gen, 128, 256, scale=3.0))
    w._rowwise_data.copy_(fresh._rowwise_data)
    w._scale_inv = fresh._scale_inv.clone()
    stale = _bytes(w._transpose)
    w._create_transpose()
    assert torch.equal(_bytes(w._transpose), _bytes(fresh._data).t().contiguous())
    assert not torch.equal(_bytes(w._transpose), stale)
    dy = state.quantizer("grad_output").quantize(randn(gen, 32, 128), columnwise=True)
    fresh.update_usage(columnwise_usage=True)
    torch.testing.assert_close(dgrad_gemm(dy, w, out_dtype=torch.float32),
                               dgrad_gemm(dy, fresh, out_dtype=torch.float32), rtol=0, atol=0)


# --- TE's save protocol over several tensors (transformer_engine.pytorch.quantized_tensor's functions)

class _Storage:
    """A storage object that is not a tensor (as TE's *TensorStorage classes): taken apart for saving."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def prepare_for_saving(self):
        parts, self.a, self.b = [self.a, self.b], None, None
        return parts, self

    def restore_from_saved(self, tensors):
        self.a, self.b = tensors[0], tensors[1]
        return tensors[2:]


@pytest.mark.parametrize("kind", list(RECIPES))
def test_an_autograd_function_saves_quantized_tensors_through_tes_protocol(gen, kind):
    """TE's pattern in a custom autograd Function: prepare_for_saving in the forward,
    restore_from_func_ctx in the backward; te-core's quantized tensors are saved as the tensors
    they are, so the backward computes with the very FP8 operands of the forward."""
    from te_core.quantization.te_storage import prepare_for_saving, restore_from_func_ctx

    state = _state(kind)
    w = state.quantizer("weight").quantize(randn(gen, 64, 256), columnwise=True)
    seen = {}

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            xq = state.quantizer("input").quantize(x, columnwise=True)
            tensors, ctx.tensor_objects = prepare_for_saving(xq, w, None)
            ctx.save_for_backward(*tensors)
            seen["forward"] = (xq, w)
            return fprop_gemm(xq, w, out_dtype=torch.float32)

        @staticmethod
        def backward(ctx, dy):
            xq, wq, nothing = restore_from_func_ctx(ctx)
            assert ctx.tensor_objects is None and nothing is None
            seen["backward"] = (xq, wq)
            dyq = state.quantizer("grad_output").quantize(dy.contiguous(), columnwise=True)
            return dgrad_gemm(dyq, wq, out_dtype=torch.float32)

    x = randn(gen, 32, 256).requires_grad_()
    y = Fn.apply(x)
    dy = randn(gen, 32, 64)
    y.backward(dy)
    (xf, wf), (xb, wb) = seen["forward"], seen["backward"]
    assert type(xb) is type(xf) and type(wb) is type(wf)
    for before, after in ((xf, xb), (wf, wb)):
        assert before._data.data_ptr() == after._data.data_ptr()
        torch.testing.assert_close(after.dequantize(), before.dequantize(), rtol=0, atol=0)
    dyq = state.quantizer("grad_output").quantize(dy, columnwise=True)
    torch.testing.assert_close(x.grad, dgrad_gemm(dyq, w, out_dtype=torch.float32), rtol=0, atol=0)


def test_storage_objects_are_taken_apart_and_put_back():
    from te_core.quantization.te_storage import prepare_for_saving, restore_from_saved

    a, b, c = torch.ones(2), torch.zeros(3), torch.full((1,), 7.0)
    storage = _Storage(a, b)
    saved, objects = prepare_for_saving(c, storage, None)
    assert saved[0] is c and saved[1] is a and saved[2] is b and saved[3] is None
    assert objects == [None, storage, None] and storage.a is None
    restored, rest = restore_from_saved(objects, saved + [c], return_saved_tensors=True)
    assert restored[0] is c and restored[1] is storage and restored[2] is None and rest == [c]
    assert storage.a is a and storage.b is b
    with pytest.raises(ValueError, match="fewer saved tensors than prepare_for_saving listed"):
        restore_from_saved([None, None], [c])
    with pytest.raises(TypeError, match="got str"):
        prepare_for_saving("x")


# --- Transformer Engine's constructor of a Float8Tensor from raw bytes, get_metadata and make_like

@pytest.mark.parametrize("kind", PER_TENSOR)
def test_float8_tensor_from_tes_keywords_is_the_same_tensor(gen, kind):
    from te_core.quantization import Float8Tensor

    state = _state(kind)
    w = state.quantizer("weight").quantize(randn(gen, 4, 32, 64), columnwise=True)
    meta = w.get_metadata()
    assert meta["data"].dtype == torch.uint8 and meta["data_transpose"].dtype == torch.uint8
    assert meta["fake_dtype"] == w.dtype and meta["quantizer"] is w._quantizer
    rebuilt = Float8Tensor(shape=w.shape, dtype=w.dtype, **meta)
    assert type(rebuilt) is Float8Tensor and rebuilt.shape == w.shape and rebuilt.dtype == w.dtype
    assert _shares(rebuilt._data, w._data) and _shares(rebuilt._transpose, w._transpose)
    torch.testing.assert_close(rebuilt.dequantize(), w.dequantize(), rtol=0, atol=0)
    x = state.quantizer("input").quantize(randn(gen, 16, 64))
    dy = state.quantizer("grad_output").quantize(randn(gen, 16, 128), columnwise=True)
    w2d, rebuilt2d = (Float8Tensor.make_like(t, shape=(128, 64)) for t in (w, rebuilt))
    for gemm, a in ((fprop_gemm, x), (dgrad_gemm, dy)):
        torch.testing.assert_close(gemm(a, rebuilt2d, out_dtype=torch.float32), gemm(a, w2d, out_dtype=torch.float32),
                                   rtol=0, atol=0)
    # a bf16 nominal dtype over the same bytes, and a column-wise-only tensor
    half = Float8Tensor(shape=(128, 64), dtype=torch.bfloat16, data=w._rowwise_data.reshape(128, 64),
                        fp8_scale_inv=w._scale_inv, fp8_dtype=torch.float8_e4m3fn)
    torch.testing.assert_close(half.dequantize(), w.dequantize().reshape(128, 64).to(torch.bfloat16), rtol=0, atol=0)
    cols = Float8Tensor(shape=w.shape, dtype=w.dtype, **{**meta, "data": None})
    assert cols.get_usages() == {"rowwise": False, "columnwise": True}
    torch.testing.assert_close(cols.dequantize(), w.dequantize(), rtol=0, atol=0)


def test_make_like_gives_another_shape_on_the_same_bytes(gen):
    from te_core.quantization import Float8Tensor

    w = _weight(gen, "delayed")
    flat = Float8Tensor.make_like(w, shape=(w.numel(),), requires_grad=True)
    assert flat.shape == (w.numel(),) and flat.requires_grad and flat._transpose is None
    assert flat._data.data_ptr() == w._data.data_ptr()
    torch.testing.assert_close(flat.dequantize(), w.dequantize().reshape(-1), rtol=0, atol=0)
    with pytest.raises(TypeError, match="takes a Float8Tensor"):
        Float8Tensor.make_like(_weight(gen, "1x128"))


def test_make_like_on_new_bytes_as_megatrons_checkpoint_reader_calls_it(gen):
    """Megatron-LM reads a sliced (non-contiguous) FP8 weight through a contiguous twin,
    Float8Tensor.make_like(t, data=t._data.contiguous()), then t.copy_(twin) writes it back."""
    from te_core.quantization import Float8Tensor

    w2d = _weight(gen, "current")  # (128, 256)
    t = w2d[:, 16:48]
    assert not t.is_contiguous()
    twin = Float8Tensor.make_like(t, data=t._data.contiguous())
    assert type(twin) is Float8Tensor and twin.shape == t.shape and twin.is_contiguous()
    assert twin._transpose is None  # t's copy was made from other bytes: never kept beside new data
    torch.testing.assert_close(twin.dequantize(), t.dequantize(), rtol=0, atol=0)
    loaded = w2d.dequantize()[:, 16:48].flip(0).contiguous()  # what the checkpoint holds: other values
    replacement = Float8Tensor.make_like(twin, data=t._data.flip(0).contiguous().view(torch.uint8))
    before = w2d.dequantize()
    t.copy_(replacement)
    after = w2d.dequantize()
    torch.testing.assert_close(after[:, 16:48], loaded, rtol=0, atol=0)
    torch.testing.assert_close(after[:, :16], before[:, :16], rtol=0, atol=0)
    torch.testing.assert_close(after[:, 48:], before[:, 48:], rtol=0, atol=0)
    # a column-wise copy given with the bytes is kept; bytes of another size say so
    with_t = Float8Tensor.make_like(twin, data=twin._data, data_transpose=twin._data.t().contiguous())
    assert with_t._transpose is not None and _shares(with_t._data, twin._data)
    with pytest.raises(ValueError, match=r"data has 8 elements, shape \(4, 4\) needs 16"):
        Float8Tensor.make_like(twin, data=twin._data.reshape(-1)[:8], shape=(4, 4))


def test_tes_keywords_with_bad_values_say_what_to_pass(gen):
    from te_core.quantization import Float8Tensor

    w = _weight(gen, "current")
    meta = w.get_metadata()
    with pytest.raises(ValueError, match="needs fp8_dtype, fp8_scale_inv and data"):
        Float8Tensor(shape=w.shape, dtype=w.dtype, data=meta["data"])
    with pytest.raises(ValueError, match="data has 32768 elements, shape \\(4, 4\\) needs 16"):
        Float8Tensor(shape=(4, 4), dtype=w.dtype, **meta)
    with pytest.raises(TypeError, match="data must be a uint8 tensor of FP8 bytes"):
        Float8Tensor(shape=w.shape, dtype=w.dtype, **{**meta, "data": w.dequantize()})
    with pytest.raises(ValueError, match="fp8_dtype must be an FP8 format"):
        Float8Tensor(shape=w.shape, dtype=w.dtype, **{**meta, "fp8_dtype": torch.bfloat16})
    with pytest.raises(ValueError, match="fp8_scale_inv must be a 1-element float32 tensor"):
        Float8Tensor(shape=w.shape, dtype=w.dtype, **{**meta, "fp8_scale_inv": torch.ones(2)})
    with pytest.raises(TypeError, match="unexpected keyword\\(s\\) \\['rowwise'\\]"):
        Float8Tensor(shape=w.shape, dtype=w.dtype, rowwise=True, **meta)
