"""What the installed torch + cuBLASLt can do on one NVIDIA device, probed once per device.

FP8 needs compute capability >= 8.9. Scaling modes beyond tensor-wise depend on the torch
build (row-wise and the 1x128/128x128 block scales of torch._scaled_mm need recent cuBLAS),
so each is probed with a tiny _scaled_mm whose result is checked against an emulation.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch
from te_core.backend.types import (
    BLOCK_1x128_1x128,
    BLOCK_1x128_128x128,
    FP8_FORMATS,
    MXFP8,
    ROWWISE,
    TENSORWISE,
    Capabilities,
)

from . import scaled_mm

FP8_MIN_CAPABILITY = (8, 9)
MXFP8_MIN_CAPABILITY = (10, 0)


def _probe_inputs(device, M=128, N=256, K=512):
    g = torch.Generator(device="cpu").manual_seed(7)
    a = (torch.rand(M, K, generator=g) * 4 - 2).to(torch.float8_e4m3fn).to(device)
    b = (torch.rand(N, K, generator=g) * 4 - 2).to(torch.float8_e4m3fn).to(device)
    return a, b


def _scales_for(mode: str, M: int, N: int, K: int, device):
    """Distinct power-of-two scales so that a wrong scale layout shows in the result."""
    def pattern(*shape):
        n = 1
        for s in shape:
            n *= s
        return (2.0 ** (torch.arange(n) % 3 - 1)).reshape(shape).to(device)

    kb, nb = -(-K // 128), -(-N // 128)
    shapes = {
        TENSORWISE: ((1,), (1,)),
        ROWWISE: ((M, 1), (N, 1)),
        BLOCK_1x128_128x128: ((M, kb), (nb, kb)),
        BLOCK_1x128_1x128: ((M, kb), (N, kb)),
    }[mode]
    return pattern(*shapes[0]), pattern(*shapes[1])


def probe_scaling_mode(mode: str, device) -> Tuple[bool, str]:
    """(works, why not): run a tiny scaled GEMM in `mode` and compare with an emulation."""
    try:
        a, b = _probe_inputs(device)
        sa, sb = _scales_for(mode, a.shape[0], b.shape[0], a.shape[1], device)
        got = scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=torch.float32, scaling=mode)
        want = scaled_mm.emulate(a, b, sa, sb, mode)
        err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        if err > 1e-3:
            return False, f"torch._scaled_mm gave wrong results in {mode} mode (relative error {err:.2e})"
        return True, ""
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as exc:
        return False, f"torch._scaled_mm does not run {mode} here: {str(exc).splitlines()[0][:160]}"


def decode_cudnn_version(encoded: int) -> Tuple[int, int, int]:
    """cuDNN's version integer as (major, minor, patch): cuDNN 9 and later encode it as
    major * 10000 + minor * 100 + patch (9.1.0 is 90100), earlier releases as
    major * 1000 + minor * 100 + patch (8.9.7 is 8907)."""
    major, rest = divmod(int(encoded), 10000 if encoded >= 90000 else 1000)
    minor, patch = divmod(rest, 100)
    return major, minor, patch


def library_versions() -> Dict[str, Tuple[int, int, int]]:
    """{"cudnn": (major, minor, patch)} of the cuDNN loaded at run time (what torch's SDPA runs
    on this device), or {} where torch has none."""
    try:
        encoded = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except (RuntimeError, AttributeError):  # a torch build without cuDNN answers one of these
        encoded = None
    return {} if encoded is None else {"cudnn": decode_cudnn_version(encoded)}


def _launch_note() -> str:
    """Whether te_triton's repeated launches go through its C extension (te-core info shows it)."""
    try:
        from te_triton.launch import c_launch_status
    except ImportError as err:  # (te_triton loads with the ops; say so rather than fail the query)
        return f"te_triton is not importable ({err})"
    return c_launch_status()


@functools.lru_cache(maxsize=None)
def capabilities_for(index: int, probe: Optional[Callable[[str, object], Tuple[bool, str]]] = None) -> Capabilities:
    probe = probe or probe_scaling_mode
    major, minor = (int(v) for v in torch.cuda.get_device_capability(index))
    name = torch.cuda.get_device_name(index)
    arch = f"sm_{major}{minor}"
    device_facts = dict(compute_capability=(major, minor), library_versions=library_versions())
    notes = [_launch_note()]
    if (major, minor) < FP8_MIN_CAPABILITY:
        notes.append(f"FP8 needs compute capability >= 8.9; {name} is {major}.{minor}")
        return Capabilities({}, frozenset(), arch, name, "nccl", tuple(notes), **device_facts)
    modes = {TENSORWISE}
    device = torch.device("cuda", index)
    for mode in (ROWWISE, BLOCK_1x128_128x128, BLOCK_1x128_1x128):
        ok, why = probe(mode, device)
        if ok:
            modes.add(mode)
        else:
            notes.append(why)
    if (major, minor) >= MXFP8_MIN_CAPABILITY:
        modes.add(MXFP8)
        notes.append("mxfp8 GEMMs run on the reference path (scale swizzling not implemented yet)")
    formats: Dict[str, float] = {fname: fmax for fname, fmax in FP8_FORMATS.values()}
    return Capabilities(formats, frozenset(modes), arch, name, "nccl", tuple(notes), **device_facts)
