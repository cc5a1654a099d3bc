"""RoPE through muDNN: torch.nn.functional.rope (torch_musa csrc/aten/ops/RoPE.cpp).

What torch_musa's own test (tests/unittest/operator/test_rope.py) pins down, and the only
mode used here: F.rope(input=x (s, b, h, d), freq_cis=(s, r) angles, rotary_interleaved=False,
batch_first=False) = x * cos(f) + rotate_half(x) * sin(f) over the first r dims — the
contract's non-interleaved form with freqs = cat(f, f) already in the angles. The other modes
are reached by conversions in PyTorch around that one call, never by the untested flags:
- "bshd": a transposed view to (s, b, h, d) and back;
- interleaved (GPT-J): de-interleave the pairs into halves, rotate with cat(f, f) of the
  first r/2 angles, interleave back;
- partial rotation (r < d): only x[..., :r] goes in, the rest is concatenated back;
- backward: the forward's transpose, in PyTorch ops: a channel's partner term takes the
  partner's angle, which F.rope (one angle per output channel) cannot express where freqs
  pairs differ.
Math in float32 (x and freqs are upcast), y in x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from te_core.reference import rope as reference_rope

from ..runtime import arch_name, arch_of
from .activation import MUDNN_FUSED_MIN_ARCH
from .gemm import HIGH_PRECISION, Verdict

TENSOR_FORMATS = ("sbhd", "bshd")


def _rope_kernel(x_sbhd: Tensor, angles: Tensor) -> Tensor:
    return F.rope(input=x_sbhd, freq_cis=angles, rotary_interleaved=False, batch_first=False)


def _rotate(x: Tensor, freqs: Tensor, tensor_format: str, interleaved: bool) -> Tensor:
    x_sbhd = x if tensor_format == "sbhd" else x.transpose(0, 1)
    seq, rot = x_sbhd.shape[0], freqs.shape[-1]
    angles = freqs[:seq].reshape(seq, rot).float()
    part = x_sbhd[..., :rot].float()
    if interleaved:
        # channel d reads angle d (TE's interleaved layout): de-interleave the angles like x
        angles = torch.cat((angles[:, 0::2], angles[:, 1::2]), dim=-1)
        part = torch.cat((part[..., 0::2], part[..., 1::2]), dim=-1)
    rotated = _rope_kernel(part.contiguous(), angles.contiguous())
    if interleaved:
        rotated = torch.stack((rotated[..., : rot // 2], rotated[..., rot // 2 :]), dim=-1).flatten(-2)
    y = torch.cat((rotated.to(x.dtype), x_sbhd[..., rot:]), dim=-1)
    return y if tensor_format == "sbhd" else y.transpose(0, 1).contiguous()


def rope_fwd(x: Tensor, freqs: Tensor, *, tensor_format: str = "sbhd", interleaved: bool = False) -> Tensor:
    return _rotate(x, freqs, tensor_format, interleaved)


# The forward's transpose: a channel's partner term takes the partner's angle, which F.rope (one
# angle per output channel) cannot express where a pair's angles differ; the reference's PyTorch
# ops compute it on the device.
rope_bwd = reference_rope.rope_bwd


def rope_supports(x, freqs, *, tensor_format="sbhd", interleaved=False) -> Verdict:
    if tensor_format not in TENSOR_FORMATS:
        return False, f"tensor_format {tensor_format!r}: native RoPE handles {', '.join(TENSOR_FORMATS)}"
    if x.dim() != 4 or x.dtype not in HIGH_PRECISION:
        return False, f"x must be a 4-D float32/float16/bfloat16 tensor, got {x.dtype} {tuple(x.shape)}"
    seq = x.shape[0] if tensor_format == "sbhd" else x.shape[1]
    rot = freqs.shape[-1]
    if freqs.dim() != 4 or freqs.shape[0] < seq or freqs.shape[1:3] != (1, 1):
        return False, f"freqs {tuple(freqs.shape)} is not (s >= {seq}, 1, 1, r)"
    if rot % 2 or rot > x.shape[-1] or rot == 0:
        return False, f"rotary dim r={rot} must be even and in (0, {x.shape[-1]}]"
    arch = arch_of(x.device)
    if arch < MUDNN_FUSED_MIN_ARCH:
        return False, f"F.rope is verified by torch_musa only on arch >= 2.2, device is {arch_name(arch)}"
    return True, ""
