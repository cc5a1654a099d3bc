"""FSDP2 (torch.distributed.fsdp.fully_shard) with FP8 all-gather of FP8 primary weights.

A weight made under `te.quantized_model_init` with DelayedScaling or Float8CurrentScaling is a
Float8Tensor: FSDP2 shards it along dim 0 keeping it FP8 (see quantization/float8_views), and
through torch's all-gather extension points (`fsdp_pre_all_gather` / `fsdp_post_all_gather` on
the parameter's tensor class) each rank sends its shard's FP8 bytes, viewed as uint8 so that
every process-group backend (gloo included) moves them. The gathered bytes become the full
weight's Float8Tensor with the shards' common scale_inv, and its column-wise copy (a transpose
of the bytes): what the module's GEMMs read, with no dequantization and no second cast.

That needs one scale on every rank, the whole weight's. A shard is requantized (by the
optimizer's in-place update, or a checkpoint load) through a ShardQuantizer, which all-reduces
the shard's amax (MAX) over the FSDP group first:
- delayed scaling: the whole weight's amax goes into the weight's amax history on every rank,
  so the histories, and the scales made from them, stay identical; the cast uses that scale;
- current scaling: the scale comes from the whole weight's amax, as the single-process cast of
  the whole weight computes it.
The first all-gather of a shard binds its ShardQuantizer to the FSDP group and requantizes the
shard through it, so shards quantized before (at init from identical full weights, which
leaves their FP8 bytes as they are, or by a load before the first forward) share a scale too.
A shard loaded from a checkpoint's FP8 bytes and scale_inv (te_core.distributed.state_dict)
is bound as it is: its scale is the saved one on every rank already.
A foreach optimizer step (one op over every parameter) requantizes all shards at once, with one
all-reduce of their amaxes per process group; an optimizer that loops over parameters costs one
4-byte all-reduce per weight.

Block-scaled weights (Float8BlockScaling) need no shared scale: see te_core.distributed.fsdp_block.
"""
from __future__ import annotations

import copy
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from ..backend.types import fp8_max
from ..quantization.float8_tensor import Float8Tensor
from ..quantization.quantizers import Float8CurrentScalingQuantizer, Float8Quantizer
from ..reference.cast import amax_of, scale_from_amax

__all__ = ["ShardQuantizer", "bind_shard", "pre_all_gather", "post_all_gather"]

SUPPORTED = (Float8Quantizer, Float8CurrentScalingQuantizer)


class ShardQuantizer:
    """Casts one FSDP2 shard of an FP8 primary weight with the scale of the whole weight (the
    amax all-reduced over `group`), so every rank's shard has the same scale_inv. Wraps the
    module's quantizer of that weight (`inner`), whose role, format and state it keeps."""

    def __init__(self, inner, group):
        if not isinstance(inner, SUPPORTED):
            raise NotImplementedError(
                f"FSDP2 FP8 all-gather: the weight's quantizer is a {type(inner).__name__}; supported are the "
                "quantizers of DelayedScaling and Float8CurrentScaling (see te_core.distributed.fsdp)")
        self.inner, self.group = inner, group

    role = property(lambda self: self.inner.role)
    fp8_dtype = property(lambda self: self.inner.fp8_dtype)
    scaling_group = property(lambda self: self.inner.scaling_group)
    split_accumulator = property(lambda self: self.inner.split_accumulator)
    gemm_alignment = property(lambda self: self.inner.gemm_alignment)

    def _scales(self, amax: Tensor) -> Tuple[Tensor, Tensor]:
        """(scale, scale_inv) for the whole weight's amax."""
        inner = self.inner
        if isinstance(inner, Float8Quantizer):
            inner.scaling_group.record(inner.column, amax)
            return inner.scale, inner.scaling_group.scale_inv_of(inner.column)
        scale = scale_from_amax(amax, fp8_max(inner.fp8_dtype), inner.amax_epsilon, inner.power_2_scale)
        return scale.reshape(1), torch.reciprocal(scale).reshape(1)

    def quantize(self, x: Tensor, *, columnwise: bool = False) -> Float8Tensor:
        return ShardQuantizer.quantize_batch([(self, x, columnwise)])[0]

    @staticmethod
    def quantize_batch(items) -> List[Float8Tensor]:
        """[(ShardQuantizer, x, columnwise)] -> their Float8Tensors, with the shards' amaxes
        all-reduced (MAX) in one collective per process group (te_core.quantization.tensor's
        requantize_all: a foreach optimizer step)."""
        amaxes = [amax_of(x).reshape(1) for _, x, _ in items]
        by_group: dict = {}
        for i, (quantizer, _, _) in enumerate(items):
            by_group.setdefault(id(quantizer.group), (quantizer.group, []))[1].append(i)
        for group, index in by_group.values():
            flat = torch.cat([amaxes[i] for i in index])
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
            for j, i in enumerate(index):
                amaxes[i] = flat[j : j + 1]
        return [quantizer._cast(x, amax, columnwise) for (quantizer, x, columnwise), amax in zip(items, amaxes)]

    def _cast(self, x: Tensor, amax: Tensor, columnwise: bool) -> Float8Tensor:
        scale, scale_inv = self._scales(amax)
        data, _ = ops.quantize_fp8(x, scale, self.fp8_dtype)
        data_t = ops.transpose_fp8(data.reshape(-1, data.shape[-1])) if columnwise else None
        return Float8Tensor.make(data, scale_inv, data_t, nominal_dtype=x.dtype, quantizer=self)

    def load_primary(self, x: Tensor) -> Optional[Float8Tensor]:
        """A shard's value loaded from a dequantized checkpoint (module.state_dict()), after the
        checkpoint's extra state restored the module's scaling state. Delayed scaling: cast with
        the restored scale, which every rank holds, recording no amax, as the inner quantizer loads
        a whole weight (the saved bytes come back exactly, and the history stays the saved one).
        None for current scaling: copy_ cast the shard with the whole weight's amax already."""
        inner = self.inner
        if not isinstance(inner, Float8Quantizer):
            return None
        scale = inner.scale
        data, _ = ops.quantize_fp8(x, scale, self.fp8_dtype)
        return Float8Tensor.make(data, torch.reciprocal(scale), None, nominal_dtype=x.dtype, quantizer=self)

    def __deepcopy__(self, memo):  # a copied model shares the process group, never copies it
        return ShardQuantizer(copy.deepcopy(self.inner, memo), self.group)

    def __copy__(self):  # copy.copy would otherwise go through __reduce_ex__
        return ShardQuantizer(self.inner, self.group)

    def __reduce_ex__(self, protocol):
        # what torch.distributed.checkpoint's default planner reaches when it is handed torch's
        # state dict of an FSDP2-sharded FP8 weight (a DTensor over its Float8Tensor shard)
        raise TypeError(
            "an FSDP2-sharded FP8 primary weight (te.quantized_model_init) cannot be pickled with its quantizer, "
            "which holds the FSDP process group. To checkpoint it with torch.distributed.checkpoint, build the "
            "model's state dict with te_core.distributed.state_dict.get_model_state_dict (and load it with its "
            "set_model_state_dict): it saves each FP8 weight as its FP8 bytes and scale_inv, plain tensors")

    def __repr__(self) -> str:
        return f"ShardQuantizer({self.inner!r}, group size {dist.get_world_size(self.group)})"


