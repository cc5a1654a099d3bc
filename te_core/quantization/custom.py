"""CustomRecipe's quantization state: each slot's quantizer from the user's factory.

The factory is asked once per slot, with the slot's QuantizerRole, when a module's state is made
(or rebound to another CustomRecipe); what it returns must be one of te-core's TE-signature
quantizers (te_quantizers; identity: the slot in high precision; hybrid: one per direction),
which the state copies and binds to the slot's te-core role.
"""
from __future__ import annotations

from typing import Tuple

from .hybrid import HybridQuantizer
from .identity import IdentityQuantizer
from .roles import QuantizerSlot
from .state import RecipeState
from .te_quantizers import QUANTIZER_CLASSES, Float8BlockQuantizer

# what a factory may return: a quantizer of one format, a high-precision slot, or one per direction
FACTORY_QUANTIZERS = QUANTIZER_CLASSES + (IdentityQuantizer, HybridQuantizer)

__all__ = ["QuantizerRole", "CustomRecipeState", "role_of_slot"]


class QuantizerRole(str):
    """Which tensor a CustomRecipe factory is asked to quantize: `module_type` ("linear",
    "grouped_linear"), `tensor_type` ("input", "weight", "grad_output") and `name` (the module's
    name= argument, with ".fc1" / ".fc2" for LayerNormMLP's GEMMs; "" or "fc1" / "fc2" unnamed).

    Transformer Engine gave factories a string ("linear_input", ... : every GEMM tensor of every
    module as linear_<tensor_type>) before 2.20, and since then a QuantizerRole with these three
    fields. This role is both, so factories written for either run unchanged: as a string it is
    the old name (`role == "linear_weight"`, `role in (...)`, `str(role)`); it has the three
    fields; two roles are equal when their fields are. (Not a dataclass: dataclasses.replace
    does not apply to it.)"""

    __slots__ = ("_fields",)

    def __new__(cls, module_type: str = "", tensor_type: str = "", name: str = ""):
        for arg, value in (("module_type", module_type), ("tensor_type", tensor_type), ("name", name)):
            if not isinstance(value, str):
                raise TypeError(f"QuantizerRole: {arg} must be a str, got {value!r} ({type(value).__name__})")
        family = "linear" if module_type == "grouped_linear" else module_type
        self = super().__new__(cls, f"{family}_{tensor_type}" if family and tensor_type else "unknown")
        self._fields = (module_type, tensor_type, name)
        return self

    module_type = property(lambda self: self._fields[0])
    tensor_type = property(lambda self: self._fields[1])
    name = property(lambda self: self._fields[2])

    def __eq__(self, other):
        if isinstance(other, QuantizerRole):
            return self._fields == other._fields
        return str.__eq__(self, other)

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__

    def __repr__(self) -> str:
        module_type, tensor_type, name = self._fields
        return f"QuantizerRole(module_type={module_type!r}, tensor_type={tensor_type!r}, name={name!r})"

    def __getnewargs__(self) -> Tuple[str, str, str]:
        return self._fields


def role_of_slot(slot: QuantizerSlot) -> QuantizerRole:
    """The role te-core's module slot `slot` plays, in Transformer Engine's terms. Modules name
    their slots <prefix><role> (quantization.roles.gemm_slots): GroupedLinear's prefixes are
    gemm<i>_, LayerNormMLP's fc1_ / fc2_ (TE's names of those GEMMs), a one-GEMM module has none.
    The role's name is TE's: the module's name= (the slot's owner), "<owner>.fc1" for a GEMM of
    LayerNormMLP (just "fc1" for an unnamed one). A slot's own module_type overrides the prefix's
    (TE's grouped linear operation asks with "linear", its module with "grouped_linear")."""
    prefix = slot.name[: len(slot.name) - len(slot.role.value)] if slot.name.endswith(slot.role.value) else ""
    owner = slot.owner
    if prefix.startswith("gemm"):
        return QuantizerRole(slot.module_type or "grouped_linear", slot.role.value, owner)
    gemm = prefix.rstrip("_")
    return QuantizerRole(slot.module_type or "linear", slot.role.value,
                         f"{owner}.{gemm}" if owner and gemm else owner or gemm)


def _accepted() -> str:
    return ", ".join(f"te.{cls.__name__}" for cls in FACTORY_QUANTIZERS)


def quantizer_from_factory(recipe, slot: QuantizerSlot):
    """The factory's quantizer for `slot`, checked, as a copy bound to the slot's role."""
    role = role_of_slot(slot)
    quantizer = recipe.qfactory(role)
    if quantizer is None:
        raise ValueError(
            f"CustomRecipe: qfactory returned None for role {role!r} ({str(role)!r}), a tensor te-core quantizes "
            f"under this recipe; return a quantizer ({_accepted()}) for every input, weight and grad_output role "
            "(te-core asks for no other role: its modules never quantize their outputs or input gradients)")
    if not isinstance(quantizer, FACTORY_QUANTIZERS):
        raise TypeError(f"CustomRecipe: qfactory returned a {type(quantizer).__name__} for role {role!r}; it must "
                        f"return one of {_accepted()} (Transformer Engine's quantizer classes, as te-core provides "
                        "them)")
    return quantizer.for_role(slot.role)


class CustomRecipeState(RecipeState):
    """Stateless: each slot's quantizer comes from the recipe's factory, made again on rebind."""

    def __init__(self, recipe, slots):
        super().__init__(recipe, slots)
        self._build()

    def rebind(self, recipe) -> None:
        super().rebind(recipe)
        self._build()

    def _build(self) -> None:
        self.quantizers = {slot.name: quantizer_from_factory(self.recipe, slot) for slot in self.slots}
        self._adopt_gemm_choices()
        for quantizer in self.quantizers.values():
            if isinstance(quantizer, HybridQuantizer) and self.recipe.backward_override is not None:
                raise ValueError(
                    f"CustomRecipe: backward_override={self.recipe.backward_override!r} with a HybridQuantizer: "
                    "both choose what the backward GEMMs read. Drop backward_override and give the hybrid an "
                    "IdentityQuantizer as columnwise_quantizer (columnwise_source='rowwise_dequantized' for "
                    "'dequantized'), with an IdentityQuantizer for the grad_output roles")
            for part in getattr(quantizer, "sub_quantizers", (quantizer,)):
                if isinstance(part, Float8BlockQuantizer):
                    # block-scaled GEMMs accumulate in float32 (Float8BlockScaling allows nothing else)
                    part.split_accumulator = _always_split


def _always_split(gemm: str) -> bool:
    return True
