"""Loading an optimizer whose states keep their own dtypes, not their parameters'.

torch.optim.Optimizer.load_state_dict casts every floating-point state to its parameter's dtype.
For bf16 or fp16 parameters that would silently turn FusedAdam's float32 master weights and
moments, and FusedSGD's float32 momentum, into low-precision ones on every resume from a
checkpoint (and bf16 moments of float32 parameters into float32 ones). The mixin reloads each
state the optimizer names from the saved values, in the dtype the optimizer keeps it in, after
torch's load (as Transformer Engine's FusedAdam restores its state dtypes).
"""
from __future__ import annotations

from itertools import chain
from typing import Optional

import torch


class StateDtypesMixin:
    """load_state_dict keeping each state in state_dtype(name) (None: torch's rule)."""

    def state_dtype(self, name: str) -> Optional[torch.dtype]:
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = chain.from_iterable(group["params"] for group in self.param_groups)
        for saved_id, param in zip(saved_ids, params):
            for name, value in state_dict["state"].get(saved_id, {}).items():
                if torch.is_tensor(value):
                    self._load_state(param, name, value)

    def _load_state(self, param, name: str, value: torch.Tensor) -> None:
        """Set state `name` of `param` from its saved value (a subclass's own forms override): a
        copy, never the saved tensor itself, so that an optimizer loaded from another's live
        state_dict (in the same process) does not step that one's states too."""
        dtype = self.state_dtype(name)
        if dtype is not None and value.is_floating_point():
            self.state[param][name] = value.to(device=param.device, dtype=dtype, copy=True)
