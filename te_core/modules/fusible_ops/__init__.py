"""Transformer Engine's fusible-operation API (`transformer_engine.pytorch.ops`), the subset its
Mixtral tutorials build their experts from: `Sequential(GroupedLinear, SwiGLU, GroupedLinear)`, and
`Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)` with the routing probabilities (MXFP8 tutorial).

te-core fuses nothing across the operations: each runs as te-core's own module or op would
(GroupedLinear is te.GroupedLinear, so under te.autocast its GEMMs run in FP8 exactly as there).
Sequential only hands each operation its extra inputs (a GroupedLinear's split sizes, a
ScaledSwiGLU's probabilities)."""

from .grouped_linear import GroupedLinear
from .sequential import Sequential
from .swiglu import ScaledSwiGLU, SwiGLU

__all__ = ["GroupedLinear", "ScaledSwiGLU", "Sequential", "SwiGLU"]
