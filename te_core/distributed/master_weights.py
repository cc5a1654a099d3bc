"""FP8 primary weights under a sharded optimizer (ZeRO, Megatron-LM's distributed optimizer with
`--fp8-param-gather`): Transformer Engine's `transformer_engine.pytorch.tensor.utils`.

Every data-parallel rank holds every FP8 weight, its bytes packed into one flat buffer that the
ranks all-gather, and the float32 master of only its own flat range of each weight. After the
optimizer step each rank casts its master range into its range of the bytes, all ranks with the
scale of the whole weight, so that the gathered bytes are the whole weight cast once:
- `replace_raw_data(weight, view)`: the weight's row-wise FP8 bytes move into `view` (a slice
  of the buffer, uint8 or the weight's FP8 dtype), keeping their values;
- `quantize_master_weights(weights, masters, start_offsets, group)` (and its older name
  `cast_master_weights_to_fp8`): each master range is cast to the weight's dtype, then to FP8
  into the weight's bytes; the scales come from amaxes all-reduced (MAX) over `group`, one
  collective per call and recipe:
  - delayed scaling: the cast uses the weight's current scale, and the range's amax goes into
    the weight's amax history (reduced over `group`), whose update makes the next scale, as
    Transformer Engine's does; the weight's scale_inv becomes 1 / scale;
  - current scaling: the scale is the one the whole weight's cast computes from its amax;
  - block scaling (128x128 tiles): each tile's scale from the tile's amax over all ranks.
  Ranks holding no range of a weight pass None as its master and still take part.
- `post_all_gather_processing(weights)`: after the all-gather, the column-wise copies (what the
  backward GEMMs read) are made again from the gathered bytes, in place where they exist.
  Without `manual_post_all_gather_processing=True` the cast drops them instead, and the next
  backward that needs one makes it.

MXFP8 weights are not supported (Transformer Engine's replace_raw_data refuses them too; their
column-wise copy has scales of its own, so it cannot follow a gather of the row-wise bytes).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from ..backend.types import fp8_max
from ..quantization import quantizers as core
from ..quantization.block_tensor import Float8BlockwiseTensor, MXFP8Tensor
from ..quantization.float8_tensor import Float8Tensor
from ..quantization.lent_scales import is_lent
from ..quantization.tensor import QuantizedTensor, _same_layout
from ..reference.cast import BLOCK, amax_of, saturating_cast, scale_from_amax

__all__ = ["replace_raw_data", "quantize_master_weights", "cast_master_weights_to_fp8", "post_all_gather_processing",
           "clear_columnwise_cache", "is_custom"]

_MXFP8_REFUSED = ("MXFP8 weights are not supported by te-core's sharded-optimizer helpers (their column-wise copy "
                  "has scales of its own, so it cannot follow a gather of the row-wise bytes); gather the weights "
                  "in high precision and copy them in (weight.quantize_(gathered))")


def _rowwise_bytes(tensor: QuantizedTensor, caller: str) -> Tensor:
    data = tensor._data
    if data is None:
        raise ValueError(f"{caller}: this {type(tensor).__name__} keeps only its column-wise copy, so it has no "
                         "row-wise bytes to place; use a weight made by te.quantized_model_init")
    return data


def replace_raw_data(tensor: QuantizedTensor, new_raw_data: Tensor) -> None:
    """Move `tensor`'s row-wise FP8 bytes into `new_raw_data` (same number of elements, uint8 or
    the tensor's FP8 dtype, contiguous), which then holds them: writing the buffer writes the
    weight. Its column-wise copy is left as it is (same values)."""
    caller = "replace_raw_data"
    if isinstance(tensor, MXFP8Tensor):
        raise NotImplementedError(f"{caller}: {_MXFP8_REFUSED}")
    if not isinstance(tensor, (Float8Tensor, Float8BlockwiseTensor)):
        raise ValueError(f"{caller}: expected a Float8Tensor or Float8BlockwiseQTensor (an FP8 primary weight of "
                         f"te.quantized_model_init), got {type(tensor).__name__}")
    old = _rowwise_bytes(tensor, caller)
    if not isinstance(new_raw_data, Tensor) or isinstance(new_raw_data, QuantizedTensor):
        raise TypeError(f"{caller}: new_raw_data must be a plain torch.Tensor, got {type(new_raw_data).__name__}")
    if new_raw_data.dtype not in (torch.uint8, old.dtype):
        raise ValueError(f"{caller}: the data types of raw data don't match: the weight's bytes are {old.dtype}, "
                         f"new_raw_data is {new_raw_data.dtype} (pass a uint8 or {old.dtype} view of the buffer)")
    if new_raw_data.numel() != old.numel():
        raise ValueError(f"{caller}: new_raw_data has {new_raw_data.numel()} elements, the weight's bytes "
                         f"{old.numel()} (shape {tuple(old.shape)})")
    if new_raw_data.device != old.device:
        raise ValueError(f"{caller}: new_raw_data is on {new_raw_data.device}, the weight on {old.device}")
    if not new_raw_data.is_contiguous():
        raise ValueError(f"{caller}: new_raw_data must be contiguous (a slice of a flat buffer, viewed to any shape)")
    data = new_raw_data.detach().view(old.dtype).view(old.shape)
    data.copy_(old)
    tensor._data = data


def _core_quantizer(weight: Tensor):
    quantizer = getattr(weight, "_quantizer", None)
    return getattr(quantizer, "inner", quantizer)  # an FSDP2 ShardQuantizer wraps the module's


def _check_items(model_weights, master_weights, start_offsets, fsdp_shard_model_weights) -> list:
    lists = {"model_weights": model_weights, "master_weights": master_weights, "start_offsets": start_offsets}
    if fsdp_shard_model_weights is not None:
        lists["fsdp_shard_model_weights"] = fsdp_shard_model_weights
    lists = {name: list(value) for name, value in lists.items()}
    lengths = {name: len(value) for name, value in lists.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"quantize_master_weights: the lists differ in length ({lengths}); pass one entry per "
                         "model weight (None as the master of a weight whose range is on other ranks)")
    fragments = lists.get("fsdp_shard_model_weights", [None] * lengths["model_weights"])
    items = []
    for i, (weight, master, start, fragment) in enumerate(zip(lists["model_weights"], lists["master_weights"],
                                                               lists["start_offsets"], fragments)):
        where = f"quantize_master_weights: model_weights[{i}]"
        if isinstance(weight, MXFP8Tensor):
            raise NotImplementedError(f"{where}: {_MXFP8_REFUSED}")
        if not isinstance(weight, (Float8Tensor, Float8BlockwiseTensor)):
            raise ValueError(f"{where} is a {type(weight).__name__}; expected an FP8 primary weight "
                             "(te.quantized_model_init) of delayed, current or block scaling")
        if master is not None:
            if not isinstance(master, Tensor) or not master.is_floating_point():
                raise TypeError(f"{where}: its master weight must be a floating-point tensor or None, "
                                f"got {type(master).__name__}")
            if start is None or isinstance(start, bool) or int(start) != start or start < 0:
                raise ValueError(f"{where}: start_offset must be an integer >= 0 when a master weight is given, "
                                 f"got {start!r}")
            start = int(start)
            if start + master.numel() > weight.numel():
                raise ValueError(f"{where}: its master weight covers elements {start}..{start + master.numel()} "
                                 f"but the weight has {weight.numel()}")
            if fragment is not None and fragment.numel() != master.numel():
                raise ValueError(f"{where}: its FSDP shard has {fragment.numel()} elements, its master weight "
                                 f"{master.numel()}")
            # as Transformer Engine: cast to the weight's dtype first, the values a bf16 master
            # copy would hold (the same rounding as training without FP8 primary weights)
            master = master.detach().reshape(-1).to(device=weight.device, dtype=weight.dtype)
        items.append((weight, master, start, fragment))
    return items


def _target(weight: QuantizedTensor, start: int, count: int, fragment: Optional[Tensor]) -> Tensor:
    """The FP8 bytes the range [start, start + count) of `weight` is cast into."""
    if fragment is not None:
        fragment = getattr(fragment, "_data", fragment)  # a shard given as a quantized tensor
        if fragment.dtype not in (torch.uint8, weight.fp8_dtype):
            raise ValueError(f"quantize_master_weights: an FSDP shard of {fragment.dtype} cannot hold the weight's "
                             f"{weight.fp8_dtype} bytes; pass its uint8 or {weight.fp8_dtype} storage")
        return fragment.view(-1).view(weight.fp8_dtype) if fragment.dtype == torch.uint8 else fragment.view(-1)
    data = _rowwise_bytes(weight, "quantize_master_weights")
    if not data.is_contiguous():
        raise ValueError("quantize_master_weights: the weight's bytes are not contiguous, so a flat range of them "
                         "is not a slice; give it contiguous bytes (replace_raw_data)")
    return data.view(-1)[start : start + count]


def _distributed(group) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("quantize_master_weights: a process group was given but torch.distributed is not "
                               "initialized; call torch.distributed.init_process_group first")
        return False  # one process: its amaxes are the whole weights'
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # (torch would skip the collective on this rank, silently)
        raise ValueError(f"quantize_master_weights: the group does not contain this rank ({dist.get_rank()}): "
                         "torch.distributed.new_group returned its placeholder for the ranks it leaves out; pass each "
                         "rank the data-parallel group it belongs to")
    return True


def _all_reduce_max(flat: Tensor, group) -> Tensor:
    """The whole weights' amaxes from the ranks' partial ones: the max, and NaN wherever any rank
    saw a NaN (as the amax of the whole weight is), whatever order the library reduces in."""
    if not _distributed(group):
        return flat
    nan = torch.isnan(flat)
    both = torch.cat([torch.where(nan, 0.0, flat), nan.to(flat.dtype)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    largest, any_nan = both.split(flat.numel())
    return torch.where(any_nan > 0, float("nan"), largest)


def _check_same_on_every_rank(buckets: dict, group) -> None:
    """One small all-reduce that tells every rank whether the ranks passed the same weights (the
    amax reductions pair up one per bucket and weight): otherwise all raise, where mismatched
    collectives would hang, abort or mix different weights' amaxes."""
    if not _distributed(group):
        return
    signature, device = [], None
    for bucket in buckets.values():
        device = device or next((item[0].device for item in bucket), None)
        numels = [item[0].numel() for item in bucket]
        signature += [len(bucket), sum(numels), sum((i + 1) * n for i, n in enumerate(numels)) % (2**31 - 1)]
    # (on the weights' device: a collective library may reduce only its device's tensors)
    flat = torch.tensor(signature + [-v for v in signature], dtype=torch.int64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(flat[: len(signature)], -flat[len(signature):]):
        raise ValueError("quantize_master_weights: the ranks passed different model weights (another count, size or "
                         "order per recipe); every rank must pass the same weights in the same order, with None as "
                         "the master of a weight it holds no range of")


def _set(weight: QuantizedTensor, name: str, value: Tensor) -> None:
    """A payload entry set to `value`, written into the held buffer where the layout allows (a
    captured graph keeps reading it), as a requantization does (QuantizedTensor._take_payload);
    a lent scale (lent_scales), which other tensors read, is replaced instead."""
    old = getattr(weight, name)
    if _same_layout(old, value) and not is_lent(old):
        old.copy_(value)
    elif old is not value:
        setattr(weight, name, value)


def _delayed(items, group, manual: bool) -> None:
    slots = []
    for weight, master, start, fragment in items:
        quantizer = _core_quantizer(weight)
        state, column = quantizer.scaling_group, quantizer.column
        scale, slot = state.scale_of(column), state.amax_slot(column)
        if not manual:
            drop_columnwise(weight)
        if master is not None:
            data, _ = ops.quantize_fp8(master, scale, quantizer.fp8_dtype, amax_out=slot)
            _target(weight, start, master.numel(), fragment).copy_(data)
        slots.append(slot)
    flat = _all_reduce_max(torch.cat(slots), group)
    for (weight, _, _, _), slot, amax in zip(items, slots, flat.split(1)):
        slot.copy_(amax)
        quantizer = _core_quantizer(weight)
        # the reciprocal of the scale the bytes were cast with, written into the tensor the weight
        # holds, as its requantization does: views and aliases of the weight share it
        _set(weight, "_scale_inv", quantizer.scaling_group.scale_inv_of(quantizer.column))


def _current(items, group, manual: bool) -> None:
    flat = _all_reduce_max(torch.stack([amax_of(master) if master is not None
                                        else torch.zeros((), device=weight.device) for weight, master, _, _ in items]),
                           group)
    for (weight, master, start, fragment), amax in zip(items, flat.split(1)):
        quantizer = _core_quantizer(weight)
        scale = scale_from_amax(amax, fp8_max(quantizer.fp8_dtype), quantizer.amax_epsilon, quantizer.power_2_scale)
        if not manual:
            drop_columnwise(weight)
        _set(weight, "_scale_inv", torch.reciprocal(scale))
        if master is not None:
            data, _ = ops.quantize_fp8(master, scale, quantizer.fp8_dtype)
            _target(weight, start, master.numel(), fragment).copy_(data)


def _band(weight: QuantizedTensor, master: Tensor, start: int):
    """(band, first_row): the rows of the 2-D payload that [start, start + n) touches, float32,
    with the range's values in place and zeros elsewhere (zeros leave a tile's amax alone), padded
    to whole 128-row tiles; first_row is the band's first row (a multiple of 128)."""
    rows, cols = weight._data.shape if weight._data is not None else weight._data_t.t().shape
    first = (start // cols) // BLOCK * BLOCK
    last = (start + master.numel() - 1) // cols + 1
    height = -(-(last - first) // BLOCK) * BLOCK
    width = -(-cols // BLOCK) * BLOCK
    band = torch.zeros((height, width), dtype=torch.float32, device=master.device)
    flat = band[:, :cols].reshape(-1) if width == cols else None
    offset = start - first * cols
    if flat is not None:
        flat[offset : offset + master.numel()] = master.float()
    else:  # padded columns: place the range through a (height, cols) staging copy
        staged = torch.zeros((height, cols), dtype=torch.float32, device=master.device)
        staged.view(-1)[offset : offset + master.numel()] = master.float()
        band[:, :cols] = staged
    return band, first


def _tiles(band: Tensor) -> Tensor:
    height, width = band.shape
    return band.reshape(height // BLOCK, BLOCK, width // BLOCK, BLOCK)


def _block(items, group, manual: bool) -> None:
    grids, bands = [], []
    for weight, master, start, _ in items:
        quantizer = _core_quantizer(weight)
        if not quantizer.block_2d:
            raise NotImplementedError(
                "quantize_master_weights: a weight of 1x128 block scaling has column-wise scales of its own, so "
                "its column-wise copy cannot follow a gather of the row-wise bytes; use 128x128 tiles for weights "
                "(Float8BlockScaling's default)")
        grid = torch.zeros_like(weight._scale_inv, dtype=torch.float32)
        band = None
        if master is not None:
            band, first = _band(weight, master, start)
            amax = _tiles(band).abs().amax(dim=(1, 3))
            tile_row = first // BLOCK
            grid[tile_row : tile_row + amax.shape[0]] = amax[: grid.shape[0] - tile_row]
            band = (band, first)
        grids.append(grid)
        bands.append(band)
    flat = _all_reduce_max(torch.cat([g.reshape(-1) for g in grids]), group)
    for (weight, master, start, fragment), grid, band in zip(items, flat.split([g.numel() for g in grids]), bands):
        quantizer = _core_quantizer(weight)
        scale = scale_from_amax(grid.reshape(weight._scale_inv.shape), fp8_max(quantizer.fp8_dtype),
                                quantizer.amax_epsilon, quantizer.power_2_scale)
        if not manual:
            drop_columnwise(weight)
        _set(weight, "_scale_inv", torch.reciprocal(scale))
        if band is None:
            continue
        values, first = band
        tile_row = first // BLOCK
        tile_scale = scale[tile_row : tile_row + values.shape[0] // BLOCK]
        tiles = _tiles(values)
        cast = saturating_cast(tiles[: tile_scale.shape[0]] * tile_scale[:, None, :, None], quantizer.fp8_dtype)
        cols = weight._data.shape[1]
        cast = cast.reshape(-1, values.shape[1])[:, :cols].reshape(-1)
        offset = start - first * cols
        _target(weight, start, master.numel(), fragment).copy_(cast[offset : offset + master.numel()])


def quantize_master_weights(model_weights: Sequence[Tensor], master_weights: Sequence[Optional[Tensor]],
                            start_offsets: Sequence[Optional[int]], group, fsdp_shard_model_weights=None,
                            manual_post_all_gather_processing: bool = False) -> None:
    """Cast each rank's master ranges into the FP8 weights' bytes with the whole weights' scales
    (see the module docstring). Every rank calls it with the same weights, in the same order.

    model_weights: the FP8 primary weights (full, on every rank).
    master_weights: per weight, this rank's master range (flat, any float dtype) or None.
    start_offsets: per weight, where the range starts in the weight's flat (row-major) elements.
    group: the process group the amaxes are reduced over (the data-parallel group).
    fsdp_shard_model_weights: per weight, the bytes to cast the range into instead of the
      weight's own (an FSDP shard: uint8, FP8, or a quantized tensor holding them).
    manual_post_all_gather_processing: keep the column-wise copies (stale until
      post_all_gather_processing is called after the all-gather) instead of dropping them.
    """
    items = _check_items(model_weights, master_weights, start_offsets, fsdp_shard_model_weights)
    buckets = {_delayed: [], _current: [], _block: []}
    for item in items:
        weight = item[0]
        clear = getattr(weight, "clear_high_precision_init_val", None)  # its job is done once masters exist
        if clear is not None:
            clear()
        quantizer = _core_quantizer(weight)
        if isinstance(quantizer, core.Float8Quantizer):
            buckets[_delayed].append(item)
        elif isinstance(quantizer, core.Float8CurrentScalingQuantizer):
            buckets[_current].append(item)
        elif isinstance(quantizer, core.Float8BlockQuantizer):
            buckets[_block].append(item)
        else:
            raise ValueError(f"quantize_master_weights: a weight quantized by {type(quantizer).__name__} is not "
                             "supported; supported are the weights of DelayedScaling, Float8CurrentScaling and "
                             "Float8BlockScaling made by te.quantized_model_init")
    _check_same_on_every_rank(buckets, group)
    with torch.no_grad():
        for cast, bucket in buckets.items():
            if bucket:
                cast(bucket, group, manual_post_all_gather_processing)


def cast_master_weights_to_fp8(model_weights, master_weights, start_offsets, group, fsdp_shard_model_weights=None,
                               manual_post_all_gather_processing: bool = False) -> None:
    """Transformer Engine's earlier name of quantize_master_weights."""
    quantize_master_weights(model_weights, master_weights, start_offsets, group, fsdp_shard_model_weights,
                            manual_post_all_gather_processing)


def drop_columnwise(weight: QuantizedTensor) -> None:
    """Forget the column-wise copy of a weight whose row-wise bytes are being rewritten; the next
    backward that needs it makes it from the new bytes."""
    if isinstance(weight, Float8Tensor):
        weight._transpose_invalid = True
    elif weight._data is not None:
        weight._data_t = weight._scale_inv_t = None


def _remake_columnwise(weight: QuantizedTensor) -> None:
    if isinstance(weight, Float8Tensor):
        if weight._data is None or not (weight.requires_grad or weight._transpose is not None):
            return  # nothing to remake it from, or nothing will read it (an inference weight)
        data = weight._data if weight._data.dim() == 2 else weight._data.reshape(-1, weight._data.shape[-1])
        _set(weight, "_transpose", ops.transpose_fp8(data.contiguous()))
        return
    if isinstance(weight, Float8BlockwiseTensor):
        if weight._data is None:
            return
        if not weight._block_2d:
            raise NotImplementedError("post_all_gather_processing: a weight of 1x128 block scaling cannot remake its "
                                      "column-wise copy from the row-wise bytes (its scales run along the other "
                                      "dimension); use 128x128 tiles for weights")
        _set(weight, "_data_t", weight._data.t().contiguous())
        _set(weight, "_scale_inv_t", weight._scale_inv.t().contiguous())


def post_all_gather_processing(model_weights) -> None:
    """After the all-gather of the weights' bytes: make each FP8 weight's column-wise copy again
    from its row-wise bytes (in place where it is held). Plain tensors and MXFP8 weights are left
    as they are."""
    weights: List = model_weights if isinstance(model_weights, (list, tuple)) else [model_weights]
    with torch.no_grad():
        for weight in weights:
            if isinstance(weight, (Float8Tensor, Float8BlockwiseTensor)):
                _remake_columnwise(weight)
            elif isinstance(weight, QuantizedTensor) and not isinstance(weight, MXFP8Tensor):
                raise ValueError(f"post_all_gather_processing: {type(weight).__name__} is not supported")


def clear_columnwise_cache(tensor: QuantizedTensor) -> None:
    """Free the column-wise copy (its row-wise data stays; a backward that needs the copy makes it
    again where the format allows)."""
    if not isinstance(tensor, QuantizedTensor):
        raise TypeError(f"clear_columnwise_cache: expected a quantized tensor, got {type(tensor).__name__}")
    if isinstance(tensor, MXFP8Tensor) or (isinstance(tensor, Float8BlockwiseTensor) and not tensor._block_2d):
        raise ValueError(f"clear_columnwise_cache: a {type(tensor).__name__} of 1x128 or 1x32 blocks cannot remake its "
                         "column-wise copy from the row-wise data (its scales run along the other dimension), so a "
                         "backward would fail without it; keep it")
    if tensor._data is None:
        raise ValueError("clear_columnwise_cache: this tensor keeps only its column-wise copy; clearing it would "
                         "lose its data")
    drop_columnwise(tensor)


def is_custom(x=None) -> bool:
    """Whether `x` is a custom quantizer (Transformer Engine's flag for quantizers of its
    CustomRecipe kernels); te-core's quantizers and tensors never are."""
    if x is None or isinstance(x, Tensor):
        return False
    if not isinstance(x, core.Quantizer):
        raise TypeError(f"is_custom: expected a quantizer or a quantized tensor, got {type(x).__name__}")
    return bool(getattr(x, "custom", False))
