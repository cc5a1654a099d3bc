"""A module's quantization state under one recipe: its quantizers, by slot name, and (delayed
scaling) the amax histories and scales behind them, with their checkpoint form."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from ..reference.scaling import history_amax
from .quantizers import Float8Quantizer, Quantizer
from .roles import BACKWARD, FORWARD, QuantizerSlot, Role
from .scaling import ScalingGroup, _scale_for, _user_result, fit_history, group_state


class RecipeState:
    """Quantizers of a module's slots; subclasses add persistent scaling state."""

    version = 0  # (a state pickled before recipes took assignments has none of its own)

    def __init__(self, recipe, slots: Sequence[QuantizerSlot]):
        self.recipe = recipe
        self.version = recipe._te_version  # the recipe's fields as this state took them (see rebind)
        self.slots = tuple(slots)
        self.quantizers: Dict[str, Quantizer] = {}
        self.gemm_alignment = 16

    def quantizer(self, slot: str) -> Quantizer:
        try:
            return self.quantizers[slot]
        except KeyError:
            raise KeyError(f"no quantizer slot {slot!r}; this module declares {', '.join(self.quantizers)}") from None

    def quantization_state(self) -> Dict[str, Dict[str, Dict[str, Tensor]]]:
        return {FORWARD: {}, BACKWARD: {}}

    def scaling_groups(self) -> Dict[Role, ScalingGroup]:
        """The delayed-scaling group of each role (none for stateless recipes)."""
        return {}

    def load_quantization_state(self, saved: dict, fresh: Optional[dict] = None,
                                init_scaled: Optional[dict] = None) -> None:
        """Copy saved tensors in (the inverse of quantization_state); `fresh` and `init_scaled`:
        fresh_slots() and init_scaled_slots() of the saved state, where the checkpoint has them."""

    def fresh_slots(self) -> Dict[str, Dict[str, bool]]:
        """{direction: {slot: whether it has not cast yet}} of the delayed-scaling slots: a fresh
        slot's first cast takes its scale from its own amax (QuantizationStep.first_scale). A
        flag per slot, not a list of the fresh ones: the checkpoint's bytes then have one size
        for a module type (torch.distributed.checkpoint loads into a buffer of the saved size)."""
        return {}

    def init_scaled_slots(self) -> Dict[str, Dict[str, bool]]:
        """{direction: {slot: whether its scale is still its own amax's}} of the delayed-scaling
        slots: an FP8 primary weight's slot before the first scale update, whose whole writes (an
        optimizer step, a copy_) take their own amax's scale (Float8Quantizer.requantize). Saved
        so that a run resumed before that update writes the weight as the uninterrupted one."""
        return {}

    def rebind(self, recipe) -> None:
        """Use `recipe` (compatible with the current one) from now on, keeping the state: also
        the same recipe object after an assignment to one of its fields."""
        self.recipe, self.version = recipe, recipe._te_version

    def rescale_for_format(self, old_recipe) -> List[str]:
        """After this state took a recipe of `old_recipe`'s kind in another fp8_format while
        holding scales made under `old_recipe` (a checkpoint's): make those scales fit the new
        format. Returns the roles whose scales were recomputed."""
        return []

    def carries_over_to(self, recipe) -> bool:
        """Whether this state serves `recipe` after rebind(recipe), rather than a fresh state: for
        any recipe of the same class, as Transformer Engine keeps a module's recipe state (and so
        its amax histories) across recipes of one kind, e.g. a nested autocast's."""
        return type(recipe) is type(self.recipe)

    def _adopt_gemm_choices(self) -> None:
        """Each quantizer's GEMMs accumulate as this state's recipe says (fp8_gemm_* fields), and
        the inputs and output gradients feed the wgrad GEMM in FP8 or in high precision as it
        says (override_linear_precision); a weight is no wgrad operand."""
        wgrad_in_fp8 = self.recipe.gemm_in_fp8("wgrad")
        # backward_override: the backward GEMMs run in high precision (on the original or the
        # dequantized operands), so nothing feeds a wgrad GEMM in FP8
        override = getattr(self.recipe, "backward_override", None)
        for slot in self.slots:
            quantizer = self.quantizers[slot.name]
            quantizer.split_accumulator = self.recipe.split_accumulator
            quantizer.wgrad_in_fp8 = (wgrad_in_fp8 and override is None) or slot.role is Role.WEIGHT
            quantizer.backward_override = override
        # what every GEMM dimension must be a multiple of (checked once per forward; see
        # QuantizationStep.check_gemm_dims), taken whenever the quantizers change
        if self.quantizers:
            self.gemm_alignment = max(q.gemm_alignment for q in self.quantizers.values())

    def follow_device(self, device: torch.device) -> None:
        """Keep persistent state on the module's device (it is not a parameter or buffer, so
        module.to(...) does not move it; the module calls this on each step instead)."""


