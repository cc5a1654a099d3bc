"""Transformer Engine checkpoints into te-core modules: its `_extra_state` and its QKV names.

TE stores a module's delayed-scaling state as a pickle (a uint8 tensor) holding its recipe
object and the tensors scale_fwd / amax_history_fwd / scale_bwd / amax_history_bwd. Unpickling
it could run arbitrary code, so it is read by an unpickler that knows only an allow-list:
tensors (rebuilt from their bytes with torch.load(weights_only=True)), OrderedDict, and TE's
recipe classes, rebuilt as inert records whose fields are read as plain values. Anything else,
or contents that do not fit the module, restart the module's scales, with one warning.
"""
from __future__ import annotations

import collections
import io
import pickle
import warnings
from typing import Optional

import torch
from torch import Tensor

from ..quantization.roles import Role

TE_RECIPE_MODULE = "transformer_engine.common.recipe"
_FORMAT_BY_MAX = {(448, 448): "E4M3", (57344, 57344): "E5M2", (448, 57344): "HYBRID"}
_DELAYED_FIELDS = ("margin", "amax_history_len", "amax_compute_algo", "reduce_amax")
# Recipe subclasses that checkpoints of Transformer Engine models hold in place of TE's own class
# (Megatron-LM's passes its config to DelayedScaling and adds nothing to its state): read as the
# TE recipe they subclass.
_SUBCLASSED_RECIPES = {("megatron.core.extensions.transformer_engine", "TEDelayedScaling"): "DelayedScaling"}


class _Record:
    """An inert stand-in for one of TE's recipe objects: constructor arguments and state only."""

    te_name = ""
    member = None  # an enum member pickled by name: getattr(cls, member)

    def __new__(cls, *args):  # pickle's NEWOBJ calls __new__ only, REDUCE calls the class
        record = super().__new__(cls)
        record.args, record.fields = args, {}
        return record

    def __init__(self, *args):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple):  # (dict, slots) from objects with __slots__
            state = {k: v for part in state if isinstance(part, dict) for k, v in part.items()}
        if isinstance(state, dict):
            self.fields.update(state)


def _record_class(name: str):
    return type(name, (_Record,), {"te_name": name})


def _reconstructor(cls, base, state):
    if not (isinstance(cls, type) and issubclass(cls, _Record)):
        raise pickle.UnpicklingError(f"refusing to rebuild {cls!r}")
    record = cls()
    record.__setstate__(state)
    return record


def _member(cls, name):
    """getattr(cls, name) of a TE recipe class: how some Python versions (3.11's first releases)
    pickle an enum member, by name. Only a member name of one of TE's recipe classes."""
    if not (isinstance(cls, type) and issubclass(cls, _Record)) or not isinstance(name, str) \
            or not name.isidentifier():
        raise pickle.UnpicklingError(f"refusing getattr({cls!r}, {name!r}): only members of TE's recipe classes")
    record = cls()
    record.member = name
    return record


def _storage_from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("builtins", "object"): object,
    ("builtins", "getattr"): _member,
}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == TE_RECIPE_MODULE and name.isidentifier():
            return _record_class(name)
        if (module, name) in _SUBCLASSED_RECIPES:  # a training framework's subclass of a TE recipe
            return _record_class(_SUBCLASSED_RECIPES[module, name])
        raise pickle.UnpicklingError(f"{module}.{name} is not on the allow-list of Transformer Engine extra state")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent references are not part of Transformer Engine extra state")


def read_te_extra_state(data: bytes) -> dict:
    """The dict TE pickled, its recipe as a _Record; raises for anything off the allow-list."""
    state = _AllowListUnpickler(io.BytesIO(data)).load()
    if not isinstance(state, dict):
        raise pickle.UnpicklingError(f"expected a dict, found {type(state).__name__}")
    return state


def _format_name(value) -> str:
    """TE's Format enum member, from its (max_fwd, max_bwd) value or its name."""
    if isinstance(value, _Record) and value.member is not None:
        if value.member not in _FORMAT_BY_MAX.values():
            raise ValueError(f"unknown fp8_format {value.member!r}")
        return value.member
    helper = value.args[0] if isinstance(value, _Record) and value.args else None
    limits = tuple(helper.args) if isinstance(helper, _Record) else tuple(getattr(helper, "_asdict", dict)().values())
    if tuple(int(x) for x in limits) not in _FORMAT_BY_MAX:
        raise ValueError(f"unknown fp8_format {limits!r}")
    return _FORMAT_BY_MAX[tuple(int(x) for x in limits)]


