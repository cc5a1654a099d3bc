"""Transformer Engine's fusible-operation API (`transformer_engine.pytorch.ops`), the subset its
Mixtral tutorials build their experts from: `Sequential(GroupedLinear, SwiGLU, GroupedLinear)`, and
`Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)` with the routing probabilities (MXFP8 tutorial);
and the subset Megatron-LM's `--use-transformer-engine-op-fuser` builds its MLP from:
`Sequential(RMSNorm or LayerNorm, BasicLinear, Bias, an activation, BasicLinear, Bias)`, whose
operations are built on the meta device and then given the model's parameters, with AllReduce (or
ReduceScatter under sequence parallelism) after the second BasicLinear above one tensor-parallel
rank; and its fused residual RMSNorm, `Sequential(MakeExtraOutput, RMSNorm)`, which returns
(normalized, residual). AllGather completes TE's collectives.

te-core fuses nothing across the operations: each runs as te-core's own module or op would
(GroupedLinear is te.GroupedLinear and BasicLinear te.Linear(bias=False), so under te.autocast
their GEMMs run in FP8 exactly as there; the norms are te.LayerNorm and te.RMSNorm). Sequential only
hands each operation its extra inputs (a GroupedLinear's split sizes, a ScaledSwiGLU's probabilities)
and returns the extra outputs they make after its output."""

from ._op import FusibleOperation
from .activation import GEGLU, GELU, ReGLU, ReLU, SiLU
from .basic_linear import BasicLinear
from .bias import Bias
from .communication import AllGather, AllReduce, ReduceScatter
from .grouped_linear import GroupedLinear
from .make_extra_output import MakeExtraOutput
from .norm import LayerNorm, RMSNorm
from .sequential import Sequential
from .swiglu import ScaledSwiGLU, SwiGLU

__all__ = ["AllGather", "AllReduce", "BasicLinear", "Bias", "FusibleOperation", "GEGLU", "GELU", "GroupedLinear",
           "LayerNorm", "MakeExtraOutput", "RMSNorm", "ReGLU", "ReLU", "ReduceScatter", "ScaledSwiGLU", "Sequential",
           "SiLU", "SwiGLU"]
