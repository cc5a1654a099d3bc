"""QuantizedModule: the base of te_core modules that run GEMMs under te_core.autocast.

It resolves device / params_dtype defaults, owns the module's quantization state (created from
the active recipe on first use), hands each forward a QuantizationStep, and stores the state as
checkpoint-safe extra state (tensors and plain values only).
"""
from __future__ import annotations

import io
import threading
import warnings
import weakref
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor, nn

from .._tracing import run_while_tracing
from ..quantization import extra_state as extra_state_bytes
from ..quantization import high_precision_init, tensor_pickle
from ..quantization.autocast import get_autocast_context, model_init_preserves_high_precision, model_init_recipe
from ..quantization.roles import QuantizerSlot
from ..quantization.state import RecipeState, describe, extra_state, same_kind
from ..quantization.step import HIGH_PRECISION, CalibrationStep, QuantizationStep
from ..quantization.tensor import QuantizedTensor
from ..quantization.weight_refresh import refresh_gate
from .._recipe_objects import callable_for, remember_config
from .._sharded import local_tensor, sharded_like
from ..recipe import config_from_text, recipe_from_config
from ._common import check_optional_bool, resolve_device, resolve_params_dtype
from ._microbatch import first_microbatch, forced_first_microbatch_active
from ._reset import DeferredInit
from ._te_base import TransformerEngineBaseModule

_STATE_IN_GRAPH = (
    "{module}: torch.compile is tracing the first use of {recipe}, whose amax histories and scales a compiled "
    "graph updates in place (the backward's after the forward has returned), so they must exist before the graph "
    "is built, and could not be made before tracing. Call te_core.init_quantization_state(model, recipe) before "
    "the first compiled call.")

_RECOMPUTED_OUTSIDE_AUTOCAST = (
    "{module} ran under te.autocast in its forward and is now run again inside the backward pass without it: "
    "torch.utils.checkpoint (Hugging Face's gradient_checkpointing_enable() among its users) does not restore "
    "te.autocast, so the recompute would run in high precision and the gradients would not belong to the FP8 "
    "forward. Use te_core.checkpoint(function, *args) instead, or give torch.utils.checkpoint "
    "use_reentrant=False and context_fn=te_core.checkpoint_context (Hugging Face: activation_checkpointing_kwargs="
    "{{'use_reentrant': False, 'context_fn': te_core.checkpoint_context}}); both recompute with the forward's FP8 "
    "state.")


class _Recompute(threading.local):
    log = None  # the innermost checkpoint log (te_core/modules/checkpoint.py) active on this thread


RECOMPUTE = _Recompute()

GRAD_PROXIES = "_fp8_grad_proxies"  # the module attribute holding its FP8 weights' stand-ins (_grad_proxy)
_QUANTIZER_LINKS = "_quantizer_links"  # a pickled module's (tensor, quantizer) pairs (tensor_pickle.relink)

_LIVE = weakref.WeakValueDictionary()  # id -> QuantizedModule, for _prepare_untraced
_UNTRACED = [False]  # True while _prepare_untraced runs


def _refuse_traced_fp8_weight_training(module: nn.Module) -> None:
    """A compiled graph reads an FP8 primary weight (te.quantized_model_init) through its data
    and scale tensors, so the weight gets a gradient only from modules that route it through a
    stand-in (_grad_proxy); training it through any other module would be silently wrong."""
    if type(module)._routes_fp8_weight_grads or not torch.is_grad_enabled():
        return
    for name, param in module._parameters.items():
        if isinstance(param, QuantizedTensor) and param.requires_grad:
            raise NotImplementedError(
                f"torch.compile cannot train {type(module).__name__}.{name}, an FP8 primary weight made under "
                "te.quantized_model_init: the compiled graph would give it no gradient. Train it eagerly or "
                "graph-captured (te.make_graphed_callables), or compile under torch.no_grad() for inference")


def _equal_recipes(a, b) -> bool:
    """a == b, by their fields' text where both have one (Recipe._te_config: every field, and the
    callables by identity): traced, comparing the fields one by one would add a guard per field
    per module, each checked on every call of the compiled function."""
    text_a, text_b = a._te_config, b._te_config
    if text_a is not None and text_b is not None:
        return type(a) is type(b) and text_a == text_b
    return a == b