def _recipe_config(recipe) -> dict:
    """te-core's checkpoint config for TE's DelayedScaling record (TE 1.x had no recipe: the default)."""
    from ..recipe import DelayedScaling, Format

    if recipe is None:
        return DelayedScaling().to_config()
    if not isinstance(recipe, _Record) or recipe.te_name != "DelayedScaling":
        raise ValueError(f"recipe {getattr(recipe, 'te_name', type(recipe).__name__)} keeps no state te-core reads")
    kwargs = {k: recipe.fields[k] for k in _DELAYED_FIELDS if k in recipe.fields}
    if not isinstance(kwargs.get("amax_compute_algo", "max"), str):
        kwargs.pop("amax_compute_algo")
    if "fp8_format" in recipe.fields:
        kwargs["fp8_format"] = Format[_format_name(recipe.fields["fp8_format"])]
    return DelayedScaling(**kwargs).to_config()


def _slot_state(slots, state: dict) -> dict:
    """te-core's quantization_state from TE's tensors. TE keeps per GEMM three forward columns
    (input, weight, output) and two backward ones (grad output, grad input); te-core's slots
    come three per GEMM (input, weight, grad_output) in the module's GEMM order."""
    out = {"forward": {}, "backward": {}}
    for n, slot in enumerate(slots):
        gemm = n // 3
        if slot.role is Role.GRAD_OUTPUT:
            direction, column, suffix = "backward", 2 * gemm, "bwd"
        else:
            direction, column, suffix = "forward", 3 * gemm + (slot.role is Role.WEIGHT), "fwd"
        scale, history = state[f"scale_{suffix}"], state[f"amax_history_{suffix}"]
        if not (isinstance(scale, Tensor) and isinstance(history, Tensor) and history.dim() == 2):
            raise ValueError(f"scale_{suffix} / amax_history_{suffix} are not tensors of the expected rank")
        out[direction][slot.name] = {"scale": scale[column:column + 1].float().clone(),
                                     "amax_history": history[:, column].float().clone()}
    return out


def te_extra_state(module, tensor: Tensor) -> Optional[dict]:
    """te-core's extra state for `module` from TE's serialized one, or None (nothing to restore,
    or unreadable: then the scales restart, with a warning)."""
    if tensor.numel() == 0:
        return None  # TE's "no FP8 state"
    try:
        state = read_te_extra_state(tensor.detach().cpu().contiguous().numpy().tobytes())
        config = _recipe_config(state.get("recipe"))
        slots = getattr(module, "_quantizer_slots", ())
        if not slots or "scale_fwd" not in state:
            return None
        return {"recipe": config, "quantization_state": _slot_state(slots, state)}
    except Exception as err:  # noqa: BLE001 - any unreadable content means: start afresh, once, loudly
        warnings.warn(f"{type(module).__name__}: Transformer Engine extra state could not be read ({err}); "
                      "the FP8 scales of this module restart from their initial values", UserWarning, stacklevel=3)
        return None


def _interleave(parts, groups: int) -> Tensor:
    """Rows of `parts` ([q,] k, v) regrouped per kv group: TE's interleaved fused-QKV layout."""
    return torch.cat([p.reshape(groups, -1, *p.shape[1:]) for p in parts], dim=1).reshape(-1, *parts[0].shape[1:])


def load_split_qkv_names(mha, state_dict, prefix, *_):
    """load_state_dict pre-hook of MultiheadAttention: TE's separate q/k/v parameters
    (fuse_qkv_params=False: query_weight, key_weight, value_weight and their biases) become
    te-core's fused weight, in the row order the module reads (interleaved per kv group when
    mha.qkv_weight_interleaved)."""
    for sub, (names, _) in _qkv_parts(mha).items():
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{sub}.{n}_{kind}" for n in names]
            if not all(k in state_dict for k in keys):
                continue  # te-core's own names, or an incomplete set that load_state_dict reports
            tensors = [state_dict.pop(k) for k in keys]
            fused = _interleave(tensors, mha.num_gqa_groups_per_partition) if mha.qkv_weight_interleaved else torch.cat(tensors)
            state_dict[f"{prefix}{sub}.{kind}"] = fused


