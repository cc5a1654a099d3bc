"""GEMMs on MUSA: FP8 through torch._scaled_mm (muDNN, arch >= 3.1), high precision through
F.linear (aten::addmm / aten::mm, muDNN MatMul).

torch._scaled_mm on MUSA (torch_musa csrc/aten/ops/Matmul.cpp): 2-D FP8 operands in any
row/column-major mix; float32 scales with 1 or M (a) / 1 or N (b) elements; output fp16,
bf16, fp32 or FP8; bias of N elements in the output dtype (bf16/fp16, or fp32 for fp32
output); no block-wise scales, no amax; tested sizes are multiples of 16.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from te_core.backend.types import ROWWISE, TENSORWISE, as_dtype
from torch import Tensor

from ..capabilities import FP8_MIN_ARCH
from ..runtime import arch_of, arch_name

HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
GEMM_ALIGNMENT = 16
Verdict = Tuple[bool, str]


def scaled_mm_scales(a_scale_inv: Tensor, b_scale_inv: Tensor, scaling: str, m: int, n: int) -> Tuple[Tensor, Tensor]:
    """The contract's scale_inv tensors as _scaled_mm's scale_a / scale_b: both multiply the
    FP8 operands back, so they pass through; row-wise b goes (N, 1) -> (1, N), the layout
    upstream torch requires and MUSA accepts (it checks the element count only)."""
    if scaling == TENSORWISE:
        return a_scale_inv.reshape(1).float().contiguous(), b_scale_inv.reshape(1).float().contiguous()
    return a_scale_inv.reshape(m, 1).float().contiguous(), b_scale_inv.reshape(1, n).float().contiguous()


def scaled_mm_plan(bias: Optional[Tensor], out_dtype: torch.dtype, accumulate: bool) -> Tuple[torch.dtype, bool]:
    """(dtype _scaled_mm writes, whether bias goes into _scaled_mm).

    Accumulation into `out` and a float32 bias on a 16-bit output need the float32 result, so
    that the sum is rounded once, as the contract's float32 math does."""
    mm_dtype = torch.float32 if accumulate else out_dtype
    if bias is not None and bias.dtype == torch.float32 and mm_dtype != torch.float32:
        mm_dtype = torch.float32
    fuse_bias = bias is not None and bias.dtype == mm_dtype
    return mm_dtype, fuse_bias


def finish(result: Tensor, out_dtype: torch.dtype, out: Optional[Tensor], accumulate: bool) -> Tensor:
    """Write `result` as the contract says: returned, copied into `out`, or added to it."""
    if out is None:
        return as_dtype(result, out_dtype)
    if accumulate:
        return out.add_(result)
    return out.copy_(result)


def gemm_fp8(
    a: Tensor,
    b: Tensor,
    a_scale_inv: Tensor,
    b_scale_inv: Tensor,
    *,
    out_dtype: torch.dtype,
    scaling: str = TENSORWISE,
    bias: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
    accumulate: bool = False,
    fast_accumulation: bool = False,  # not passed on: float32 accumulation, as the contract allows
) -> Tensor:
    m, n = a.shape[0], b.shape[0]
    scale_a, scale_b = scaled_mm_scales(a_scale_inv, b_scale_inv, scaling, m, n)
    mm_dtype, fuse_bias = scaled_mm_plan(bias, out_dtype, accumulate and out is not None)
    result = torch._scaled_mm(
        a.contiguous(), b.contiguous().t(), scale_a, scale_b, bias=bias if fuse_bias else None, out_dtype=mm_dtype
    )
    if bias is not None and not fuse_bias:
        result = result + bias
    return finish(result, out_dtype, out, accumulate)


def gemm_fp8_supports(a, b, a_scale_inv, b_scale_inv, *, out_dtype, scaling=TENSORWISE, bias=None, out=None,
                      accumulate=False, fast_accumulation=False) -> Verdict:
    if scaling not in (TENSORWISE, ROWWISE):
        return False, f"scaling {scaling!r}: torch._scaled_mm on MUSA takes only per-tensor or per-row scales"
    arch = arch_of(a.device)
    if arch < FP8_MIN_ARCH:
        return False, f"torch._scaled_mm on MUSA needs arch >= 3.1, device is {arch_name(arch)}"
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        return False, "E5M2 x E5M2 is not a supported FP8 GEMM (use E4M3 for at least one operand)"
    if a.dim() != 2 or b.dim() != 2:
        return False, f"torch._scaled_mm needs 2-D operands, got a {tuple(a.shape)} and b {tuple(b.shape)}"
    dims = (a.shape[0], b.shape[0], a.shape[1])
    if any(d % GEMM_ALIGNMENT for d in dims):
        return False, f"M, N, K = {dims} must be multiples of {GEMM_ALIGNMENT} for torch._scaled_mm on MUSA"
    if out_dtype not in HIGH_PRECISION:
        return False, f"out_dtype {out_dtype}: only float32, bfloat16 and float16 outputs run natively"
    if a_scale_inv.dtype != torch.float32 or b_scale_inv.dtype != torch.float32:
        return False, "scale_inv tensors must be float32 for torch._scaled_mm"
    return True, ""


def gemm(
    a: Tensor,
    b: Tensor,
    *,
    bias: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
    accumulate: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    # F.linear is aten::addmm with a bias and aten::mm without: the path every nn.Linear on
    # MUSA takes, so the best-tested muDNN GEMM entry.
    result = F.linear(a, b, bias)
    if out is None:
        return result
    return out.add_(result) if accumulate else out.copy_(result)


def gemm_supports(a, b, *, bias=None, out=None, accumulate=False, out_dtype=None) -> Verdict:
    if a.dtype not in HIGH_PRECISION or b.dtype != a.dtype:
        return False, f"operands {a.dtype} x {b.dtype}: native GEMM needs equal float32/bfloat16/float16 dtypes"
    if a.dim() != 2 or b.dim() != 2:
        return False, f"gemm needs 2-D operands, got a {tuple(a.shape)} and b {tuple(b.shape)}"
    wanted = out.dtype if out is not None else (out_dtype or a.dtype)
    if wanted != a.dtype or (out_dtype is not None and out_dtype != a.dtype):
        return False, (
            f"output {wanted} from {a.dtype} operands: torch_musa's mm writes the operand dtype only, "
            "and rounding before a float32 accumulation would lose precision"
        )
    if bias is not None and bias.dtype != a.dtype:
        return False, f"bias {bias.dtype} with {a.dtype} operands: native GEMM needs the operand dtype"
    return True, ""
