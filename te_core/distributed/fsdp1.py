"""Transformer Engine's `prepare_te_modules_for_fsdp` for FSDP1
(torch.distributed.fsdp.FullyShardedDataParallel).

In Transformer Engine the call records each FSDP-wrapped TE module's process group in its
`fsdp_group`; the module then shards the tensors its forward saves for backward (its input,
its FP8 weight copy) over that group and gathers them again in backward: activation memory,
not numerics. TE refuses FP8 primary weights there, which FSDP1 cannot shard as FP8.

te-core records the group the same way and refuses the same weights (FSDP1 would flatten them
into high precision without a word), but keeps saved tensors whole: more activation memory,
the same results. FP8 numerics need nothing from the call. FSDP1 hands each module its whole
unsharded weight in forward and backward, so every rank computes the same weight amax and
scale; input and gradient amaxes differ per rank and are reduced over te.autocast's
amax_reduction_group, as in TE (pass the data-parallel group, or None for the default one).
FSDP2 (fully_shard) needs no preparation: see te_core.distributed.fsdp.
"""
from __future__ import annotations

from torch import nn

__all__ = ["prepare_te_modules_for_fsdp"]


def _te_core_module(module: nn.Module) -> bool:
    from ..modules._base import QuantizedContainer, QuantizedModule

    return isinstance(module, (QuantizedModule, QuantizedContainer))


def _refuse_primary_fp8_weights(root: nn.Module) -> None:
    from ..modules._base import QuantizedModule

    held = [name or type(root).__name__ for name, m in root.named_modules()
            if isinstance(m, QuantizedModule) and m.holds_primary_fp8_weights()]
    if held:
        raise RuntimeError(
            f"prepare_te_modules_for_fsdp: {', '.join(held[:4])}{' ...' if len(held) > 4 else ''} hold FP8 primary "
            "weights (made under te.quantized_model_init), which FSDP1 flattens into high precision. Build the "
            "model without te.quantized_model_init for FSDP1, or shard it with FSDP2 "
            "(torch.distributed.fsdp.fully_shard), which all-gathers FP8 primary weights as FP8")


def prepare_te_modules_for_fsdp(fsdp_root: nn.Module) -> None:
    """Record the FSDP1 process group of every FSDP-wrapped te-core module in `fsdp_root` (an
    FSDP1-wrapped model) as its `fsdp_group`, after checking that none holds FP8 primary
    weights. See the module docstring for what te-core does and does not do with it."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if not isinstance(fsdp_root, FullyShardedDataParallel):
        hint = ("FSDP2's fully_shard needs no preparation; leave this call out" if isinstance(fsdp_root, FSDPModule)
                else "wrap the model first: fsdp_root = torch.distributed.fsdp.FullyShardedDataParallel(model, ...)")
        raise TypeError(f"prepare_te_modules_for_fsdp: fsdp_root must be an FSDP1-wrapped model "
                        f"(torch.distributed.fsdp.FullyShardedDataParallel), got {type(fsdp_root).__name__}; {hint}")
    _refuse_primary_fp8_weights(fsdp_root)
    for wrapper in FullyShardedDataParallel.fsdp_modules(fsdp_root):  # the root and every nested wrapper
        if _te_core_module(wrapper.module):
            wrapper.module.fsdp_group = wrapper.process_group
