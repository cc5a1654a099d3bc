"""What the fusible operations share: how many extra inputs Sequential hands each one and how many
extra outputs it collects from each, their checks of dtype and extra inputs, Transformer Engine's
initial weights and empty extra state, and the initialization of parameters left on the meta device."""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor

from .._common import HP_DTYPES
from .._quantizer_roles import check_op_mode
from ._channels import ChannelBindings

# TE's operations initialize a weight as torch.nn.Linear does (its modules: normal(0, 0.023))
TORCH_LINEAR_INIT = functools.partial(torch.nn.init.kaiming_uniform_, a=math.sqrt(5))


class FusibleOperation(ChannelBindings):
    """A te-core fusible operation (a mixin of an nn.Module). Sequential hands it the input and the
    next `num_extra_inputs` of the extra inputs it was called with, in the order of the operations;
    a plain nn.Module in a Sequential takes the input only. An operation with `num_extra_outputs`
    returns (output, *that many extra outputs), which Sequential returns after its own output.
    Slots bound to a named channel (set_extra_input_channel / set_extra_output_channel) pass their
    tensors between the operations instead."""

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0
    is_fused_op: bool = False  # (Transformer Engine's: True for a FusedOperation, a run of basic operations)

    @property
    def _name(self) -> str:
        return f"ops.{type(self).__name__}"

    def get_quantizer_roles(self, mode: str):
        """Transformer Engine's hook for an operation's QuantizerRole per quantizer slot of `mode`
        ("forward" or "backward"): None (no explicit roles), as TE's base class answers; the
        linear operations override it."""
        check_op_mode(self, mode)
        return None

    def _materialize_meta_parameters(self) -> None:
        """As Transformer Engine's operations do at their first forward: parameters still on the
        meta device (an operation built there and given none of a model's parameters) are
        initialized on te-core's device, by the operation's reset_parameters()."""
        if any(p is not None and p.is_meta for p in self._parameters.values()):
            self.reset_parameters()


class EmptyExtraState:
    """Transformer Engine's `_extra_state` of an operation that holds no quantization state: empty,
    so that state dicts have TE's keys (a mixin of an nn.Module before it in the bases)."""

    def get_extra_state(self) -> Tensor:
        return torch.empty(0, dtype=torch.uint8, device="cpu")  # (host-side, as a module's extra state)

    def set_extra_state(self, state) -> None:
        from ...compat.te_checkpoint import holds_fp8_scales, is_te_tensor_form
        from ...quantization.extra_state import from_text

        state = from_text(state)  # (te_core.distributed.state_dict's text form of the empty entry)
        # TE's form without scales: empty (of any dtype), or TE 2.3-2.8's pickled {} for an operation
        # without quantization state, so that every entry of their Sequential checkpoints loads
        if state is None or (is_te_tensor_form(state) and not holds_fp8_scales(state)):
            return
        raise ValueError(f"ops.{type(self).__name__}: its _extra_state must be empty (it holds no quantization "
                         f"state), got {state!r}; drop that entry from the state dict")


def check_dtype(dtype: Optional[torch.dtype], op: str) -> Optional[torch.dtype]:
    """An operation's parameter dtype: None (torch's default dtype) or a high-precision one."""
    if dtype is not None and dtype not in HP_DTYPES:
        raise TypeError(f"{op}: dtype must be torch.float32, torch.bfloat16 or torch.float16 (or None: torch's "
                        f"default dtype), got {dtype}")
    return dtype


def check_extra_inputs(op: str, expected: int, extra_inputs: tuple, what: str) -> None:
    """`extra_inputs` are the `expected` ones `op` takes (described by `what`)."""
    if len(extra_inputs) != expected:
        raise TypeError(f"{op}: takes the input and {expected} extra input(s) ({what}), got {len(extra_inputs)} extra "
                        "input(s)")
