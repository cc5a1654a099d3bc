"""Contract: matrix multiplies. Every GEMM computes `a @ b.T` ("TN"), like F.linear.

a is (M, K) and b is (N, K), both row-major; the output is (M, N). The three GEMMs of a
linear layer map onto it as: fprop y = x @ w.T (a=x, b=w); dgrad dx = dy @ w (a=dy, b=w_t,
the column-wise copy of w, (K, N)); wgrad dw = dy.T @ x (a=dy_t, b=x_t).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..backend.types import Capabilities
from ._spec import contract_op


@contract_op("gemm")
def gemm(
    a: Tensor,
    b: Tensor,
    *,
    bias: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
    accumulate: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """High-precision a @ b.T (+ bias broadcast over rows). out_dtype defaults to a.dtype.
    Unlike gemm_fp8, a and b may be any strided 2-D tensors: the modules pass dgrad's and
    wgrad's operands as transposed views of row-major tensors (a backend that needs row-major
    operands copies them or declines the call). With `out`, the result is written there (accumulate=True adds to its contents: the fused
    wgrad accumulation into a main_grad) and `out` is returned."""


def _gemm_fp8_caps(caps: Capabilities, a, b, a_scale_inv=None, b_scale_inv=None, *, scaling="tensorwise", **_):
    return caps.check_fp8(a.dtype) or caps.check_fp8(b.dtype) or caps.check_scaling(scaling)


@contract_op("gemm", _gemm_fp8_caps)
def gemm_fp8(
    a: Tensor,
    b: Tensor,
    a_scale_inv: Tensor,
    b_scale_inv: Tensor,
    *,
    out_dtype: torch.dtype,
    scaling: str = "tensorwise",
    bias: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
    accumulate: bool = False,
    fast_accumulation: bool = False,
) -> Tensor:
    """FP8 a @ b.T, accumulated in float32: dequant(a) @ dequant(b).T (+ bias), cast to out_dtype.

    a, b: FP8 (E4M3 or E5M2, any mix except E5M2 x E5M2). Scale shapes by `scaling`
    (te_core.backend.types): "tensorwise" 1 element each; "rowwise" a (M, 1), b (N, 1);
    "block_1x128_128x128" a (M, ceil(K/128)), b (ceil(N/128), ceil(K/128));
    "block_1x128_1x128" a (M, ceil(K/128)), b (N, ceil(K/128)); "mxfp8" uint8 E8M0
    a (M, K/32), b (N, K/32). bias has N elements (out_dtype or float32). `out`/`accumulate`
    as for gemm. Backends may require M, N, K to be multiples of 16 and decline otherwise
    (te-core's modules pad tensor-wise GEMMs to such shapes before calling).
    fast_accumulation=True lets the backend keep the tensor cores' own accumulator for the whole
    K loop instead of promoting partial sums to float32 (Hopper's fast FP8 accumulation, which
    Transformer Engine and torchao use for forward GEMMs; error grows with K); a backend without
    such a mode, and the reference, accumulate in float32 regardless."""
