"""GEMMs of a linear layer on quantized or plain operands, one function per role.

Every GEMM is ops.gemm_fp8 / ops.gemm's `a @ b.T`. With QuantizedTensors the scaling mode
comes from the operands' layout kinds; the backward GEMMs read the column-wise copies made at
quantization time. With plain tensors the same call runs ops.gemm in high precision, so a
module's autograd Function has one code path; so does a GEMM with one plain operand (a
CustomRecipe's IdentityQuantizer), on the other operand dequantized.
"""
from __future__ import annotations

from typing import NoReturn, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from .._torch_fixes import pad_end
from ..backend.dispatch import resolution
from ..backend.plugin import BackendError
from ..backend.types import BLOCK_1x128_1x128, BLOCK_1x128_128x128, MXFP8, TENSORWISE
from ..recipe import default_split_accumulator
from .hybrid import HybridOperand, HybridQuantizedTensor
from .identity import IdentityTensor
from .quantizers import Quantizer
from .tensor import BLOCK_1x128, BLOCK_128x128, MX_1x32, QUANTIZED, TENSOR, GemmOperand, QuantizedTensor

Operand = Union[Tensor, QuantizedTensor]
# Quantized tensors whose GEMM operand is a tensor they hold: an IdentityQuantizer's high-precision
# tensor, a HybridQuantizer's direction (gemm_operand; traced, a HybridOperand)
_HOLDERS = (IdentityTensor, HybridQuantizedTensor, HybridOperand)

_MODES = {
    (TENSOR, TENSOR): TENSORWISE,
    (BLOCK_1x128, BLOCK_128x128): BLOCK_1x128_128x128,
    (BLOCK_1x128, BLOCK_1x128): BLOCK_1x128_1x128,
    (MX_1x32, MX_1x32): MXFP8,
}


def fprop_gemm(x: Operand, w: Operand, *, out_dtype: torch.dtype, bias: Optional[Tensor] = None) -> Tensor:
    """y = x @ w.T: x (M, K), w (N, K) -> (M, N)."""
    return quantized_gemm(x, w, out_dtype=out_dtype, bias=bias, gemm="fprop")


def dgrad_gemm(dy: Operand, w: Operand, *, out_dtype: torch.dtype) -> Tensor:
    """dx = dy @ w: dy (M, N), w (N, K) -> (M, K); reads w's column-wise copy (K, N)."""
    return quantized_gemm(dy, w, b_columnwise=True, out_dtype=out_dtype, gemm="dgrad")


def wgrad_gemm(dy: Operand, x: Operand, *, out_dtype: torch.dtype, out: Optional[Tensor] = None,
               accumulate: bool = False) -> Tensor:
    """dw = dy.T @ x: dy (M, N), x (M, K) -> (N, K); reads both column-wise copies. With `out`
    and accumulate=True the product is added into `out` (fused main_grad accumulation)."""
    return quantized_gemm(dy, x, a_columnwise=True, b_columnwise=True, out_dtype=out_dtype, out=out,
                          accumulate=accumulate, gemm="wgrad")


def keep_columnwise(t: Operand) -> Operand:
    """What to save for backward of an operand only a wgrad/dgrad will read: a QuantizedTensor's
    column-wise copy alone (half the bytes); a plain tensor as it is."""
    return t.columnwise_only() if isinstance(t, QUANTIZED) else t


def wgrad_operand(operand: Operand, hp, dtype: Optional[torch.dtype] = None, *, now: bool = False) -> Operand:
    """What the wgrad GEMM reads of an input or output-gradient operand, to keep for it:
    `operand`'s column-wise copy alone (keep_columnwise) when its quantizer's recipe runs the
    wgrad in FP8; else `hp`, the high-precision tensor the operand was cast from (a tensor, or
    a list of its column blocks), in `dtype` when given (DelayedScaling's
    override_linear_precision=(False, False, True), as Transformer Engine's wgrad override).
    `now`: the wgrad GEMM runs at once, nothing keeps the operand, so an FP8 one is returned as
    it is (the GEMM reads its column-wise copy in place; a twin would be made only to be dropped)."""
    quantized = isinstance(operand, QUANTIZED)
    quantizer = operand._quantizer if quantized else None
    # a quantizer that wraps another (FSDP2's ShardQuantizer, for weights) has no wgrad to decide
    if quantizer is None or getattr(quantizer, "wgrad_in_fp8", True):
        return operand.columnwise_only() if quantized and not now else operand
    if quantizer.backward_override == "dequantized":  # the FP8 operand itself, dequantized by the GEMM
        return operand
    hp = torch.cat(hp, dim=-1) if isinstance(hp, (list, tuple)) else hp
    if not isinstance(hp, Tensor) or isinstance(hp, QUANTIZED) or hp.shape != operand.shape:
        # the GEMM's whole operand exists only in FP8, or in high precision only as this rank's
        # shard (sequence parallelism gathers it after the norm or the cast)
        raise NotImplementedError(
            "override_linear_precision=(False, False, True) (the weight-gradient GEMM in high precision) is not "
            "supported together with sequence parallelism, whose all-gathered GEMM input exists only in FP8 "
            "or as this rank's shard; use override_linear_precision=(False, False, False) there")
    hp = hp if dtype is None else hp.to(dtype)
    # Traced, a copy: hp may be the autograd Function's own input, and dynamo cannot keep an alias
    # of a Function input for the backward of a forward that also writes Python state (the weight
    # cache, under is_first_microbatch). The copy costs one activation's bandwidth in the graph.
    return hp.clone() if torch.compiler.is_compiling() else hp


