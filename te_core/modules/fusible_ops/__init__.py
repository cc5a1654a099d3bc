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
and returns the extra outputs they make after its output.

Also TE's other basic operations (Identity, Reshape, ConstantScale, Dropout, AddExtraInput, Quantize,
L2Normalization, the remaining activations and SwiGLU variants), its composite ops.Linear (a FusedOperation of
BasicLinear, Bias and a collective) and the base classes BasicOperation and FusedOperation; the
registration of fusions is refused, since te-core fuses nothing."""

from ._op import FusibleOperation
from .activation import GEGLU, GELU, GLU, QGEGLU, QGELU, ReGLU, ReLU, SiLU, SReGLU, SReLU
from .basic_linear import BasicLinear
from .bias import Bias
from .communication import AllGather, AllReduce, ReduceScatter
from .fuser import register_backward_fusion, register_forward_backward_fusion, register_forward_fusion
from .grouped_linear import GroupedLinear
from .l2_normalization import L2Normalization
from .linear import Linear
from .make_extra_output import MakeExtraOutput
from .norm import LayerNorm, RMSNorm
from .operation import BasicOperation, FusedOperation
from .quantize import Quantize
from .sequential import Sequential
from .swiglu import ClampedSwiGLU, ScaledClampedQGeGLU, ScaledSiTUGLU, ScaledSReLU, ScaledSwiGLU, SiTUGLU, SwiGLU
from .tensor_ops import AddExtraInput, ConstantScale, Dropout, Identity, Reshape

__all__ = ["AddExtraInput", "AllGather", "AllReduce", "BasicLinear", "BasicOperation", "Bias", "ClampedSwiGLU",
           "ConstantScale", "Dropout", "FusedOperation", "FusibleOperation", "GEGLU", "GELU", "GLU", "GroupedLinear",
           "Identity", "L2Normalization", "LayerNorm", "Linear", "MakeExtraOutput", "QGEGLU", "QGELU", "Quantize",
           "RMSNorm", "ReGLU", "ReLU", "ReduceScatter", "Reshape", "SReGLU", "SReLU", "ScaledClampedQGeGLU",
           "ScaledSReLU", "ScaledSiTUGLU", "ScaledSwiGLU", "Sequential", "SiLU", "SiTUGLU", "SwiGLU",
           "register_backward_fusion", "register_forward_backward_fusion", "register_forward_fusion"]
