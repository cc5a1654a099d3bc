"""Transformer Engine's pickled quantized tensors (FP8 primary weights made under
quantized_model_init, in TE's checkpoints): Float8Tensor, MXFP8Tensor and Float8BlockwiseQTensor,
read back as the plain tensors they hold.

TE pickles such a tensor as a call of a function of its tensor module, given the tensor's buffers
in TE's layouts (and, for the block-scaled formats, its quantizer object). The functions here
take those arguments and return the dequantized value: the form te-core's own state dicts hold
an FP8 primary weight in, which load_state_dict takes into a high-precision parameter or
requantizes into an FP8 one. They are
registered for torch.load(weights_only=True), so each argument is checked and nothing but a
tensor is built; the quantizer object is read as an inert record (PickledQuantizer).

TE's layouts, for the logical shape flattened to (M, K) = (prod(shape[:-1]), shape[-1]); scale
matrices carry padding, which is not read:
- Float8Tensor: uint8 data in the logical shape, one float32 scale_inv; where it kept only its
  column-wise copy, that copy as [last, *leading].
- MXFP8 keeps its data (M, K) in both directions. Row-wise scales are (M, K/32) E8M0 bytes,
  padded to multiples of (128, 4); column-wise scales, one per 32 rows of a column, are
  (M/32, K), padded to multiples of (4, 128). An E8M0 byte e scales by 2^(e - 127); 255 is NaN.
  With with_gemm_swizzled_scales the scales are in cuBLAS's tiled order and are put back into
  row order first (unswizzled).
- 1x128 blocks: row-wise data (M, K) with scales (ceil(K/128), M padded to 4), the block index
  first; column-wise data (K, M), the transpose, with scales (ceil(M/128), K padded to 4).
- 128x128 blocks: row-wise scales (ceil(M/128), ceil(K/128) padded to 4); column-wise data
  (K, M) with scales (ceil(K/128), ceil(M/128) padded to 4).
Where both directions are kept the row-wise data is read, as TE's dequantize() reads it.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

# Float8Tensor.__reduce_ex__ of TE >= 2.16 (older releases pickle through a classmethod, not read)
TE_FLOAT8_REBUILD = "transformer_engine.pytorch.tensor.float8_tensor._make_float8_tensor_in_reduce_ex"
TE_MXFP8_REBUILD = "transformer_engine.pytorch.tensor.mxfp8_tensor._make_mxfp8_tensor_in_reduce_ex"
TE_BLOCK_REBUILD = ("transformer_engine.pytorch.tensor.float8_blockwise_tensor."
                    "_make_float8_blockwise_tensor_in_reduce_ex")
# the quantizer classes TE pickles beside these tensors, by their TE names
TE_PICKLED_QUANTIZERS = ("transformer_engine.pytorch.tensor.mxfp8_tensor.MXFP8Quantizer",
                         "transformer_engine.pytorch.tensor.float8_blockwise_tensor.Float8BlockQuantizer")

_MX_BLOCK = 32
_BLOCK = 128


class PickledQuantizer:
    """The quantizer object TE pickles beside an MXFP8 or block-scaled tensor, unpickled under
    torch.load(weights_only=True) as an inert record of its settings (`state`): the tensor's
    value does not depend on it, and te-core's modules make quantizers of their own."""

    def __setstate__(self, state) -> None:
        self.state = state


def rebuild_te_float8_tensor(data, fp8_dtype, fp8_scale_inv, dtype, shape=None, data_transpose=None) -> Tensor:
    """The value of Transformer Engine's pickled Float8Tensor (`TE_FLOAT8_REBUILD`'s arguments:
    its uint8 data, DType, scale_inv, nominal dtype, shape, and its column-wise copy
    [last, *leading] where it kept no data), dequantized."""
    where = "Transformer Engine Float8Tensor in the checkpoint"
    fp8, nominal = _fp8_dtype(fp8_dtype, where), _nominal(dtype, where)
    stored = data if data is not None else data_transpose
    if not (isinstance(stored, Tensor) and stored.dtype in (torch.uint8, fp8) and stored.dim() >= 1):
        raise ValueError(f"{where}: its FP8 data is {_describe(stored)}, expected a uint8 tensor; the "
                         "checkpoint is corrupt")
    value = stored.view(fp8) if data is not None else stored.view(fp8).movedim(0, -1)
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{where}: its FP8 data has shape {tuple(value.shape)}, but its shape is recorded as "
                         f"{tuple(shape)}; the checkpoint is corrupt")
    if not (isinstance(fp8_scale_inv, Tensor) and fp8_scale_inv.is_floating_point() and fp8_scale_inv.numel() == 1):
        raise ValueError(f"{where}: its scale_inv is {_describe(fp8_scale_inv)}, expected one float (per-tensor "
                         "scaling); the checkpoint is corrupt")
    return (value.float() * fp8_scale_inv.float().reshape(())).to(nominal)


