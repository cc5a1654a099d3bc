"""A module's extra state in Transformer Engine's form: one uint8 tensor, empty when there is no
scaling state to keep.

State dicts are saved by tools that take tensors only (safetensors, and Hugging Face's
`save_pretrained` through it), so the entry is a tensor, as Transformer Engine's is. Its bytes are
a pickle of TE's module layout (TE's `get_extra_state`): `scale_fwd` / `amax_history_fwd` with
three columns per GEMM (input, weight, output), `scale_bwd` / `amax_history_bwd` with two (grad
output, grad input), and `extra_fp8_variables` with `num_gemms`; te-core keeps no output or grad
input scales and writes TE's initial values there (scale 1, zero history). The columns go role by
role (every GEMM's input, then every weight, then every output), the layout that Megatron-LM's
TEGroupedLinear slices per expert for its distributed checkpoints (`view(3, -1)[:, gemm]`), so
each expert's entry holds its own scales. Everything pickled is a plain value or a CPU tensor:
te-core's recipe goes in as its config dict, in `recipe` and in `extra_fp8_variables` (which
Megatron's split and merge carry over, where they drop other keys).

Reading never runs code from a checkpoint: safe_pickle's allow-list, shared with the reader of
Transformer Engine's form (tensors, OrderedDict, recipe objects as inert records: a training
framework pickles the module's fp8_meta["recipe"] when it merges the split entries; this form's
are never read); any other global is refused. Loading still takes te-core's
earlier forms: a torch.save archive (zip header) of its checkpoint dict, and the dict itself.
"""
from __future__ import annotations

import base64
import collections
import io
import pickle
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .roles import BACKWARD, FORWARD, Role
from .safe_pickle import AllowListUnpickler

_ZIP_HEADER = b"PK\x03\x04"  # torch.save's archives (te-core's form before 2): a pickle starts with b"\x80"
_MARKER = "te_core_extra_state"  # names the form, so that another archive or pickle is never misread
_VERSION = 2
_PICKLE_PROTOCOL = 4
# Where a pickle of te-core's form shows its marker: the first key of extra_fp8_variables, itself
# the first key (also after Megatron-LM's split and merge, which keep that order)
_MARKER_WINDOW = 160
# TE's columns per GEMM, by direction; None: a column te-core keeps no state for
_COLUMNS = {"fwd": (FORWARD, (Role.INPUT, Role.WEIGHT, None)), "bwd": (BACKWARD, (Role.GRAD_OUTPUT, None))}
_AFRESH = "Drop the module's '_extra_state' entry from the state dict to start its scaling state afresh."


def _on_cpu(value):
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


def _slot_roles(slots, module: str) -> List[Tuple[str, Role]]:
    """[(name, Role)] of QuantizerSlots or of the [[name, role value]] record in the bytes."""
    if slots is None:
        raise ValueError(f"{module}: te-core extra state without its slot record needs the module's quantizer slots "
                         "to place its columns; load it with the module's load_state_dict / set_extra_state")
    try:
        return [(str(slot[0]), slot[1] if isinstance(slot[1], Role) else Role(slot[1])) for slot in slots]
    except (TypeError, ValueError, IndexError) as err:
        raise ValueError(f"{module}: the extra state's slot record is malformed ({err}); the checkpoint is corrupt. "
                         f"{_AFRESH}") from err


def _columns(slots: List[Tuple[str, Role]]) -> Tuple[int, Dict[str, List[Optional[str]]]]:
    """(num_gemms, {"fwd"|"bwd": slot name of each column, None for a pad}): role by role, GEMM
    by GEMM within a role (the k-th slot of a role is GEMM k's)."""
    by_role: Dict[Role, List[str]] = collections.defaultdict(list)
    for name, role in slots:
        by_role[role].append(name)
    gemms = max([len(names) for names in by_role.values()] + [1])
    layout = {suffix: [by_role[role][g] if role is not None and g < len(by_role[role]) else None
                       for role in roles for g in range(gemms)]
              for suffix, (_, roles) in _COLUMNS.items()}
    return gemms, layout


