"""What a quantized tensor is for: its role in a GEMM, and the named slots a module declares."""
from __future__ import annotations

import enum
from typing import NamedTuple, Tuple

FORWARD = "forward"
BACKWARD = "backward"


class Role(enum.Enum):
    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"

    def __init__(self, value: str):
        # direction: the pass whose scales this role follows: forward scales update when the
        # outermost autocast exits, backward scales at the end of the backward pass. A plain
        # attribute, not a property: every cast asks it.
        self.direction = BACKWARD if value == "grad_output" else FORWARD


class QuantizerSlot(NamedTuple):
    """One tensor a module quantizes: `name` keys its state (quantization_state, checkpoints);
    `owner` is the module's own name= (Transformer Engine's instance name), which a CustomRecipe
    factory reads as QuantizerRole.name to treat one layer apart from the others; `module_type`:
    the QuantizerRole.module_type it is asked with where the slot name does not say it (see
    quantization.custom.role_of_slot)."""

    name: str
    role: Role
    owner: str = ""
    module_type: str = ""


def gemm_slots(prefix: str = "") -> Tuple[QuantizerSlot, QuantizerSlot, QuantizerSlot]:
    """The three slots of one linear GEMM: input, weight and the gradient of its output."""
    return (
        QuantizerSlot(prefix + "input", Role.INPUT),
        QuantizerSlot(prefix + "weight", Role.WEIGHT),
        QuantizerSlot(prefix + "grad_output", Role.GRAD_OUTPUT),
    )
