"""Tensor parallelism of the blocks built from the GEMM modules (MultiheadAttention,
TransformerLayer): their arguments are checked once here and handed down to the submodules,
which do the communication (see te_core.distributed.tensor_parallel)."""
from __future__ import annotations

import contextlib

from ..distributed import tensor_parallel
from ._common import check_bool


class TensorParallelContainer(tensor_parallel.TensorParallelMixin):
    """A block whose tensor-parallel submodules share its group."""

    def init_container_parallel(self, name: str, *, tp_group, tp_size: int, sequence_parallel: bool,
                                get_rng_state_tracker, set_parallel_mode: bool) -> dict:
        """Check and store the block's tensor-parallel arguments; returns those its submodules take.
        As in Transformer Engine, splitting the block needs set_parallel_mode=True (its first
        GEMMs column-parallel, its last row-parallel)."""
        tensor_parallel.init_tensor_parallel(
            self, name, tp_group=tp_group, tp_size=tp_size, parallel_mode=None, sequence_parallel=sequence_parallel,
            get_rng_state_tracker=get_rng_state_tracker, rng_tracker_name=None)
        set_parallel_mode = check_bool(set_parallel_mode, name="set_parallel_mode", module=name)
        if self.tp_size > 1 and not set_parallel_mode:
            raise ValueError(f"{name}: tp_size={self.tp_size} needs set_parallel_mode=True (the input projections "
                             "column-parallel, the output projections row-parallel), as in Transformer Engine")
        self.set_parallel_mode = set_parallel_mode
        return dict(tp_group=tp_group, tp_size=self.tp_size, sequence_parallel=self.sequence_parallel,
                    get_rng_state_tracker=get_rng_state_tracker)

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        """Transformer Engine's: context parallelism for every attention core of the block (each
        DotProductAttention inside; the rotary embedding then rotates this rank's positions)."""
        from .attention import DotProductAttention  # (attention imports this module's package)

        for module in self.modules():
            if isinstance(module, DotProductAttention):
                module.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """The group of the block and of every tensor-parallel submodule (each checks its size)."""
        super().set_tensor_parallel_group(tp_group)
        for module in self.modules():
            if module is not self and isinstance(module, tensor_parallel.TensorParallelMixin):
                tensor_parallel.TensorParallelMixin.set_tensor_parallel_group(module, tp_group)

    def tracker_fork(self, draws: bool = True):
        """The context of dropout on this rank's heads: the RNG tracker's fork when the block has a
        tracker, as Transformer Engine's attention does; under sequence parallelism TE runs it on
        the default generator, and so does te-core. `draws=False` (no dropout this call): no fork,
        which would leave every state as it is (and which torch.compile cannot trace)."""
        if self.get_rng_state_tracker is None or self.sequence_parallel or not draws:
            return contextlib.nullcontext()
        return tensor_parallel.tracker_of(self.get_rng_state_tracker, type(self).__name__).fork(
            tensor_parallel.MODEL_PARALLEL_RNG_TRACKER_NAME)
