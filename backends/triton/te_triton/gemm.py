"""A tensor-wise scaled FP8 GEMM for small problems, where host time is the cost.

For a GEMM whose GPU time is a few microseconds (a small layer, a short sequence) an eager
step is bound by what the host does around it. A Triton kernel launched through `launch` takes
the same GPU time as a vendor library's up to about 1024x1024x1024 on Hopper, and a backend can
skip the library call's argument and scale-layout handling for it; on larger problems the
library's kernels are faster, so backends choose by size.

out = (a @ b.T) * a_scale_inv * b_scale_inv (+ bias), a (M, K) and b (N, K) row-major FP8,
float32 accumulation, as te_core.ops.gemm_fp8 with tensor-wise scaling.

add_bias_ adds a bias to a GEMM's output in place, for GEMMs whose library epilogue takes none.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import FP8_DTYPES, Config, cdiv
from .launch import launcher

GEMM_DEFAULT = Config(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ADD_BIAS_DEFAULT = Config(block_m=16, block_n=256, num_warps=4)


@launcher
@triton.jit
def _gemm_kernel(a_ptr, b_ptr, out_ptr, sa_ptr, sb_ptr, bias_ptr, M, N, K, HAS_BIAS: tl.constexpr,
                 FAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """FAST: the tensor cores' own accumulation across the whole K (fast accumulation); else
    their partial sums are added into the float32 accumulator after every BK step."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_rows = a_ptr + rm[:, None].to(tl.int64) * K
    b_rows = b_ptr + rn[:, None].to(tl.int64) * K
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_rows + (k + rk)[None, :], mask=(rm[:, None] < M) & ((k + rk)[None, :] < K), other=0.0)
        b = tl.load(b_rows + (k + rk)[None, :], mask=(rn[:, None] < N) & ((k + rk)[None, :] < K), other=0.0)
        if FAST:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BK)
    acc = acc * (tl.load(sa_ptr) * tl.load(sb_ptr))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_args(a, b, a_scale_inv, b_scale_inv, out_dtype, bias) -> Optional[str]:
    """Why the kernel cannot take this call, or None."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        return f"a (M, K) and b (N, K) must be 2-D with one K, got {tuple(a.shape)} and {tuple(b.shape)}"
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        return f"operands must be FP8, got {a.dtype} and {b.dtype}"
    if not (a.is_contiguous() and b.is_contiguous()):
        return "operands must be contiguous row-major"
    if a_scale_inv.numel() != 1 or b_scale_inv.numel() != 1:
        return "tensor-wise scaling takes one-element scale_inv tensors"
    if a_scale_inv.dtype != torch.float32 or b_scale_inv.dtype != torch.float32:
        return "scale_inv tensors must be float32"
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}"
    if bias is not None and (bias.dim() != 1 or bias.numel() != b.shape[0] or not bias.is_contiguous()):
        return f"bias must be a contiguous ({b.shape[0]},) tensor, got {tuple(bias.shape)}"
    device = a.device  # (the kernel reads every operand on a's device)
    if b.device != device or a_scale_inv.device != device or b_scale_inv.device != device or (
            bias is not None and bias.device != device):
        return f"b, the scale_inv tensors and bias must be on a's device {device}"
    return None


def gemm_fp8(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor, *,
             out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, fast_accumulation: bool = False,
             cfg: Config = GEMM_DEFAULT) -> torch.Tensor:
    """(a @ b.T) * a_scale_inv * b_scale_inv (+ bias) as out_dtype; a ValueError names a call
    the kernel cannot take (check_args)."""
    why = check_args(a, b, a_scale_inv, b_scale_inv, out_dtype, bias)
    if why:
        raise ValueError(f"te_triton.gemm.gemm_fp8: {why}")
    (M, K), N = a.shape, b.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    grid = (cdiv(M, cfg.block_m), cdiv(N, cfg.block_n))
    _gemm_kernel[grid](a, b, out, a_scale_inv, b_scale_inv, bias, M, N, K, bias is not None, bool(fast_accumulation),
                       cfg.block_m, cfg.block_n, cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@launcher
@triton.jit
def _add_bias_kernel(y_ptr, bias_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    b = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    ptrs = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + b[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


def add_bias_reason(y: torch.Tensor, bias: torch.Tensor) -> Optional[str]:
    """Why add_bias_ cannot take this y and bias, or None."""
    if y.dim() != 2 or not y.is_contiguous() or y.dtype not in (torch.bfloat16, torch.float16):
        return (f"y must be a contiguous 2-D bf16 or fp16 tensor, got {y.dtype} {tuple(y.shape)} "
                f"(contiguous: {y.is_contiguous()})")
    if bias.dtype != y.dtype or bias.dim() != 1 or bias.numel() != y.shape[1] or not bias.is_contiguous():
        return (f"bias must be a contiguous ({y.shape[1]},) tensor of y's dtype {y.dtype}, "
                f"got {bias.dtype} {tuple(bias.shape)}")
    if bias.device != y.device:
        return f"bias is on {bias.device} but y is on {y.device}; move it to y's device"
    return None


def add_bias_(y: torch.Tensor, bias: torch.Tensor, cfg: Config = ADD_BIAS_DEFAULT) -> torch.Tensor:
    """y += bias (broadcast over y's rows) in place, y a contiguous (M, N) bf16 or fp16 tensor and
    bias (N,) of its dtype: the bytes torch's y.add_(bias) writes (the sum in float32, rounded
    once), near a copy's bandwidth. torch runs a row-broadcast add through its strided
    elementwise kernel, well below that: this is the bias of a GEMM whose library epilogue takes
    none. A ValueError names a y or bias it cannot take (add_bias_reason)."""
    why = add_bias_reason(y, bias)
    if why:
        raise ValueError(why)
    M, N = y.shape
    if y.numel():
        _add_bias_kernel[(cdiv(M, cfg.block_m), cdiv(N, cfg.block_n))](y, bias, M, N, BM=cfg.block_m,
                                                                      BN=cfg.block_n, num_warps=cfg.num_warps)
    return y
