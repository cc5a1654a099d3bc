"""make_graphed_callables' arguments, in Transformer Engine 2.x's names and its older fp8_* ones,
turned into one GraphOptions or a clear error.

The fp8_* names (fp8_enabled, fp8_recipe, fp8_group, fp8_weight_caching, fp8_calibrating) still
work and warn, as in Transformer Engine; giving both spellings of one argument is an error.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from ._graph_order import capture_time_hooks
from ._graph_warmup import check_hook
from .quantization.autocast import _check_recipe
from .recipe import Recipe

# old name -> TE 2.x name
_RENAMED = {
    "fp8_enabled": "enabled", "fp8_calibrating": "calibrating", "fp8_recipe": "recipe",
    "fp8_group": "amax_reduction_group", "fp8_weight_caching": "cache_quantized_params",
}



@dataclass(frozen=True)
class GraphOptions:
    """enabled: FP8 per module; recipe: the one the graphs bake in (None without FP8 or
    calibration); amax_reduction_group: as te_core.autocast's; cache_quantized_params: weight
    caching."""

    enabled: Tuple[bool, ...]
    recipe: Optional[Recipe]
    amax_reduction_group: object
    cache_quantized_params: bool
    pool: object = None  # a graph memory pool handle to share with other graphs; None: a pool of their own
    clone_param_grads: bool = True  # replays hand autograd copies of the parameters' gradients
    pre_warmup_hook: Optional[Callable[[], None]] = None  # called before the first warm-up step, as in TE
    post_warmup_hook: Optional[Callable[[], None]] = None  # called after the last one
    order: Optional[list] = None  # TE's _order: the pipeline schedule captured (te_core._graph_order)
    layers_per_chunk: object = None  # TE's _num_layers_per_chunk
    reuse_buffers: bool = False  # TE's _reuse_graph_input_output_buffers
    retain_graph: bool = False  # TE's retain_graph_in_backward
    capture_time_hooks: Optional[list] = None  # per module, {point: {name: hook(module)}}, run outside capture
    calibrating: bool = False  # the graphs compute in high precision and record amaxes (te_core.autocast's)


def _pick(given: dict, old: str):
    """The value of TE 2.x's name for `old`, taken from either spelling."""
    new = _RENAMED[old]
    old_value, new_value = given.pop(old, None), given.pop(new, None)
    if old_value is None:
        return new_value
    if new_value is not None:
        raise ValueError(f"make_graphed_callables: {old} is the deprecated name of {new}; pass only {new}")
    warnings.warn(f"make_graphed_callables: {old} is deprecated; use {new}", DeprecationWarning, stacklevel=4)
    return old_value


def _enabled_per_module(enabled, n_modules: int) -> Tuple[bool, ...]:
    if enabled is None:
        return (False,) * n_modules
    if isinstance(enabled, bool):
        return (enabled,) * n_modules
    if isinstance(enabled, tuple) and all(isinstance(e, bool) for e in enabled):
        if len(enabled) != n_modules:
            raise ValueError(f"make_graphed_callables: enabled has {len(enabled)} entries for {n_modules} modules; "
                             "give one bool per module, or one bool for all")
        return enabled
    raise TypeError(f"make_graphed_callables: enabled must be a bool or a tuple of bools (one per module), "
                    f"got {enabled!r}")


def graph_options(n_modules: int, given: dict) -> GraphOptions:
    """Options from make_graphed_callables' keyword arguments `given` (consumed)."""
    given = dict(given)
    enabled = _enabled_per_module(_pick(given, "fp8_enabled"), n_modules)
    recipe = _pick(given, "fp8_recipe")
    group = _pick(given, "fp8_group")
    cache = _pick(given, "fp8_weight_caching")
    pool = given.pop("pool", None)
    clone = given.pop("clone_param_grads_on_return", True)
    hooks = [check_hook(name, given.pop(name, None)) for name in ("pre_warmup_hook", "post_warmup_hook")]
    if not isinstance(clone, bool):
        raise TypeError(f"make_graphed_callables: clone_param_grads_on_return must be a bool, got {clone!r}")
    calibrating = _pick(given, "fp8_calibrating")
    if calibrating is not None and not isinstance(calibrating, bool):
        raise TypeError(f"make_graphed_callables: calibrating must be a bool, got {calibrating!r}")
    order, layers = given.pop("_order", None), given.pop("_num_layers_per_chunk", None)
    reuse, retain = given.pop("_reuse_graph_input_output_buffers", False), given.pop("retain_graph_in_backward", False)
    capture_hooks = capture_time_hooks(given.pop("capture_time_hooks", None), n_modules)
    if given:
        raise TypeError(f"make_graphed_callables got unexpected keyword arguments {', '.join(sorted(given))}")
    for name, value in (("_reuse_graph_input_output_buffers", reuse), ("retain_graph_in_backward", retain)):
        if not isinstance(value, bool):
            raise TypeError(f"make_graphed_callables: {name} must be a bool, got {value!r}")
    if layers is not None and order is None:
        raise ValueError("make_graphed_callables: _num_layers_per_chunk describes the pipeline schedule in _order; "
                         "give _order too, or leave it out")
    if reuse and order is None:
        raise ValueError("make_graphed_callables: _reuse_graph_input_output_buffers shares input buffers between "
                         "passes that the pipeline schedule keeps apart, so it needs _order")
    if cache is not None and not isinstance(cache, bool):
        raise TypeError(f"make_graphed_callables: cache_quantized_params must be a bool, got {cache!r}")
    if cache and not any(enabled):
        raise ValueError("make_graphed_callables: cache_quantized_params=True caches FP8 weights, so it needs "
                         "enabled=True (for at least one module)")
    recipe = _check_recipe(recipe, "make_graphed_callables")
    return GraphOptions(enabled, recipe if any(enabled) or calibrating else None, group, bool(cache), pool, clone,
                        *hooks, order, layers, reuse, retain, capture_hooks, bool(calibrating))