@run_while_tracing
def _prepare_untraced(module_id: int, recipe_config: dict, qfactory=None) -> bool:
    """Create a module's state for the recipe described by `recipe_config` (or move it to the
    module's device, or bind it to a recipe of other fields) unless it is ready. torch.compile runs
    this while tracing instead of tracing it, so delayed scaling's histories exist before the
    graph (which updates them in place) is built, and a new recipe of the same kind (another
    margin, an assigned field) rebinds the state here, not inside the graph; the traced forward
    uses it as made for an equal recipe (new_quantization_step). `qfactory`: a CustomRecipe's,
    which its config names only and without which it cannot be rebuilt."""
    return _prepare(module_id, recipe_config, {} if qfactory is None else {"qfactory": qfactory})


@run_while_tracing
def _prepare_untraced_text(module_id: int, config_text: str) -> bool:
    """_prepare_untraced for a recipe made outside the trace, by the text of its fields
    (Recipe._te_config): constant while tracing, where the fields themselves may be symbolic."""
    config, callable_keys = config_from_text(config_text)
    callables = {name: callable_for(key) for name, key in callable_keys.items()}
    return _prepare(module_id, config, {name: f for name, f in callables.items() if f is not None})


def _prepare(module_id: int, config: dict, callables: dict) -> bool:
    module = _LIVE.get(module_id)
    # the recipe's own callables (to_config names them only), so that the state made here is the
    # traced recipe's equal and the traced forward keeps it (a CustomRecipe's qfactory: the
    # recipe itself); without them (a recipe made in the trace), a callable recorded by name
    # counts as the same and the traced forward binds the state to the recipe that carries it
    recipe = recipe_from_config(config, callables)
    remember_config(recipe, untraced=True)  # (its text: what the traced forward compares, _equal_recipes)
    state = None if module is None else module._recipe_state
    stale = state is None or not state.carries_over_to(recipe) or any(
        group.device != module._state_device() for group in state.scaling_groups().values())
    stale = stale or state.recipe.to_config() != config or any(  # made for a recipe of other fields
        getattr(state.recipe, name) is not getattr(recipe, name) for name in callables)
    if module is not None and stale:
        _UNTRACED[0] = True  # is_compiling() answers True in here too
        try:
            init_quantization_state(module, recipe)
        finally:
            _UNTRACED[0] = False
    if module is not None and module._recipe_state is not None:
        for group in module._recipe_state.scaling_groups().values():
            group._updated_in_graphs = True  # see ScalingGroup: eager casts stop trusting the version counter
    return True


def init_quantization_state(model: nn.Module, recipe) -> None:
    """Create the quantization state of every te_core module in `model` for `recipe` now, as
    the first forward under te_core.autocast(recipe=recipe) would: what torch.compile needs
    before its first trace with a recipe that keeps state (DelayedScaling); tracing does it by
    itself (_prepare_untraced). The state's tensors are marked as static inputs, so CUDA graphs
    capture their in-place updates. Unlike a state made by an eager forward, whose first casts
    take their scales from their tensors (QuantizationStep.first_scale), a state made here starts
    from scale 1, as Transformer Engine's and a compiled graph's do."""
    from torch._dynamo import mark_static_address

    from ..quantization.autocast import _check_recipe

    recipe = _check_recipe(recipe, "init_quantization_state")
    for module in model.modules():
        if isinstance(module, QuantizedModule):
            state = module._state_for(recipe)
            state.follow_device(module._state_device())
            for group in state.scaling_groups().values():
                # A graph cannot branch on which casts come first without recompiling: a state made
                # here starts from scale 1 as Transformer Engine's does (see QuantizationStep.first_scale).
                group.settle()
                # fixed addresses: CUDA graphs (mode="reduce-overhead") replay their in-place updates
                mark_static_address(group.amax_history)
                mark_static_address(group.scale)


