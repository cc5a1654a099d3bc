"""What a MUSA device can do, as data: derived from its architecture alone (pure, testable).

Facts (torch_musa v2.7.1 / 2.9.1): FP8 dtypes and torch._scaled_mm need arch >= (3, 1);
_scaled_mm takes per-tensor or per-row float32 scales only; MCCL runs on arch >= (2, 2),
bf16 collectives need (2, 2), FP8 payloads (3, 1).
"""
from __future__ import annotations

from typing import Tuple

import torch
from te_core.backend.types import (
    BLOCK_1x128_1x128,
    BLOCK_1x128_128x128,
    MXFP8,
    ROWWISE,
    TENSORWISE,
    Capabilities,
    fp8_max,
)

from .runtime import Arch, arch_name

FP8_MIN_ARCH: Arch = (3, 1)
MCCL_MIN_ARCH: Arch = (2, 2)
FP8_DTYPE_NAMES = ("float8_e4m3fn", "float8_e5m2")

NOTE_NO_BLOCKWISE = (
    f"FP8 scaling modes {BLOCK_1x128_128x128!r} and {BLOCK_1x128_1x128!r} run on the reference "
    "(dequantize + matmul): torch._scaled_mm on MUSA accepts only per-tensor or per-row float32 "
    "scales, and MT-TransformerEngine's block-scaled GEMM (muDNN BatchMatMul::RunLt with "
    "SetScale tiles) lives in its own C++ extension, which torch_musa does not expose"
)
NOTE_NO_MXFP8 = (
    f"FP8 scaling mode {MXFP8!r} runs on the reference: torch_musa has no E8M0 dtype and no "
    "MX-scaled GEMM"
)


def has_fp8_dtypes() -> bool:
    return all(hasattr(torch, name) for name in FP8_DTYPE_NAMES)


def fp8_notes(arch: Arch, dtypes_present: bool) -> Tuple[Tuple[str, ...], bool]:
    """(notes, fp8 usable) for an architecture."""
    if arch < FP8_MIN_ARCH:
        return (
            f"no FP8 on {arch_name(arch)}: FP8 (E4M3/E5M2) and torch._scaled_mm need MUSA arch >= "
            f"{FP8_MIN_ARCH[0]}.{FP8_MIN_ARCH[1]} (S5000); FP8 recipes run on the reference here",
        ), False
    if not dtypes_present:
        return ("no FP8: this torch build lacks torch.float8_e4m3fn / torch.float8_e5m2 (MUSA >= 4.0 needed)",), False
    return (), True


def distributed_notes(arch: Arch) -> Tuple[str, Tuple[str, ...]]:
    """(torch.distributed backend, notes)."""
    if arch < MCCL_MIN_ARCH:
        return "gloo", (
            f"MCCL does not support {arch_name(arch)} (S80/S3000); torch.distributed falls back to gloo",
        )
    notes = ["MCCL: allgather_coalesced is not implemented; use allgather per tensor"]
    if arch < FP8_MIN_ARCH:
        notes.append(f"MCCL: FP8 payloads need arch >= {FP8_MIN_ARCH[0]}.{FP8_MIN_ARCH[1]}")
    notes.append("MCCL: bf16 collectives need arch >= 2.2")
    return "mccl", tuple(notes)


def capabilities_for(arch: Arch, device_name: str, dtypes_present: bool) -> Capabilities:
    notes, fp8 = fp8_notes(arch, dtypes_present)
    backend, dist_notes = distributed_notes(arch)
    formats = {}
    modes = frozenset()
    if fp8:
        formats = {"E4M3": fp8_max(torch.float8_e4m3fn), "E5M2": fp8_max(torch.float8_e5m2)}
        modes = frozenset({TENSORWISE, ROWWISE})
    return Capabilities(
        fp8_formats=formats,
        scaling_modes=modes,
        arch=arch_name(arch),
        device_name=device_name,
        distributed_backend=backend,
        notes=notes + (NOTE_NO_BLOCKWISE, NOTE_NO_MXFP8) + dist_notes,
        # torch.musa.get_device_capability's (major, minor): what TE's get_device_compute_capability
        # answers here. No library_versions: there is no cuDNN on MUSA, and muDNN's version call and
        # its encoding are not documented (BackendInfo.vendor_versions shows it where torch_musa has one).
        compute_capability=(int(arch[0]), int(arch[1])),
    )
