"""State dicts for torch.distributed.checkpoint (DCP) of te-core models with FP8 primary weights
(te.quantized_model_init), sharded by FSDP2 or not: `get_model_state_dict` and
`set_model_state_dict`, called as torch.distributed.checkpoint.state_dict's functions are.

torch's own functions hold each weight dequantized (module.state_dict(); an FSDP2 shard as a DTensor
over its dequantized shard): 2 to 4 bytes per element, and a load casts the values again, with the
checkpoint's restored scale where the module restores one (te_core.modules._base), with the
module's current one where it does not (a fresh model's scale can saturate a trained weight).

Here each Float8Tensor weight is one entry of plain values instead:

    {"fp8_data": its FP8 bytes (a DTensor sharded as the weight, or a plain tensor),
     "fp8_scale_inv": the one scale_inv of the whole weight, (1,) float32,
     "fp8_format": the FP8 dtype's name, e.g. "float8_e4m3fn"}

A block-scaled weight (Float8BlockScaling, 128x128 tiles: a Float8BlockwiseTensor) has the same
entry with its tile scale_inv grid, sharded along dim 0 like its bytes (see state_dict_block).
So DCP writes each rank's bytes and reads them back into any sharding (another world size, or an
unsharded model in one process), a checkpoint made into a torch.save file loads with
weights_only=True, and a loaded weight is the saved one bit for bit, with its saved scales. A
per-tensor scaled FSDP2 weight's shards share one scale (te_core.distributed.fsdp), so a single
scale_inv serves every sharding; saving checks that the ranks agree on it. A load that one rank
refuses is refused on every rank. Every other entry (high-precision parameters, buffers, the
modules' extra state with the recipe and the delayed-scaling amax histories and scales) is
torch's, the extra state as text holding its uint8 tensor's bytes (DCP restores a string whole,
where it would load a tensor in place into one of the same size, and would split a dict into
entries a fresh model does not have). The optimizer's functions are torch's, made to leave the FP8
weights and scaling state as they are (torch may run a zero-learning-rate step, which requantizes).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.modules.module import _IncompatibleKeys

from ..quantization import extra_state as extra_state_bytes
from ..quantization.float8_tensor import Float8Tensor
from ..quantization.tensor import QuantizedTensor
from .fsdp import bind_shard
from .state_dict_block import BlockScaled

__all__ = ["get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict",
           "FP8_ENTRY_KEYS"]

FP8_ENTRY_KEYS = ("fp8_data", "fp8_scale_inv", "fp8_format")


def _local(param: Tensor) -> Tensor:
    return param._local_tensor if isinstance(param, DTensor) else param


def _format_name(dtype: torch.dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


class _PerTensor:
    """Entry format of Float8Tensor weights: one scale_inv for the whole weight, every shard's."""

    kind = Float8Tensor
    shared_scale = True

    @staticmethod
    def refusal(local: Float8Tensor) -> Optional[str]:
        return None

    @staticmethod
    def data(local: Float8Tensor) -> Tensor:
        return local._row_bytes()

    @staticmethod
    def scale_inv(local: Float8Tensor) -> Tensor:
        return local._scale_inv.detach().float().reshape(1)

    @staticmethod
    def write(local: Float8Tensor, data: Tensor, scale_inv: Tensor) -> None:
        """The weight's bytes and scale_inv become `data` and `scale_inv`, exactly."""
        with torch.no_grad():
            data = data.to(local.device)
            if local._data is not None:
                local._data.copy_(data)  # in place: FSDP2's padded shard storage is this buffer
            if local._transpose is not None:
                local._transpose.copy_(data.reshape(-1, data.shape[-1]).t())
            # a new tensor, not a write into the old one: that may be a view of a scaling group's
            # cached scale_inv, which other casts read
            local._scale_inv = scale_inv.detach().to(device=local.device, dtype=torch.float32).reshape(1).clone()

    @staticmethod
    def after_load(param: Tensor) -> None:
        if isinstance(param, DTensor):  # the scale is every rank's already: bound without requantization
            bind_shard(_local(param), param.device_mesh.get_group())