class QuantizedModule(DeferredInit, TransformerEngineBaseModule):
    """Base for modules whose GEMMs follow te_core.autocast. Subclasses declare their quantizer
    slots, call `quantization_step(is_first_microbatch)` once per forward and pass the step to
    their autograd Function (see te_core/modules/linear.py)."""

    # whether the module hands its FP8 primary weights' stand-ins (_grad_proxy) to its autograd
    # Function, so that torch.compile can train them
    _routes_fp8_weight_grads = False

    def __init__(self, slots: Sequence[QuantizerSlot], *, device=None, params_dtype=None):
        super().__init__()
        self.device = resolve_device(device)
        self.params_dtype = resolve_params_dtype(params_dtype)
        self._quantizer_slots = tuple(slots)
        self._recipe_state: Optional[RecipeState] = None
        self._state_from_checkpoint = False
        self._weight_cache: Dict[str, QuantizedTensor] = {}
        self._fp8_forward = False  # whether the last forward outside a backward pass ran under FP8 autocast
        # quantized_model_init: {parameter name: quantizer slot} of the FP8 primary weights, and
        # (its recipe, preserve_high_precision_init_val), which reset_parameters quantizes them by again
        self._fp8_primary: Dict[str, str] = {}
        self._fp8_init = None
        _LIVE[id(self)] = self

    def __getstate__(self) -> dict:
        # a copy (deepcopy, pickle) leaves out the FP8 weights' gradient stand-ins (_grad_proxy):
        # their hooks feed this module's weights, and the copy makes its own when compiled
        state = super().__getstate__()  # (a copy of __dict__: popping from it leaves the module alone)
        state.pop(GRAD_PROXIES, None)
        # a quantized tensor pickles a copy of its quantizer (tensor_pickle): the copy gives its
        # tensors back the very quantizers they hold, which its scaling state holds too
        held = (*self._parameters.values(), *self._buffers.values(), *state.get("_weight_cache", {}).values())
        state[_QUANTIZER_LINKS] = tensor_pickle.quantizer_links(held)
        return state

    def __setstate__(self, state) -> None:  # copies (deepcopy, pickle) bypass __init__
        state = dict(state)
        tensor_pickle.relink(state.pop(_QUANTIZER_LINKS, []))
        super().__setstate__(state)
        _LIVE[id(self)] = self

    def _apply(self, fn, recurse=True):
        # module.to(device) / to_empty(device=...) put a quantized parameter moved to another
        # device in a new Parameter (torch cannot swap a wrapper subclass's data in place): it
        # keeps the attributes set on the old one (Transformer Engine's and Megatron-LM's
        # tensor-parallel ones, the preserved high-precision value)
        before = dict(self._parameters)
        module = super()._apply(_keeping_fp8_data(fn), recurse)
        for name, old in before.items():
            new = self._parameters.get(name)
            if old is not None and new is not None and new is not old:
                _carry_attributes(old, new)
        return module

    # ------------------------------------------------------------------ per forward
    def quantization_step(self, is_first_microbatch: Optional[bool] = None):
        """The step this forward runs with: FP8 under autocast(enabled=True), calibration under
        autocast(calibrating=True), plain high precision otherwise; inside an activation
        checkpoint (te_core.checkpoint_context), the step its log records or replays."""
        # every forward passes here: identity tests first, the full check only for a value that fails them
        if is_first_microbatch is not None and is_first_microbatch is not True and is_first_microbatch is not False:
            is_first_microbatch = check_optional_bool(is_first_microbatch, name="is_first_microbatch",
                                                      module=type(self).__name__)
        if not torch.compiler.is_compiling():
            log = RECOMPUTE.log
            if log is not None:
                return log.step(self, is_first_microbatch)
        return self.new_quantization_step(is_first_microbatch)

    def new_quantization_step(self, is_first_microbatch: Optional[bool] = None):
        """quantization_step as the autocast context decides it, with no checkpoint log consulted."""
        context = get_autocast_context()
        if context is None or not (context.enabled or context.calibrating):
            if not torch.compiler.is_compiling() and self._fp8_forward:  # (a graph neither reads nor writes it)
                self._check_not_recomputed_outside_autocast()
            return HIGH_PRECISION
        is_first_microbatch = first_microbatch(is_first_microbatch)  # a graph capture's, when forced
        if torch.compiler.is_compiling():
            _refuse_traced_fp8_weight_training(self)
            text = context.recipe._te_config  # (a recipe made outside the trace: see Recipe._te_config)
            if text is not None:
                _prepare_untraced_text(id(self), text)
            else:
                _prepare_untraced(id(self), context.recipe.to_config(), getattr(context.recipe, "qfactory", None))
        else:
            self._fp8_forward = True
            self.__dict__["_fp8_modes"] = (context.enabled, context.calibrating)  # (fp8, fp8_calibration)
        state = self._recipe_state
        recipe = context.recipe
        if state is None or state.recipe is not recipe or state.version != recipe._te_version:  # (_state_for's test)
            # Traced, a state made for an equal recipe (_prepare_untraced's) is kept as it is: binding
            # it to this recipe object would mutate module state inside the graph, which a graph
            # region (an activation checkpoint's) cannot hold. A CustomRecipe's is always _prepare's:
            # its factory runs untraced only (dynamo builds no QuantizerRole), and one made in the
            # trace (a lambda, a partial) reaches _prepare as an equal copy, never the same object.
            if not (torch.compiler.is_compiling() and state is not None and state.recipe is not recipe
                    and (_equal_recipes(state.recipe, recipe) or recipe.custom())):
                state = self._state_for(recipe)
        # traced, _prepare (run untraced) has moved the state already, and reading each group's
        # device here would put a guard on it for every call
        if not torch.compiler.is_compiling():
            state.follow_device(self._state_device())
        if context.enabled:
            # a caller's own capture with a weight-refresh flag set (not make_graphed_callables' forced variants)
            flag = refresh_gate()
            if flag is not None and forced_first_microbatch_active():
                flag = None
            return QuantizationStep(state, context, is_first_microbatch, self._weight_cache, flag)
        return CalibrationStep(state, context, is_first_microbatch)

    def _check_not_recomputed_outside_autocast(self) -> None:
        """After a forward under te.autocast, a forward without it inside a backward pass is an
        activation recompute that lost the autocast: an error. Outside a backward, the module
        simply runs in high precision from now on."""
        if torch._C._current_graph_task_id() != -1:
            raise RuntimeError(_RECOMPUTED_OUTSIDE_AUTOCAST.format(module=type(self).__name__))
        self._fp8_forward = False

    def _owned_slots(self) -> tuple:
        """The slots, each carrying this module's name= (set after the slots are declared), for the
        recipe state: a CustomRecipe factory gets it as QuantizerRole.name, as in Transformer Engine."""
        owner = getattr(self, "name", None) or ""
        return tuple(slot._replace(owner=owner) for slot in self._quantizer_slots)

    def _state_device(self) -> torch.device:
        for param in self._parameters.values():  # (not self.parameters(): this runs every step)
            if param is not None:
                return param.device
        return self.device

    def _state_for(self, recipe) -> RecipeState:
        state = self._recipe_state
        if state is not None and state.recipe is recipe and state.version == recipe._te_version:
            return state
        if state is not None and self._state_from_checkpoint and same_kind(recipe, state.recipe):
            saved = state.recipe
            state.rebind(recipe)
            if saved.compatible_key() != recipe.compatible_key():
                _warn_format_change(type(self).__name__, saved, recipe, state.rescale_for_format(saved), stacklevel=5)
                self._weight_cache.clear()
        elif state is None or not state.carries_over_to(recipe):
            # (a checkpoint's state under a recipe of another kind too: its scales mean nothing there)
            if state is not None:
                _warn_recipe_type_change(type(self).__name__, state.recipe, recipe)
            state = recipe.make_state(self._owned_slots(), self._state_device())
            if state.scaling_groups() and torch.compiler.is_compiling() and not _UNTRACED[0]:
                raise RuntimeError(_STATE_IN_GRAPH.format(module=type(self).__name__, recipe=type(recipe).__name__))
            self._weight_cache.clear()
        else:
            if state.recipe != recipe or state.version != recipe._te_version:  # weights cached under another
                self._weight_cache.clear()
                if self.__dict__.get("_fp8_primary") and not torch.compiler.is_compiling():
                    warnings.warn(_PRIMARY_QUANTIZER_UPDATED.format(module=type(self).__name__, old=state.recipe,
                                                                    new=recipe), UserWarning, stacklevel=4)
            state.rebind(recipe)
        self._recipe_state = state
        self._state_from_checkpoint = False
        return state

    # ------------------------------------------------------------------ quantized_model_init
    def primary_weight_quantizer(self, slot: str):
        """Under quantized_model_init: the quantizer to store weight `slot` with, else None."""
        recipe = model_init_recipe()
        if recipe is None:
            return None
        return self._state_for(recipe).quantizer(slot)

    def note_primary_weights(self, **slots: str) -> bool:
        """Under quantized_model_init: record parameters (name=slot) as FP8 primary weights, which
        the module's initialization (_reset.resetting) then quantizes, now and at each
        reset_parameters(); False (nothing recorded) outside it."""
        recipe = model_init_recipe()
        if recipe is None:
            return False
        self._fp8_init = (recipe, model_init_preserves_high_precision())
        self.__dict__.setdefault("_fp8_primary", {}).update(slots)
        return True

    def holds_primary_fp8_weights(self) -> bool:
        """Whether weights were made under quantized_model_init (kept only in quantized form)."""
        return bool(self.__dict__.get("_fp8_primary"))

    def preserves_high_precision_init_val(self) -> bool:
        init = self.__dict__.get("_fp8_init")
        return bool(init and init[1])

    def quantize_primary_weight(self, name: str, value: Tensor, current=None) -> QuantizedTensor:
        """`value` (the initial value of FP8 primary weight `name`) quantized as construction
        quantizes it: by the quantizer of its slot in the state of the quantized_model_init recipe,
        that state on value's device (a state made on meta starts afresh there: ScalingGroup.to_device).
        `current`: the parameter's present quantized tensor, whose quantizer serves a module that
        recorded no slot (one unpickled from an older te-core)."""
        slot = self.__dict__.get("_fp8_primary", {}).get(name)
        init = self.__dict__.get("_fp8_init")
        if slot is None or init is None:
            quantizer = getattr(current, "_quantizer", None)
            quantizer = getattr(quantizer, "inner", quantizer)  # an FSDP2 shard's (te_core.distributed.fsdp)
            if quantizer is None:
                raise RuntimeError(f"{type(self).__name__}.{name}: no quantizer to quantize this FP8 weight with")
            return quantizer.quantize_primary(value)
        state = self._state_for(init[0])
        state.follow_device(value.device)
        return state.quantizer(slot).quantize_primary(value)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:  # the parameters themselves, as torch promises: callers map state to them by identity
            return
        # Quantized primary weights are saved dequantized: a plain tensor loads with weights_only=True
        # and on any backend; loading requantizes it (QuantizedTensor.copy_). An FSDP2 shard of one
        # is saved as a DTensor over its dequantized shard, which torch.distributed.checkpoint writes
        # as any high-precision parameter (it would pickle the quantized shard with its quantizer).
        for name, param in self._parameters.items():
            local = local_tensor(param)
            if isinstance(local, QuantizedTensor) and prefix + name in destination:
                destination[prefix + name] = sharded_like(param, local.dequantize().detach())

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        errors = len(error_msgs)
        # FP8 primary weights, whole or as FSDP2 shards (a DTensor over a quantized local tensor)
        quantized = {name: p for name, p in self._parameters.items() if isinstance(local_tensor(p), QuantizedTensor)}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if len(error_msgs) != errors:
            return
        for name, old in quantized.items():
            value = state_dict.get(prefix + name)
            param = self._parameters.get(name)
            if not isinstance(value, Tensor):
                continue
            if param is not old:  # assign=True put the loaded value in a parameter of its own
                if old is local_tensor(old) and not (isinstance(param, QuantizedTensor) and type(param) is type(old)):
                    self._assign_primary_weight(name, old, value, prefix, error_msgs)
                continue
            # copy_ requantized the weight (or this rank's shard of it) with this module's scale of
            # before; a delayed scale from a fresh init can saturate trained values, so such a
            # quantizer casts it again with the scale the checkpoint's extra state has restored
            value, weight = local_tensor(value), local_tensor(old)
            if weight._quantizer is None or isinstance(value, QuantizedTensor):
                continue  # (a quantized value's bytes and scale were copied as they are)
            with torch.no_grad():
                fresh = weight._quantizer.load_primary(value.detach().to(weight.device, weight.dtype)
                                                       .reshape(weight.shape))
            if fresh is not None:
                weight._take_payload(fresh)
                self._weight_cache.clear()

    def _assign_primary_weight(self, name: str, old: QuantizedTensor, value: Tensor, prefix: str,
                               error_msgs) -> None:
        """load_state_dict(assign=True) of FP8 primary weight `name`: the loaded value (on its
        device, in its dtype, as assign takes it) quantized as a load into the weight in place
        would (_quantized_like: load_primary, else the weight's quantizer), in a new parameter
        that trains as the old one did; Transformer Engine's state dict holds the FP8 tensor, which
        assign keeps FP8."""
        try:
            with torch.no_grad():
                quantized = old._quantized_like(value)  # (torch checked the shape)
        except (RuntimeError, TypeError) as err:
            error_msgs.append(f"While assigning the FP8 primary weight named \"{prefix + name}\": {err}")
            return
        new = nn.Parameter(quantized, requires_grad=old.requires_grad)
        _carry_attributes(old, new)  # (as the load in place keeps them)
        self._parameters[name] = new
        self._weight_cache.clear()

    # ------------------------------------------------------------------ state and checkpoints
    def quantization_state(self) -> Dict[str, Dict[str, Dict[str, Tensor]]]:
        """{"forward"|"backward": {slot: {"scale": (1,), "amax_history": (L,)}}}: live views of the
        delayed-scaling state; empty dicts for recipes that keep no state (current, block, MXFP8)."""
        if self._recipe_state is None:
            return {"forward": {}, "backward": {}}
        return self._recipe_state.quantization_state()

    def get_extra_state(self) -> Tensor:
        """Transformer Engine's form: a uint8 tensor, empty without scaling state (extra_state.py)."""
        return extra_state_bytes.encode(extra_state(self._recipe_state), self._quantizer_slots)

    def set_extra_state(self, state) -> None:
        from ..compat.te_checkpoint import is_te_tensor_form

        state = extra_state_bytes.from_text(state)  # (te_core.distributed.state_dict's form)
        self.__dict__.pop("_fp8_meta_recipe", None)  # (a recipe written to fp8_meta for this load: _te_base)
        if extra_state_bytes.is_encoded(state):
            state = extra_state_bytes.decode(state, type(self).__name__, self._quantizer_slots)
        elif is_te_tensor_form(state):  # Transformer Engine's serialized form
            from ..compat.te_checkpoint import te_extra_state

            state = te_extra_state(self, state)
        elif isinstance(state, io.BytesIO):  # Transformer Engine 1.x's default form
            from ..compat.te_checkpoint import te_bytesio_extra_state

            state = te_bytesio_extra_state(self, state)
        if state is None:
            return
        if not isinstance(state, dict) or "recipe" not in state or "quantization_state" not in state:
            from ..compat.te_checkpoint import unrecognised_extra_state

            raise ValueError(unrecognised_extra_state(type(self).__name__, state))
        for key in ("recipe", "quantization_state"):
            if not isinstance(state[key], dict):
                raise ValueError(f"{type(self).__name__}: extra state entry {key!r} is a {type(state[key]).__name__}, "
                                 "expected the dict te_core writes; the checkpoint is corrupt. Drop the module's "
                                 "'_extra_state' entry from the state dict to start its scaling state afresh.")
        saved_recipe = recipe_from_config(state["recipe"])
        current = self._recipe_state
        if current is not None and same_kind(current.recipe, saved_recipe):
            current.follow_device(self._state_device())  # (one made on meta takes no values)
            current.load_quantization_state(state["quantization_state"], state.get("fresh"), state.get("init_scaled"))
            if current.recipe.compatible_key() != saved_recipe.compatible_key():
                _warn_format_change(type(self).__name__, saved_recipe, current.recipe,
                                    current.rescale_for_format(saved_recipe), stacklevel=4)
        else:
            # Another kind of recipe's state (or none) gives way to the checkpoint's, as Transformer
            # Engine's load installs the saved recipe: running under that recipe resumes it, under
            # another kind the module drops it with the recipe-change warning (_state_for).
            current = saved_recipe.make_state(self._owned_slots(), self._state_device())
            current.load_quantization_state(state["quantization_state"], state.get("fresh"), state.get("init_scaled"))
            self._state_from_checkpoint = True
        self._recipe_state = current
        self._weight_cache.clear()


