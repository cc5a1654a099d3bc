"""SwiGLU through muDNN: torch.nn.functional.swish_glu (torch_musa csrc/aten/ops/SwiGlu.cpp).

F.swish_glu(x) = silu(x[..., :h]) * x[..., h:] for float32/float16/bfloat16 x, with an
autograd backward (muDNN SwiGlu::RunBwd) — the contract's "swiglu". The other kinds have no
muDNN kernel exposed by torch_musa and run on the reference. FP8 output: the op in float32, then
a cast.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..runtime import arch_name, arch_of
from .fp8_cast import cast_with_amax
from .gemm import HIGH_PRECISION, Verdict

NATIVE_KINDS = ("swiglu",)
# torch_musa's tests run swish_glu (and rope) only on arch >= 2.2; older devices are unverified.
MUDNN_FUSED_MIN_ARCH = (2, 2)


def _swish_glu(x: Tensor) -> Tensor:
    return F.swish_glu(x)


def activation_fwd(
    x: Tensor,
    kind: str,
    *,
    fp8_scale: Optional[Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
    amax_out: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    if fp8_dtype is None:
        return _swish_glu(x), None
    # FP8 out: the activation in float32, cast once, as the contract computes it (a 16-bit result
    # cast again to FP8 rounds twice, which moves more values by one FP8 step than the contract allows)
    return cast_with_amax(_swish_glu(x.float()), fp8_scale, fp8_dtype, amax_out)


def activation_bwd(dy: Tensor, x: Tensor, kind: str) -> Tensor:
    # F.swish_glu's autograd node is muDNN's backward kernel; torch_musa exposes it no other way.
    with torch.enable_grad():
        leaf = x.detach().requires_grad_(True)
        (dx,) = torch.autograd.grad(_swish_glu(leaf), leaf, dy)
    return dx


def _verdict(x: Tensor, kind: str) -> Verdict:
    if kind not in NATIVE_KINDS:
        return False, f"activation {kind!r} has no muDNN kernel in torch_musa (native: {', '.join(NATIVE_KINDS)})"
    if x.dtype not in HIGH_PRECISION:
        return False, f"x is {x.dtype}; F.swish_glu takes float32, float16 or bfloat16"
    if x.dim() == 0 or x.shape[-1] % 2:
        return False, f"swiglu needs an even last dimension, x is {tuple(x.shape)}"
    arch = arch_of(x.device)
    if arch < MUDNN_FUSED_MIN_ARCH:
        return False, f"F.swish_glu is verified by torch_musa only on arch >= 2.2, device is {arch_name(arch)}"
    return True, ""


def activation_fwd_supports(x, kind, *, fp8_scale=None, fp8_dtype=None, amax_out=None, **params) -> Verdict:
    # params: clamped_swiglu's limit/alpha, passed only for that kind, which _verdict declines
    if fp8_dtype is not None and fp8_scale is None:
        return False, "fp8_dtype given without fp8_scale"
    if amax_out is not None and fp8_dtype is None:
        return False, "amax_out given without FP8 output"
    return _verdict(x, kind)


def activation_bwd_supports(dy, x, kind, **params) -> Verdict:
    if dy.dtype != x.dtype:
        return False, f"dy {dy.dtype} differs from x {x.dtype}"
    return _verdict(x, kind)
