"""The contract ops this backend implements natively, as OpImpl(fn, supports).

Each fn takes exactly the arguments of the contract op (te_core/ops/<family>.py). Here they
delegate to the reference implementations; a vendor replaces them with calls into its kernels.
Ops left out of OPS run on the reference backend. `supports` declines calls the kernel cannot
run (the dispatcher then runs the reference, warning once with the reason).
"""
from __future__ import annotations

from typing import Tuple

from te_core.backend import OpImpl
from te_core.reference import activation, cast, gemm, norm

GEMM_ALIGNMENT = 16


def gemm_fp8_supports(a, b, a_scale_inv, b_scale_inv, **_) -> Tuple[bool, str]:
    """FP8 tensor-core GEMMs typically need every dimension a multiple of 16."""
    m, k = a.shape
    n = b.shape[0]
    if m % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT or k % GEMM_ALIGNMENT:
        return False, f"gemm_fp8 needs M, N, K multiples of {GEMM_ALIGNMENT}, got M={m}, N={n}, K={k}"
    return True, ""


def quantize_fp8(x, scale, fp8_dtype, *, amax_out=None):
    # Replace the body with your kernel launch; keep the signature of te_core.ops.quantize_fp8.
    return cast.quantize_fp8(x, scale, fp8_dtype, amax_out=amax_out)


OPS = {
    "quantize_fp8": OpImpl(quantize_fp8),
    "cast_transpose_fp8": OpImpl(cast.cast_transpose_fp8),
    "gemm": OpImpl(gemm.gemm),
    "gemm_fp8": OpImpl(gemm.gemm_fp8, supports=gemm_fp8_supports),
    "layernorm_fwd": OpImpl(norm.layernorm_fwd),
    "activation_fwd": OpImpl(activation.activation_fwd),
}