_FORMATS = (_PerTensor, BlockScaled)


def _format(local: Tensor):
    """The entry format of a quantized weight, None for a kind no format describes."""
    return next((f for f in _FORMATS if isinstance(local, f.kind)), None)


def _fp8_weights(model: nn.Module) -> Dict[str, Tensor]:
    """{state-dict key: parameter} of the model's FP8 weights (a DTensor over one when FSDP2
    shards it). Weights that no entry format describes are refused here, before any collective,
    on every rank alike."""
    weights: Dict[str, Tensor] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            local = _local(param)
            if not isinstance(local, QuantizedTensor):
                continue
            key = f"{module_name}.{name}" if module_name else name
            fmt = _format(local)
            why = f"it is a {type(local).__name__}" if fmt is None else fmt.refusal(local)
            if why is not None:
                raise NotImplementedError(
                    f"{key}: te_core.distributed.state_dict saves Float8Tensor weights (DelayedScaling, "
                    "Float8CurrentScaling) and 128x128-tiled Float8BlockwiseTensor weights (Float8BlockScaling) made "
                    f"under te.quantized_model_init, and {why}. Save this model with module.state_dict(), which holds "
                    "its weights dequantized")
            if getattr(module, "tp_size", 1) > 1:
                raise NotImplementedError(
                    f"{key} is a tensor-parallel partition (tp_size={module.tp_size}): every tensor-parallel rank "
                    "holds a different weight under the same key, which DCP cannot tell apart. Checkpoint "
                    "tensor-parallel FP8 models per rank (module.state_dict() and torch.save)")
            if isinstance(param, DTensor) and param.device_mesh.ndim != 1:
                raise NotImplementedError(
                    f"{key} is sharded over a {param.device_mesh.ndim}-D device mesh; FP8 weights are checkpointed "
                    "for FSDP2 over a 1-D mesh (fully_shard without HSDP)")
            weights[key] = param
    return weights


def _check_scales_agree(weights: Dict[str, Tensor]) -> None:
    """One all-reduce per FSDP process group: every rank's shard of a per-tensor scaled weight has
    the same scale_inv, else the one scale_inv DCP writes would be wrong for the other ranks' bytes."""
    by_group: Dict[int, Tuple[Any, list]] = {}
    for key, param in weights.items():
        if isinstance(param, DTensor) and _format(_local(param)).shared_scale:
            group = param.device_mesh.get_group()
            by_group.setdefault(id(group), (group, []))[1].append(key)
    for group, keys in by_group.values():
        scales = torch.cat([_PerTensor.scale_inv(_local(weights[k])) for k in keys])
        bounds = torch.cat([scales, -scales])  # max and -min in one collective
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)
        for key, high, low in zip(keys, bounds[: len(keys)].tolist(), (-bounds[len(keys):]).tolist()):
            if high != low:
                raise RuntimeError(
                    f"{key}: the ranks' shards have different scale_inv ({low!r} to {high!r}), so no single scale "
                    "describes the weight's FP8 bytes: they were requantized outside FSDP2's all-gather and the "
                    "optimizer step. The next all-gather gives them one scale again: run a forward before saving")


