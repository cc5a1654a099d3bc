"""The ops this backend runs natively, each declared only when the torch_musa feature it
relies on is present — detected by feature (hasattr), never by version, because torch on
MUSA is Moore Threads' patched build."""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from te_core.backend.types import OpImpl

from ..capabilities import has_fp8_dtypes
from . import activation, attention, gemm, norm, optimizer, rope

# (feature test, {op name: OpImpl}); the test names what torch_musa must provide.
Feature = Tuple[str, Callable[[], bool], Dict[str, OpImpl]]


def _features() -> List[Feature]:
    return [
        ("torch._scaled_mm + float8 dtypes", lambda: hasattr(torch, "_scaled_mm") and has_fp8_dtypes(),
         {"gemm_fp8": OpImpl(gemm.gemm_fp8, gemm.gemm_fp8_supports)}),
        ("F.linear", lambda: True, {"gemm": OpImpl(gemm.gemm, gemm.gemm_supports)}),
        ("aten::_fused_rmsnorm_forward", lambda: hasattr(torch.ops.aten, "_fused_rmsnorm_forward"),
         {"rmsnorm_fwd": OpImpl(norm.rmsnorm_fwd, norm.rmsnorm_fwd_supports)}),
        ("aten::_fused_rmsnorm_backward", lambda: hasattr(torch.ops.aten, "_fused_rmsnorm_backward"),
         {"rmsnorm_bwd": OpImpl(norm.rmsnorm_bwd, norm.rmsnorm_bwd_supports)}),
        ("F.swish_glu", lambda: hasattr(F, "swish_glu"),
         {"activation_fwd": OpImpl(activation.activation_fwd, activation.activation_fwd_supports),
          "activation_bwd": OpImpl(activation.activation_bwd, activation.activation_bwd_supports)}),
        ("F.rope", lambda: hasattr(F, "rope"),
         {"rope_fwd": OpImpl(rope.rope_fwd, rope.rope_supports),
          "rope_bwd": OpImpl(rope.rope_bwd, rope.rope_supports)}),
        ("F.scaled_dot_product_attention", lambda: hasattr(F, "scaled_dot_product_attention"),
         {"attention": OpImpl(attention.attention, attention.attention_supports)}),
        ("torch._fused_adamw_ / torch._fused_adam_", lambda: hasattr(torch, "_fused_adamw_") and hasattr(torch, "_fused_adam_"),
         {"multi_tensor_adam": OpImpl(optimizer.multi_tensor_adam, optimizer.multi_tensor_adam_supports)}),
    ]


def native_ops() -> Tuple[Dict[str, OpImpl], List[str]]:
    """(op name -> OpImpl for every present feature, names of the missing features)."""
    ops: Dict[str, OpImpl] = {}
    missing = []
    for name, present, impls in _features():
        if present():
            ops.update(impls)
        else:
            missing.append(name)
    return ops, missing


def first_supported(primary: OpImpl, secondary: OpImpl) -> OpImpl:
    """One OpImpl that runs `primary` where it accepts the call, else `secondary`."""

    def choose(*args, **kwargs):
        ok, why = primary.supports(*args, **kwargs)
        if ok:
            return primary.fn, ""
        ok2, why2 = secondary.supports(*args, **kwargs) if secondary.supports else (True, "")
        return (secondary.fn, "") if ok2 else (None, f"{why}; Triton: {why2}")

    def supports(*args, **kwargs):
        fn, why = choose(*args, **kwargs)
        return fn is not None, why

    def run(*args, **kwargs):
        return choose(*args, **kwargs)[0](*args, **kwargs)

    return OpImpl(run, supports)


def merge(native: Dict[str, OpImpl], extra: Dict[str, OpImpl]) -> Dict[str, OpImpl]:
    """muDNN-backed ops first; Triton kernels fill the ops they lack and the calls they decline."""
    merged = dict(native)
    for name, impl in extra.items():
        merged[name] = first_supported(native[name], impl) if name in native else impl
    return merged
