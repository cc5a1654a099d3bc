"""Tensor and sequence parallelism on torch.distributed (Transformer Engine's
`transformer_engine.pytorch.distributed`): the communication steps as autograd Functions, the
FP8 all-gather under sequence parallelism, the RNG-states tracker, and the checks on the user's
process groups. The process group always comes from the user; the collectives are torch's.
FSDP2 of FP8 primary weights: the FP8 all-gather in `te_core.distributed.fsdp` (per-tensor scales)
and `te_core.distributed.fsdp_block` (128x128 tile scales), and checkpoints
through torch.distributed.checkpoint with the state dicts of `te_core.distributed.state_dict`.
FSDP1: `prepare_te_modules_for_fsdp` (te_core.distributed.fsdp1). FP8 primary weights under a
ZeRO-style sharded optimizer (Megatron-LM's distributed optimizer): te_core.distributed.master_weights."""

from .collectives import copy_to_tp_region, gather_along_first_dim, reduce_from_tp_region, scatter_reduce_first_dim
from .fsdp1 import prepare_te_modules_for_fsdp
from .random import MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker, RNGStatesTracker

__all__ = [
    "RNGStatesTracker", "CudaRNGStatesTracker", "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "copy_to_tp_region", "reduce_from_tp_region", "gather_along_first_dim", "scatter_reduce_first_dim",
    "prepare_te_modules_for_fsdp",
]