def accept_te_norm_extra_state(module, state_dict, prefix, *_):
    """load_state_dict pre-hook of LayerNorm / RMSNorm: Transformer Engine's norms write an
    `_extra_state` entry (empty without FP8 state), which te-core's norms have no use for."""
    state = state_dict.get(prefix + "_extra_state")
    if isinstance(state, Tensor) and state.dtype == torch.uint8:
        del state_dict[prefix + "_extra_state"]
        if state.numel():
            warnings.warn(f"{type(module).__name__}: the checkpoint's Transformer Engine extra state is not used "
                          "(te-core's norms keep no FP8 state)", UserWarning, stacklevel=3)


def to_transformer_engine_state_dict(model) -> dict:
    """`model`'s state dict in the names Transformer Engine's modules of the same configuration
    load: q/k/v weights split where fuse_qkv_params=False. Extra state is written empty (TE's
    form for "no FP8 state"), so TE restarts the scales: TE reads its recipe state only from
    its own pickled objects."""
    from ..modules.multihead_attention import MultiheadAttention

    state = model.state_dict()
    for name in [k for k in state if k.endswith("_extra_state")]:
        state[name] = torch.empty(0, dtype=torch.uint8)
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, MultiheadAttention) and not module.fuse_qkv_params:
            _split_qkv(module, state, prefix)
    return state


def _qkv_parts(mha) -> dict:
    """{input projection's name: ((part names), (rows))} of a non-interleaved MultiheadAttention:
    the row blocks Transformer Engine keeps as separate parameters with fuse_qkv_params=False,
    for this rank's heads (all of them without tensor parallelism)."""
    from ..modules.multihead_attention import _input_proj_name

    h, g, d = mha.num_attention_heads_per_partition, mha.num_gqa_groups_per_partition, mha.kv_channels
    proj = _input_proj_name(mha.attention_type, mha.input_layernorm)
    if mha.attention_type == "self":
        return {proj: (("query", "key", "value"), (h * d, g * d, g * d))}
    parts = {"key_value": (("key", "value"), (g * d, g * d))}
    if proj != "query_layer":  # TE's plain cross-attention query projection keeps the name "weight"
        parts[proj] = (("query",), (h * d,))
    return parts


def _split_qkv(mha, state: dict, prefix: str, plain_only: bool = False) -> None:
    """Replace `state`'s fused q/k/v entries of `mha` by TE's per-part names, in place and in
    order; the parts are views of the fused tensor. `plain_only`: only plain tensors (see
    save_split_qkv_names)."""
    splits = {}
    for sub, (names, sizes) in _qkv_parts(mha).items():
        for kind in ("weight", "bias"):
            key = f"{prefix}{sub}.{kind}"
            fused = state.get(key)
            if fused is None or (plain_only and type(fused) is not torch.Tensor):
                continue
            splits[key] = [(f"{prefix}{sub}.{name}_{kind}", part) for name, part in zip(names, fused.split(sizes))]
    if not splits:
        return
    items = list(state.items())
    state.clear()
    for key, value in items:
        state.update(splits.get(key, ((key, value),)))


def expose_split_qkv_names(mha) -> None:
    """Give `mha`'s fused projections Transformer Engine's part names (fuse_qkv_params=False):
    `layernorm_qkv.query_weight` and the like read as row views of the fused weight, as the
    state dict names them (save_split_qkv_names), so code and tools that look a state dict's
    names up as attributes (torch.distributed.checkpoint's state-dict functions) find them."""
    for sub, (names, sizes) in _qkv_parts(mha).items():
        getattr(mha, sub).expose_row_views(tuple(zip(names, sizes)))


def save_split_qkv_names(mha, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook of MultiheadAttention with fuse_qkv_params=False: the q, k and v
    weights and biases under Transformer Engine's names (query_weight, key_weight, value_weight,
    query_bias, ...), as views of te-core's fused parameter, so that code written for TE's state
    dict (its Hugging Face loading recipes write `state_dict()[...query_weight].data[:]`) reads
    and writes the module's weights. Only plain tensors are split: `keep_vars=True` (the
    Parameters themselves), FP8 primary weights and sharded (DTensor) weights keep the fused
    name, as `named_parameters()` does. load_split_qkv_names reads both forms back."""
    _split_qkv(mha, state_dict, prefix, plain_only=True)