def bind_shard(shard: Float8Tensor, group) -> bool:
    """Make `shard` requantize through a ShardQuantizer of `group` from now on; False when it
    already does. Its bytes are left as they are: for a shard whose scale_inv is known to be the
    same on every rank (a checkpoint's, see te_core.distributed.state_dict)."""
    quantizer = shard.quantizer
    if isinstance(quantizer, ShardQuantizer):
        if quantizer.group is group:
            return False
        quantizer = quantizer.inner
    if quantizer is None:
        raise RuntimeError("FSDP2 FP8 all-gather: this Float8Tensor parameter has no quantizer, so its shards "
                           "cannot be requantized after an update; create FP8 weights with te.quantized_model_init")
    shard._quantizer = ShardQuantizer(quantizer, group)
    return True


def _bind(shard: Float8Tensor, group) -> None:
    """bind_shard, then requantize the shard so that its scale is the whole weight's (see the
    module docstring); every rank does this at the same all-gather, so the collective matches."""
    if bind_shard(shard, group):
        shard.requantize_(shard.dequantize(torch.float32))


def check_row_shard(shard: Tensor, orig_size: torch.Size) -> None:
    if tuple(shard.shape[1:]) != tuple(orig_size[1:]):
        raise NotImplementedError(
            f"FSDP2 FP8 all-gather: a shard of shape {tuple(shard.shape)} of a weight of shape {tuple(orig_size)} "
            "is not a block of rows; only FSDP2's default Shard(0) placement is supported (drop shard_placement_fn "
            "for FP8 primary weights)")


def pre_all_gather(shard: Float8Tensor, mesh, orig_size: torch.Size):
    """(all-gather inputs, metadata): the shard's FP8 bytes as uint8, padded to FSDP2's padded
    shard rows (ceil(rows / ranks)); the metadata is what post_all_gather needs."""
    check_row_shard(shard, orig_size)
    _bind(shard, mesh.get_group())
    data = shard._row_bytes()
    rows = -(-orig_size[0] // mesh.size())
    if data.shape[0] != rows:  # uneven sharding: this rank's shard is short (or empty)
        padded = data.new_zeros((rows, *data.shape[1:]))
        padded[: data.shape[0]].copy_(data)
        data = padded
    data = data if data.is_contiguous() else data.contiguous()
    return (data.view(torch.uint8),), (shard._scale_inv, shard.quantizer, shard.fp8_dtype, orig_size[0])


def _fill_transpose(data_t: Optional[Tensor], data: Tensor) -> None:
    if data_t is not None:
        data_t.copy_(data.t())


def post_all_gather(all_gather_outputs: Tuple[Tensor, ...], metadata, param_dtype: torch.dtype, *,
                    out: Optional[Tensor] = None):
    """The full weight as a Float8Tensor over the gathered bytes, with its column-wise copy (what
    dgrad reads). FSDP2 owns the storage of both (the returned inner tensors): it frees them when
    it reshards, as it frees a high-precision parameter, and allocates them again before the next
    all-gather, which calls this with `out`, the tensor built the first time: its copy is filled
    again and its scale_inv set to the new bytes'. A forward's saved column-wise copy is that
    same storage, filled again by the backward's all-gather before dgrad reads it."""
    (gathered,) = all_gather_outputs
    scale_inv, quantizer, fp8_dtype, rows = metadata
    data = gathered.view(fp8_dtype)[:rows]
    if out is not None:
        target = getattr(out, "_local_tensor", out)  # a DTensor under tensor parallelism
        if not isinstance(target, Float8Tensor):
            raise TypeError(f"FSDP2 FP8 all-gather: the unsharded parameter is a {type(target).__name__}, "
                            "expected the Float8Tensor built at the first all-gather")
        target._scale_inv, target._quantizer = scale_inv, quantizer
        _fill_transpose(target._transpose, data)
        return None
    data_t = data.new_empty(data.shape[1], rows) if data.dim() == 2 else None
    _fill_transpose(data_t, data)
    weight = Float8Tensor.make(data, scale_inv, data_t, nominal_dtype=param_dtype, quantizer=quantizer)
    return weight, (gathered,) if data_t is None else (gathered, data_t)
