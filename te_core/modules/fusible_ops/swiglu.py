"""ops.SwiGLU and ops.ScaledSwiGLU: Transformer Engine's fusible SwiGLU, silu(a) * b of the
input's halves [a, b], and the variant that scales each output row by an extra input (an MoE's
routing probabilities, applied before the down projection instead of when combining); and
ops.ScaledSReLU, the squared ReLU scaled so. Transformer Engine's variants: ops.ClampedSwiGLU
(GPT-OSS's) and ops.SiTUGLU (Kimi K3's soft-capped one), and their row-scaled ScaledClampedQGeGLU
and ScaledSiTUGLU.

They run te-core's activation ops in the input's precision; under te.autocast the next
GroupedLinear quantizes the result as its input, as te-core's modules quantize theirs.
cache_quantized_input=True saves the input for the backward as FP8 (see cached_input)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ... import ops
from .._common import check_bool
from ._op import EmptyExtraState, FusibleOperation, check_extra_inputs
from .activation import ActivationFunction, check_activation_input, check_gate_columns
from .cached_input import FromCachedInput, cache_quantized_input_flag


class _ScaledActivationFunction(torch.autograd.Function):
    """act(x) * scales (act: te-core's activation `kind`), scales (rows..., 1) in x's dtype. Like
    Transformer Engine's, it saves only x and the scales: backward recomputes act(x) for the
    scales' gradient, and only when they need one."""

    @staticmethod
    def forward(ctx, x: Tensor, scales: Tensor, kind: str, params: Optional[dict] = None) -> Tensor:
        ctx.params = params or {}
        y, _ = ops.activation_fwd(x, kind, **ctx.params)
        ctx.save_for_backward(x, scales)
        ctx.kind = kind
        return y * scales

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, scales = ctx.saved_tensors
        dy = dy.contiguous()
        dx = ops.activation_bwd(dy * scales, x, ctx.kind, **ctx.params) if ctx.needs_input_grad[0] else None
        dscales = None
        if ctx.needs_input_grad[1]:
            # act(x) and the row sum over the FFN width in float32, rounded once, as TE's kernel: summing
            # products of an activation already rounded to bf16 loses a row sum that cancels beyond bf16's tolerance
            y, _ = ops.activation_fwd(x.float(), ctx.kind, **ctx.params)
            dscales = (dy.float() * y).sum(-1, keepdim=True).to(scales.dtype)
        return dx, dscales, None, None


def _gates_first(x: Tensor, block: int) -> Tensor:
    """x's last dimension, alternating blocks of `block` gate and `block` linear columns, as
    [all gate columns, all linear columns] (through torch ops, so autograd interleaves the
    gradient back)."""
    shape = x.shape
    return x.reshape(-1, shape[-1] // (2 * block), 2, block).transpose(1, 2).reshape(shape)


class _GatedOperation(EmptyExtraState, FusibleOperation, nn.Module):
    """What SwiGLU and ScaledSwiGLU share: the layout of their input's gate and linear columns
    (glu_interleave_size), its checks, and Transformer Engine's empty extra state."""

    def __init__(self, glu_interleave_size: Optional[int]):
        super().__init__()
        size = glu_interleave_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{self._name}: glu_interleave_size must be a positive int or None, got {size!r}")
        self.glu_interleave_size = glu_interleave_size

    def _gates_first_input(self, input: Tensor) -> Tensor:  # noqa: A002 (TE's name)
        """The checked input, contiguous, its gate columns first."""
        check_activation_input(input, self._name)
        check_gate_columns(input, self._name, self.glu_interleave_size)
        return _gates_first(input, self.glu_interleave_size) if self.glu_interleave_size else input.contiguous()


class SwiGLU(_GatedOperation):
    """SiLU(a) * b where a and b are the first and second halves of the input's last dimension
    (Transformer Engine's order: the gate comes first, unlike torch's GLU). glu_interleave_size:
    the input alternates blocks of that many gate and linear columns instead."""

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size: Optional[int] = None):
        cache = cache_quantized_input_flag(cache_quantized_input, "ops.SwiGLU")
        super().__init__(glu_interleave_size)
        self.cache_quantized_input = cache

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        # (with glu_interleave_size, the FP8 copy is of the reordered input: one per-tensor scale, so
        # the same values as Transformer Engine's copy of the interleaved one)
        return ActivationFunction.apply(self._gates_first_input(input), "swiglu", None, self.cache_quantized_input,
                                        self._name)


class ScaledSwiGLU(_GatedOperation):
    """SwiGLU (as ops.SwiGLU, glu_interleave_size included) whose output row i is multiplied by
    probs[i], the extra input: one value per row of the input, shaped as the input without its
    last dimension (any shape of that many values is taken, as Transformer Engine does).
    Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)(x, split_sizes, probs, split_sizes).

    probs are cast to the input's dtype; both the input and probs (where it requires grad) get
    gradients, the latter in probs' own shape and dtype. Transformer Engine's CUDA kernel takes
    only a glu_interleave_size that is a multiple of 32; te-core takes any positive size."""

    num_extra_inputs = 1

    def __init__(self, glu_interleave_size: Optional[int] = None, *, activation_recompute_in_mlp: bool = False):
        _refuse_recompute(activation_recompute_in_mlp, "ops." + type(self).__name__)
        super().__init__(glu_interleave_size)
        self.activation_recompute_in_mlp = False

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 1, extra_inputs, "probs: one scale per row of the input")
        x = self._gates_first_input(input)
        return _ScaledActivationFunction.apply(x, _row_scales(self._name, extra_inputs[0], input), "swiglu")


