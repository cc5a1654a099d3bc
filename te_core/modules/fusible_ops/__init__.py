"""Transformer Engine's fusible-operation API (`transformer_engine.pytorch.ops`), the subset its
Mixtral tutorial builds its experts from: `Sequential(GroupedLinear, SwiGLU, GroupedLinear)`.

te-core fuses nothing across the operations: each runs as te-core's own module or op would
(GroupedLinear is te.GroupedLinear, so under te.autocast its GEMMs run in FP8 exactly as there).
Sequential only hands each operation its extra inputs (a GroupedLinear's split sizes)."""

from .grouped_linear import GroupedLinear
from .sequential import Sequential
from .swiglu import SwiGLU

__all__ = ["GroupedLinear", "Sequential", "SwiGLU"]