def encode(state: Optional[dict], slots: Optional[Sequence] = None) -> Tensor:
    """The uint8 tensor a module's `get_extra_state` returns for its checkpoint dict (or None).
    `slots`: the module's QuantizerSlots in order (default: the dict's own "slots" record, which
    `decode` returns)."""
    if state is None:  # (on the CPU as the pickled form is, not on a torch.device(...) context's device)
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    roles = _slot_roles(slots if slots is not None else state.get("slots"), "encode")
    gemms, layout = _columns(roles)
    # all on the CPU: the module's scales may be on its device, and factory calls follow torch.device(...) contexts
    recipe, saved = _on_cpu(state["recipe"]), _on_cpu(state["quantization_state"])
    entries = [entry for direction in saved.values() for entry in direction.values()]
    length = entries[0]["amax_history"].numel() if entries else 1
    payload = {"extra_fp8_variables": {_MARKER: _VERSION, "num_gemms": gemms, "te_core_recipe": recipe},
               "recipe": recipe}
    one, zero_history = torch.ones(1, device="cpu"), torch.zeros(length, device="cpu")  # placeholder columns
    for suffix, (direction, _) in _COLUMNS.items():
        columns = [saved[direction].get(name) if name is not None else None for name in layout[suffix]]
        payload[f"scale_{suffix}"] = torch.cat([one if c is None else c["scale"].float().reshape(1) for c in columns])
        payload[f"amax_history_{suffix}"] = torch.stack(
            [zero_history if c is None else c["amax_history"].float().reshape(-1) for c in columns], dim=1)
    payload["te_core_slots"] = [[name, role.value] for name, role in roles]
    for flags in ("fresh", "init_scaled"):
        if state.get(flags) is not None:
            payload[flags] = _on_cpu(state[flags])
    out = io.BytesIO()
    _StableSizePickler(out, protocol=_PICKLE_PROTOCOL).dump(payload)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


class _StableSizePickler(pickle.Pickler):
    """Pickles tensors as torch does (torch._utils._rebuild_tensor_v2 of a storage read by
    torch.storage._load_from_bytes: what Transformer Engine and Megatron-LM's restricted
    unpickler read), but each storage as a torch.save archive, whose size depends on the tensor
    alone: torch's own pickle names the storage by its memory address, so the bytes' length
    changed from call to call, and torch's distributed checkpoint loads an entry in place only
    into a tensor of the same size (a model's initialized extra state then refused the saved one
    at random)."""

    def reducer_override(self, obj):
        if not isinstance(obj, Tensor):
            return NotImplemented
        t = obj.detach().to("cpu").contiguous()
        archive = io.BytesIO()
        torch.save(torch.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype, _internal=True), archive)
        return torch._utils._rebuild_tensor_v2, (_Archived(archive.getvalue()), t.storage_offset(), tuple(t.shape),
                                                 t.stride(), False, collections.OrderedDict())


class _Archived:
    """A storage pickled as the torch.save archive it is read back from."""

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return torch.storage._load_from_bytes, (self.data,)


_TEXT_PREFIX = "te_core_extra_state:base64:"


def as_text(state: Tensor) -> str:
    """A tensor `encode` wrote, as text (its bytes in base64, after a marker): the form
    te_core.distributed.state_dict hands to torch's distributed checkpoint, which saves and
    restores a non-tensor value whole (a tensor it loads in place, into one of the same size; a
    dict it splits into entries of their own, which a model whose scaling state is not made yet
    has none of), and which torch.load(weights_only=True) reads back (it refuses bytes objects)."""
    return _TEXT_PREFIX + base64.b64encode(state.detach().to("cpu").contiguous().numpy().tobytes()).decode("ascii")


def from_text(state):
    """`state` as the uint8 tensor of `encode`'s form where it is as_text's text, else as given."""
    if isinstance(state, str) and state.startswith(_TEXT_PREFIX):
        data = base64.b64decode(state[len(_TEXT_PREFIX):])
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return state


def _bytes(state: Tensor) -> bytes:
    return state.detach().to("cpu").contiguous().numpy().tobytes()


def is_encoded(state) -> bool:
    """Whether `state` is a tensor of te-core's extra state: empty, a pickle of its form (also as
    Megatron-LM's split and merge re-pickle it), or an earlier te-core's torch.save archive.
    Transformer Engine's pickles are not (compat.te_checkpoint reads those)."""
    if not (isinstance(state, Tensor) and state.dtype == torch.uint8 and state.dim() == 1):
        return False
    if state.numel() == 0:
        return True
    head = bytes(state[:_MARKER_WINDOW].tolist())
    return head.startswith(_ZIP_HEADER) or (head.startswith(b"\x80") and _MARKER.encode() in head)


