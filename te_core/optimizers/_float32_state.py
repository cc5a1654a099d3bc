"""Loading an optimizer whose states stay float32 for low-precision parameters.

torch.optim.Optimizer.load_state_dict casts every floating-point state to its parameter's dtype.
For bf16 or fp16 parameters that would silently turn FusedAdam's float32 master weights and
moments, and FusedSGD's float32 momentum, into low-precision ones on every resume from a
checkpoint. The mixin reloads those states from the saved values in float32 after torch's
load (as Transformer Engine's FusedAdam restores its state dtypes).
"""
from __future__ import annotations

from itertools import chain
from typing import FrozenSet

import torch


class Float32StateMixin:
    """load_state_dict keeping the states named in FLOAT32_STATES in float32."""

    FLOAT32_STATES: FrozenSet[str] = frozenset()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = chain.from_iterable(group["params"] for group in self.param_groups)
        for saved_id, param in zip(saved_ids, params):
            for name, value in state_dict["state"].get(saved_id, {}).items():
                if name in self.FLOAT32_STATES and torch.is_tensor(value) and value.is_floating_point():
                    self.state[param][name] = value.to(device=param.device, dtype=torch.float32)
