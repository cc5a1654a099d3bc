"""Transformer Engine's `cpp_extensions.general_gemm` for high-precision operands, on the selected
backend's GEMM (te_core.ops.gemm): what Megatron-LM calls for a GEMM whose output dtype differs
from its inputs' (a float32 logit layer over bfloat16 activations, a weight gradient written into
a float32 buffer).

TE's layout names the transposes of its column-major cuBLAS call; in row-major terms the product
is op(B) @ op(A), with A transposed under a first letter "T" and B under a second letter "T":
"TN" is B @ A.T (a forward GEMM: B the input, A the weight), "NN" is B @ A (dgrad), "NT" is
B.T @ A (wgrad). FP8 operands, fused GELU and the bias gradient are TE kernel features that
te-core's modules run through their own ops; asking for them here is an error that says so.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import ops
from ..quantization.tensor import QuantizedTensor

_LAYOUTS = ("TN", "NN", "NT")


def general_gemm(A: Tensor, B: Tensor, workspace: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                 quantization_params=None, gelu: bool = False, gelu_in: Optional[Tensor] = None,
                 accumulate: bool = False, layout: str = "TN", out: Optional[Tensor] = None,
                 bias: Optional[Tensor] = None, use_split_accumulator: bool = False, grad: bool = False,
                 ub=None, ub_type=None, extra_output: Optional[Tensor] = None, bulk_overlap: bool = False):
    """(result, bias gradient, GELU input, extra output) as Transformer Engine returns them; the
    last three are None here. The product accumulates in float32 wherever the backend's GEMM does
    (te_core.ops.gemm), then takes `out_dtype` (default A's dtype); `out` receives it (added to
    its contents with accumulate=True). `workspace` and `use_split_accumulator` change nothing in
    a high-precision GEMM."""
    where = "transformer_engine.pytorch.cpp_extensions.general_gemm"
    if layout not in _LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {', '.join(_LAYOUTS)}, got {layout!r}")
    unsupported = [name for name, value in (
        ("quantization_params", quantization_params), ("gelu", gelu), ("gelu_in", gelu_in), ("ub", ub),
        ("ub_type", ub_type), ("extra_output", extra_output), ("bulk_overlap", bulk_overlap)) if value]
    if grad and bias is not None:
        unsupported.append("bias with grad=True (the bias gradient)")
    if isinstance(A, QuantizedTensor) or isinstance(B, QuantizedTensor):
        unsupported.append("quantized operands")
    if unsupported:
        raise NotImplementedError(f"{where}: te-core runs high-precision GEMMs here, without {', '.join(unsupported)}; "
                                  "te-core's modules (transformer_engine.pytorch.Linear, ...) run their FP8 and fused "
                                  "GEMMs through their own ops")
    left = B if layout[1] == "N" else B.t()
    right = A.t() if layout[0] == "T" else A  # result = left @ right = left @ (right.T).T
    dtype = out.dtype if out is not None else (out_dtype or A.dtype)
    result = ops.gemm(left, right.t(), bias=None if grad else bias, out=out, accumulate=accumulate,
                      out_dtype=dtype)
    return result, None, None, None
