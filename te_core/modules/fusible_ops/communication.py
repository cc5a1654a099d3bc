"""ops.AllReduce, ops.ReduceScatter and ops.AllGather: Transformer Engine's fusible collectives.
Megatron-LM's op-fuser MLP appends AllReduce to its second BasicLinear (each rank's holding its
share of the input features) above a tensor-parallel size of 1, and ReduceScatter under sequence
parallelism.

Each is one of te-core's tensor-parallel communication steps (te_core.distributed.collectives) over
the operation's process group (the world group where none is given), along the first dimension,
the sequence's in (s, b, h) and (tokens, h) inputs:

    AllReduce      forward: sum over the ranks               backward: identity
    ReduceScatter  forward: sum, this rank keeps its block   backward: all-gather
    AllGather      forward: the ranks' blocks, in rank order backward: reduce-scatter (sum)

AllReduce passes the gradient on as is, as in Transformer Engine: its output feeds computations
that every rank repeats, so every rank already holds the whole gradient. Over a group of one rank
each operation is the identity.

As in Transformer Engine, AllReduce reads its group's size at each call, so that it can be built
before torch.distributed is initialized; ReduceScatter and AllGather read it when they are built."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...distributed.collectives import gather_along_first_dim, reduce_from_tp_region, scatter_reduce_first_dim
from ...distributed.groups import check_ranks_agree
from .._common import check_bool
from ._op import EmptyExtraState, FusibleOperation, check_extra_inputs
from ._parallel import process_group_size


class _Collective(EmptyExtraState, FusibleOperation, nn.Module):
    """A collective over process_group (None: the world group), `communicate(x, group)` above one
    rank (process_group_size: a property of AllReduce, an attribute of the others). The ranks'
    shapes and dtypes are checked against each other at the first call, so that a mismatch fails
    with a message naming them instead of inside the collective."""

    communicate = staticmethod(reduce_from_tp_region)

    def __init__(self, process_group=None):
        super().__init__()
        self.process_group = process_group
        self._ranks_checked = False

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        self._check_input(input)
        if self.process_group_size == 1:
            return input
        if not self._ranks_checked:
            check_ranks_agree(input, self.process_group, self._name)
            if not torch.compiler.is_compiling():  # (a traced graph checks at each run: the flag would retrace it)
                self._ranks_checked = True
        return self.communicate(input, self.process_group)

    def _check_input(self, input: Tensor) -> None:  # noqa: A002 (TE's name)
        if not isinstance(input, Tensor) or not input.is_floating_point():
            got = f"a {input.dtype} tensor" if isinstance(input, Tensor) else type(input).__name__
            raise TypeError(f"{self._name}: input must be a floating-point tensor, got {got}")

    def extra_repr(self) -> str:
        if self.process_group is None and not (dist.is_available() and dist.is_initialized()):
            return "process_group=None (the world group, once torch.distributed is initialized)"
        return f"process_group_size={self.process_group_size}"


class AllReduce(_Collective):
    """The sum of the ranks' inputs, on every rank; the gradient passes on unchanged.

    reduce_in_backward is taken and, as in Transformer Engine, has no effect: the backward is the
    identity either way."""

    def __init__(self, process_group=None, reduce_in_backward: bool = True):
        super().__init__(process_group)
        self._reduce_in_backward = check_bool(reduce_in_backward, name="reduce_in_backward", module="ops.AllReduce")

    @property
    def process_group_size(self) -> int:
        """The number of ranks of process_group, read at each call, as Transformer Engine's AllReduce
        reads it in its forward."""
        return process_group_size(self.process_group, self._name)


class _SplittingCollective(_Collective):
    """A collective that splits or gathers the first dimension over the ranks, whose group's size
    is read when it is built, as Transformer Engine's ReduceScatter and AllGather read it."""

    def __init__(self, process_group=None):
        super().__init__(process_group)
        self.process_group_size = process_group_size(process_group, self._name)

    def _check_input(self, input: Tensor) -> None:  # noqa: A002 (TE's name)
        super()._check_input(input)
        if input.dim() == 0:
            raise ValueError(f"{self._name}: input must have at least one dimension (the first is split or gathered "
                             "over the ranks), got a 0-dimensional tensor")


class ReduceScatter(_SplittingCollective):
    """The sum of the ranks' inputs, of which each rank keeps its block of the first dimension (rank
    0 the first); the input's first dimension must be divisible by the number of ranks. The
    gradient is all-gathered along the first dimension."""

    communicate = staticmethod(scatter_reduce_first_dim)

    def _check_input(self, input: Tensor) -> None:  # noqa: A002 (TE's name)
        super()._check_input(input)
        ranks = self.process_group_size
        if input.shape[0] % ranks:
            raise ValueError(f"ops.ReduceScatter: the input's first dimension ({input.shape[0]}, shape "
                             f"{tuple(input.shape)}) must be divisible by the {ranks} ranks of process_group, each of "
                             f"which keeps an equal block of it; pad it to a multiple of {ranks}")


class AllGather(_SplittingCollective):
    """The ranks' inputs concatenated along the first dimension, in rank order; every rank's input
    has the same shape. The gradient is summed over the ranks, each keeping its block."""

    communicate = staticmethod(gather_along_first_dim)
