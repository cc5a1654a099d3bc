"""te.Fp8Padding / te.Fp8Unpadding: pad each row group of a grouped GEMM's input to a multiple
of the FP8 GEMM alignment, and take the padding off its output.

FP8 GEMMs need their token dimension aligned (16 rows; 32 with MXFP8; a CustomRecipe's
quantization_alignment). Before a GroupedLinear, Fp8Padding appends zero rows to each of the
m_splits groups and returns the padded splits; after it, Fp8Unpadding drops those rows again.
The padding is plain torch (zeros, split, cat), so autograd gives the exact gradients: the
padded rows' gradients are dropped, and the dropped rows get zero gradient. As in Transformer
Engine, align_size=None takes the alignment from the recipe of the autocast around the module's
first forward (DelayedScaling's 16 outside one) and keeps it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ._common import check_m_splits, check_positive


def _recipe_align_size() -> int:
    """The row alignment the running autocast's recipe needs (16 outside one)."""
    from ..quantization.autocast import get_align_size_for_quantization, get_autocast_context

    context = get_autocast_context()
    if context is None or context.recipe is None:
        return 16
    return get_align_size_for_quantization(context.recipe)


def _rows(inp: Tensor, module: str) -> Tensor:
    if inp.dim() < 2:
        raise ValueError(f"{module}: the input must have at least 2 dimensions (rows, features), got {inp.dim()}")
    return inp.reshape(-1, inp.shape[-1])


class _Padding(nn.Module):
    def __init__(self, num_gemms: int, align_size: Optional[int] = None) -> None:
        super().__init__()
        name = type(self).__name__
        self.num_gemms = check_positive(num_gemms, name="num_gemms", module=name)
        self.align_size = None if align_size is None else check_positive(align_size, name="align_size", module=name)

    def padded(self, m_splits: Sequence[int]) -> List[int]:
        if self.align_size is None:  # the first forward's recipe decides, once (Transformer Engine's rule)
            self.align_size = _recipe_align_size()
        return [-(-m // self.align_size) * self.align_size for m in m_splits]

    def extra_repr(self) -> str:
        return f"num_gemms={self.num_gemms}, align_size={self.align_size}"


class Fp8Padding(_Padding):
    """forward(inp, m_splits) -> (padded input, padded m_splits)."""

    def forward(self, inp: Tensor, m_splits: Sequence[int]) -> Tuple[Tensor, List[int]]:
        x = _rows(inp, "Fp8Padding")
        splits = check_m_splits(m_splits, self.num_gemms, x.shape[0], "Fp8Padding", "the input")
        padded = self.padded(splits)
        if padded == splits:  # already aligned: the input itself, as in Transformer Engine
            return inp, splits
        parts = []
        for part, m, p in zip(x.split(splits), splits, padded):
            parts += [part, x.new_zeros(p - m, x.shape[1])]
        return torch.cat(parts), padded


class Fp8Unpadding(_Padding):
    """forward(inp, m_splits) -> inp without the rows Fp8Padding added for these m_splits
    (the unpadded row counts)."""

    def forward(self, inp: Tensor, m_splits: Sequence[int]) -> Tensor:
        x = _rows(inp, "Fp8Unpadding")
        splits = check_m_splits(m_splits, self.num_gemms, None, "Fp8Unpadding")
        padded = check_m_splits(self.padded(splits), self.num_gemms, x.shape[0], "Fp8Unpadding", "the input")
        if padded == splits:
            return inp
        return torch.cat([part[:m] for part, m in zip(x.split(padded), splits)])