class ScaledSReLU(EmptyExtraState, FusibleOperation, nn.Module):
    """max(x, 0)^2 whose output row i is multiplied by probs[i], the extra input (one value per row
    of the input, as for ScaledSwiGLU, cast to the input's dtype; both get gradients). Not
    provided: activation_recompute_in_mlp=True, which Transformer Engine takes only in its fused
    grouped MLP (te-core fuses nothing)."""

    num_extra_inputs = 1

    def __init__(self, *, activation_recompute_in_mlp: bool = False):
        if check_bool(activation_recompute_in_mlp, name="activation_recompute_in_mlp", module="ops.ScaledSReLU"):
            raise NotImplementedError("ops.ScaledSReLU: activation_recompute_in_mlp=True (recomputing the activation "
                                      "in a fused grouped MLP's backward) is not supported by te-core, which fuses no "
                                      "operations; pass False")
        super().__init__()
        self.activation_recompute_in_mlp = False

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 1, extra_inputs, "probs: one scale per row of the input")
        check_activation_input(input, self._name)
        if input.dim() == 0:
            raise ValueError(f"{self._name}: input must have at least one dimension (its rows are scaled), got a "
                             "0-dimensional tensor")
        scales = _row_scales(self._name, extra_inputs[0], input)
        return _ScaledActivationFunction.apply(input.contiguous(), scales, "srelu")


def _row_scales(op: str, probs, input: Tensor) -> Tensor:  # noqa: A002 (TE's name)
    """probs as a (rows..., 1) column in the input's dtype (autograd maps the gradient back)."""
    rows = input.shape[:-1]
    want = f"one value per row of the input: {rows.numel()} values, shape {tuple(rows)} for an input of shape " \
           f"{tuple(input.shape)}"
    if not isinstance(probs, Tensor) or not probs.is_floating_point():
        got = f"a {probs.dtype} tensor" if isinstance(probs, Tensor) else type(probs).__name__
        raise TypeError(f"{op}: probs (its extra input) must be a floating-point tensor of {want}; got {got}")
    if probs.numel() != rows.numel():
        raise ValueError(f"{op}: probs (its extra input) must hold {want}; got shape {tuple(probs.shape)}")
    if probs.device != input.device:
        raise ValueError(f"{op}: probs are on {probs.device} but the input is on {input.device}; move them to the "
                         "input's device")
    return probs.reshape(*rows, 1).to(input.dtype)


def _refuse_recompute(activation_recompute_in_mlp, op: str) -> None:
    if check_bool(activation_recompute_in_mlp, name="activation_recompute_in_mlp", module=op):
        # (with Transformer Engine's words for the refusal, which callers match on)
        raise ValueError(f"{op}: activation_recompute_in_mlp=True is not supported: Transformer Engine's "
                         f"{op.removeprefix('ops.')} does not support activation recomputation either; pass False")


def _finite(value, name: str, op: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and value <= 0):
        what = "a finite number > 0" if positive else "a finite number"
        raise ValueError(f"{op}: {name} must be {what}, got {value!r}")
    return float(value)


def _clamped_params(op: str, limit, alpha, glu_linear_offset) -> dict:
    """te-core's clamped_swiglu takes only a positive limit (a limit <= 0 clamps every gate)."""
    return {"limit": _finite(limit, "limit", op, positive=True), "alpha": _finite(alpha, "alpha", op),
            "glu_linear_offset": _finite(glu_linear_offset, "glu_linear_offset", op)}


def _situglu(x: Tensor, beta1: float, beta2: float) -> Tensor:
    """beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) of x's halves [a, b], in float32 as
    Transformer Engine's kernel (autograd differentiates it there too, so gradients round once)."""
    a, b = x.float().chunk(2, dim=-1)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * (beta2 * torch.tanh(b / beta2))


class ClampedSwiGLU(_GatedOperation):
    """GPT-OSS's SwiGLU: a' sigmoid(alpha a') (b' + glu_linear_offset) with a' = min(a, limit) and
    b' = clamp(b, -limit, limit) of the input's halves [a, b] (gate first; glu_interleave_size as
    ops.SwiGLU); no gradient flows through an active clamp. Not provided: a limit <= 0."""

    def __init__(self, *, limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0,
                 cache_quantized_input: bool = False, glu_interleave_size: Optional[int] = None):
        cache = cache_quantized_input_flag(cache_quantized_input, "ops.ClampedSwiGLU")
        params = _clamped_params("ops.ClampedSwiGLU", limit, alpha, glu_linear_offset)
        super().__init__(glu_interleave_size)
        self.limit, self.alpha, self.glu_linear_offset = params.values()
        self.cache_quantized_input = cache

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        params = {"limit": self.limit, "alpha": self.alpha, "glu_linear_offset": self.glu_linear_offset}
        return ActivationFunction.apply(self._gates_first_input(input), "clamped_swiglu", params,
                                        self.cache_quantized_input, self._name)


