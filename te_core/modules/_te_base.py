"""TransformerEngineBaseModule: Transformer Engine's base class of its GEMM modules and of
DotProductAttention, which te-core's counterparts derive from as well.

Code ported from Transformer Engine (Megatron-LM's FSDP and CUDA-graph code, among others) finds
TE's modules in a model by `isinstance(m, TransformerEngineBaseModule)` and then reads a few of
their members. te-core keeps its quantization state elsewhere (QuantizedModule: a recipe state made
from te.autocast's recipe on first use), so the members here are read-only views of that state
under TE's names; only the ones such code reads are provided.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator, NamedTuple, Optional

from torch import nn

from ..quantization.roles import FORWARD
from ._quantizer_roles import check_module_arguments

_FP8_META_READ_ONLY = (
    "{module}.fp8_meta is a read-only view in te-core (but for 'recipe', before a checkpoint load, and 'fp8_group' "
    "set to the active te.autocast's amax_reduction_group, which it reads already): its modules "
    "take the recipe and the amax reduction group from te.autocast(recipe=..., amax_reduction_group=...) at each "
    "forward, and keep their scaling state in the module (quantization_state(), saved as its extra state), not in "
    "fp8_meta. Run the forward under te.autocast with the recipe and group wanted instead of assigning "
    "fp8_meta[{key!r}]")


class ParameterInitMeta(NamedTuple):
    """What Transformer Engine records of a parameter at registration, as far as callers read it:
    `fp8_meta_index` is the position of the weight's quantizer among the module's forward
    quantizers when the parameter is an FP8 primary weight (te.quantized_model_init), else None."""

    fp8_meta_index: Optional[int]


class FP8MetaView(Mapping):
    """A module's `fp8_meta`: "recipe" (the recipe its quantization state serves, else the one it
    was made under by quantized_model_init, else the active autocast's, else TE's default
    DelayedScaling()), "fp8_checkpoint" (whether it holds scaling state that its extra state saves)
    and "fp8_group" (the active autocast's amax reduction group, None outside autocast).

    Only "recipe" takes a write, as the recipe of extra state about to be loaded: Megatron-LM's
    TEGroupedLinear, merging its per-expert checkpoint entries, assigns the saved recipe (te-core's
    config dict, or a recipe) and reads it back for the amax history length and for the merged
    entry. It reads back until the module loads extra state or its quantization state changes."""

    _KEYS = ("recipe", "fp8_checkpoint", "fp8_group")

    def __init__(self, module: nn.Module):
        self._module = module

    def __getitem__(self, key: str) -> Any:
        if key not in self._KEYS:
            raise KeyError(f"{type(self._module).__name__}.fp8_meta has no {key!r} in te-core: it holds only "
                           f"{', '.join(self._KEYS)} (te-core keeps scaling state in the module: quantization_state())")
        return getattr(self, "_" + key)()

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)

    @property
    def module(self) -> nn.Module:
        """The module this view reads."""
        return self._module

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "fp8_group" and self._is_active_group(value):
            return  # (what the view reads already: Megatron-LM's graph replays write it before each replay)
        if key != "recipe":
            raise TypeError(_FP8_META_READ_ONLY.format(module=type(self._module).__name__, key=key))
        from ..recipe import Recipe, recipe_from_config

        if isinstance(value, dict):  # (te-core's extra state holds its recipe's config)
            value = recipe_from_config(value)
        if not isinstance(value, Recipe):
            raise TypeError(f"{type(self._module).__name__}.fp8_meta['recipe'] takes a recipe (te.recipe."
                            "DelayedScaling, ...) or the recipe config of te-core's extra state, got "
                            f"{type(value).__name__}")
        state = getattr(self._module, "_recipe_state", None)
        self._module.__dict__["_fp8_meta_recipe"] = (value, state)

    def __delitem__(self, key: str) -> None:
        raise TypeError(_FP8_META_READ_ONLY.format(module=type(self._module).__name__, key=key))

    def _recipe(self):
        from ..quantization.autocast import get_autocast_context
        from ..recipe import DelayedScaling

        state = getattr(self._module, "_recipe_state", None)
        written, state_then = self._module.__dict__.get("_fp8_meta_recipe", (None, None))
        if written is not None and state_then is state:
            return written
        if state is not None:
            return state.recipe
        init = self._module.__dict__.get("_fp8_init")
        if init is not None:
            return init[0]
        context = get_autocast_context()
        return context.given if context is not None and context.given is not None else DelayedScaling()

    def _fp8_checkpoint(self) -> bool:
        state = getattr(self._module, "_recipe_state", None)
        return bool(state is not None and state.scaling_groups())

    @staticmethod
    def _is_active_group(value) -> bool:
        from ..quantization.autocast import get_autocast_context

        context = get_autocast_context()
        return context is not None and value is context.amax_reduction_group

    def _fp8_group(self):
        from ..quantization.autocast import get_autocast_context

        context = get_autocast_context()
        return None if context is None else context.amax_reduction_group


class TransformerEngineBaseModule(nn.Module):
    """The base of te-core's Linear, LayerNormLinear, LayerNormMLP, GroupedLinear and
    DotProductAttention, under Transformer Engine's name, with the members of TE's base class that
    ported code reads (set_tensor_parallel_group comes with each module's tensor-parallel mixin)."""

    @property
    def fp8_meta(self) -> FP8MetaView:
        return FP8MetaView(self)

    @property
    def fp8(self) -> bool:
        """Whether the module's last forward ran with FP8 on (te.autocast(enabled=True)), as
        Transformer Engine's attribute of that name; False before any."""
        return bool(self.__dict__.get("_fp8_forward")) and self.__dict__.get("_fp8_modes", (False, False))[0]

    @property
    def fp8_calibration(self) -> bool:
        """Whether the module's last forward ran under te.autocast(calibrating=True)."""
        return bool(self.__dict__.get("_fp8_forward")) and self.__dict__.get("_fp8_modes", (False, False))[1]

    @property
    def primary_weights_in_fp8(self) -> bool:
        """Whether the module's weights were made under te.quantized_model_init (kept in FP8)."""
        return bool(self.__dict__.get("_fp8_primary"))

    @property
    def param_init_meta(self) -> dict:
        """{parameter name: ParameterInitMeta} for the module's own parameters."""
        primary = self.__dict__.get("_fp8_primary", {})
        forward = [slot.name for slot in getattr(self, "_quantizer_slots", ()) if slot.role.direction == FORWARD]
        return {name: ParameterInitMeta(forward.index(primary[name]) if primary.get(name) in forward else None)
                for name in self._parameters}

    # the boundary roles a parent module may set (TE's attributes; GemmQuantizerRoles reports them)
    _output_quantizer_role = None
    _grad_input_quantizer_role = None

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int):
        """Transformer Engine's hook for a module's QuantizerRole per quantizer slot: None here
        (no explicit roles), as TE's base class answers; te-core's GEMM modules override it
        (GemmQuantizerRoles), and a subclass describing its own slots overrides it in turn."""
        check_module_arguments(self, fwd, num_quantizers)
        return None

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """Nothing to prepare in te-core (TE sets up its FP8 state here before a forward): a
        module makes its quantization state from te.autocast's recipe on first use."""
        expected = getattr(self, "num_gemms", 1)
        if not isinstance(num_gemms, int) or isinstance(num_gemms, bool) or num_gemms != expected:
            raise ValueError(f"{type(self).__name__}.init_fp8_metadata: num_gemms={num_gemms!r}, but the module "
                             f"runs {expected} GEMM(s); pass num_gemms={expected}")