def _bytes(t: Tensor) -> Tensor:
    """FP8 tensors as uint8, which every process-group backend moves; others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _sharded_like(local: Tensor, param: Tensor, shape: Tuple[int, ...], full: bool) -> Tensor:
    """This rank's rows `local` of a tensor of `shape` sharded along dim 0 as the DTensor `param`
    is: a DTensor, or with `full` the whole tensor (a collective)."""
    whole = DTensor.from_local(_bytes(local), param.device_mesh, param.placements, run_check=False,
                               shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
    return (whole.full_tensor() if full else whole).view(local.dtype)


def _fp8_entry(param: Tensor, options: StateDictOptions) -> Dict[str, Any]:
    """The plain-values entry of one FP8 weight (copies: loading fills them, then checks them
    before the model is touched). A full state dict gathers the bytes (a collective)."""
    local = _local(param)
    fmt = _format(local)
    data, scale_inv = fmt.data(local).detach().clone(), fmt.scale_inv(local).detach().clone()
    if isinstance(param, DTensor):
        data = _sharded_like(data, param, tuple(param.shape), options.full_state_dict)
        if not fmt.shared_scale:
            scale_inv = _sharded_like(scale_inv, param, fmt.scale_shape(tuple(param.shape)), options.full_state_dict)
    if options.cpu_offload:
        data, scale_inv = data.cpu(), scale_inv.cpu()
    return {"fp8_data": data, "fp8_scale_inv": scale_inv, "fp8_format": _format_name(local.fp8_dtype)}


def _check_model(model, function: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"te_core.distributed.state_dict.{function}: model must be a torch.nn.Module (the model "
                        f"itself, FSDP2-sharded or not), got {type(model).__name__}")


def get_model_state_dict(model: nn.Module, *, options: Optional[StateDictOptions] = None) -> Dict[str, Any]:
    """torch.distributed.checkpoint.state_dict.get_model_state_dict, with each FP8 primary weight
    as its FP8 bytes and scale_inv (see the module docstring). Call it on every rank."""
    _check_model(model, "get_model_state_dict")
    options = options or StateDictOptions()
    weights = _fp8_weights(model)
    _check_scales_agree(weights)
    state = torch_state_dict.get_model_state_dict(model, options=options)
    _extra_state_as_objects(state)
    entries = {key: _fp8_entry(param, options) for key, param in weights.items()}  # a full one gathers here
    for key, entry in entries.items():
        if key in state:
            state[key] = entry
        elif state:  # a gathered state dict (full_state_dict with cpu_offload) is empty off rank 0
            raise KeyError(f"FP8 weight {key} is not a key of torch's state dict of this model (keys: "
                           f"{', '.join(list(state)[:8])}, ...); wrapped models (torch.compile's _orig_mod) are "
                           "not supported, pass the unwrapped model")
    return state


def _extra_state_as_objects(state: Dict[str, Any]) -> None:
    """Modules' extra state as text holding its uint8 tensor's bytes (extra_state.as_text): DCP
    loads a tensor in place, into the destination's tensor of the same size, which a model whose
    scaling state is not made yet (or another history length) does not have, and splits a dict
    into entries of its own, which such a model lacks too; a string it saves and restores whole,
    and torch.load(weights_only=True) reads it. set_extra_state takes every form."""
    for key, value in state.items():
        if key.endswith("_extra_state") and extra_state_bytes.is_encoded(value):
            state[key] = extra_state_bytes.as_text(value)


def _this_rank(key: str, what: str, t: Tensor, param: Tensor, shape: Tuple[int, ...], local_shape) -> Tensor:
    """The loaded `what` of this rank's part of the weight: a DTensor's local part, or this rank's
    rows of a whole (gathered) tensor of `shape`, checked against this rank's `local_shape`."""
    if isinstance(t, DTensor):
        t = t.to_local()
    elif isinstance(param, DTensor) and tuple(t.shape) == tuple(shape):
        rows = distribute_tensor(_bytes(t), param.device_mesh, param.placements, src_data_rank=None)
        t = rows.to_local().view(t.dtype)
    if tuple(t.shape) != tuple(local_shape):
        raise ValueError(f"{key}: the checkpoint's {what} has shape {tuple(t.shape)}, this rank's part of the "
                         f"weight's {tuple(local_shape)} (whole {tuple(shape)}); was the model built with other sizes "
                         "or another recipe (one scale_inv per weight, or one per 128x128 tile)?")
    return t


