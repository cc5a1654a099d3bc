"""FP8 all-gather of a column-parallel GEMM's input under sequence parallelism (Transformer
Engine's): each rank quantizes its sequence shard, and the ranks all-gather the FP8 bytes, half
the bytes of a BF16 gather, a quarter of FP32's. The gathered Float8Tensor is the GEMM's input
operand as it is: the module quantizes it no further.

That needs one scale on every rank of the group, the whole input's:
- delayed scaling: the scale comes from the amax history, which the amax reduction keeps
  identical on every rank when it spans the tensor-parallel group (the recipe's reduce_amax with
  te.autocast's amax_reduction_group, the default group when None). Each rank records its shard's
  amax; the reduction makes it the whole input's. No collective is added. (A fresh state's first
  cast takes its scale from its own amax, reduced over the same ranks: QuantizationStep.first_scale.)
- current scaling: the shard's amax is all-reduced (MAX) over the group before the cast, so the
  scale is the one the cast of the whole input computes (te_core.distributed.fsdp.ShardQuantizer).
The FP8 bytes then equal those of the whole input quantized after a high-precision gather.

Elsewhere (no FP8, block and MXFP8 scaling whose column-wise scales span the shards, delayed
scales that no reduction keeps in step, a Linear's input while torch.compile traces, see
tensor_parallel.column_parallel_input) the input is gathered in high precision and quantized
after the gather, as before. The backward's gradient reduce-scatter is in high precision in
every case.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..quantization.autocast import get_autocast_context
from ..quantization.float8_tensor import Float8Tensor
from ..quantization.quantizers import Float8CurrentScalingQuantizer, Float8Quantizer
from .collectives import all_gather_first_dim, reduce_scatter_first_dim
from .fsdp import ShardQuantizer


def _reduction_covers(amax_group, tp_group) -> bool:
    """Whether amax reductions over `amax_group` (None: the default group) span `tp_group`."""
    if amax_group is None:
        return True
    return set(dist.get_process_group_ranks(tp_group)) <= set(dist.get_process_group_ranks(amax_group))


def gathers_fp8(step, slot: str, group) -> bool:
    """Whether the input of `slot` is all-gathered in FP8 under `step` (see the module docstring)."""
    if not step.fp8:
        return False
    quantizer = step.quantizer(slot)
    if isinstance(quantizer, Float8CurrentScalingQuantizer):
        return True
    if isinstance(quantizer, Float8Quantizer):
        context = get_autocast_context()
        return (quantizer.scaling_group.recipe.reduce_amax and context is not None
                and _reduction_covers(context.amax_reduction_group, group))
    return False


def _quantize_shard(x: Tensor, step, slot: str, group) -> Float8Tensor:
    """The shard quantized with the scale of the whole input (row-wise only: the column-wise
    copy of the whole input is made from the gathered bytes, by the GEMM that needs it)."""
    quantizer = step.quantizer(slot)
    if isinstance(quantizer, Float8Quantizer):  # the scale is the group's already
        return step.operand(slot, x)
    return ShardQuantizer(quantizer, group).quantize(x)


def gather_shard_bytes(shard: Float8Tensor, group) -> Float8Tensor:
    """The ranks' shards (quantized with one scale) gathered along the first dimension."""
    data = shard._row_bytes()
    data = data if data.is_contiguous() else data.contiguous()
    # moved as bytes: every process-group backend (gloo included) gathers uint8
    gathered = all_gather_first_dim(data.view(torch.uint8), group).view(data.dtype)
    return Float8Tensor.make(gathered, shard._scale_inv, None, nominal_dtype=shard.dtype, quantizer=shard.quantizer)


def gather_fp8_now(x: Tensor, step, slot: str, group) -> Float8Tensor:
    """The shards of x (this rank's: x) quantized for `slot` and gathered as one Float8Tensor."""
    return gather_shard_bytes(_quantize_shard(x, step, slot, group), group)


class _GatherFp8(torch.autograd.Function):
    """forward: quantize the shard, all-gather its FP8 bytes; backward: reduce-scatter the
    gradient (high precision)."""

    @staticmethod
    def forward(ctx, x, step, slot, group):
        ctx.group = group
        return gather_fp8_now(x, step, slot, group)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter_first_dim(dy, ctx.group), None, None, None


def gather_along_first_dim_fp8(x: Tensor, step, slot: str, group) -> Tensor:
    """The sequence shards gathered as the FP8 operand of `slot`; the gradient reduce-scattered."""
    return _GatherFp8.apply(x, step, slot, group)
