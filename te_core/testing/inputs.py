"""A conformance case (one op, one set of fresh seeded inputs) and the input generators.

Inputs are built on the CPU from a generator seeded by the case's id, so every run and every
device sees the same values; the runner copies them to the backend's device. Values are
random and never all zeros; FP8 inputs use power-of-two scales, so that x * scale is exact
and a correct cast is bit-exact.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..backend.types import fp8_max
from .compare import ErrorBound, Tol

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

Inputs = Tuple[tuple, dict]
MakeInputs = Callable[[torch.Generator], Inputs]


@dataclass(frozen=True)
class Case:
    """One call of one contract op.

    make: builds (args, kwargs) on the CPU from a seeded generator.
    exact_fp8: FP8 outputs must be bit-exact (pure casts); else bit-exact but for a small budget
        of values one FP8 step away (compare.FP8_STEP_BUDGET: FP8 after float32 math).
    tol: a floor for float tolerances (e.g. attention's, whose kernels reorder a softmax).
    bound: the output's own error model, bound(inputs, expected) -> ErrorBound, for results
        whose computation allows a tolerance other than their dtype's (an FP8 GEMM).
    grad_of: positions of the args to differentiate w.r.t. (differentiable ops).
    returns_out: the op must return the `out` tensor it was given.
    same_strides: the outputs must have the reference's strides, where the contract fixes a layout
        (1x128 block scales column by column): torch.compile checks an opaque op's outputs
        against the reference's strides, and fails a step whose outputs differ.
    """

    op: str
    name: str
    make: MakeInputs
    exact_fp8: bool = True
    tol: Optional[Tol] = None
    bound: Optional[Callable[[Inputs, Tensor], ErrorBound]] = None
    grad_of: Tuple[int, ...] = ()
    returns_out: bool = False
    same_strides: bool = False

    @property
    def id(self) -> str:
        return f"{self.op}[{self.name}]"

    def inputs(self) -> Inputs:
        return self.make(generator(self.id))


CASES: List[Case] = []
"""Every case, in registration order (filled by importing te_core.testing.cases)."""


def case(op: str, name: str, **options) -> Callable[[MakeInputs], MakeInputs]:
    """Registers the decorated input builder as a case of `op`."""

    def register(make: MakeInputs) -> MakeInputs:
        CASES.append(Case(op, name, make, **options))
        return make

    return register


def generator(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, std: float = 1.0,
          mean: float = 0.0) -> Tensor:
    return (torch.randn(shape, generator=gen) * std + mean).to(dtype)


def uniform(gen: torch.Generator, *shape: int, low: float, high: float, dtype=torch.float32) -> Tensor:
    return (torch.rand(shape, generator=gen) * (high - low) + low).to(dtype)


def amax_slot(start: float) -> Tensor:
    """amax_out as modules pass it: the 1-element slot of an amax history row (a view at an
    offset), already holding an earlier amax `start` of this step."""
    history = torch.zeros(3, 2)
    history[0, 1] = start
    return history[0, 1:2]


def column_slice(gen: torch.Generator, x: Tensor, pad: int = 24) -> Tensor:
    """x's values as a slice of the last dimension of a wider tensor (x[..., 32:96] of a module's
    activations, say): not contiguous, at a storage offset, the columns around it holding values of
    four times x's magnitude. A kernel that walks x's memory as dense row-major, or from the start
    of its storage, casts the wrong values and finds the wrong amax."""
    magnitude = 4 * (x.float().abs().nan_to_num(0.0).amax().item() if x.numel() else 1.0)
    limit = fp8_max(x.dtype) if x.dtype in (E4M3, E5M2) else torch.finfo(x.dtype).max / 2
    wide = (torch.randn((*x.shape[:-1], x.shape[-1] + pad), generator=gen) * magnitude).clamp(-limit, limit)
    wide = wide.to(x.dtype)
    start = pad // 3
    wide[..., start:start + x.shape[-1]] = x
    return wide[..., start:start + x.shape[-1]]


def transposed_view(x: Tensor) -> Tensor:
    """x's values laid out column-major (x.t() of a contiguous (K, M) tensor, as a weight's
    transpose reaches a cast): dense memory, but not in x's row-major order."""
    return x.t().contiguous().t()


def flat_range(gen: torch.Generator, x: Tensor, before: int = 24, after: int = 8) -> Tensor:
    """A 1-D x as a range of a larger flat buffer (a master weight's range of a weight, as
    te_core.distributed.master_weights casts it): contiguous, at a storage offset."""
    flat = torch.randn(before + x.numel() + after, generator=gen).to(x.dtype)
    flat[before:before + x.numel()] = x.reshape(-1)
    return flat[before:before + x.numel()]


def pow2(exponent: int) -> Tensor:
    """A 1-element float32 scale 2**exponent (exact to multiply by)."""
    return torch.tensor([2.0**exponent], dtype=torch.float32)


def fp8_specials(fp8_dtype: torch.dtype) -> List[float]:
    """Values a cast must get exactly right: ties (round half to even), saturation, subnormals."""
    mantissa_bits = 3 if fp8_dtype == E4M3 else 2
    half_step = 2.0 ** -(mantissa_bits + 1)
    min_subnormal = 2.0**-9 if fp8_dtype == E4M3 else 2.0**-16
    fmax = fp8_max(fp8_dtype)
    return [
        1 + half_step, 1 + 3 * half_step, -(1 + half_step), 8 * (1 + 3 * half_step),  # ties
        2 * fmax, -3 * fmax, fmax * (1 + half_step / 2),  # beyond the max: saturate
        1.5 * min_subnormal, -2.5 * min_subnormal,  # subnormal ties
    ]


def to_cast(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype, fp8_dtype: torch.dtype,
            scale: Tensor, *, specials: bool = True) -> Tensor:
    """x to quantize at `scale`: spread over the format's range, a few beyond it, plus the
    special values (first elements, divided by the power-of-two scale, so exact)."""
    x = torch.randn(tuple(shape), generator=gen) * (fp8_max(fp8_dtype) / 3) / scale.item()
    if specials:
        values = torch.tensor(fp8_specials(fp8_dtype)) / scale.item()
        n = min(values.numel(), x.numel())
        x.view(-1)[:n] = values[:n]
    return x.to(dtype)


def fp8_data(gen: torch.Generator, shape: Sequence[int], fp8_dtype: torch.dtype, std: float = 8.0) -> Tensor:
    """Random finite FP8 data (as a cast of normal values, clamped into range)."""
    fmax = fp8_max(fp8_dtype)
    return (torch.randn(tuple(shape), generator=gen) * std).clamp(-fmax, fmax).to(fp8_dtype)


def row_scaled(gen: torch.Generator, rows: int, cols: int, dtype: torch.dtype) -> Tensor:
    """Rows of very different magnitudes (powers of two), so block scales differ."""
    exponents = torch.randint(-6, 7, (rows, 1), generator=gen).float()
    return (torch.randn(rows, cols, generator=gen) * torch.exp2(exponents)).to(dtype)


_SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", E4M3: "e4m3", E5M2: "e5m2"}


def short(dtype: torch.dtype) -> str:
    """fp32, bf16, e4m3, ...: for case names."""
    return _SHORT_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def dims(shape: Sequence[int]) -> str:
    return "x".join(map(str, shape))
