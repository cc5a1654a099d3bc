"""Transformer Engine checkpoints into te-core modules: its `_extra_state` (its state-dict names:
te_state_dict_names; its pickled FP8 primary weights: te_tensor_pickles).

TE stores a module's delayed-scaling state as a pickle (a uint8 tensor) holding its recipe
object and the tensors scale_fwd / amax_history_fwd / scale_bwd / amax_history_bwd; its fusible
operations (ops.BasicLinear, ops.GroupedLinear) pickle {"forward": {recipe, scale_fwd, ...},
"backward": {recipe, scale_bwd, ...}} with fewer columns per GEMM (_Layout); TE 1.13's
operations pickled another form, not read (a warning where it holds trained values). Unpickling
it could run arbitrary code, so it is read by te-core's allow-listed unpickler
(quantization.safe_pickle: tensors, OrderedDict, and TE's recipe classes, or te-core's, which a
framework's merge of TE's entries on te-core pickles in their place, rebuilt as inert records
whose fields are read as plain values), which also takes the recipe subclasses of training
frameworks below. Anything else,
or contents that do not fit the module, restart the module's scales, with one warning. A pickle
holding no scales (TE 2.0-2.3's None, a stateless recipe's record) has nothing to restore.
"""
from __future__ import annotations

import io
import pickle
import warnings
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..quantization.roles import Role
from ..quantization.safe_pickle import AllowListUnpickler, Record
from ..quantization.state import DelayedScalingState

_FORMAT_BY_MAX = {(448, 448): "E4M3", (57344, 57344): "E5M2", (448, 57344): "HYBRID"}
_DELAYED_FIELDS = ("margin", "amax_history_len", "amax_compute_algo", "reduce_amax")
# Recipe subclasses that checkpoints of Transformer Engine models hold in place of TE's own class
# (Megatron-LM's passes its config to DelayedScaling and adds nothing to its state): read as the
# TE recipe they subclass.
_SUBCLASSED_RECIPES = {("megatron.core.extensions.transformer_engine", "TEDelayedScaling"): "DelayedScaling"}



class _AllowListUnpickler(AllowListUnpickler):
    what = "Transformer Engine extra state"
    renamed = _SUBCLASSED_RECIPES


def read_te_extra_state(data: bytes) -> Optional[dict]:
    """The dict TE pickled, its recipe as a Record, or None (TE 2.0-2.3 pickle None for a
    module that never ran FP8); raises for anything off the allow-list."""
    state = _AllowListUnpickler(io.BytesIO(data)).load()
    if state is not None and not isinstance(state, dict):
        raise pickle.UnpicklingError(f"expected a dict, found {type(state).__name__}")
    return state


def _format_name(value) -> str:
    """TE's Format enum member, from its (max_fwd, max_bwd) value or its name."""
    if isinstance(value, Record) and value.member is not None:
        if value.member not in _FORMAT_BY_MAX.values():
            raise ValueError(f"unknown fp8_format {value.member!r}")
        return value.member
    helper = value.args[0] if isinstance(value, Record) and value.args else None
    limits = tuple(helper.args) if isinstance(helper, Record) else tuple(getattr(helper, "_asdict", dict)().values())
    if tuple(int(x) for x in limits) not in _FORMAT_BY_MAX:
        raise ValueError(f"unknown fp8_format {limits!r}")
    return _FORMAT_BY_MAX[tuple(int(x) for x in limits)]


def _recipe_config(recipe) -> dict:
    """te-core's checkpoint config for TE's DelayedScaling record."""
    from ..recipe import DelayedScaling, Format

    if not isinstance(recipe, Record) or recipe.te_name != "DelayedScaling":
        raise ValueError(f"recipe {getattr(recipe, 'te_name', type(recipe).__name__)} keeps no state te-core reads")
    kwargs = {k: recipe.fields[k] for k in _DELAYED_FIELDS if k in recipe.fields}
    if not isinstance(kwargs.get("amax_compute_algo", "max"), str):
        kwargs.pop("amax_compute_algo")
    if "fp8_format" in recipe.fields:
        kwargs["fp8_format"] = Format[_format_name(recipe.fields["fp8_format"])]
    return DelayedScaling(**kwargs).to_config()


