"""Autocast state: which recipe modules quantize with, in one small thread-local context object.

`autocast(...)` pushes an AutocastContext; modules read the innermost one. Forward scaling
groups used anywhere inside are collected by the outermost context and updated when it exits.
"""
from __future__ import annotations

import threading
import warnings
from contextlib import ContextDecorator, contextmanager
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch

from .. import backend as _backend
from .._flags import flag
from .._tracing import run_while_tracing
from ..recipe import NVFP4_UNSUPPORTED, DelayedScaling, Recipe, in_use
from .scaling import PendingUpdates, ScalingGroup, check_reduction_member
from .shared_cast import SharedCast

__all__ = [
    "AutocastContext", "autocast", "fp8_autocast", "get_autocast_context", "quantized_model_init",
    "fp8_model_init", "model_init_recipe", "model_init_preserves_high_precision", "is_fp8_available",
    "is_mxfp8_available", "is_fp8_block_scaling_available",
]


@dataclass(frozen=True)
class AutocastContext:
    enabled: bool
    calibrating: bool
    recipe: Recipe
    amax_reduction_group: object = None
    forward_updates: PendingUpdates = field(default=None, compare=False, repr=False)
    # the recipe object the user passed (what TE's get_fp8_recipe returns); modules run `recipe`,
    # its in_use copy
    given: Optional[Recipe] = field(default=None, compare=False, repr=False)
    # the outermost autocast's last shareable input cast, for sibling layers reading the same tensor
    shared_cast: SharedCast = field(default=None, compare=False, repr=False)

    def schedule_forward_update(self, group: ScalingGroup) -> None:
        """Update `group` when the outermost autocast exits (amax reduced over this context's group)."""
        self.forward_updates.add(group, self.amax_reduction_group)


class _ThreadState(threading.local):
    def __init__(self):
        self.stack: List[AutocastContext] = []
        # per quantized_model_init: (its recipe, or None where disabled; preserve_high_precision_init_val)
        self.model_init: List[Tuple[Optional[Recipe], bool]] = []


_STATE = _ThreadState()


def get_autocast_context() -> Optional[AutocastContext]:
    """The innermost active autocast context of this thread, or None."""
    stack = _STATE.stack
    return stack[-1] if stack else None


_DEFAULT_RECIPE = in_use(DelayedScaling())  # a copy in use never changes: one default serves every call


def _check_recipe(recipe, where: str) -> Recipe:
    """The recipe modules run with for `recipe` (None: the default), checked."""
    if recipe is None:
        return _DEFAULT_RECIPE
    if isinstance(recipe, type) and issubclass(recipe, Recipe):  # (a class carries no settings to run with)
        raise TypeError(f"{where}: recipe must be a recipe instance, got the class {recipe.__name__}; pass "
                        f"{recipe.__name__}() instead")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{where}: recipe must be a te_core.recipe recipe (DelayedScaling, Float8CurrentScaling, "
                        f"Float8BlockScaling, MXFP8BlockScaling), got {type(recipe).__name__}")
    return in_use(recipe)


@run_while_tracing
def _fp8_unavailable_reason() -> str:
    """"" when the selected backend runs FP8, else why not. torch.compile runs this while tracing
    and keeps the answer as a constant, rather than tracing (and guarding on) the registry."""
    ok, reason = _backend.is_fp8_available()  # (is_fp8_available(return_reason=True), one call less per step)
    return "" if ok else (reason or "FP8 is not available")


class autocast(ContextDecorator):
    """Run te_core modules in FP8 (`enabled`) per `recipe` (default DelayedScaling()).

    calibrating=True with enabled=False computes in high precision while recording amaxes (and
    updating scales), so an FP8 run can start from calibrated scales. amax_reduction_group: the
    torch.distributed process group whose amaxes are reduced (MAX) before each scale update.
    """

    # A class, not a generator-based context manager: it is entered once per training step
    # around every forward, and the generator machinery was a measurable part of a small step.
    def __init__(self, enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
                 amax_reduction_group=None):
        self.enabled = flag(enabled, "enabled", "autocast")
        self.calibrating = flag(calibrating, "calibrating", "autocast")
        self.recipe, self.amax_reduction_group = recipe, amax_reduction_group

    def __enter__(self):
        recipe = _check_recipe(self.recipe, "autocast")
        if self.amax_reduction_group is not None:
            check_reduction_member(self.amax_reduction_group)
        if (self.enabled or self.calibrating) and recipe.nvfp4():  # (importable, as TE code names it; not run)
            raise NotImplementedError(f"autocast: {NVFP4_UNSUPPORTED}")
        if self.enabled:
            reason = _fp8_unavailable_reason()
            if reason:
                raise RuntimeError(f"autocast(enabled=True): FP8 is not available on the selected backend: {reason}")
        stack = _STATE.stack
        outer = stack[0] if stack else None
        updates = outer.forward_updates if outer is not None else PendingUpdates()
        shared = outer.shared_cast if outer is not None else SharedCast()
        stack.append(AutocastContext(self.enabled, self.calibrating, recipe, self.amax_reduction_group, updates,
                                   self.recipe, shared))
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        stack = _STATE.stack
        context = stack.pop()
        if not stack:
            context.shared_cast.clear()  # (the steps saved for backward hold the context)
            if exc_type is None:
                context.forward_updates.flush()
            else:
                context.forward_updates.clear()
        return False


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None):
    """Transformer Engine's older name for `autocast` (fp8_recipe -> recipe, fp8_group ->
    amax_reduction_group)."""
    warnings.warn("fp8_autocast is deprecated; use te_core.autocast(recipe=..., amax_reduction_group=...)",
                  DeprecationWarning, stacklevel=2)
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group)


@contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """Modules created inside keep their weights only in quantized form (primary FP8 weights).

    preserve_high_precision_init_val=True: each such weight also keeps its value from before
    quantization, on the CPU, for master weights that should start from it rather than from the
    FP8 value (Transformer Engine's contract, which Megatron-LM's distributed optimizer reads):
    `weight.get_high_precision_init_val()` returns it, `weight.clear_high_precision_init_val()`
    frees it (get then returns None). Only weights that have one carry the two methods."""
    enabled = flag(enabled, "enabled", "quantized_model_init")
    preserve_high_precision_init_val = flag(preserve_high_precision_init_val, "preserve_high_precision_init_val",
                                            "quantized_model_init")
    recipe = _check_recipe(recipe, "quantized_model_init") if enabled else None
    _STATE.model_init.append((recipe, preserve_high_precision_init_val and enabled))
    try:
        yield
    finally:
        _STATE.model_init.pop()


def fp8_model_init(enabled: bool = True, recipe: Optional[Recipe] = None, preserve_high_precision_init_val: bool = False):
    """Transformer Engine's older name for `quantized_model_init`."""
    warnings.warn("fp8_model_init is deprecated; use te_core.quantized_model_init", DeprecationWarning, stacklevel=2)
    return quantized_model_init(enabled=enabled, recipe=recipe,
                                preserve_high_precision_init_val=preserve_high_precision_init_val)


def model_init_recipe() -> Optional[Recipe]:
    """The recipe of the innermost enabled quantized_model_init, or None."""
    stack = _STATE.model_init
    return stack[-1][0] if stack else None


def model_init_preserves_high_precision() -> bool:
    """Whether the innermost quantized_model_init keeps each weight's value from before
    quantization (preserve_high_precision_init_val)."""
    stack = _STATE.model_init
    return stack[-1][1] if stack else False


def _answer(ok: bool, reason: str, return_reason: bool) -> Union[bool, Tuple[bool, str]]:
    """Transformer Engine's convention: a bool, or (bool, reason) when return_reason."""
    return (ok, reason) if return_reason else ok


def get_default_recipe() -> Recipe:
    """The recipe te.autocast uses when given none: DelayedScaling() with Transformer Engine's
    defaults (Transformer Engine's get_default_recipe)."""
    return _DEFAULT_RECIPE


def get_align_size_for_quantization(recipe: Recipe) -> int:
    """The multiple each group's row count is padded to before a grouped quantized GEMM under
    `recipe` (Transformer Engine's get_align_size_for_quantization): a CustomRecipe's declared
    quantization_alignment (its factories may be stateful, so they are not asked), 32 for MXFP8,
    128 for NVFP4 and 16 for the per-tensor and block recipes."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"get_align_size_for_quantization: expected a recipe (te.recipe.DelayedScaling(), "
                        f"MXFP8BlockScaling(), ...), got {type(recipe).__name__}; pass the recipe of your "
                        f"te.autocast, or te.get_default_recipe() outside one")
    if recipe.custom():
        return recipe.quantization_alignment
    if recipe.mxfp8():
        return 32
    if recipe.nvfp4():
        return 128
    return 16


def is_bf16_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether the selected backend's device computes in bfloat16: a bool, or (bool, reason) with
    return_reason=True, as in Transformer Engine. The device's own answer where its torch device
    module gives one (is_bf16_supported), else whether a bfloat16 matmul runs there."""
    be = _backend.get_backend()
    if be.device_type == "cpu":
        return _answer(True, "", return_reason)
    query = getattr(be.device_module, "is_bf16_supported", None)
    if query is not None:
        ok = bool(query())
        return _answer(ok, "" if ok else f"the {be.name} backend's device does not support bfloat16", return_reason)
    try:
        probe = torch.ones(2, 2, dtype=torch.bfloat16, device=be.device)
        (probe @ probe).sum().item()
    except RuntimeError as err:
        return _answer(False, f"a bfloat16 matmul fails on the {be.name} backend's device: {err}", return_reason)
    return _answer(True, "", return_reason)


def is_fp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether the selected backend runs FP8 (E4M3) on its device: a bool, or (bool, reason)
    with return_reason=True (reason is "" when available), as in Transformer Engine."""
    from .. import backend

    ok, reason = backend.is_fp8_available()
    return _answer(ok, reason, return_reason)


def _native_scaling(mode: str) -> Tuple[bool, str]:
    from .. import backend

    ok, reason = backend.is_fp8_available()
    if not ok:
        return ok, reason
    why = backend.get_backend().capabilities.check_scaling(mode)
    return (why is None), (why or "")


def is_mxfp8_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether MXFP8 GEMMs run natively (bool, or (bool, reason) with return_reason=True); if
    not, MXFP8BlockScaling still works, emulated."""
    return _answer(*_native_scaling("mxfp8"), return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether 1x128/128x128 block-scaled GEMMs run natively (bool, or (bool, reason) with
    return_reason=True); emulated otherwise."""
    return _answer(*_native_scaling("block_1x128_128x128"), return_reason)
