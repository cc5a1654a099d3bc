"""FusedAdam's compact optimizer states, as Transformer Engine keeps them.

Scaled states (exp_avg_dtype / exp_avg_sq_dtype torch.float16 or torch.uint8, meaning FP8, and
master_weight_dtype torch.float16): each state is stored in its low-precision dtype with one
float32 scale per tensor, chosen after every update so the tensor's largest magnitude lands at
the format's range (half of float16's maximum, 448 for FP8 E4M3); its value is the stored one
times the scale. The update itself reads and writes float32 copies. FP8 states are kept as
torch.float8_e4m3fn tensors; an all-zero state keeps scale 0 and stays zero. A sharded
parameter's (FSDP2's DTensor) states are scaled per shard, each rank its own.

Param remainders (store_param_remainders=True, bf16 parameters with float32 master weights): the
float32 master weight is not stored; its upper 16 bits are the bf16 parameter (rounded up in
magnitude where the lower half is 0x8000 or more) and its lower 16 bits are kept as an int16
"remainder", so the pair rebuilds the float32 master exactly, in half its memory.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .._sharded import local_tensor, sharded_like

FP8 = torch.float8_e4m3fn
SCALED = (torch.float16, torch.uint8)  # the dtypes a state is stored scaled in (uint8: FP8, TE's name for it)
RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.uint8: 448.0}
_LOW16, _SIGN16 = 0xFFFF, 0x8000


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    return FP8 if dtype == torch.uint8 else dtype


# A sharded (DTensor) state's own shard: each rank scales its shard, as Transformer Engine's
# FusedAdam does (no collective in the optimizer step).
local = local_tensor


def rescaled(unscaled: torch.Tensor, dtype: torch.dtype, out: torch.Tensor, scale: torch.Tensor) -> None:
    """Store float32 `unscaled` into `out` (dtype's storage) and its new scale into `scale`."""
    unscaled, out = local(unscaled), local(out)
    absmax = unscaled.abs().amax().float() if unscaled.numel() else unscaled.new_zeros((), dtype=torch.float32)
    torch.div(absmax, RANGE[dtype], out=scale.view(()))
    inverse = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale)).view(())
    scaled = unscaled.float() * inverse
    if dtype == torch.uint8:
        scaled = scaled.clamp_(-RANGE[dtype], RANGE[dtype])  # (the rounding of the inverse may pass 448 by an ulp)
    out.copy_(scaled)


def unscaled(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 value of a scaled state."""
    return stored.float() * scale.view(())  # (0-dim: a sharded state takes it as a scalar)


def join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master weight from a bf16 parameter and its int16 remainder (of a sharded
    parameter: built from this rank's shards, and sharded alike)."""
    return sharded_like(param, _join(local(param), local(remainder)))


def _join(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    high = param.contiguous().view(torch.int16).to(torch.int64) & _LOW16
    low = remainder.to(torch.int64) & _LOW16
    high = (high - (low >= _SIGN16).to(torch.int64)) & _LOW16  # undo the rounding up
    bits = (high << 16) | low
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def split(master: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(bf16 parameter, int16 remainder) of a float32 master weight (join's inverse; of a sharded
    one, this rank's shards of them)."""
    bits = local(master).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & _LOW16
    high = ((bits >> 16) + (low >= _SIGN16).to(torch.int64)) & _LOW16

    def int16(v):
        return torch.where(v >= _SIGN16, v - 2 * _SIGN16, v).to(torch.int16)

    return int16(high).view(torch.bfloat16), int16(low)