class _Unpickler(AllowListUnpickler):
    what = "te-core extra state"


def decode(state: Tensor, module: str, slots: Optional[Sequence] = None) -> Optional[dict]:
    """The checkpoint dict of a tensor `is_encoded` accepts, None for an empty one; a clear error
    for bytes that are not te-core's extra state. `slots`: the module's QuantizerSlots, which
    place the columns of an entry that Megatron-LM's merge re-pickled without te-core's record."""
    if state.numel() == 0:
        return None
    data = _bytes(state)
    try:
        if data.startswith(_ZIP_HEADER):
            loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        else:
            loaded = _Unpickler(io.BytesIO(data)).load()
    except Exception as err:  # noqa: BLE001 - any unreadable bytes get the same message
        raise ValueError(f"{module}: the extra state could not be read ({type(err).__name__}: {err}); the checkpoint "
                         f"is corrupt or not te-core's. {_AFRESH}") from err
    if data.startswith(_ZIP_HEADER):  # te-core's torch.save form
        if not isinstance(loaded, dict) or loaded.pop(_MARKER, None) != 1:
            raise ValueError(f"{module}: the extra state is a torch.save archive of {type(loaded).__name__}, not "
                             f"te-core's extra state. {_AFRESH}")
        return loaded
    extra = loaded.get("extra_fp8_variables") if isinstance(loaded, dict) else None
    if not (isinstance(extra, dict) and extra.get(_MARKER) == _VERSION):
        raise ValueError(f"{module}: the extra state is a pickled {type(loaded).__name__} without te-core's marker, "
                         f"not te-core's extra state. {_AFRESH}")
    return _checkpoint_dict(loaded, extra, module, slots)


def _checkpoint_dict(loaded: dict, extra: dict, module: str, slots) -> dict:
    """te-core's checkpoint dict from the pickled form: each slot's column of TE's tensors; the
    fresh flags as recorded, else (dropped by Megatron-LM's split) a slot is fresh where it holds
    a new state's values (scale 1, zero history: it never cast)."""
    recipe = extra.get("te_core_recipe")
    if not isinstance(recipe, dict):
        raise ValueError(f"{module}: the extra state's recipe config is a {type(recipe).__name__}, expected a dict; "
                         f"the checkpoint is corrupt. {_AFRESH}")
    roles = _slot_roles(loaded.get("te_core_slots", slots), module)
    gemms, layout = _columns(roles)
    if extra.get("num_gemms", gemms) != gemms:
        raise ValueError(f"{module}: the extra state holds FP8 scales of num_gemms={extra.get('num_gemms')}, but the "
                         f"module has {gemms} GEMM(s); was it saved from another module type or num_gemms? {_AFRESH}")
    saved: Dict[str, dict] = {FORWARD: {}, BACKWARD: {}}
    for suffix, (direction, _) in _COLUMNS.items():
        scale, history, names = loaded.get(f"scale_{suffix}"), loaded.get(f"amax_history_{suffix}"), layout[suffix]
        if not (isinstance(scale, Tensor) and isinstance(history, Tensor) and scale.dim() == 1 and history.dim() == 2
                and scale.numel() == len(names) == history.shape[1]):
            shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (scale, history)]
            raise ValueError(f"{module}: the extra state's scale_{suffix} / amax_history_{suffix} have shapes "
                             f"{shapes[0]} / {shapes[1]}, expected ({len(names)},) / (length, {len(names)}) for "
                             f"{gemms} GEMM(s); was it saved from another module type or num_gemms? {_AFRESH}")
        for column, name in enumerate(names):
            if name is not None:
                saved[direction][name] = {"scale": scale[column:column + 1].clone(),
                                          "amax_history": history[:, column].clone()}
    fresh = loaded.get("fresh")
    if fresh is None:
        fresh = {direction: {name: bool((entry["scale"] == 1).all() and (entry["amax_history"] == 0).all())
                             for name, entry in entries.items()} for direction, entries in saved.items()}
    return {"recipe": recipe, "quantization_state": saved, "fresh": fresh, "init_scaled": loaded.get("init_scaled"),
            "slots": [[name, role.value] for name, role in roles]}
