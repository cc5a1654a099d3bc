"""An FSDP2-sharded parameter (a DTensor) and this rank's shard of it: the two conversions the
modules (initialization, state dicts) and the optimizers (scaled states, master weights) make."""
from __future__ import annotations

from torch import Tensor


def local_tensor(t: Tensor) -> Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return getattr(t, "_local_tensor", t)


def sharded_like(param: Tensor, shard: Tensor) -> Tensor:
    """`shard`, this rank's part of a tensor laid out as `param`, as a DTensor of `param`'s mesh
    and placements where `param` is one (and `shard` is not one already); `shard` otherwise."""
    if not hasattr(param, "_local_tensor") or hasattr(shard, "_local_tensor"):
        return shard
    from torch.distributed.tensor import DTensor  # (a sharded parameter: torch.distributed is there)

    return DTensor.from_local(shard, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())
