"""Transformer Engine's pickled MXFP8Tensor and Float8BlockwiseQTensor (FP8 primary weights of
MXFP8 / block-scaled models in its checkpoints) load through the stand-in as the values they hold.

The checkpoints are written here as TE writes them: the tensor pickles as a call of TE's module
function with its buffers in TE's layouts (padded scales, column-wise data transposed for blocks,
cuBLAS's tiled scale order where asked) and its quantizer object. Their buffers are made from
te-core's own casts of fresh random weights, so the expected value is te-core's dequantization of
those casts, compared bit for bit."""
from __future__ import annotations

import enum
import io
import sys
import types

import pytest
import torch

from te_core import ops
from te_core.compat.te_tensor_pickles import TE_BLOCK_REBUILD, TE_MXFP8_REBUILD
from te_core.recipe import Float8BlockScaling, MXFP8BlockScaling

E4M3 = 7
_TENSOR_PKG = "transformer_engine.pytorch.tensor"


def _te_checkpoint(monkeypatch, rebuild: str, quantizer_class: str, args) -> bytes:
    """torch.save of a state dict whose weight pickles as TE's tensor does: a call of `rebuild` (TE's
    name) with `args`, in which the int E4M3 stands for TE's DType and QUANTIZER for the quantizer
    object of class `quantizer_class` (TE's name), both pickled as TE pickles them."""
    module_name, _, function_name = rebuild.rpartition(".")
    with monkeypatch.context() as m:
        mods = {}
        for name in ("transformer_engine", "transformer_engine.pytorch", _TENSOR_PKG, module_name,
                     "transformer_engine.pytorch.constants"):
            mods[name] = types.ModuleType(name)
            m.setitem(sys.modules, name, mods[name])

        class DType(enum.IntEnum):
            kFloat8E4M3 = 7
            kFloat8E5M2 = 8

            def __reduce_ex__(self, protocol):
                return type(self), (int(self),)

        quantizer_type = type(quantizer_class, (), {})

        def rebuild_fn(*_):
            raise AssertionError("only TE's name is pickled")

        for obj, name, module in ((DType, "DType", "transformer_engine.pytorch.constants"),
                                  (rebuild_fn, function_name, module_name),
                                  (quantizer_type, quantizer_class, module_name)):
            obj.__module__, obj.__qualname__, obj.__name__ = module, name, name
            setattr(mods[module], name, obj)
        quantizer = quantizer_type()
        # what TE's quantizers keep in their __dict__
        quantizer.__dict__.update(dtype=DType(E4M3), rowwise_usage=True, columnwise_usage=True, internal=False,
                                  optimize_for_gemm=False)

        class TEWeight:
            def __reduce_ex__(self, protocol):
                values = [DType(a) if a is E4M3 else quantizer if a is QUANTIZER else a for a in args]
                return rebuild_fn, tuple(values)

        buffer = io.BytesIO()
        torch.save({"weight": TEWeight(), "bias": torch.zeros(args_out_features(args), dtype=torch.bfloat16),
                    "_extra_state": torch.empty(0, dtype=torch.uint8)}, buffer)
    return buffer.getvalue()


QUANTIZER = object()  # where the pickled quantizer object goes in `args`


def args_out_features(args) -> int:
    shape = next(a for a in args if isinstance(a, torch.Size))
    return shape[0]


