"""TE's storage attribute names, as integrations swapping a parameter's raw storage read them.

Megatron's FSDP gets a quantized parameter's bytes through `_rowwise_data` when the tensor has
that attribute and `_data` otherwise (`_columnwise_data` for the column-wise copy), checks that
they are a tensor of their own (`_base is None`), copies them into a slice of its uint8 buffer,
checks that the dtypes agree and sets that slice back under the same name. A te-core tensor must
answer each step with its own storage, and its GEMMs must then read the new bytes.
"""
from __future__ import annotations

import pytest
import torch

from te_core.quantization import dgrad_gemm, fprop_gemm, gemm_slots
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

from .conftest import randn

FP32 = dict(rtol=1.3e-6, atol=1e-5)
PER_TENSOR = {"delayed": DelayedScaling(), "current": Float8CurrentScaling()}
BLOCKED = {"1x128": Float8BlockScaling(w_block_scaling_dim=1), "128x128": Float8BlockScaling(),
           "mxfp8": MXFP8BlockScaling()}


# --- the two helpers, as Megatron's fp8_get_raw_data / fp8_set_raw_data behave
def _raw_name(t, transpose: bool) -> str:
    if transpose:
        return "_columnwise_data"
    return "_rowwise_data" if hasattr(t, "_rowwise_data") else "_data"


def get_raw_data(t, transpose: bool = False):
    return getattr(t, _raw_name(t, transpose))


def set_raw_data(t, data, transpose: bool = False) -> None:
    name = _raw_name(t, transpose)
    held = getattr(t, name)
    if held is not None:
        assert held.dtype == data.dtype and held.shape == data.shape
    setattr(t, name, data)


def _swap_into_buffer(t, transpose: bool = False):
    """Megatron's step: the bytes copied into a slice of a uint8 buffer, which then replaces the storage."""
    held = get_raw_data(t, transpose)
    assert held._base is None
    buffer = torch.zeros(held.numel() + 64, dtype=torch.uint8)[32:32 + held.numel()]
    slot = buffer.view(held.shape)
    slot.detach().copy_(held)
    set_raw_data(t, slot, transpose)
    return slot


def _shares(a, b) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _assert_gemms_read(state, gen, w, m, want, want_t):
    """The forward and dgrad GEMMs of `m` fresh rows on `w` equal float64 products with `want`, the
    weight's value, and `want_t`, its column-wise copy's (x.T)."""
    n, k = want.shape
    x = state.quantizer("input").quantize(randn(gen, m, k))
    dy = state.quantizer("grad_output").quantize(randn(gen, m, n), columnwise=True)
    x64, dy64 = x.dequantize().double(), dy.dequantize().double()
    torch.testing.assert_close(fprop_gemm(x, w, out_dtype=torch.float32).double(), x64 @ want.T, **FP32)
    torch.testing.assert_close(dgrad_gemm(dy, w, out_dtype=torch.float32).double(), dy64 @ want_t.T, **FP32)


# --- float64 dequantization of each layout, from its bytes and scales
def _expand(scale, rows, cols, block_rows, block_cols):
    return scale.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)[:rows, :cols]


def _dequantize64(data, scale_inv, kind: str):
    rows, cols = data.shape
    if kind in PER_TENSOR:
        scale = scale_inv.double().reshape(())
    elif kind == "mxfp8":
        scale = _expand(torch.pow(2.0, scale_inv.double() - 127), rows, cols, 1, 32)
    else:
        tile = 128 if kind == "128x128" else 1
        scale = _expand(scale_inv.double(), rows, cols, tile, 128)
    return data.double() * scale


def _state(kind):
    recipe = PER_TENSOR.get(kind) or BLOCKED[kind]
    return recipe.make_state(gemm_slots(), torch.device("cpu"))


@pytest.mark.parametrize("kind", list(PER_TENSOR))
def test_float8_tensor_answers_its_bytes_as_uint8(gen, kind):
    """TE's Float8Tensor keeps uint8 bytes under `_data`; te-core's `_data` is float8, so the
    helpers must find `_rowwise_data`, the same bytes as uint8, a tensor of its own."""
    w = _state(kind).quantizer("weight").quantize(randn(gen, 32, 64), columnwise=True)
    assert w._transpose is not None and not w._transpose_invalid
    raw = get_raw_data(w)
    assert raw.dtype == torch.uint8 and raw._base is None and _shares(raw, w._data)
    assert w._data.dtype == torch.float8_e4m3fn
    assert torch.equal(raw, w.rowwise().data.view(torch.uint8))


