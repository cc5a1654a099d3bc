"""ops.SwiGLU: Transformer Engine's fusible SwiGLU, silu(a) * b of the input's halves [a, b].

It runs te-core's activation ops in the input's precision; under te.autocast the next
GroupedLinear quantizes the result as its input, as te-core's modules quantize theirs."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ... import ops
from .._common import HP_DTYPES, check_bool
from ._op import FusibleOperation, check_extra_inputs

_NAME = "ops.SwiGLU"


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y, _ = ops.activation_fwd(x, "swiglu")
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return ops.activation_bwd(dy.contiguous(), x, "swiglu")


def _gates_first(x: Tensor, block: int) -> Tensor:
    """x's last dimension, alternating blocks of `block` gate and `block` linear columns, as
    [all gate columns, all linear columns] (through torch ops, so autograd interleaves the
    gradient back)."""
    shape = x.shape
    return x.reshape(-1, shape[-1] // (2 * block), 2, block).transpose(1, 2).reshape(shape)


class SwiGLU(FusibleOperation, nn.Module):
    """SiLU(a) * b where a and b are the first and second halves of the input's last dimension
    (Transformer Engine's order: the gate comes first, unlike torch's GLU). glu_interleave_size:
    the input alternates blocks of that many gate and linear columns instead. Not provided:
    cache_quantized_input=True."""

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size: Optional[int] = None):
        super().__init__()
        if check_bool(cache_quantized_input, name="cache_quantized_input", module=_NAME):
            raise NotImplementedError(f"{_NAME}: cache_quantized_input=True (an FP8 copy of the input saved for "
                                      "backward) is not supported by te-core; pass False")
        size = glu_interleave_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{_NAME}: glu_interleave_size must be a positive int or None, got {size!r}")
        self.cache_quantized_input = False
        self.glu_interleave_size = glu_interleave_size

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(_NAME, 0, extra_inputs, "none")
        if not isinstance(input, Tensor) or input.dtype not in HP_DTYPES:
            got = input.dtype if isinstance(input, Tensor) else type(input).__name__
            raise TypeError(f"{_NAME}: input must be a float32, bfloat16 or float16 tensor, got {got}")
        width, unit = (input.shape[-1] if input.dim() else 0), 2 * (self.glu_interleave_size or 1)
        if width == 0 or width % unit:
            what = f"2 * glu_interleave_size = {unit}" if self.glu_interleave_size else "2"
            raise ValueError(f"{_NAME}: the input's last dimension must be a positive multiple of {what} (gate and "
                             f"linear columns), got shape {tuple(input.shape)}")
        x = _gates_first(input, self.glu_interleave_size) if self.glu_interleave_size else input.contiguous()
        return _SwiGLUFunction.apply(x)

    def get_extra_state(self) -> Tensor:
        """Empty, as Transformer Engine's SwiGLU writes it (the operation holds no quantization
        state), so that state dicts have TE's keys."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is not None and not (isinstance(state, Tensor) and state.numel() == 0):
            raise ValueError(f"{_NAME}: its _extra_state must be empty (SwiGLU holds no quantization state), got "
                             f"{state!r}; drop that entry from the state dict")