def _checked_scale_inv(key: str, scale_inv: Any, param: Tensor, fmt) -> Tensor:
    """The loaded scale_inv of this rank's part of the weight (the one scale, or its tile rows),
    checked: of the weight's format, finite and > 0."""
    local = _local(param)
    if not isinstance(scale_inv, Tensor):
        raise ValueError(f"{key}: fp8_scale_inv must be a tensor, found {type(scale_inv).__name__}")
    if fmt.shared_scale:
        if scale_inv.numel() != 1:
            raise ValueError(f"{key}: fp8_scale_inv must be a 1-element tensor for this per-tensor scaled weight, "
                             f"found shape {tuple(scale_inv.shape)} (a block-scaled checkpoint? build the model "
                             "with the recipe it was saved with)")
    given = _local(scale_inv)  # all of it in a full state dict: every rank sees the same bad value
    if not bool((torch.isfinite(given) & (given > 0)).all()):
        raise ValueError(f"{key}: fp8_scale_inv holds {given.flatten()[:4].tolist()}...; a scale_inv is finite "
                         "and > 0, the checkpoint is corrupt")
    if not fmt.shared_scale:
        scale_inv = _this_rank(key, "fp8_scale_inv", scale_inv, param, fmt.scale_shape(tuple(param.shape)),
                               fmt.scale_inv(local).shape)
    return scale_inv


def _checked_entry(key: str, entry: Any, param: Tensor) -> Tuple[Tensor, Tensor]:
    """(bytes, scale_inv) of a loaded entry, after every check, so that a bad entry raises
    before any weight of the model is written."""
    local = _local(param)
    if isinstance(entry, Tensor):
        raise ValueError(
            f"{key}: the state dict holds a {entry.dtype} tensor for this FP8 weight, a dequantized value (torch's "
            "get_model_state_dict or module.state_dict() writes that); requantizing it is not exact, and under delayed "
            "scaling it can saturate. Save with te_core.distributed.state_dict.get_model_state_dict, or load this "
            "state dict into a model built without te.quantized_model_init")
    if not isinstance(entry, dict) or set(entry) != set(FP8_ENTRY_KEYS):
        found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise ValueError(f"{key}: expected an FP8 weight entry with keys {FP8_ENTRY_KEYS}, found {found}")
    if entry["fp8_format"] != _format_name(local.fp8_dtype):
        raise ValueError(f"{key}: the checkpoint's weight is {entry['fp8_format']}, this model's is "
                         f"{_format_name(local.fp8_dtype)}; build the model with the fp8_format of the recipe it "
                         "was saved with")
    if not isinstance(entry["fp8_data"], Tensor):
        raise ValueError(f"{key}: fp8_data must be a tensor of FP8 bytes, found {type(entry['fp8_data']).__name__}")
    fmt = _format(local)
    scale_inv = _checked_scale_inv(key, entry["fp8_scale_inv"], param, fmt)
    data = _this_rank(key, "fp8_data", entry["fp8_data"], param, tuple(param.shape), local.shape)
    return data, scale_inv


def _checked_entries(weights: Dict[str, Tensor], state: Dict[str, Any], strict: bool) -> Dict[str, Tuple]:
    """{key: (bytes, scale_inv)} of the FP8 weights' entries, popped from `state`, all checked."""
    loaded = {}
    for key, param in weights.items():
        if key in state:
            loaded[key] = _checked_entry(key, state.pop(key), param)
        elif strict:
            raise RuntimeError(f"Missing key in the model state dict: {key} (an FP8 weight)")
    return loaded