_DIRECTIONS = {"fwd": "forward", "bwd": "backward"}


class _Layout(NamedTuple):
    """Where TE keeps a GEMM's scales: `per_gemm` columns of each direction's tensors ("fwd",
    "bwd") per GEMM, GEMM after GEMM, the input's and then the weight's first among the forward
    ones and the grad output's first among the backward ones; `sources`: what else writes state
    of this layout, for the message of a misfit."""

    per_gemm: Dict[str, int]
    sources: str

    def counts(self, columns: Dict[str, int]) -> str:
        return " and ".join(f"{n} {_DIRECTIONS[suffix]}" for suffix, n in columns.items())


# A module keeps input, weight and output forward, grad output and grad input backward.
_MODULE_LAYOUT = _Layout({"fwd": 3, "bwd": 2}, "another module type (LayerNormMLP has 2 GEMMs, Linear and "
                                              "LayerNormLinear 1) or from a GroupedLinear with another num_gemms")
# An operation keeps only its own quantizers' (TE's num_quantizers / get_quantizer): input and
# weight forward, grad output backward.
_OP_LAYOUT = _Layout({"fwd": 2, "bwd": 1}, "another operation (ops.BasicLinear has 1 GEMM, ops.GroupedLinear one "
                                          "per group) or from an ops.GroupedLinear with another num_groups")


class _MisfitState(ValueError):
    """TE extra state that was read but is not restored: another kind of module's, or a form
    te-core does not read; the message says which."""


def _check_gemm_count(module: str, gemms: int, state: dict, layout: _Layout) -> None:
    """State of another column count than `gemms` GEMMs have in `layout` is another module
    type's (or another GroupedLinear's; a module's also records num_gemms), and reading it by
    column would take other GEMMs' scales (more columns) or fail (fewer)."""
    saved = {}
    for suffix in layout.per_gemm:
        scale, history = state.get(f"scale_{suffix}"), state.get(f"amax_history_{suffix}")
        for key, value, rank in ((f"scale_{suffix}", scale, 1), (f"amax_history_{suffix}", history, 2)):
            if not (isinstance(value, Tensor) and value.dim() == rank):
                raise ValueError(f"{key} is not a tensor of rank {rank}")
        if history.shape[1] != scale.shape[0]:
            raise ValueError(f"the {_DIRECTIONS[suffix]} amax history has {history.shape[1]} columns, its scales "
                             f"{scale.shape[0]}")
        saved[suffix] = scale.shape[0]
    wanted = {suffix: n * gemms for suffix, n in layout.per_gemm.items()}
    extra = state.get("extra_fp8_variables")
    recorded = extra.get("num_gemms") if isinstance(extra, dict) else None
    if saved == wanted and recorded in (None, gemms):
        return
    saved_gemms = f"num_gemms={recorded}, " if recorded is not None else ""
    raise _MisfitState(
        f"the checkpoint's Transformer Engine extra state holds FP8 scales for {saved_gemms}{layout.counts(saved)} "
        f"tensors, but this {module} has {gemms} GEMM{'s' if gemms != 1 else ''}, so {layout.counts(wanted)}; it "
        f"was saved from {layout.sources}")