def rebuild_te_mxfp8_tensor(rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv, fp8_dtype, dtype,
                            shape, quantizer=None, with_gemm_swizzled_scales=False) -> Tensor:
    """The value of Transformer Engine's pickled MXFP8Tensor (`TE_MXFP8_REBUILD`'s arguments),
    dequantized into its nominal dtype; see the module docstring for the layouts."""
    where = "Transformer Engine MXFP8Tensor in the checkpoint"
    fp8, nominal, (m, k) = _fp8_dtype(fp8_dtype, where), _nominal(dtype, where), _flat(shape, where)
    if not isinstance(with_gemm_swizzled_scales, bool):
        raise ValueError(f"{where}: with_gemm_swizzled_scales is {with_gemm_swizzled_scales!r}, expected a bool; "
                         "the checkpoint is corrupt")
    if rowwise_data is not None:
        if k % _MX_BLOCK:
            raise ValueError(f"{where}: its last dimension {k} is not a multiple of {_MX_BLOCK}; the checkpoint is "
                             "corrupt")
        data = _fp8_data(rowwise_data, (m, k), fp8, where, "row-wise data")
        scales = _scales(rowwise_scale_inv, torch.uint8, (_up(m, 128), _up(k // _MX_BLOCK, 4)), where,
                         "row-wise scales")
        if with_gemm_swizzled_scales:
            scales = _unswizzle(scales)
        value = _scaled(data, _e8m0(scales[:m, : k // _MX_BLOCK]).repeat_interleave(_MX_BLOCK, dim=1))
    else:
        if m % _MX_BLOCK:
            raise ValueError(f"{where}: its {m} rows (all but the last dimension) are not a multiple of {_MX_BLOCK}, "
                             "as column-wise MXFP8 data needs; the checkpoint is corrupt")
        data = _fp8_data(columnwise_data, (m, k), fp8, where, "column-wise data (it keeps no row-wise data)")
        scales = _scales(columnwise_scale_inv, torch.uint8, (_up(m // _MX_BLOCK, 4), _up(k, 128)), where,
                         "column-wise scales")
        if with_gemm_swizzled_scales:  # tiled as their transpose
            scales = _unswizzle(scales.reshape(scales.shape[1], scales.shape[0])).t()
        value = _scaled(data, _e8m0(scales[: m // _MX_BLOCK, :k]).repeat_interleave(_MX_BLOCK, dim=0))
    return value.reshape(shape).to(nominal)


def rebuild_te_blockwise_tensor(shape, rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv,
                                fp8_dtype, dtype, quantizer=None, is_2D_scaled=False, data_format=None) -> Tensor:
    """The value of Transformer Engine's pickled Float8BlockwiseQTensor (`TE_BLOCK_REBUILD`'s
    arguments), dequantized into its nominal dtype; see the module docstring for the layouts."""
    where = "Transformer Engine Float8BlockwiseQTensor in the checkpoint"
    fp8, nominal, (m, k) = _fp8_dtype(fp8_dtype, where), _nominal(dtype, where), _flat(shape, where)
    if not isinstance(is_2D_scaled, bool):
        raise ValueError(f"{where}: is_2D_scaled is {is_2D_scaled!r}, expected a bool; the checkpoint is corrupt")
    if data_format is not None:
        raise ValueError(f"{where}: it was pickled with data_format={data_format!r}, a layout of an older Transformer "
                         "Engine that te-core does not read; load the checkpoint with that Transformer Engine and "
                         "save it again with a current one (or as high-precision weights)")
    mb, kb = -(-m // _BLOCK), -(-k // _BLOCK)
    if rowwise_data is not None:
        data = _fp8_data(rowwise_data, (m, k), fp8, where, "row-wise data")
        if is_2D_scaled:
            grid = _scales(rowwise_scale_inv, torch.float32, (mb, _up(kb, 4)), where, "row-wise scales")[:, :kb]
            grid = grid.repeat_interleave(_BLOCK, dim=0)[:m]
        else:
            grid = _scales(rowwise_scale_inv, torch.float32, (kb, _up(m, 4)), where, "row-wise scales")[:, :m].t()
        return _scaled(data, grid.repeat_interleave(_BLOCK, dim=1)[:, :k]).reshape(shape).to(nominal)
    data_t = _fp8_data(columnwise_data, (k, m), fp8, where, "column-wise data (it keeps no row-wise data)",
                       transposed=True)
    if is_2D_scaled:
        grid = _scales(columnwise_scale_inv, torch.float32, (kb, _up(mb, 4)), where, "column-wise scales")[:, :mb]
        grid = grid.repeat_interleave(_BLOCK, dim=0)[:k]
    else:
        grid = _scales(columnwise_scale_inv, torch.float32, (mb, _up(k, 4)), where, "column-wise scales")[:, :k].t()
    return _scaled(data_t, grid.repeat_interleave(_BLOCK, dim=1)[:, :m]).t().reshape(shape).to(nominal)


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _fp8_dtype(fp8_dtype, where: str) -> torch.dtype:
    from ..dtype import DType

    if not isinstance(fp8_dtype, int) or int(fp8_dtype) not in (DType.kFloat8E4M3, DType.kFloat8E5M2):
        raise ValueError(f"{where}: fp8_dtype {fp8_dtype!r} is not DType.kFloat8E4M3 or kFloat8E5M2; the checkpoint "
                         "is corrupt or not Transformer Engine's")
    return DType(int(fp8_dtype)).torch_dtype


def _nominal(dtype, where: str) -> torch.dtype:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{where}: its nominal dtype {dtype!r} is not a floating-point torch.dtype; the checkpoint "
                         "is corrupt")
    return dtype


def _flat(shape, where: str) -> Tuple[int, int]:
    """(M, K) of the logical shape."""
    if not (isinstance(shape, (tuple, list)) and len(shape) >= 1 and all(isinstance(d, int) and d >= 0
                                                                          for d in shape)):
        raise ValueError(f"{where}: its shape is recorded as {shape!r}, expected a torch.Size; the checkpoint is "
                         "corrupt")
    return math.prod(shape[:-1]), shape[-1]


def _fp8_data(t, expected: Tuple[int, int], fp8: torch.dtype, where: str, what: str, transposed: bool = False
              ) -> Tensor:
    """The FP8 bytes `t` (uint8 as TE keeps them, or already FP8) as an `expected`-shaped FP8
    tensor: t is the logical shape (.., K), or with `transposed` [K, *leading] as (K, M)."""
    if not (isinstance(t, Tensor) and t.dtype in (torch.uint8, fp8)):
        raise ValueError(f"{where}: its {what} is {_describe(t)}, expected a uint8 tensor; the checkpoint is corrupt")
    if (t.dim() == 0 or t.numel() != expected[0] * expected[1]
            or (t.shape[0] != expected[0] if transposed else t.shape[-1] != expected[1])):
        raise ValueError(f"{where}: its {what} has shape {tuple(t.shape)}, which does not hold the ({expected[0]}, "
                         f"{expected[1]}) its recorded shape needs; the checkpoint is corrupt")
    return t.reshape(expected).view(fp8)


def _scales(t, dtype: torch.dtype, expected: Tuple[int, int], where: str, what: str) -> Tensor:
    if not (isinstance(t, Tensor) and t.dtype == dtype and tuple(t.shape) == expected):
        raise ValueError(f"{where}: its {what} are {_describe(t)}, expected a {dtype} tensor of shape {expected} "
                         "(Transformer Engine's layout, padded); the checkpoint is corrupt")
    return t


def _unswizzle(scales: Tensor) -> Tensor:
    """Row-ordered (R, C) scales from cuBLAS's tiled order (R a multiple of 128, C of 4): each
    128x4 tile stored as 512 bytes, row r and column c of the tile at (r % 32) * 16 + (r // 32) * 4
    + c, the tiles in row-major order."""
    r, c = scales.shape
    tiles = scales.reshape(r // 128, c // 4, 32, 4, 4)  # (row tile, column tile, r % 32, r // 32, c)
    return tiles.permute(0, 3, 2, 1, 4).reshape(r, c)


def _e8m0(scales: Tensor) -> Tensor:
    """2^(e - 127) of E8M0 bytes as float32 (exact, 2^-127 included), NaN for 255."""
    powers = torch.exp2(scales.to(torch.float64) - 127).to(torch.float32)
    return torch.where(scales == 255, torch.full_like(powers, float("nan")), powers)


def _scaled(data: Tensor, scale: Tensor) -> Tensor:
    """data (FP8) times its per-element scale, in float32 as Transformer Engine dequantizes."""
    return data.float() * scale


def _describe(value: Optional[object]) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return "None" if value is None else f"a {type(value).__name__}"