def quantized_gemm(a: Operand, b: Operand, *, a_columnwise: bool = False, b_columnwise: bool = False,
                   out_dtype: torch.dtype, bias: Optional[Tensor] = None, out: Optional[Tensor] = None,
                   accumulate: bool = False, gemm: Optional[str] = None) -> Tensor:
    """op(a) @ op(b).T where op transposes an operand whose `*_columnwise` flag is set. `gemm`
    ("fprop", "dgrad", "wgrad"): which GEMM of a linear layer this is, so that FP8 operands
    accumulate as their recipe says (Recipe.split_accumulator; TE's default: forward GEMMs fast,
    gradient GEMMs in float32); None: float32 accumulation.

    Every layer's every GEMM comes through here, so the checks are inline, with a call only to
    build an error."""
    if out is not None:
        out_dtype = out.dtype
    if isinstance(a, _HOLDERS):
        a = a.gemm_operand(a_columnwise)
    if isinstance(b, _HOLDERS):
        b = b.gemm_operand(b_columnwise)
    if isinstance(a, QUANTIZED) and isinstance(b, QUANTIZED):
        qa = a.columnwise() if a_columnwise else a.rowwise()
        qb = b.columnwise() if b_columnwise else b.rowwise()
        mode = _MODES.get((qa.kind, qb.kind)) or _no_scaling_mode(qa, qb)
        m, k, n = qa.data.shape[0], qa.data.shape[1], qb.data.shape[0]
        align = max(getattr(a._quantizer, "gemm_alignment", 16), getattr(b._quantizer, "gemm_alignment", 16))
        if m % align or n % align or k % align:
            check_gemm_dims(m, n, k, align)
        if bias is not None and bias.dtype not in (out_dtype, torch.float32):
            bias = bias.to(out_dtype)
        fast = gemm is not None and _fast_accumulation(a, b, gemm)
        if (m | n | k) % PAD_TO and mode == TENSORWISE:
            y = _padded_gemm_fp8(qa, qb, m, n, k, out_dtype=out_dtype, bias=bias, out=out, accumulate=accumulate,
                                 fast_accumulation=fast)
        else:
            y = ops.gemm_fp8(qa.data, qb.data, qa.scale_inv, qb.scale_inv, out_dtype=out_dtype, scaling=mode,
                             bias=bias, out=out, accumulate=accumulate, fast_accumulation=fast)
        op = "gemm_fp8"
    else:
        a_hp, b_hp = _high_precision(a, a_columnwise, b), _high_precision(b, b_columnwise, a)
        if bias is not None and bias.dtype != out_dtype:
            bias = bias.to(out_dtype)
        y = ops.gemm(a_hp, b_hp, bias=bias, out=out, accumulate=accumulate, out_dtype=out_dtype)
        m, n, op = a_hp.shape[0], b_hp.shape[0], "gemm"
    # The op contract: (M, N) in out_dtype. The shapes were checked on the way in, so another
    # result is the backend's fault, and saying so beats a reshape error that blames the
    # caller's input, or a silently short output.
    if isinstance(y, Tensor) and y.shape == (m, n) and y.dtype == out_dtype:
        return y
    raise _broken_contract(op, y, m, n, out_dtype)


def _broken_contract(op: str, y, m: int, n: int, out_dtype: torch.dtype) -> BackendError:
    """The error for a GEMM result that is not (M, N) in out_dtype (see quantized_gemm)."""
    got = f"shape {tuple(y.shape)} in {y.dtype}" if isinstance(y, Tensor) else type(y).__name__
    backend = resolution(ops.CONTRACT[op]).backend
    return BackendError(
        f"backend {backend!r} broke the contract of {op}: for an ({m}, K) x ({n}, K) product it returned "
        f"{got}, where the contract requires shape ({m}, {n}) in {out_dtype}. This is a bug in the backend, "
        f"not in your inputs: report it to the backend's authors, certify it with `te-core certify {backend}`, "
        f"and meanwhile select another backend (TE_BACKEND=reference) or route this op elsewhere "
        f"(TE_BACKEND_OVERRIDES='{op}=reference')."
    )


# Tensor-wise FP8 GEMMs take any shape (as Transformer Engine's take a batch of 1000 tokens):
# where M, N or K is not a multiple of this, what FP8 tensor cores (and backends' gemm_fp8)
# need, the operands are zero-padded to it. Exact: the padded products are zeros, and the
# result's padded rows and columns are dropped. Block and MXFP8 scales cover blocks of the
# operands, so those recipes keep their alignment rule (Quantizer.gemm_alignment).
PAD_TO = 16


