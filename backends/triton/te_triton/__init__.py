"""Triton kernels shared by te-core backends (any vendor whose Triton compiles them).

One module per op family (cast, blockwise, norm, activation, dbias, softmax, rope, loss, gemm,
scaling); every kernel launches through `launch`, which reuses a compiled kernel without
Triton's per-call argument binding. Every launcher takes its tuning parameters (block sizes,
warps, program caps) from the caller as a `Config`, so each backend picks configs for its
hardware. Launchers take and return torch tensors on the kernel's device and follow the te_core
op contract (te_core/ops) for the op of the same name.

The names below are what a backend needs besides the family modules: `Config`; `MAX_NUMEL`,
the most elements a kernel indexes (int32 offsets); `amax_out_ok(amax_out, x)`, whether the
kernels can max an amax straight into a caller's slot; `fp8_max(dtype)`; `tma_ready(*tensors)`,
whether tensors can go through TMA descriptors; `cdiv` and `next_power_of_2`, for grids and
block sizes on the host (cheaper than Triton's own, which are constexpr functions). Modules and names with a leading underscore
are internal and may change.
"""
from ._common import MAX_NUMEL, Config, amax_out_ok, cdiv, fp8_max, next_power_of_2, tma_ready

__all__ = ["Config", "MAX_NUMEL", "amax_out_ok", "cdiv", "fp8_max", "next_power_of_2", "tma_ready"]
