"""Inputs shared by the norm-backward probes: the two benchmark shapes, LayerNorm and RMSNorm,
with the statistics of te_triton's forward and te-backend-cuda's config for each case."""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch

SHAPES = [(16384, 4096), (16384, 8192)]


class NormBwdCase(NamedTuple):
    name: str  # "layernorm" or "rmsnorm"
    M: int
    N: int
    rms: bool
    x: torch.Tensor
    dy: torch.Tensor
    w: torch.Tensor
    mean: object  # None for RMSNorm
    rstd: torch.Tensor
    cfg: object  # te-backend-cuda's choice (fused._norm_bwd_cfg)


def norm_bwd_cases() -> Iterator[NormBwdCase]:
    from te_backend_cuda import fused
    from te_triton import norm

    for M, N in SHAPES:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3 + 1
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for rms in (False, True):
            _, mean, rstd, _ = norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms)
            yield NormBwdCase("rmsnorm" if rms else "layernorm", M, N, rms, x, dy, w, mean, rstd,
                              fused._norm_bwd_cfg(x, rms=rms))