def _round_up(v: int) -> int:
    return -(-v // PAD_TO) * PAD_TO


def _pad_fp8(data: Tensor, rows: int, cols: int) -> Tensor:
    """FP8 `data` zero-padded to (rows, cols): zero is the zero byte in both FP8 formats (padded
    as bytes, since torch pads no FP8 dtype)."""
    r, c = data.shape
    if (r, c) == (rows, cols):
        return data
    return pad_end(data.view(torch.uint8), cols - c, rows - r).view(data.dtype)


def _padded_gemm_fp8(qa: GemmOperand, qb: GemmOperand, m: int, n: int, k: int, *, out_dtype: torch.dtype,
                     bias: Optional[Tensor], out: Optional[Tensor], accumulate: bool,
                     fast_accumulation: bool) -> Tensor:
    """A tensor-wise FP8 GEMM whose M, N or K is not a multiple of PAD_TO, on padded operands."""
    rows, cols = _round_up(m), _round_up(n)
    a, b = _pad_fp8(qa.data, rows, _round_up(k)), _pad_fp8(qb.data, cols, _round_up(k))
    if bias is not None and cols != n:
        bias = F.pad(bias, (0, cols - n))
    kwargs = dict(out_dtype=out_dtype, scaling=TENSORWISE, fast_accumulation=fast_accumulation)
    if out is not None and (rows, cols) == (m, n):  # only K padded: the product has out's shape
        return ops.gemm_fp8(a, b, qa.scale_inv, qb.scale_inv, bias=bias, out=out, accumulate=accumulate, **kwargs)
    y = ops.gemm_fp8(a, b, qa.scale_inv, qb.scale_inv, bias=bias, **kwargs)[:m, :n]
    if out is None:
        return y.contiguous()
    return out.add_(y) if accumulate else out.copy_(y)


def _fast_accumulation(a: QuantizedTensor, b: QuantizedTensor, gemm: str) -> bool:
    """Whether `gemm` keeps the tensor cores' accumulator: not the recipe's split_accumulator,
    through the quantizer it made for the first operand (a primary weight may have none: then
    the second's, then TE's default). A Quantizer holds the answer per GEMM, taken when its
    recipe was set; another quantizer (a wrapper), or a name no table holds, asks the callable
    (which names a wrong GEMM)."""
    quantizer = a._quantizer if a._quantizer is not None else b._quantizer
    table = Quantizer.fast_accumulation if quantizer is None else getattr(quantizer, "fast_accumulation", None)
    fast = None if table is None else table.get(gemm)
    if fast is None:
        return not (quantizer.split_accumulator if quantizer is not None else default_split_accumulator)(gemm)
    return fast


def _high_precision(t: Operand, columnwise: bool, other: Operand) -> Tensor:
    """The operand for ops.gemm: a transposed view, not a copy (BLAS libraries transpose for free;
    a copy of each activation and gradient cost the bf16 layer bandwidth and peak memory). A
    quantized operand is dequantized, in the dtype of a plain `other` operand (a backward_override's
    backward pairs an FP8 operand with a high-precision one)."""
    if isinstance(t, QUANTIZED):
        t = t.dequantize(None if isinstance(other, QUANTIZED) else other.dtype)
    return t.t() if columnwise else t


class RecipeMismatchError(ValueError, RuntimeError):
    """FP8 GEMM operands quantized under recipes of different kinds (a weight kept in FP8 under
    another recipe's format, most often). A ValueError for te-core's callers, and the RuntimeError
    ("Recipe mismatch ...") that Transformer Engine raises for it, for code written against TE."""


def _no_scaling_mode(a: GemmOperand, b: GemmOperand) -> NoReturn:
    raise RecipeMismatchError(
        "Recipe mismatch for the operands of an FP8 GEMM: "
        f"no FP8 GEMM scaling mode for operands quantized as {a.kind} (a) and {b.kind} (b); quantize both "
        "operands with the same recipe (a 128x128-block operand must be the second one, b). A weight kept "
        "only in FP8 (te.quantized_model_init) stays in the format of the recipe it was made under: run "
        "the module under a te.autocast recipe of that kind, or build it again under the new recipe"
    )


def check_gemm_dims(m: int, n: int, k: int, align: int = 16, *, what: str = "FP8 GEMM") -> None:
    """Raise a ValueError naming the shape when an FP8 GEMM dimension is not a multiple of `align`
    (block-scaled and MXFP8 GEMMs: their scales cover blocks of aligned operands; tensor-wise
    GEMMs are padded instead, see PAD_TO)."""
    bad = [f"{name}={value}" for name, value in (("M", m), ("N", n), ("K", k)) if value % align]
    if bad:
        raise ValueError(
            f"{what}: every dimension must be a multiple of {align}; got M={m}, N={n}, K={k} "
            f"({', '.join(bad)} not). Pad the tokens (batch x sequence) or features to a multiple of {align}, "
            "or run this layer outside te_core.autocast."
        )
