"""FSDP2 (torch.distributed.fsdp.fully_shard) FP8 all-gather of block-scaled primary weights.

A weight made under `te.quantized_model_init` with Float8BlockScaling is a Float8BlockwiseTensor
with one scale per 128x128 tile. FSDP2 shards it along dim 0 keeping it FP8 (see
quantization/block_views): each shard holds whole tiles, so its scales are the whole weight's
scales of those tiles and no rank needs another's (no amax all-reduce, unlike per-tensor
scaling in te_core.distributed.fsdp). Through torch's all-gather extension points each rank
sends its shard's FP8 bytes (as uint8, which every process-group backend moves) and its tile
scale_inv rows; the gathered bytes with the gathered scale grid are the full weight's
Float8BlockwiseTensor, and its column-wise copy (what dgrad reads) is their transpose: a 128x128
tile of W.T is the transpose of a tile of W, with the same scale.

The optimizer's in-place update of a shard requantizes it through the weight's quantizer
(QuantizedTensor's in-place path), tile by tile from the shard's own values, which is what the
single-process cast of the whole updated weight computes for those tiles.

Where FSDP2's shards would cut a tile (ceil(rows / world size) or rows not a multiple of 128),
sharding raises an error that says what to do. Weights with 1x128 blocks
(w_block_scaling_dim=1) are refused: their column-wise copy is another quantization, which
would have to be gathered too.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..quantization.block_tensor import Float8BlockwiseTensor
from ..quantization.block_views import BLOCK, tile_cut_error
from .fsdp import check_row_shard

__all__ = ["pre_all_gather", "post_all_gather"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_tiles(shard: Float8BlockwiseTensor, orig_size: torch.Size, world: int) -> int:
    """The padded shard rows (FSDP2's ceil(rows / world)), after checking that shards hold whole tiles."""
    if not shard._block_2d:
        raise NotImplementedError(
            f"FSDP2 FP8 all-gather of a weight of shape {tuple(orig_size)} with 1x128 scale blocks "
            "(Float8BlockScaling(w_block_scaling_dim=1)): its column-wise copy is another quantization, which would "
            "have to be gathered too. Use 128x128 tiles (the default w_block_scaling_dim=2), whose column-wise "
            "copy is the transpose of the gathered bytes, or create the weights without te.quantized_model_init")
    if shard._data is None or tuple(shard._data.shape) != tuple(shard.shape):
        raise RuntimeError(f"FSDP2 FP8 all-gather: the shard of a weight of shape {tuple(orig_size)} holds no "
                           "row-wise FP8 data of its own shape; it was not sharded by fully_shard")
    rows = _ceil_div(orig_size[0], world)
    if world > 1 and (rows % BLOCK or orig_size[0] % BLOCK):
        raise tile_cut_error(orig_size, rows, str(world))
    return rows


def _padded(t: Tensor, rows: int) -> Tensor:
    """t with zero rows appended up to `rows` (FSDP2 gathers equal pieces), contiguous."""
    if t.shape[0] != rows:
        padded = t.new_zeros((rows, *t.shape[1:]))
        padded[: t.shape[0]].copy_(t)
        t = padded
    return t if t.is_contiguous() else t.contiguous()


def pre_all_gather(shard: Float8BlockwiseTensor, mesh, orig_size: torch.Size):
    """(all-gather inputs, metadata): the shard's FP8 bytes as uint8 and its tile scale_inv
    rows, padded to FSDP2's padded shard (an uneven last shard, or an empty one)."""
    check_row_shard(shard, orig_size)
    rows = _check_tiles(shard, orig_size, mesh.size())
    data = _padded(shard._data, rows).view(torch.uint8)
    scale_inv = _padded(shard._scale_inv, rows // BLOCK)
    return (data, scale_inv), (shard.quantizer, shard.fp8_dtype, orig_size[0])


def fill_columnwise(target: Float8BlockwiseTensor) -> None:
    """The column-wise copy of a 128x128-tiled tensor from its row-wise bytes and scales, in place."""
    target._data_t.copy_(target._data.t())
    target._scale_inv_t.copy_(target._scale_inv.t())


def post_all_gather(all_gather_outputs: Tuple[Tensor, ...], metadata, param_dtype: torch.dtype, *,
                    out: Optional[Tensor] = None):
    """The full weight as a Float8BlockwiseTensor over the gathered bytes and scales, with its
    column-wise copy. FSDP2 owns the storage of all four (the returned inner tensors): it frees
    them when it reshards and allocates them again before the next all-gather, which calls this
    with `out`, the tensor built the first time, whose column-wise copy is filled again in place
    (a forward's saved column-wise copy is that storage, filled again before dgrad reads it)."""
    gathered, gathered_scale_inv = all_gather_outputs
    quantizer, fp8_dtype, rows = metadata
    data, scale_inv = gathered.view(fp8_dtype)[:rows], gathered_scale_inv[: _ceil_div(rows, BLOCK)]
    if out is not None:
        target = getattr(out, "_local_tensor", out)  # a DTensor under tensor parallelism
        if not isinstance(target, Float8BlockwiseTensor):
            raise TypeError(f"FSDP2 FP8 all-gather: the unsharded parameter is a {type(target).__name__}, "
                            "expected the Float8BlockwiseTensor built at the first all-gather")
        target._quantizer = quantizer
        fill_columnwise(target)
        return None
    data_t, scale_inv_t = data.new_empty(data.shape[::-1]), scale_inv.new_empty(scale_inv.shape[::-1])
    weight = Float8BlockwiseTensor.make(data, scale_inv, data_t, scale_inv_t, nominal_dtype=param_dtype,
                                        quantizer=quantizer, _block_2d=True)
    fill_columnwise(weight)
    return weight, (gathered, gathered_scale_inv, weight._data_t, weight._scale_inv_t)
