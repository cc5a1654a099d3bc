"""QuantizedModule: the base of te_core modules that run GEMMs under te_core.autocast.

It resolves device / params_dtype defaults, owns the module's quantization state (created from
the active recipe on first use), hands each forward a QuantizationStep, and stores the state as
checkpoint-safe extra state (tensors and plain values only).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
from torch import Tensor, nn

from ..quantization.autocast import get_autocast_context, model_init_recipe
from ..quantization.roles import QuantizerSlot
from ..quantization.state import RecipeState, check_compatible, extra_state
from ..quantization.step import HIGH_PRECISION, CalibrationStep, QuantizationStep
from ..quantization.tensor import QuantizedTensor
from ..recipe import recipe_from_config
from ._common import resolve_device, resolve_params_dtype

class QuantizedModule(nn.Module):
    """Base for modules whose GEMMs follow te_core.autocast. Subclasses declare their quantizer
    slots, call `quantization_step(is_first_microbatch)` once per forward and pass the step to
    their autograd Function (see te_core/modules/linear.py)."""

    def __init__(self, slots: Sequence[QuantizerSlot], *, device=None, params_dtype=None):
        super().__init__()
        self.device = resolve_device(device)
        self.params_dtype = resolve_params_dtype(params_dtype)
        self._quantizer_slots = tuple(slots)
        self._recipe_state: Optional[RecipeState] = None
        self._state_from_checkpoint = False
        self._weight_cache: Dict[str, QuantizedTensor] = {}

    # ------------------------------------------------------------------ per forward
    def quantization_step(self, is_first_microbatch: Optional[bool] = None):
        """The step this forward runs with: FP8 under autocast(enabled=True), calibration under
        autocast(calibrating=True), plain high precision otherwise."""
        context = get_autocast_context()
        if context is None or not (context.enabled or context.calibrating):
            return HIGH_PRECISION
        state = self._state_for(context.recipe)
        state.follow_device(self._state_device())
        if context.enabled:
            return QuantizationStep(state, context, is_first_microbatch, self._weight_cache)
        return CalibrationStep(state, context, is_first_microbatch)

    def _state_device(self) -> torch.device:
        for param in self._parameters.values():  # (not self.parameters(): this runs every step)
            if param is not None:
                return param.device
        return self.device

    def _state_for(self, recipe) -> RecipeState:
        state = self._recipe_state
        if state is not None and state.recipe is recipe:
            return state
        if state is not None and self._state_from_checkpoint:
            check_compatible(recipe, state.recipe, where=type(self).__name__)
            state.rebind(recipe)
        elif state is None or state.recipe != recipe:
            state = recipe.make_state(self._quantizer_slots, self._state_device())
            self._weight_cache.clear()
        else:
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

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # Quantized primary weights are saved dequantized: a plain tensor loads with weights_only=True
        # and on any backend; loading requantizes it (QuantizedTensor.copy_).
        for name, param in self._parameters.items():
            if isinstance(param, QuantizedTensor) and prefix + name in destination:
                destination[prefix + name] = param.dequantize().detach()

    # ------------------------------------------------------------------ state and checkpoints
    def quantization_state(self) -> Dict[str, Dict[str, Dict[str, Tensor]]]:
        """{"forward"|"backward": {slot: {"scale": (1,), "amax_history": (L,)}}}: live views of the
        delayed-scaling state; empty dicts for recipes that keep no state (current, block, MXFP8)."""
        if self._recipe_state is None:
            return {"forward": {}, "backward": {}}
        return self._recipe_state.quantization_state()

    def get_extra_state(self) -> Optional[dict]:
        return extra_state(self._recipe_state)

    def set_extra_state(self, state) -> None:
        if state is None:
            return
        if not isinstance(state, dict) or "recipe" not in state or "quantization_state" not in state:
            raise ValueError(f"{type(self).__name__}: unrecognised extra state {type(state).__name__}; expected the "
                             "dict written by te_core (keys 'recipe' and 'quantization_state')")
        saved_recipe = recipe_from_config(state["recipe"])
        if self._recipe_state is not None:
            check_compatible(self._recipe_state.recipe, saved_recipe, where=f"loading {type(self).__name__}")
            target = self._recipe_state
        else:
            target = saved_recipe.make_state(self._quantizer_slots, self._state_device())
            self._state_from_checkpoint = True
        target.load_quantization_state(state["quantization_state"])
        self._recipe_state = target
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