@pytest.mark.parametrize("kind", list(PER_TENSOR))
def test_float8_raw_data_swap_is_what_gemms_read(gen, kind):
    state = _state(kind)
    w = state.quantizer("weight").quantize(randn(gen, 32, 64), columnwise=True)
    old = w.dequantize().double()
    slot = _swap_into_buffer(w)
    assert _shares(w._data, slot) and w._data.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(w.dequantize().double(), old, rtol=0, atol=0)  # the same bytes, now the buffer's

    # new bytes written into the buffer (a gathered shard's), with their scale; the transpose held
    # is stale, which TE code marks as Megatron does
    fresh = state.quantizer("weight").quantize(randn(gen, 32, 64, scale=3.0))
    slot.copy_(fresh._rowwise_data)
    w._scale_inv = fresh._scale_inv.clone()
    w._transpose_invalid = True
    want = _dequantize64(fresh._data, fresh._scale_inv, kind)
    assert not torch.allclose(want, old, **FP32)
    torch.testing.assert_close(w.dequantize().double(), want, **FP32)

    _assert_gemms_read(state, gen, w, 16, want, want.T)


@pytest.mark.parametrize("kind", list(BLOCKED))
def test_blocked_raw_data_get_returns_held_bytes(gen, kind):
    w = _state(kind).quantizer("weight").quantize(randn(gen, 64, 256), columnwise=True)
    rows, cols = get_raw_data(w), get_raw_data(w, transpose=True)
    assert rows.dtype == cols.dtype == torch.uint8 and rows._base is None and cols._base is None
    assert _shares(rows, w.rowwise().data) and _shares(cols, w.columnwise().data)
    assert w._rowwise_scale_inv is w.rowwise().scale_inv and w._columnwise_scale_inv is w.columnwise().scale_inv
    torch.testing.assert_close(_dequantize64(rows.view(w.fp8_dtype), w._rowwise_scale_inv, kind),
                               w.dequantize().double(), **FP32)


@pytest.mark.parametrize("kind", list(BLOCKED))
def test_blocked_raw_data_swap_is_what_gemms_read(gen, kind):
    state = _state(kind)
    w = state.quantizer("weight").quantize(randn(gen, 64, 256), columnwise=True)
    old = w.dequantize().double()
    slot, slot_t = _swap_into_buffer(w), _swap_into_buffer(w, transpose=True)
    assert _shares(w._data, slot) and _shares(w._data_t, slot_t) and w._data.dtype == w._data_t.dtype != torch.uint8
    torch.testing.assert_close(w.dequantize().double(), old, rtol=0, atol=0)  # the same bytes, now the buffer's

    # a different value's bytes written into both buffer slices, its scales set under TE's names
    fresh = state.quantizer("weight").quantize(randn(gen, 64, 256, scale=3.0), columnwise=True)
    slot.copy_(fresh._rowwise_data)
    slot_t.copy_(fresh._columnwise_data)
    w._rowwise_scale_inv = fresh._rowwise_scale_inv.clone()
    w._columnwise_scale_inv = fresh._columnwise_scale_inv.clone()
    want = _dequantize64(fresh._data, fresh._scale_inv, kind)
    want_t = _dequantize64(fresh._data_t, fresh._scale_inv_t, kind)
    assert not torch.allclose(want, old, **FP32)
    torch.testing.assert_close(w.dequantize().double(), want, **FP32)

    _assert_gemms_read(state, gen, w, 32, want, want_t)


@pytest.mark.parametrize("kind", list(BLOCKED))
def test_blocked_replacement_of_another_layout_is_refused(gen, kind):
    w = _state(kind).quantizer("weight").quantize(randn(gen, 64, 256), columnwise=True)
    held = w._data
    with pytest.raises(ValueError, match=r"_rowwise_data: .* \(\(64, 256\), torch.float8_e4m3fn.* \(\(256, 64\)"):
        w._rowwise_data = torch.zeros(256, 64, dtype=held.dtype)
    with pytest.raises(ValueError, match=r"_columnwise_data: .* in torch.float8_e4m3fn or uint8"):
        w._columnwise_data = torch.zeros(64, 256, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"_rowwise_data: .* in torch.float8_e4m3fn or uint8"):
        w._rowwise_data = torch.zeros(64, 256, dtype=torch.int8)  # one byte, but not raw bytes
    with pytest.raises(ValueError, match="_rowwise_scale_inv: .*strides"):
        w._rowwise_scale_inv = w._scale_inv[:-1]
    with pytest.raises(TypeError, match="_columnwise_scale_inv replaces .* got NoneType"):
        w._columnwise_scale_inv = None
    assert w._data is held  # (nothing was replaced)

    rowwise_only = _state(kind).quantizer("weight").quantize(randn(gen, 64, 256))
    with pytest.raises(ValueError, match="holds no column-wise data .* quantize it with columnwise=True"):
        rowwise_only._columnwise_data = torch.zeros(256, 64, dtype=held.dtype)
