"""The checkpoint entry of a block-scaled (Float8BlockScaling, 128x128 tiles) FP8 primary weight,
for te_core.distributed.state_dict.

A Float8BlockwiseTensor weight has one float32 scale_inv per 128x128 tile, a grid of
(ceil(rows / 128), ceil(cols / 128)). FSDP2 shards such a weight along dim 0 at tile
boundaries (quantization/block_views), so a shard holds whole tiles and its scale rows are
exactly its tiles' rows: torch.chunk of the grid into as many pieces as the weight gives each
rank the scale rows of its own bytes. The entry's fp8_scale_inv is therefore that grid,
sharded along dim 0 like fp8_data, and DCP reshards both alike. No rank's scales depend on
another's, so saving needs no agreement check and loading no rebinding of the quantizer.

The column-wise copy (what dgrad reads) is not saved: for 128x128 tiles it is the transpose of
the row-wise bytes and scales, so a load into a weight that keeps one (an unsharded model)
rebuilds it; FSDP2 shards keep none (each all-gather rebuilds the full weight's).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..quantization.block_tensor import Float8BlockwiseTensor
from ..quantization.block_views import BLOCK
from .fsdp_block import fill_columnwise

__all__ = ["BlockScaled"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockScaled:
    """Entry format of Float8BlockwiseTensor weights with 128x128 tiles (see the module docstring)."""

    kind = Float8BlockwiseTensor
    shared_scale = False  # one scale per tile, sharded with the weight's rows

    @staticmethod
    def refusal(local: Float8BlockwiseTensor) -> Optional[str]:
        """Why this weight cannot be saved as an entry, or None."""
        if not local._block_2d:
            return ("its scales cover 1x128 runs (Float8BlockScaling(w_block_scaling_dim=1)), whose column-wise copy "
                    "is another quantization that the entry would have to hold too; use 128x128 tiles (the default "
                    "w_block_scaling_dim=2)")
        if local._data is None or local._data.dim() != 2:
            return "it holds no 2-D row-wise FP8 data (a column-wise-only or flattened view)"
        return None

    @staticmethod
    def data(local: Float8BlockwiseTensor) -> Tensor:
        return local._data

    @staticmethod
    def scale_inv(local: Float8BlockwiseTensor) -> Tensor:
        return local._scale_inv

    @staticmethod
    def scale_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
        """The tile scale grid's shape for a weight of `shape`."""
        return tuple(_ceil_div(n, BLOCK) for n in shape)

    @staticmethod
    def write(local: Float8BlockwiseTensor, data: Tensor, scale_inv: Tensor) -> None:
        """The weight's bytes and tile scales become `data` and `scale_inv` exactly, written in
        place (an FSDP2 shard's buffers are views of its padded storage), and a column-wise copy,
        where the weight keeps one, their transpose."""
        with torch.no_grad():
            local._data.copy_(data.to(local.device))
            local._scale_inv.copy_(scale_inv.to(device=local.device, dtype=torch.float32))
            if local._data_t is not None:
                fill_columnwise(local)

    @staticmethod
    def after_load(param: Tensor) -> None:
        """Nothing: a shard's tile scales are its own, requantization stays shard-local."""