class StatelessState(RecipeState):
    """Current, block and MXFP8 scaling: scales come from each tensor itself; nothing persists."""

    def __init__(self, recipe, slots):
        super().__init__(recipe, slots)
        for slot in self.slots:
            self.quantizers[slot.name] = recipe.quantizer_for(slot.role)
        self._adopt_gemm_choices()

    def rebind(self, recipe) -> None:
        super().rebind(recipe)
        for slot in self.slots:
            self.quantizers[slot.name] = recipe.quantizer_for(slot.role)
        self._adopt_gemm_choices()


class DelayedScalingState(RecipeState):
    """One ScalingGroup per role (inputs, weights, output gradients), one column per slot; the
    groups update separately, so weights cached with is_first_microbatch=False keep their scale."""

    def __init__(self, recipe, slots, device: torch.device):
        super().__init__(recipe, slots)
        self.groups: Dict[Role, ScalingGroup] = {}
        for role in Role:
            names = [s.name for s in self.slots if s.role is role]
            if not names:
                continue
            group = ScalingGroup(names, recipe.fp8_dtype(role), recipe, device)
            self.groups[role] = group
            for column, name in enumerate(names):
                self.quantizers[name] = Float8Quantizer(role, group, column)
        self._adopt_gemm_choices()

    def scaling_groups(self) -> Dict[Role, ScalingGroup]:
        return self.groups

    def follow_device(self, device: torch.device) -> None:
        for group in self.groups.values():
            if group.scale.device != device:  # (group.device, inline: asked on every step)
                group.to_device(device)

    def quantization_state(self):
        state = {FORWARD: {}, BACKWARD: {}}
        for role, group in self.groups.items():
            state[role.direction].update(group_state(group))
        return state

    def fresh_slots(self) -> Dict[str, Dict[str, bool]]:
        fresh: Dict[str, Dict[str, bool]] = {}
        for role, group in self.groups.items():
            fresh.setdefault(role.direction, {}).update((name, c in group.fresh) for c, name in enumerate(group.names))
        return fresh

    def init_scaled_slots(self) -> Dict[str, Dict[str, bool]]:
        flags: Dict[str, Dict[str, bool]] = {}
        for role, group in self.groups.items():
            flags.setdefault(role.direction, {}).update(
                (name, c in group.init_scaled) for c, name in enumerate(group.names))
        return flags

    def load_quantization_state(self, saved: dict, fresh: Optional[dict] = None,
                                init_scaled: Optional[dict] = None) -> None:
        """All entries are checked before any is copied, so a bad checkpoint leaves the state as it was.
        Scales load as saved; a history saved with another amax_history_len is fitted to this
        state's (scaling.fit_history: this step's row and the most recent entries). Slots that had
        not cast when saved (`fresh`, te-core's checkpoints) stay fresh, so the resumed run casts
        as the uninterrupted one; a checkpoint without that record (Transformer Engine's, older
        te-core ones) starts every slot from its saved scale. So do `init_scaled` slots (an FP8
        primary weight's before the first update): recorded, they stay so; otherwise not."""
        copies = []
        known = {}
        for role, group in self.groups.items():
            known.setdefault(role.direction, set()).update(group.names)
        for direction, names in known.items():
            entries = saved.get(direction, {})
            if not isinstance(entries, dict):
                raise ValueError(f"checkpoint's {direction} delayed-scaling state is a {type(entries).__name__}, "
                                 "expected a dict of slots; the checkpoint is corrupt")
            extra = sorted(set(entries) - names)
            if extra:  # (another module type's slots: loading ours alone would drop its state unseen)
                raise ValueError(f"checkpoint has delayed-scaling state for slot(s) {', '.join(map(repr, extra))} "
                                 f"({direction}) that this module does not have (it has {', '.join(sorted(names))}); "
                                 "was it saved from another module type? Drop the module's '_extra_state' entry "
                                 "from the state dict to start its scaling state afresh.")
        for role, group in self.groups.items():
            entries = saved.get(role.direction, {})
            for column, name in enumerate(group.names):
                if name not in entries:
                    raise ValueError(f"checkpoint has no delayed-scaling state for slot {name!r} "
                                     f"({role.direction}); it has {', '.join(entries) or 'none'}")
                missing = [k for k in ("scale", "amax_history") if not isinstance(entries[name], dict)
                           or k not in entries[name]]
                if missing:
                    raise ValueError(f"checkpoint's delayed-scaling state for slot {name!r} ({role.direction}) "
                                     f"lacks {' and '.join(missing)}; the checkpoint is corrupt")
                copies += [(group.scale[column : column + 1], entries[name]["scale"], f"{name}.scale"),
                           (group.amax_history[:, column], entries[name]["amax_history"], f"{name}.amax_history")]
        for dst, src, what in copies:
            _check_entry(dst, src, what)
        for dst, src, what in copies:
            if what.endswith(".amax_history"):
                src = fit_history(src.detach().reshape(-1, 1), dst.shape[0]).reshape(dst.shape)
            dst.copy_(src)
        fresh = fresh if isinstance(fresh, dict) else {}
        for role, group in self.groups.items():
            group.settle()
            flags = fresh.get(role.direction, {})
            group.fresh = {c for c, name in enumerate(group.names)
                           if isinstance(flags, dict) and flags.get(name) is True}
            flags = init_scaled.get(role.direction, {}) if isinstance(init_scaled, dict) else {}
            group.init_scaled = {c for c, name in enumerate(group.names)
                                 if isinstance(flags, dict) and flags.get(name) is True}

    def rescale_for_format(self, old_recipe) -> List[str]:
        """An amax history holds for any format, a scale does not (it is fp8_max / amax of its own
        format): each group whose format changed takes the scales the recipe's update computes from
        its history, which stays as it is. A column whose history holds no usable amax (one never
        cast, or amax_history_len=1, whose update leaves the history empty) restarts as a new
        state's: scale 1, fresh, so that its first cast scales by its own amax."""
        rescaled = []
        for role, group in self.groups.items():
            if old_recipe.fp8_dtype(role) == group.fp8_dtype or group.scale.is_meta:  # (meta: restarts anyway)
                continue
            amax = _history_amax(group)
            usable = torch.isfinite(amax) & (amax > 0)
            scale = torch.where(usable, _scale_for(group, amax, group.scale), torch.ones_like(group.scale))
            group.scale.copy_(scale)
            group.scale_changed()
            group.fresh.update(column for column, ok in enumerate(usable.tolist()) if not ok)
            rescaled.append(role.value)
        return rescaled

    def rebind(self, recipe) -> None:
        super().rebind(recipe)
        for role, group in self.groups.items():
            dtype = group.fp8_dtype
            group.rebind(recipe, recipe.fp8_dtype(role))
            if group.fp8_dtype != dtype:  # quantizers cast to their group's format
                for column, name in enumerate(group.names):
                    self.quantizers[name] = Float8Quantizer(role, group, column)
        self._adopt_gemm_choices()


