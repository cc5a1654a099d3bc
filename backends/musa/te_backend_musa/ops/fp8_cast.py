"""The FP8 output epilogue shared by ops that produce FP8 (norm, activation): a cast after the
high-precision kernel, since muDNN's fused kernels have no FP8 output through torch_musa."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from te_core.backend.types import fp8_max


def cast_with_amax(y: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype,
                   amax_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(saturate(y * scale) as fp8_dtype, max|y| as 0-dim float32), as te_core.ops.cast says:
    values beyond the format's max become +-max, NaN stays NaN (clamp propagates it). With
    amax_out the amax is maxed into it (NaN wins) and amax_out is returned."""
    limit = fp8_max(fp8_dtype)
    yf = y.float()
    amax = yf.abs().amax() if yf.numel() else yf.new_zeros(())
    data = (yf * scale.float().reshape(())).clamp(-limit, limit).to(fp8_dtype)
    if amax_out is not None:
        torch.maximum(amax_out, amax.reshape(amax_out.shape), out=amax_out)
        return data, amax_out
    return data, amax