class QuantizedContainer(nn.Module):
    """Base of modules made of quantized submodules (MultiheadAttention, TransformerLayer)."""

    def quantization_state(self) -> Dict[str, Dict[str, Dict[str, Tensor]]]:
        """Every quantized submodule's slots, keyed "<submodule path>.<slot>" per direction
        (e.g. "layernorm_mlp.fc1_input")."""
        merged: Dict[str, Dict[str, Dict[str, Tensor]]] = {"forward": {}, "backward": {}}
        for path, child in self.named_modules():
            if child is self or not isinstance(child, QuantizedModule):
                continue
            for direction, slots in child.quantization_state().items():
                for slot, state in slots.items():
                    merged[direction][f"{path}.{slot}"] = state
        return merged


# Transformer Engine warns on both changes with these words (its tests match them); te-core says
# what the change does to the module.
_PRIMARY_QUANTIZER_UPDATED = (
    "Quantizer is being updated, this may affect model behavior: {module}'s FP8 primary weights were "
    "quantized under {old!r} and now follow {new!r} (same kind of recipe: the scaling state is kept and "
    "adapted, the stored FP8 values are not recomputed)")


def _warn_recipe_type_change(module: str, old, new) -> None:
    """Transformer Engine's warning when a module's recipe changes kind (neither class derives
    from the other): the module's quantization state for the old recipe (amax histories,
    scales) is dropped and a new one made."""
    if torch.compiler.is_compiling() or isinstance(new, type(old)) or isinstance(old, type(new)):
        return
    warnings.warn(f"Recipe type changed from {type(old).__name__} to {type(new).__name__}. This may affect model "
                  f"behavior: {module} drops its quantization state for {type(old).__name__} (amax histories, "
                  f"scales) and starts a new one for {type(new).__name__}", UserWarning, stacklevel=5)