def _slot_state(module: str, slots, state: dict, layout: _Layout = _MODULE_LAYOUT) -> dict:
    """te-core's quantization_state from TE's tensors, in `layout`'s columns; te-core's slots
    come three per GEMM (input, weight, grad_output) in the module's GEMM order. Slots of a
    direction that `layout` leaves out (a forward-only operation's) are not in the result."""
    _check_gemm_count(module, len(slots) // 3, state, layout)
    out = {"forward": {}, "backward": {}}
    for n, slot in enumerate(slots):
        suffix = "bwd" if slot.role is Role.GRAD_OUTPUT else "fwd"
        if suffix not in layout.per_gemm:
            continue
        column = layout.per_gemm[suffix] * (n // 3) + (slot.role is Role.WEIGHT)
        scale, history = state[f"scale_{suffix}"], state[f"amax_history_{suffix}"]
        out[slot.role.direction][slot.name] = {"scale": scale[column:column + 1].float().clone(),
                                               "amax_history": history[:, column].float().clone()}
    return out


def _flatten_op_state(state: dict) -> Optional[Tuple[dict, dict, _Layout]]:
    """TE's operation state as the module form's flat tensors (scale_fwd, ...), te-core's recipe
    config and the layout of the directions that hold scales; None where none does (empty, or a
    stateless recipe's, as TE's set_extra_state copies nothing then)."""
    flat, per_gemm, configs = {}, {}, []
    for suffix, direction in _DIRECTIONS.items():
        half = state.get(direction)
        if half is None:
            continue  # (an operation without quantizers in this direction writes none)
        if not isinstance(half, dict):
            raise ValueError(f"its {direction!r} entry is a {type(half).__name__}, expected a dict")
        if f"scale_{suffix}" not in half:
            continue
        if half.get("recipe") is None:
            raise ValueError(f"its {direction!r} entry holds scales but no recipe")
        configs.append(_recipe_config(half["recipe"]))
        flat.update((key, half.get(key)) for key in (f"scale_{suffix}", f"amax_history_{suffix}"))
        per_gemm[suffix] = _OP_LAYOUT.per_gemm[suffix]
    if not per_gemm:
        return None
    if any(config != configs[0] for config in configs):  # (TE gives both directions one recipe)
        raise ValueError("its forward and backward entries hold different recipes, where a module has one")
    return flat, configs[0], _OP_LAYOUT._replace(per_gemm=per_gemm)


# Transformer Engine 1.13's operations pickled one entry per quantizer kind (None for a kind they
# lack), each with the scales of its direction(s) and no recipe. It is not read: 1.13 writes it
# (scale 1, zero history) also for an operation that never ran FP8, so without a recipe there is
# no telling the format its scales served; only state that training wrote is worth a warning.
_TE_1_13_OP_KEYS = ("input", "param", "grad_output")


def _is_te_1_13_op_state(state: dict) -> bool:
    return any(key in state for key in _TE_1_13_OP_KEYS)


def _te_1_13_holds_values(state: dict) -> bool:
    """Whether TE 1.13's operation state holds delayed-scaling values other than the initial ones
    (any scale other than 1, any amax other than 0); content that cannot be read counts as some."""
    for entry in (state.get(key) for key in _TE_1_13_OP_KEYS):
        if entry is None:
            continue
        if not isinstance(entry, dict):
            return True
        for suffix in _DIRECTIONS:
            for key, initial in ((f"scale_{suffix}", 1.0), (f"amax_history_{suffix}", 0.0)):
                value = entry.get(key)
                if value is not None and not (isinstance(value, Tensor) and value.is_floating_point()
                                              and bool((value == initial).all())):
                    return True
    return False


def _keep_unsaved_slots(module, saved: dict, history: int) -> Dict[str, Dict[str, bool]]:
    """Fill in the slots of a direction the checkpoint holds no state for (a forward-only
    operation's), as TE's set_extra_state leaves that direction: as the module has it (its live
    delayed-scaling values), or as a new state's (scale 1, zero history; fresh, so that its
    first cast scales by its own amax). Returns the fresh flags of every slot, for the load."""
    live = module.quantization_state()
    live_fresh = module._recipe_state.fresh_slots() if module._recipe_state is not None else {}
    fresh = {"forward": {}, "backward": {}}
    for slot in module._quantizer_slots:
        direction = slot.role.direction
        if slot.name in saved[direction]:
            fresh[direction][slot.name] = False
            continue
        current = live[direction].get(slot.name)
        if current is not None and not current["scale"].is_meta:
            saved[direction][slot.name] = {key: value.detach().float().clone() for key, value in current.items()}
            fresh[direction][slot.name] = live_fresh.get(direction, {}).get(slot.name) is True
        else:
            # (on the CPU, as the checkpoint's own entries: not on a torch.device(...) context's device)
            saved[direction][slot.name] = {"scale": torch.ones(1, device="cpu"),
                                           "amax_history": torch.zeros(history, device="cpu")}
            fresh[direction][slot.name] = True
    return fresh


def is_te_tensor_form(state) -> bool:
    """Whether `state` is Transformer Engine's extra state as a tensor: its pickle in a uint8 tensor,
    or an empty tensor of any dtype, its "no FP8 state" (TE 1.13's operations write torch.Tensor(), a
    float32 one)."""
    return isinstance(state, Tensor) and (state.dtype == torch.uint8 or state.numel() == 0)


def te_extra_state(module, tensor: Tensor) -> Optional[dict]:
    """te-core's extra state for `module` from TE's serialized one, or None: nothing to restore,
    restored here (TE 1.x's, _restore_unrecorded_format), or unusable (then the scales restart,
    with a warning)."""
    if tensor.numel() == 0:
        return None  # TE's "no FP8 state" (uint8; TE 1.13's operations' float32)
    return _from_te(module, lambda: read_te_extra_state(tensor.detach().cpu().contiguous().numpy().tobytes()))


def te_bytesio_extra_state(module, buffer: io.BytesIO) -> Optional[dict]:
    """te_extra_state for Transformer Engine 1.x's default form, an io.BytesIO holding torch.save
    of its state: tensors and plain values, read with torch.load(weights_only=True), so no code
    from the checkpoint runs (content of any other kind cannot be read: the scales restart, with
    a warning)."""
    def read():
        buffer.seek(0)
        return torch.load(buffer, weights_only=True, map_location="cpu")

    return _from_te(module, read)


def holds_fp8_scales(state) -> bool:
    """Whether Transformer Engine extra state (its uint8 tensor, or TE 1.x's io.BytesIO) holds FP8
    scales, in a module's form or an operation's (per direction): not when empty (of any dtype: TE
    1.13's operations write a float32 torch.Tensor() for "no FP8 state"), a pickled None
    (TE 2.0-2.3's for a module that never ran FP8), a pickled {} (TE 2.3-2.8's for an operation
    without quantization state: a norm, Bias, an activation), a stateless recipe's record, or TE
    1.13's operation state with only initial values (which 1.13 writes for operations that never ran
    FP8); content that cannot be read counts as holding some."""
    try:
        if isinstance(state, io.BytesIO):
            state.seek(0)
            state = torch.load(state, weights_only=True, map_location="cpu")
        elif isinstance(state, Tensor):
            if state.numel() == 0:
                return False
            state = read_te_extra_state(state.detach().cpu().contiguous().numpy().tobytes())
    except Exception:  # noqa: BLE001 - unreadable: the caller says it is not used
        return True
    if not isinstance(state, dict):
        return False
    if _is_te_1_13_op_state(state):
        return _te_1_13_holds_values(state)
    return "scale_fwd" in state or any(isinstance(state.get(direction), dict) and f"scale_{suffix}" in state[direction]
                                       for suffix, direction in _DIRECTIONS.items())


def _from_te(module, read) -> Optional[dict]:
    name = type(module).__name__
    try:
        state = read()
        slots = getattr(module, "_quantizer_slots", ())
        # TE 2.0-2.3 pickle None for a module that never ran FP8, and TE 2.0-2.17 a stateless
        # recipe's record (current, block or MXFP8 scaling) without scales: TE's set_extra_state
        # finds nothing to copy in either, and neither is an error
        if state is None or not slots:
            return None
        if "scale_fwd" not in state:  # an operation's ({"forward": ...}; TE 1.13's {"input": ...}), or no scales
            return _from_te_op(module, name, slots, state)
        recipe = state.get("recipe")  # (none in TE 1.x's)
        config = None if recipe is None else _recipe_config(recipe)
        saved = _slot_state(name, slots, state)
    except _MisfitState as err:
        warnings.warn(f"{name}: {err}. The FP8 scales of this module restart from their initial values; drop its "
                      "'_extra_state' entry from the state dict to start them afresh without this warning",
                      UserWarning, stacklevel=3)
        return None
    except Exception as err:  # noqa: BLE001 - any unreadable content means: start afresh, once, loudly
        warnings.warn(f"{name}: Transformer Engine extra state could not be read ({err}); "
                      "the FP8 scales of this module restart from their initial values", UserWarning, stacklevel=3)
        return None
    if config is None:
        return _restore_unrecorded_format(module, saved, state["amax_history_fwd"].shape[0])
    return {"recipe": config, "quantization_state": saved}


def _from_te_op(module, name: str, slots, state: dict) -> Optional[dict]:
    """_from_te for the state of one of TE's fusible operations (or of nothing: a stateless
    recipe's, an empty dict); raises as _from_te's reading does. TE 1.13's form is not read; it
    warns where it holds values that training wrote."""
    if _is_te_1_13_op_state(state):
        if _te_1_13_holds_values(state):
            raise _MisfitState("its extra state is Transformer Engine 1.13's operation state (one entry per "
                               "quantizer: 'input', 'param', 'grad_output'), which te-core does not read: it "
                               "records no recipe, so the format its delayed-scaling scales served is unknown")
        return None
    op = _flatten_op_state(state)
    if op is None:
        return None
    flat, config, layout = op
    saved = _slot_state(name, slots, flat, layout)
    if layout == _OP_LAYOUT:
        return {"recipe": config, "quantization_state": saved}
    history = next(flat[f"amax_history_{suffix}"].shape[0] for suffix in layout.per_gemm)
    return {"recipe": config, "quantization_state": saved, "fresh": _keep_unsaved_slots(module, saved, history)}


class _UnrecordedFormatState(DelayedScalingState):
    """Delayed-scaling state from a checkpoint that records no FP8 format (TE 1.x's): it serves
    the first DelayedScaling recipe its module runs under, in that recipe's format, as TE keeps
    such state under any delayed recipe; from then on it is an ordinary state of that recipe."""

    def __init__(self, recipe, slots, device, module: str):
        super().__init__(recipe, slots, device)
        self.module, self.format_open = module, True

    def carries_over_to(self, recipe) -> bool:
        """Any DelayedScaling recipe while the format is open; raises for another class, as a
        module refuses a loaded checkpoint's state under another recipe class."""
        if not self.format_open:
            return super().carries_over_to(recipe)
        if not recipe.delayed():
            raise ValueError(
                f"{self.module}: its FP8 scales were loaded from a Transformer Engine 1.x checkpoint, which holds "
                f"delayed scaling's state, but the recipe is now {type(recipe).__name__}; scales and amax histories "
                "do not carry over to another recipe class. Run it under a DelayedScaling recipe (any fp8_format), "
                "or drop the module's '_extra_state' entry from the state dict to start the scaling state afresh.")
        return True

    def rebind(self, recipe) -> None:
        super().rebind(recipe)
        self.format_open = False


def _restore_unrecorded_format(module, saved: dict, history: int) -> Optional[dict]:
    """TE 1.x's state: delayed scaling (1.x had no other recipe) whose format was the module's
    recipe's at run time, not recorded. A module that has a state already takes it in that
    state's format (te-core's checkpoint dict, returned); one that has none gets a state that
    adopts the format of the recipe it first runs under (made here; None returned)."""
    from ..recipe import DelayedScaling

    current = module._recipe_state
    if current is not None:  # (under another recipe class, set_extra_state refuses it as any delayed state)
        fmt = current.recipe.fp8_format if current.recipe.delayed() else DelayedScaling.fp8_format
        return {"recipe": DelayedScaling(fp8_format=fmt, amax_history_len=history).to_config(),
                "quantization_state": saved}
    state = _UnrecordedFormatState(DelayedScaling(amax_history_len=history), module._quantizer_slots,
                                   module._state_device(), type(module).__name__)
    state.load_quantization_state(saved)  # (raises for corrupt values, as set_extra_state's load does)
    module._recipe_state = state
    module._weight_cache.clear()
    return None


def unrecognised_extra_state(module: str, state) -> str:
    """The error for extra state of a type no loader reads (set_extra_state)."""
    return (f"{module}: unrecognised extra state {type(state).__name__}; expected the dict written by te_core "
            "(keys 'recipe' and 'quantization_state'), Transformer Engine's uint8 tensor, or Transformer Engine "
            "1.x's io.BytesIO")
