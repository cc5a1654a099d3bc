"""Reference GEMMs, `a @ b.T`: high precision, and FP8 by dequantizing each operand to float32."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backend.types import (
    BLOCK_1x128_128x128,
    MXFP8,
    ROWWISE,
    SCALING_MODES,
    TENSORWISE,
    as_dtype,
)
from .cast import (
    MX_BLOCK,
    blockwise_scale_shape,
    check_choice,
    check_float,
    check_fp8_tensor,
    check_ndim,
    dequantize_blockwise,
    dequantize_mxfp8,
)


def _check_operands(a: Tensor, b: Tensor) -> Tuple[int, int, int]:
    check_ndim("a", a, 2)
    check_ndim("b", b, 2)
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"a {tuple(a.shape)} and b {tuple(b.shape)} disagree on K: the GEMM computes a @ b.T, "
            "so a is (M, K) and b is (N, K)"
        )
    return a.shape[0], b.shape[0], a.shape[1]


def _finish(acc: Tensor, bias: Optional[Tensor], out: Optional[Tensor], accumulate: bool, out_dtype) -> Tensor:
    """Add bias, then write (or add) into `out` with one rounding to the output dtype."""
    n = acc.shape[1]
    if bias is not None:
        if bias.numel() != n:
            raise ValueError(f"bias has {bias.numel()} elements (shape {tuple(bias.shape)}); expected N={n}")
        acc = acc + bias.reshape(n).to(acc.dtype)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs `out` (the tensor to add the product into)")
        return as_dtype(acc, out_dtype)
    if tuple(out.shape) != tuple(acc.shape):
        raise ValueError(f"out has shape {tuple(out.shape)}; the product is {tuple(acc.shape)}")
    if out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(f"out has dtype {out.dtype} but out_dtype={out_dtype}; make them agree")
    if accumulate:
        acc = acc + out.to(acc.dtype)
    out.copy_(acc)
    return out


def gemm(
    a: Tensor,
    b: Tensor,
    *,
    bias: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
    accumulate: bool = False,
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    check_float("a", a)
    check_float("b", b)
    _check_operands(a, b)
    compute = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    acc = a.to(compute) @ b.to(compute).t()
    if out_dtype is None and out is None:
        out_dtype = a.dtype
    return _finish(acc, bias, out, accumulate, out_dtype)


def _is_2d_block(scaling: str, operand: str) -> bool:
    """Only the weight-side operand b of the fprop/dgrad block recipe uses 128x128 tiles."""
    return scaling == BLOCK_1x128_128x128 and operand == "b"


def _expected_scale_shape(scaling: str, operand: str, rows: int, k: int) -> Tuple[int, ...]:
    if scaling == TENSORWISE:
        return (1,)
    if scaling == ROWWISE:
        return (rows, 1)
    if scaling == MXFP8:
        return (rows, k // MX_BLOCK)
    return blockwise_scale_shape(rows, k, _is_2d_block(scaling, operand))


def _dequantize_operand(x: Tensor, scale_inv: Tensor, scaling: str, operand: str) -> Tensor:
    rows, k = x.shape
    name = f"{operand}_scale_inv"
    expected = _expected_scale_shape(scaling, operand, rows, k)
    if scaling == MXFP8:
        if k % MX_BLOCK != 0:
            raise ValueError(f"scaling={scaling!r} needs K to be a multiple of {MX_BLOCK}, got K={k}")
        if scale_inv.dtype != torch.uint8:
            raise ValueError(f"scaling={scaling!r}: {name} must be uint8 E8M0, got {scale_inv.dtype}")
    actual = tuple(scale_inv.shape)
    ok = scale_inv.numel() == 1 if scaling == TENSORWISE else actual == expected
    if not ok:
        raise ValueError(
            f"scaling={scaling!r}: {name} for {operand} of shape {(rows, k)} must have shape {expected}, got {actual}"
        )
    if scaling == TENSORWISE:
        return x.float() * scale_inv.reshape(()).float()
    if scaling == ROWWISE:
        return x.float() * scale_inv.float()
    if scaling == MXFP8:
        return dequantize_mxfp8(x, scale_inv, torch.float32)
    return dequantize_blockwise(x, scale_inv, _is_2d_block(scaling, operand), torch.float32)


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
    fast_accumulation: bool = False,  # float32 accumulation regardless (the contract allows it)
) -> Tensor:
    check_fp8_tensor("a", a)
    check_fp8_tensor("b", b)
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        raise ValueError("gemm_fp8 does not take E5M2 x E5M2 (no FP8 GEMM hardware does); make one operand E4M3")
    check_choice("scaling", scaling, SCALING_MODES)
    _check_operands(a, b)
    acc = _dequantize_operand(a, a_scale_inv, scaling, "a") @ _dequantize_operand(b, b_scale_inv, scaling, "b").t()
    return _finish(acc, bias, out, accumulate, out_dtype)