def _history_amax(group: ScalingGroup) -> Tensor:
    """The amax the recipe's update takes from `group`'s history, per column."""
    history, algo = group.amax_history, group.recipe.amax_compute_algo
    if callable(algo):
        return _user_result(algo(history), group.scale, "amax_compute_algo", "the (L, n) amax history").float()
    if algo == "most_recent":
        # between steps the update has rolled the step's amax from row 0 (zeroed) to the last row
        return torch.where(history[0] != 0, history[0], history[-1])
    return history_amax(history, algo)


def _check_entry(dst: Tensor, src, what: str) -> None:
    """Shape, and values the update could have produced: a scale is finite and > 0 (the update
    never writes another; a NaN or 0 scale would make every cast NaN or 0), and an amax is >= 0,
    inf or NaN (the update ignores NaN, as Transformer Engine). A history may have any length
    (it is fitted to the recipe's on load)."""
    history = what.endswith(".amax_history")
    fits = isinstance(src, Tensor) and (src.dim() == 1 and src.numel() > 0 if history
                                        else tuple(src.shape) == tuple(dst.shape))
    if not fits:
        shape = tuple(src.shape) if isinstance(src, Tensor) else type(src).__name__
        expected = "(length,) with length >= 1 (one amax per step)" if history else str(tuple(dst.shape))
        raise ValueError(f"checkpoint entry {what} has shape {shape}, expected {expected}; the checkpoint is corrupt")
    values = src.detach().double()
    bad = ~(values.isfinite() & (values > 0)) if what.endswith(".scale") else values < 0
    if bad.any():
        value = values[bad][0].item()
        raise ValueError(f"checkpoint entry {what} holds {value!r}, which no scaling update writes "
                         f"({'a scale must be finite and > 0' if what.endswith('.scale') else 'an amax is never negative'}); "
                         "the checkpoint is corrupt. Drop the module's '_extra_state' entry from the state dict "
                         "to start its scaling state afresh.")


def same_kind(recipe, other) -> bool:
    """Whether scaling state made under `other` can serve `recipe`, perhaps after
    rescale_for_format: the same te-core recipe (a subclass counts as its te-core base)."""
    return recipe.compatible_key()[0] == other.compatible_key()[0]


def describe(recipe) -> str:
    key = recipe.compatible_key()
    return f"{key[0]}(fp8_format={key[1]})"


def extra_state(state: Optional[RecipeState]) -> Optional[dict]:
    """The checkpoint form: plain values and tensors only (loads with weights_only=True)."""
    if state is None:
        return None
    saved = state.quantization_state()
    if not any(saved.values()):
        return None  # stateless recipes: nothing to restore, so nothing that could conflict on load
    tensors = {d: {name: {k: v.detach().clone() for k, v in entry.items()} for name, entry in roles.items()}
               for d, roles in saved.items()}
    return {"recipe": state.recipe.to_config(), "quantization_state": tensors, "fresh": state.fresh_slots(),
            "init_scaled": state.init_scaled_slots()}