def _pad(t: torch.Tensor, rows: int, cols: int, fill) -> torch.Tensor:
    """t in the top-left corner of a (rows, cols) tensor whose padding holds `fill` (padding must
    not be read)."""
    out = torch.full((rows, cols), fill, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _up(n, m):
    return -(-n // m) * m


def _swizzle(scales: torch.Tensor) -> torch.Tensor:
    """cuBLAS's tiled order of an (R, C) scale matrix (R a multiple of 128, C of 4), written out
    element by element: the 128x4 tile of (r, c) is the (r // 128) * (C // 4) + c // 4-th block of
    512 bytes, and (r, c) sits at (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4 in it."""
    rows, cols = scales.shape
    r = torch.arange(rows).reshape(-1, 1).expand(rows, cols)
    c = torch.arange(cols).reshape(1, -1).expand(rows, cols)
    offset = ((r // 128) * (cols // 4) + c // 4) * 512 + (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4
    flat = torch.empty(rows * cols, dtype=scales.dtype)
    flat[offset.reshape(-1)] = scales.reshape(-1)
    return flat.reshape(rows, cols)


def _wide(shape, seed):
    """Random weights spanning 2^-12..2^12: with power-of-two block scales an element's FP8 value
    depends on its block only where it is far below the block's largest, so the two directions'
    blocks give different values only with a wide range."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 13, shape, generator=g).float())


def _mxfp8_weight(shape, seed):
    """TE's MXFP8Tensor buffers of a random weight and both of its values:
    (rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, row-wise value,
    column-wise value), scales padded as TE pads them."""
    w2d = _wide(shape, seed).reshape(-1, shape[-1])
    (m, k), fp8 = w2d.shape, torch.float8_e4m3fn
    data, scales, data_t, scales_t = ops.quantize_mxfp8(w2d, fp8, with_transpose=True)
    row_value = ops.dequantize_mxfp8(data, scales, torch.float32).reshape(shape)
    col_value = ops.dequantize_mxfp8(data_t, scales_t, torch.float32).t().reshape(shape)
    rowwise_scale_inv = _pad(scales, _up(m, 128), _up(k // 32, 4), 200)
    columnwise_scale_inv = _pad(scales_t.t(), _up(m // 32, 4), _up(k, 128), 200)  # (M/32, K): one per 32 rows
    columnwise_data = data_t.t().contiguous().view(torch.uint8).reshape(shape)  # TE's: the logical shape
    return (data.view(torch.uint8).reshape(shape), rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
            row_value, col_value)


def _mxfp8_args(buffers, shape, *, rowwise=True, swizzled=False):
    row, row_s, col, col_s = buffers[:4]
    if swizzled:
        row_s = _swizzle(row_s)
        col_s = _swizzle(col_s.t().contiguous()).reshape(col_s.shape)  # tiled as their transpose
    if not rowwise:
        row, row_s = None, None
    return (row, row_s, col, col_s, E4M3, torch.bfloat16, torch.Size(shape), QUANTIZER, swizzled)


@pytest.mark.parametrize("swizzled", [False, True], ids=["row-order", "swizzled"])
@pytest.mark.parametrize("rowwise", [True, False], ids=["both", "column-wise-only"])
@pytest.mark.parametrize("weights_only", [True, False])
def test_te_mxfp8_weight_loads_as_its_value(stand_in, monkeypatch, swizzled, rowwise, weights_only):
    shape = (160, 96)  # scales padded both ways: 160 rows -> 256, 3 scale columns -> 4
    buffers = _mxfp8_weight(shape, seed=0)
    blob = _te_checkpoint(monkeypatch, TE_MXFP8_REBUILD, "MXFP8Quantizer",
                          _mxfp8_args(buffers, shape, rowwise=rowwise, swizzled=swizzled))
    weight = torch.load(io.BytesIO(blob), weights_only=weights_only)["weight"]
    expected = buffers[4] if rowwise else buffers[5]
    assert type(weight) is torch.Tensor and weight.dtype == torch.bfloat16 and weight.shape == shape
    assert not torch.equal(buffers[4], buffers[5])  # the two directions' values differ: the test tells them apart
    assert torch.equal(weight, expected.to(torch.bfloat16))


def test_te_mxfp8_weight_loads_into_an_mxfp8_primary_weight(stand_in, monkeypatch):
    shape = (64, 128)
    buffers = _mxfp8_weight(shape, seed=1)
    blob = _te_checkpoint(monkeypatch, TE_MXFP8_REBUILD, "MXFP8Quantizer", _mxfp8_args(buffers, shape))
    with stand_in.quantized_model_init(recipe=MXFP8BlockScaling()):
        layer = stand_in.Linear(128, 64, params_dtype=torch.bfloat16)
    layer.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    assert isinstance(layer.weight, stand_in.MXFP8Tensor)
    # the saved values are MXFP8 values with the same 1x32 blocks: requantized, bit for bit
    assert torch.equal(layer.weight.dequantize().float(), buffers[4].to(torch.bfloat16).float())


def _block_weight(shape, block_2d, seed):
    """TE's Float8BlockwiseQTensor buffers of a random weight and both of its values, as
    _mxfp8_weight's: 1x128 scales with the block index first, column-wise data (K, *leading)."""
    w2d = _wide(shape, seed).reshape(-1, shape[-1])
    (m, k), fp8 = w2d.shape, torch.float8_e4m3fn
    mb, kb = _up(m, 128) // 128, _up(k, 128) // 128
    data, s, data_t, s_t = ops.quantize_blockwise(w2d, fp8, block_2d=block_2d, with_transpose=True)
    row_value = ops.dequantize_blockwise(data, s, block_2d, torch.float32).reshape(shape)
    col_value = ops.dequantize_blockwise(data_t, s_t, block_2d, torch.float32).t().reshape(shape)
    if block_2d:
        row_s, col_s = _pad(s, mb, _up(kb, 4), 7.0), _pad(s_t, kb, _up(mb, 4), 7.0)
    else:
        row_s, col_s = _pad(s.t(), kb, _up(m, 4), 7.0), _pad(s_t.t(), mb, _up(k, 4), 7.0)
    columnwise_data = data_t.view(torch.uint8).reshape(shape[-1], *shape[:-1])
    return data.view(torch.uint8).reshape(shape), row_s, columnwise_data, col_s, row_value, col_value


@pytest.mark.parametrize("block_2d", [False, True], ids=["1x128", "128x128"])
@pytest.mark.parametrize("rowwise", [True, False], ids=["both", "column-wise-only"])
def test_te_block_weight_loads_as_its_value(stand_in, monkeypatch, block_2d, rowwise):
    shape = (3, 67, 200)  # flattened (201, 200): partial blocks both ways, scales padded
    row, row_s, col, col_s, row_value, col_value = _block_weight(shape, block_2d, seed=2)
    if not rowwise:
        row, row_s = None, None
    args = (torch.Size(shape), row, row_s, col, col_s, E4M3, torch.bfloat16, QUANTIZER, block_2d, None)
    blob = _te_checkpoint(monkeypatch, TE_BLOCK_REBUILD, "Float8BlockQuantizer", args)
    weight = torch.load(io.BytesIO(blob), weights_only=True)["weight"]
    expected = row_value if rowwise else col_value
    if not block_2d:
        assert not torch.equal(row_value, col_value)  # 1x128 runs along rows or columns: different values
    assert weight.dtype == torch.bfloat16 and weight.shape == shape
    assert torch.equal(weight, expected.to(torch.bfloat16))


def test_te_block_weight_loads_into_a_block_scaled_primary_weight(stand_in, monkeypatch):
    row, row_s, col, col_s, row_value, _ = _block_weight((256, 128), True, seed=3)
    args = (torch.Size((256, 128)), row, row_s, col, col_s, E4M3, torch.bfloat16, QUANTIZER, True, None)
    blob = _te_checkpoint(monkeypatch, TE_BLOCK_REBUILD, "Float8BlockQuantizer", args)
    with stand_in.quantized_model_init(recipe=Float8BlockScaling()):
        layer = stand_in.Linear(128, 256, params_dtype=torch.bfloat16)
    layer.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    assert isinstance(layer.weight, stand_in.Float8BlockwiseQTensor)
    # requantized with scales of its own: within E4M3's rounding of the saved values
    torch.testing.assert_close(layer.weight.dequantize().float(), row_value.to(torch.bfloat16).float(),
                               rtol=0.125, atol=0.0675)


def test_damaged_te_tensor_pickles_say_what_is_wrong(stand_in, monkeypatch):
    shape = (64, 96)
    buffers = _mxfp8_weight(shape, seed=4)
    args = list(_mxfp8_args(buffers, shape))
    args[1] = args[1][:64]  # scales without TE's padding
    blob = _te_checkpoint(monkeypatch, TE_MXFP8_REBUILD, "MXFP8Quantizer", args)
    with pytest.raises(Exception, match=r"MXFP8Tensor in the checkpoint: its row-wise scales are a torch.uint8 tensor "
                                        r"of shape \(64, 4\), expected .* shape \(128, 4\)"):
        torch.load(io.BytesIO(blob), weights_only=True)
    args = list(_mxfp8_args(buffers, shape))
    args[6] = torch.Size((32, 96))
    blob = _te_checkpoint(monkeypatch, TE_MXFP8_REBUILD, "MXFP8Quantizer", args)
    with pytest.raises(Exception, match=r"row-wise data has shape \(64, 96\), which does not hold the \(32, 96\)"):
        torch.load(io.BytesIO(blob), weights_only=True)
    row, row_s, col, col_s, _, _ = _block_weight((128, 128), False, seed=5)
    for fp8_dtype, data_format, match in ((E4M3, "COMPACT", "data_format='COMPACT', a layout of an older"),
                                          (4, None, "fp8_dtype .* is not DType.kFloat8E4M3 or kFloat8E5M2")):
        args = (torch.Size((128, 128)), row, row_s, col, col_s, fp8_dtype, torch.bfloat16, QUANTIZER, False,
                data_format)
        blob = _te_checkpoint(monkeypatch, TE_BLOCK_REBUILD, "Float8BlockQuantizer", args)
        with pytest.raises(Exception, match=match):
            torch.load(io.BytesIO(blob), weights_only=False)


# each bad MXFP8 argument, as a change to a good call (given its row-wise data), and the error naming it
BAD_MXFP8 = {
    "swizzled": (lambda row: dict(with_gemm_swizzled_scales="yes"),
                 r"with_gemm_swizzled_scales is 'yes', expected a bool"),
    "dtype": (lambda row: dict(dtype=torch.int32),
              r"its nominal dtype torch.int32 is not a floating-point torch.dtype"),
    "shape": (lambda row: dict(shape=(64, -96)), r"its shape is recorded as \(64, -96\), expected a torch.Size"),
    "k": (lambda row: dict(shape=torch.Size((64, 80))), r"its last dimension 80 is not a multiple of 32"),
    "rows": (lambda row: dict(rowwise_data=None, shape=torch.Size((48, 96))),
             r"its 48 rows \(all but the last dimension\) are not a multiple of 32"),
    "data": (lambda row: dict(rowwise_data=row.float()),
             r"its row-wise data is a torch.float32 tensor of shape \(64, 96\), expected a uint8 tensor"),
}


@pytest.mark.parametrize("case", sorted(BAD_MXFP8))
def test_each_bad_mxfp8_argument_is_named(case):
    from te_core.compat.te_tensor_pickles import rebuild_te_mxfp8_tensor

    shape = (64, 96)
    row, row_s, col, col_s, _, _ = _mxfp8_weight(shape, seed=6)
    args = dict(rowwise_data=row, rowwise_scale_inv=row_s, columnwise_data=col, columnwise_scale_inv=col_s,
                fp8_dtype=E4M3, dtype=torch.bfloat16, shape=torch.Size(shape), with_gemm_swizzled_scales=False)
    change, match = BAD_MXFP8[case]
    args.update(change(row))
    with pytest.raises(ValueError, match=match):
        rebuild_te_mxfp8_tensor(**args)


def test_each_bad_block_argument_is_named():
    from te_core.compat.te_tensor_pickles import rebuild_te_blockwise_tensor

    row, row_s, col, col_s, _, _ = _block_weight((128, 256), False, seed=7)
    good = dict(shape=torch.Size((128, 256)), rowwise_data=row, rowwise_scale_inv=row_s, columnwise_data=col,
                columnwise_scale_inv=col_s, fp8_dtype=E4M3, dtype=torch.bfloat16, is_2D_scaled=False)
    with pytest.raises(ValueError, match="is_2D_scaled is 1, expected a bool"):
        rebuild_te_blockwise_tensor(**{**good, "is_2D_scaled": 1})
    with pytest.raises(ValueError, match=r"column-wise data \(it keeps no row-wise data\) has shape \(128, 256\), "
                                         r"which does not hold the \(256, 128\)"):
        rebuild_te_blockwise_tensor(**{**good, "rowwise_data": None, "columnwise_data": row})
    with pytest.raises(ValueError, match=r"its row-wise scales are a torch.float64 tensor"):
        rebuild_te_blockwise_tensor(**{**good, "rowwise_scale_inv": row_s.double()})
