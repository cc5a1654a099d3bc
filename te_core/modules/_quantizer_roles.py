"""Transformer Engine's get_quantizer_roles: the QuantizerRole of each quantizer slot of a GEMM
module (TE's layout: per GEMM, forward [input, weight, output] and backward [grad_output,
grad_input]; a fusible operation's: forward [input, weight], backward [grad_output]).

The roles are read from the module's own quantizer slots through role_of_slot, the function a
CustomRecipe factory's roles come from, so the method and the factory's calls cannot disagree.
te-core quantizes no output or input gradient: those slots hold the boundary roles TE reports
(the module's output_quantizer_role / grad_input_quantizer_role, None unless set)."""
from __future__ import annotations

from typing import List, Optional, Tuple

from ..quantization.custom import QuantizerRole, role_of_slot
from ..quantization.roles import Role

_GEMM = (Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT)


def gemm_roles(module) -> List[Tuple[QuantizerRole, QuantizerRole, QuantizerRole]]:
    """(input, weight, grad_output) roles of each of `module`'s GEMMs, in its slot order."""
    slots = module._owned_slots()
    gemms = [slots[i:i + 3] for i in range(0, len(slots), 3)]
    if any(tuple(slot.role for slot in gemm) != _GEMM for gemm in gemms):
        raise TypeError(f"{type(module).__name__}: its quantizer slots {[s.name for s in slots]} are not "
                        "(input, weight, grad_output) per GEMM; it has no Transformer Engine GEMM role layout")
    return [tuple(role_of_slot(slot) for slot in gemm) for gemm in gemms]


def _check_role(value, name: str, module: str) -> Optional[QuantizerRole]:
    if value is not None and not isinstance(value, QuantizerRole):
        raise TypeError(f"{module}.{name} must be a te.QuantizerRole or None, got {value!r} "
                        f"({type(value).__name__}); e.g. te.QuantizerRole('linear', 'input', 'encoder.fc2')")
    return value


class GemmQuantizerRoles:
    """get_quantizer_roles and the boundary roles of a module of linear GEMMs (a QuantizedModule mixin)."""

    # whether each GEMM feeds the next (LayerNormMLP's fc1 -> fc2): its output then takes the next
    # GEMM's input role, and the next GEMM's input gradient this one's grad_output role, as in TE
    _chained_gemms = False
    _output_quantizer_role: Optional[QuantizerRole] = None
    _grad_input_quantizer_role: Optional[QuantizerRole] = None

    @property
    def output_quantizer_role(self) -> Optional[QuantizerRole]:
        """The role get_quantizer_roles reports for the module's output (its consumer's; None: unknown)."""
        return self._output_quantizer_role

    @output_quantizer_role.setter
    def output_quantizer_role(self, role: Optional[QuantizerRole]) -> None:
        self._output_quantizer_role = _check_role(role, "output_quantizer_role", type(self).__name__)

    @property
    def grad_input_quantizer_role(self) -> Optional[QuantizerRole]:
        """The role get_quantizer_roles reports for the input gradient (its consumer's; None: unknown)."""
        return self._grad_input_quantizer_role

    @grad_input_quantizer_role.setter
    def grad_input_quantizer_role(self, role: Optional[QuantizerRole]) -> None:
        self._grad_input_quantizer_role = _check_role(role, "grad_input_quantizer_role", type(self).__name__)

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> Optional[List[Optional[QuantizerRole]]]:
        """The QuantizerRole of each of `num_quantizers` quantizer slots of the forward (fwd=True)
        or backward pass, in Transformer Engine's order: per GEMM [input, weight, output] forward
        and [grad_output, grad_input] backward, repeated to num_quantizers. A CustomRecipe factory
        is asked with the input, weight and grad_output roles; te-core quantizes no output or
        input gradient, whose slots report output_quantizer_role / grad_input_quantizer_role."""
        check_module_arguments(self, fwd, num_quantizers)
        gemms = gemm_roles(self)
        base: List[Optional[QuantizerRole]] = []
        for g, (input_role, weight_role, grad_output_role) in enumerate(gemms):
            chained_next = self._chained_gemms and g + 1 < len(gemms)
            chained_prev = self._chained_gemms and g > 0
            if fwd:
                base += [input_role, weight_role, gemms[g + 1][0] if chained_next else self._output_quantizer_role]
            else:
                base += [grad_output_role, gemms[g - 1][2] if chained_prev else self._grad_input_quantizer_role]
        return [base[i % len(base)] for i in range(num_quantizers)]


def check_module_arguments(module, fwd, num_quantizers) -> None:
    """The module form's arguments (every module's get_quantizer_roles checks them alike)."""
    name = type(module).__name__
    if not isinstance(fwd, bool):
        raise TypeError(f"{name}.get_quantizer_roles: fwd must be a bool (True: the forward pass's "
                        f"quantizers, False: the backward's), got {fwd!r}")
    if isinstance(num_quantizers, bool) or not isinstance(num_quantizers, int) or num_quantizers < 0:
        raise ValueError(f"{name}.get_quantizer_roles: num_quantizers must be an int >= 0 (TE passes "
                         f"3 * num_gemms forward, 2 * num_gemms backward), got {num_quantizers!r}")


def check_op_mode(op, mode) -> None:
    """The fusible-operation form's argument (every operation's get_quantizer_roles checks it alike)."""
    if mode not in ("forward", "backward"):
        raise ValueError(f"ops.{type(op).__name__}.get_quantizer_roles: mode must be 'forward' or 'backward', "
                         f"got {mode!r}")


def op_quantizer_roles(op, mode: str) -> List[QuantizerRole]:
    """Transformer Engine's fusible-operation form: the roles of the quantizers the operation owns,
    per GEMM [input, weight] (mode "forward") or [grad_output] ("backward"); the output's and the
    input gradient's quantizers belong to the neighbouring operations."""
    check_op_mode(op, mode)
    gemms = gemm_roles(op)
    if mode == "forward":
        return [role for input_role, weight_role, _ in gemms for role in (input_role, weight_role)]
    return [grad_output_role for _, _, grad_output_role in gemms]