class ScaledClampedQGeGLU(_GatedOperation):
    """ClampedSwiGLU (limit, alpha, glu_linear_offset and glu_interleave_size as there) whose output
    row i is multiplied by probs[i], the extra input, as ops.ScaledSwiGLU; the input and probs get
    gradients. Not provided: activation_recompute_in_mlp=True, and a limit <= 0."""

    num_extra_inputs = 1

    def __init__(self, glu_interleave_size: Optional[int] = None, *, activation_recompute_in_mlp: bool = False,
                 limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0):
        _refuse_recompute(activation_recompute_in_mlp, "ops.ScaledClampedQGeGLU")
        params = _clamped_params("ops.ScaledClampedQGeGLU", limit, alpha, glu_linear_offset)
        super().__init__(glu_interleave_size)
        self.limit, self.alpha, self.glu_linear_offset = params.values()
        self.activation_recompute_in_mlp = False

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 1, extra_inputs, "probs: one scale per row of the input")
        x = self._gates_first_input(input)
        params = {"limit": self.limit, "alpha": self.alpha, "glu_linear_offset": self.glu_linear_offset}
        return _ScaledActivationFunction.apply(x, _row_scales(self._name, extra_inputs[0], input), "clamped_swiglu",
                                               params)


class SiTUGLU(_GatedOperation):
    """Kimi K3's soft-capped SwiGLU: beta1 tanh(a / beta1) sigmoid(a) * beta2 tanh(b / beta2) of the
    input's halves [a, b] (gate first; glu_interleave_size as ops.SwiGLU), beta1 and beta2 finite and
    positive."""

    def __init__(self, *, beta1: float = 4.0, beta2: float = 25.0, cache_quantized_input: bool = False,
                 glu_interleave_size: Optional[int] = None):
        cache = cache_quantized_input_flag(cache_quantized_input, "ops.SiTUGLU")
        beta1 = _finite(beta1, "beta1", "ops.SiTUGLU", positive=True)
        beta2 = _finite(beta2, "beta2", "ops.SiTUGLU", positive=True)
        super().__init__(glu_interleave_size)
        self.beta1, self.beta2 = beta1, beta2
        self.cache_quantized_input = cache

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 0, extra_inputs, "none")
        x = self._gates_first_input(input)
        if self.cache_quantized_input:
            return FromCachedInput.apply(x, self._situglu_in_dtype, self._situglu_grad, self._name)
        return self._situglu_in_dtype(x)

    def _situglu_in_dtype(self, x: Tensor) -> Tensor:
        return _situglu(x, self.beta1, self.beta2).to(x.dtype)

    def _situglu_grad(self, dy: Tensor, x: Tensor) -> Tensor:
        """SiTUGLU's derivative applied to dy, in float32 as its forward (written out: torch.compile
        cannot trace autograd.grad inside a backward)."""
        a, b = x.float().chunk(2, dim=-1)
        tanh_a, sigmoid_a, tanh_b = torch.tanh(a / self.beta1), torch.sigmoid(a), torch.tanh(b / self.beta2)
        gate, linear = self.beta1 * tanh_a * sigmoid_a, self.beta2 * tanh_b
        d_gate = (1 - tanh_a**2) * sigmoid_a + gate * (1 - sigmoid_a)
        dy = dy.float()
        return torch.cat([dy * linear * d_gate, dy * gate * (1 - tanh_b**2)], dim=-1).to(x.dtype)


class ScaledSiTUGLU(_GatedOperation):
    """SiTUGLU (beta1, beta2 and glu_interleave_size as there) whose output row i is multiplied by
    probs[i], the extra input, as ops.ScaledSwiGLU; the input and probs get gradients. Not provided:
    activation_recompute_in_mlp=True."""

    num_extra_inputs = 1

    def __init__(self, glu_interleave_size: Optional[int] = None, *, activation_recompute_in_mlp: bool = False,
                 beta1: float = 4.0, beta2: float = 25.0):
        _refuse_recompute(activation_recompute_in_mlp, "ops.ScaledSiTUGLU")
        beta1 = _finite(beta1, "beta1", "ops.ScaledSiTUGLU", positive=True)
        beta2 = _finite(beta2, "beta2", "ops.ScaledSiTUGLU", positive=True)
        super().__init__(glu_interleave_size)
        self.beta1, self.beta2 = beta1, beta2
        self.activation_recompute_in_mlp = False

    def forward(self, input: Tensor, *extra_inputs) -> Tensor:  # noqa: A002 (TE's name)
        check_extra_inputs(self._name, 1, extra_inputs, "probs: one scale per row of the input")
        scales = _row_scales(self._name, extra_inputs[0], input)
        y = _situglu(self._gates_first_input(input), self.beta1, self.beta2) * scales.float()
        return y.to(input.dtype)
