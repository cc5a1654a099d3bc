"""The shared Triton kernels (package te_triton) on MUSA, with tuning configs for MUSA GPUs.

They are declared only when a Moore Threads Triton backend is importable — Moore Threads'
own triton 3.2 (`triton.backends.mtgpu`) or FlagTree >= 3.6 (`triton.backends.mthreads`) —
and te_triton is installed. Upstream triton cannot target MUSA.

Tuning (from the architectures' documented warp size and shared memory; not yet checked on
hardware): a warp is 32 threads on arch 3.1 and 128 on arch <= 2.2, so num_warps is scaled
to keep ~256 threads per program; arch 2.2 has 72 KiB of shared memory per block (192 KiB
on 3.1), so its 2-D tiles are halved.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
from functools import partial
from typing import Callable, Dict, Optional, Tuple

import torch
from te_core.backend.types import OpImpl

from .runtime import Arch

MT_TRITON_BACKENDS = ("triton.backends.mtgpu", "triton.backends.mthreads")
ARCH_31 = (3, 1)

# op name -> (te_triton module, launcher, fixed keyword arguments, {config keyword: role})
LAUNCHERS: Dict[str, Tuple[str, str, dict, Dict[str, str]]] = {
    "quantize_fp8": ("cast", "quantize_fp8", {}, {"cfg": "quantize"}),
    "cast_transpose_fp8": ("cast", "cast_transpose_fp8", {}, {"cfg": "cast_transpose"}),
    "quantize_fp8_current": ("cast", "quantize_fp8_current", {}, {"cfg": "quantize", "ct_cfg": "cast_transpose"}),
    "activation_fwd": ("activation", "activation_fwd", {}, {"cfg": "elementwise"}),
    "activation_bwd": ("activation", "activation_bwd", {}, {"cfg": "elementwise"}),
    "dbias_cast_transpose": ("dbias", "dbias_cast_transpose", {}, {"cfg": "cast_transpose"}),
    "dbias_cast_transpose_parts": ("dbias", "dbias_cast_transpose_parts", {}, {"cfg": "cast_transpose"}),
    "dbias_cast_transpose_current": (
        "dbias", "dbias_cast_transpose_current", {}, {"cfg": "cast_transpose", "amax_cfg": "quantize"},
    ),
    "activation_bwd_dbias_cast_transpose": (
        "dbias", "activation_bwd_dbias_cast_transpose", {}, {"cfg": "cast_transpose", "act_cfg": "elementwise"},
    ),
    "layernorm_fwd": ("norm", "norm_fwd", {"rms": False}, {"cfg": "norm"}),
    "layernorm_bwd": ("norm", "norm_bwd", {"rms": False}, {"cfg": "norm"}),
    "layernorm_bwd_add": ("norm", "norm_bwd_add", {"rms": False}, {"cfg": "norm"}),
}


def mt_triton_backend() -> Tuple[Optional[str], str]:
    """(name of the Moore Threads Triton backend, "") or (None, why there is none)."""
    for name in MT_TRITON_BACKENDS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name, ""
        except (ImportError, ValueError):  # no triton at all, or a stub module without a spec
            continue
    return None, f"no Moore Threads Triton backend ({' or '.join(MT_TRITON_BACKENDS)}) is importable"


def warp_size(arch: Arch) -> int:
    return 32 if arch >= ARCH_31 else 128


def tuning_configs(arch: Arch) -> dict:
    """role -> te_triton.Config for a MUSA architecture."""
    from te_triton import Config

    warps_256 = max(1, 256 // warp_size(arch))
    big_smem = arch >= ARCH_31
    return {
        "quantize": Config(block=4096, num_warps=warps_256),
        "cast_transpose": Config(block_m=64 if big_smem else 32, block_n=64, num_warps=max(1, 128 // warp_size(arch))),
        "elementwise": Config(block_m=16 if big_smem else 8, block_n=256, num_warps=warps_256),
        "norm": Config(num_warps=warps_256, max_programs=1024 if big_smem else 512),
    }


def _generic_supports(*args, **kwargs) -> Tuple[bool, str]:
    """For a launcher without a supports() of its own: a float first input that int32 offsets
    index, and every tensor contiguous (the launchers raise on strided ones, where the reference
    should take the call)."""
    x = args[0]
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, f"Triton kernel input is {x.dtype}; float32, bfloat16 or float16 expected"
    if x.numel() >= 2**31:
        return False, f"{x.numel()} elements exceed the int32 indexing of the Triton kernels"
    for value in (*args, *kwargs.values()):
        for t in (value if isinstance(value, (list, tuple)) else (value,)):
            if isinstance(t, torch.Tensor) and not t.is_contiguous():
                return False, "a tensor argument is not contiguous"
    return True, ""


def _bind(module, op: str, configs: dict) -> Optional[OpImpl]:
    _, launcher_name, fixed, roles = LAUNCHERS[op]
    launcher = getattr(module, launcher_name, None)
    if launcher is None:
        return None
    params = inspect.signature(launcher).parameters
    if any(name not in params for name in (*fixed, *roles)):
        return None  # te_triton's launcher changed shape: leave the op to the reference
    fn = partial(launcher, **fixed, **{name: configs[role] for name, role in roles.items()})
    supports: Callable = getattr(module, f"{launcher_name}_supports", _generic_supports)
    return OpImpl(fn, supports)


def triton_ops(arch: Arch) -> Tuple[Dict[str, OpImpl], str]:
    """(op name -> OpImpl, why none) for the te_triton kernels usable on this MUSA device."""
    backend, why = mt_triton_backend()
    if backend is None:
        return {}, why
    try:
        configs = tuning_configs(arch)
    except ImportError as exc:
        return {}, f"te_triton is not installed ({exc}); pip install te-backend-musa[triton]"
    ops = {}
    for op, (module_name, *_rest) in LAUNCHERS.items():
        try:
            module = importlib.import_module(f"te_triton.{module_name}")
        except ModuleNotFoundError:
            continue
        impl = _bind(module, op, configs)
        if impl is not None:
            ops[op] = impl
    return ops, ""