@contextlib.contextmanager
def _refused_together(weights: Dict[str, Tensor]):
    """Every rank of the FSDP groups raises when one rank's checks fail (a block-scaled weight's
    tile scales are checked shard by shard, so one rank may see a bad value the others do not):
    a rank that went on alone would wait forever in torch's collectives of the load."""
    groups = {id(g): g for g in (p.device_mesh.get_group() for p in weights.values() if isinstance(p, DTensor))}
    failed = None
    try:
        yield
    except Exception as error:  # raised below, once the other ranks know
        failed = error
    for group in groups.values():
        flag = torch.tensor([0.0 if failed is None else 1.0], device=_local(next(iter(weights.values()))).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if flag.item() and failed is None:
            failed = RuntimeError("another rank refused its part of the checkpoint (its error says why); the model "
                                  "is left as it was")
    if failed is not None:
        raise failed


def set_model_state_dict(model: nn.Module, model_state_dict: Dict[str, Any], *,
                         options: Optional[StateDictOptions] = None) -> _IncompatibleKeys:
    """torch.distributed.checkpoint.state_dict.set_model_state_dict for a state dict made by
    this module's get_model_state_dict (sharded, or full on every rank): torch loads every other
    entry first (the extra state restores the scaling state), then each FP8 weight gets its saved
    bytes and scale_inv. Call it on every rank."""
    _check_model(model, "set_model_state_dict")
    if not isinstance(model_state_dict, Mapping):
        raise TypeError("te_core.distributed.state_dict.set_model_state_dict: model_state_dict must be a dict of "
                        "state-dict key -> value (as get_model_state_dict returns, or DCP loads into), got "
                        f"{type(model_state_dict).__name__}")
    options = options or StateDictOptions()
    weights = _fp8_weights(model)
    if weights and options.broadcast_from_rank0:
        raise NotImplementedError("broadcast_from_rank0 with FP8 weights: load the full state dict on every rank "
                                  "(torch.load(..., weights_only=True)) and pass full_state_dict=True alone")
    state = dict(model_state_dict)
    with _refused_together(weights):
        loaded = _checked_entries(weights, state, options.strict)
    result = torch_state_dict.set_model_state_dict(model, state, options=dataclasses.replace(options, strict=False))
    missing = [k for k in result.missing_keys if k not in weights]
    if options.strict and (missing or result.unexpected_keys):
        raise RuntimeError(f"Error(s) in loading the state dict of {type(model).__name__}: missing keys {missing}, "
                           f"unexpected keys {list(result.unexpected_keys)}")
    for key, (data, scale_inv) in loaded.items():
        fmt = _format(_local(weights[key]))
        fmt.write(_local(weights[key]), data, scale_inv)
        fmt.after_load(weights[key])
    return _IncompatibleKeys(missing, list(result.unexpected_keys))


class _FP8StateKept:
    """Puts the model's FP8 weights (bytes and scale_inv) and its modules' scaling state (amax
    histories, scales) back as they were on entry. torch's optimizer state dict functions fill an
    empty optimizer state (always empty for a stateless optimizer such as SGD without momentum)
    with a step at learning rate zero: that requantizes every FP8 weight, which can change its
    bytes and scale and, under delayed scaling, records its amax; saving must not change the
    model, and loading must not undo a load."""

    def __init__(self, model: nn.Module):
        self.weights = [(_local(p), fmt) for p in model.parameters()
                        if (fmt := _format(_local(p))) is not None and fmt.refusal(_local(p)) is None]
        groups = {}
        for module in model.modules():
            state = getattr(module, "_recipe_state", None)
            for group in (state.scaling_groups().values() if state is not None else ()):
                groups[id(group)] = group
        self.groups = list(groups.values())

    def __enter__(self) -> "_FP8StateKept":
        self.payloads = [(fmt.data(local).clone(), fmt.scale_inv(local).clone()) for local, fmt in self.weights]
        self.scaling = [(group, group.amax_history.clone(), group.scale.clone()) for group in self.groups]
        return self

    def __exit__(self, *exc) -> None:
        for (local, fmt), (data, scale_inv) in zip(self.weights, self.payloads):
            fmt.write(local, data, scale_inv)
        with torch.no_grad():
            for group, history, scale in self.scaling:
                group.amax_history.copy_(history)
                group.scale.copy_(scale)


def get_optimizer_state_dict(model: nn.Module, optimizers, *, options: Optional[StateDictOptions] = None):
    """torch.distributed.checkpoint.state_dict.get_optimizer_state_dict, leaving the model's FP8
    weights and scaling state unchanged (see _FP8StateKept)."""
    _check_model(model, "get_optimizer_state_dict")
    with _FP8StateKept(model):
        return torch_state_dict.get_optimizer_state_dict(model, optimizers, options=options)


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict, *,
                             options: Optional[StateDictOptions] = None) -> None:
    """torch.distributed.checkpoint.state_dict.set_optimizer_state_dict, leaving the model's FP8
    weights and scaling state unchanged (see _FP8StateKept), so it may come before or after
    set_model_state_dict."""
    _check_model(model, "set_optimizer_state_dict")
    with _FP8StateKept(model):
        torch_state_dict.set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