def _carry_attributes(old: Tensor, new: Tensor) -> None:
    """A parameter replaced by a new one (moved to another device, assigned by a load) keeps the
    attributes set on the old one: Transformer Engine's and Megatron-LM's tensor-parallel ones,
    the user's, and the preserved high-precision value."""
    for key, value in old.__dict__.items():
        if not key.startswith("_"):
            new.__dict__.setdefault(key, value)
    high_precision_init.carry_over(old, new)


def _warn_format_change(module: str, saved, new, rescaled, stacklevel: int) -> None:
    """A checkpoint's delayed-scaling state now serves a recipe of the same kind in another FP8
    format: the histories are kept, the scales that belong to the old format recomputed."""
    if torch.compiler.is_compiling():
        return
    roles = ", ".join(rescaled) or "no"
    warnings.warn(f"{module}: its FP8 scaling state was loaded from a checkpoint made with {describe(saved)} and "
                  f"now serves {describe(new)}; the amax histories are kept and the scales of the {roles} tensors "
                  f"are recomputed from them for the new format", UserWarning, stacklevel=stacklevel)


def _keeping_fp8_data(fn):
    """module._apply's fn, except that a quantized parameter converted to another floating dtype
    on its own device (module.half(), module.to(torch.bfloat16)) becomes a tensor of its kind
    with the same FP8 data and scales and the new nominal dtype: fn would dequantize it, and the
    parameter would quantize the rounded values again, with a scale from their rounded amax
    (every value moved by up to a rounding step of the new dtype). What fn does is read off its
    result on an empty tensor of the parameter's dtype and device."""
    def apply(t):
        if isinstance(t, QuantizedTensor):
            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
            if (isinstance(probe, Tensor) and probe.device == t.device and probe.dtype != t.dtype
                    and probe.dtype.is_floating_point):
                return t.with_nominal_dtype(probe.dtype)
        return fn(t)
    return apply
