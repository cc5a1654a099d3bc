"""Norms, activations, their backward epilogues and rotary embeddings in plain torch: the
twins torch.compile traces in place of those opaque ops (OpImpl.traced), as traced.py does
for the casts and the FP8 GEMM.

Each twin is the reference implementation (te_core.reference), which is plain traceable
torch: float32 math, checks on shapes and dtypes only (no host synchronisation, no branch on
values), FP8 output (of the backward epilogues) as the casts' (x times the float32 scale,
clamped to the format's max, NaN kept, rounded to nearest even; amax max|x| with NaN winning,
maxed into `amax_out` in place). Its results are the contract's by definition, so the compiled step equals the eager
one to the contract's tolerance (reductions sum in the compiler's order). A bad argument
raises the reference's error while tracing, as the opaque op's fake implementation would.

The compiler fuses a twin with its neighbours, and where it does it keeps bfloat16 values in
float32; a twin reads and returns its bfloat16 tensors as stored (as_stored), so that an FP8
cast on either side rounds what eager rounds and the FP8 bytes stay the eager ones.

A twin takes a call only on the backend's device, in float32 or bfloat16 (float16 has no
such rounding here and stays opaque), with fewer than MAX_NUMEL elements, and FP8 arguments
of the kernels' form; anything else returns NotImplemented and stays the opaque op. With
MAX_NUMEL elements or more a step is GPU-bound, and there the Triton kernels (one pass over
the row, descriptor loads) beat the compiler's. The limit is half the casts' (traced.MAX_NUMEL):
norms and activations run inside layers, whose steps are GPU-bound from smaller tensors on
than a lone Linear's. A Linear step with tensors of 2^25 elements is still host-bound, and
gains from traced casts; a layer step with such tensors is not, and loses with traced norms.
The norm backwards are the exception: their twins launch te_triton's kernel from the compiled
code at every size below the descriptor kernels' (traced_kernels.norm_bwd), which forms dx and
the weight's partial column sums in one pass where the compiler's version of the math reads
the rows again for the sums; the math runs only where that launch declines a call.

The forward twins (norms, activation) cast FP8 output with the module's delayed-scaling
scale, which the same compiled step updates in place after the forward; they read it through
traced.hold_scale, so that the backward never rebuilds the FP8 data (the column-wise copy a
wgrad reads) with the updated scale. The backward epilogues cast with the gradient's scale,
which is updated only after the backward's GEMMs have read the data. A call that maxes its
amax into `amax_out` (a delayed-scaling history slot) is taken only where traced.WRITES_SLOTS
allows it, but for the norm and activation forwards and the backward epilogues: those launch
te_triton's kernels from the compiled code where traced_kernels takes them (the eager op's
kernels and bytes, each maxing into the slot), as delayed scaling's casts do.
"""
from __future__ import annotations

import functools
from typing import Callable, Dict

import torch
from te_core.backend.types import FP8_FORMATS
from te_core.reference import activation as ref_act
from te_core.reference.plugin import implementations
from te_triton import activation as triton_activation

from . import traced, traced_kernels
from .traced import MAX_NUMEL as CAST_MAX_NUMEL
from .traced import as_stored, hold_scale

MAX_NUMEL = CAST_MAX_NUMEL // 2

DEVICE_TYPE = "cuda"
TAKEN_DTYPES = (torch.float32, torch.bfloat16)  # float16: see the module docstring


def _on(t, where) -> bool:
    """t is a tensor on `where`: a device type (the call's first tensor) or a device (the
    others, which must share the first's)."""
    if not isinstance(t, torch.Tensor):
        return False
    return t.device == where if isinstance(where, torch.device) else t.device.type == where


def _hp(t, where, *, sized: bool = True) -> bool:
    """t is a high-precision tensor on `where`; `sized`: with 1 to MAX_NUMEL - 1 elements."""
    if not _on(t, where) or t.dtype not in TAKEN_DTYPES:
        return False
    return not sized or 0 < t.numel() < MAX_NUMEL


def _one_f32(t, where) -> bool:
    return _on(t, where) and t.dtype == torch.float32 and t.numel() == 1


def _fp8_cast_ok(scale, fp8_dtype, amax_out, where) -> bool:
    """A tensor-wise FP8 output: a known format, a 1-element float32 scale, an optional
    1-element float32 amax_out (where traced.WRITES_SLOTS allows one), both on `where`."""
    if amax_out is not None:
        return traced.WRITES_SLOTS and _slot_cast_ok(scale, fp8_dtype, amax_out, where)
    return fp8_dtype in FP8_FORMATS and _one_f32(scale, where)


def _slot_cast_ok(scale, fp8_dtype, amax_out, where) -> bool:
    """A tensor-wise FP8 output maxing its amax into a history slot: a known format, a 1-element
    float32 scale and a 1-element float32 amax_out, both on `where`."""
    return amax_out is not None and fp8_dtype in FP8_FORMATS and _one_f32(scale, where) and _one_f32(amax_out, where)


def _fp8_out_ok(fp8_scale, fp8_dtype, amax_out, where) -> bool:
    """A norm or activation forward without FP8 output, or with a tensor-wise one."""
    if fp8_scale is None and fp8_dtype is None and amax_out is None:
        return True
    return _fp8_cast_ok(fp8_scale, fp8_dtype, amax_out, where)


# --- which calls each twin takes: (device type, the op's arguments) -> bool ------------------
# The first tensor on a device of that type, the others on its device. (List comprehensions,
# not generators, inside all(): dynamo traces those in every torch >= 2.7.)
def _layernorm_fwd(dev, x, weight, bias, eps, *, fp8_scale=None, fp8_dtype=None, amax_out=None, **_):
    return _rmsnorm_fwd(dev, x, weight, eps, fp8_scale=fp8_scale, fp8_dtype=fp8_dtype, amax_out=amax_out) \
        and _hp(bias, x.device, sized=False)


def _rmsnorm_fwd(dev, x, weight, eps, *, fp8_scale=None, fp8_dtype=None, amax_out=None, **_):
    return _hp(x, dev) and x.dim() >= 1 and _hp(weight, x.device, sized=False) \
        and _fp8_out_ok(fp8_scale, fp8_dtype, amax_out, x.device)


def _norm_bwd_tensors(dev, dy, x, others) -> bool:
    """dy and x small, the statistics, weight and `add` on their device (their shapes the
    reference checks)."""
    return _hp(dy, dev) and _hp(x, dy.device) and all([_hp(t, dy.device, sized=False) for t in others])


def _layernorm_bwd(dev, dy, x, mean, rstd, weight, *, zero_centered_gamma=False):
    return _norm_bwd_tensors(dev, dy, x, (mean, rstd, weight))


def _layernorm_bwd_add(dev, dy, x, mean, rstd, weight, add, *, zero_centered_gamma=False):
    return _norm_bwd_tensors(dev, dy, x, (mean, rstd, weight, add))


def _rmsnorm_bwd(dev, dy, x, rstd, weight, *, zero_centered_gamma=False):
    return _norm_bwd_tensors(dev, dy, x, (rstd, weight))


def _rmsnorm_bwd_add(dev, dy, x, rstd, weight, add, *, zero_centered_gamma=False):
    return _norm_bwd_tensors(dev, dy, x, (rstd, weight, add))


def _act_fwd(dev, x, kind, *, fp8_scale=None, fp8_dtype=None, amax_out=None, **_):
    return _hp(x, dev) and _fp8_out_ok(fp8_scale, fp8_dtype, amax_out, x.device)


def _act_bwd(dev, dy, x, kind, **_):
    return _hp(dy, dev) and _hp(x, dy.device)


def _dbias(dev, dy):
    return _hp(dy, dev)


def _act_bwd_dbias_ct(dev, dy, x, kind, scale, fp8_dtype, *, amax_out=None, **_):
    return _act_bwd(dev, dy, x, kind) and x.dim() == 2 and _fp8_cast_ok(scale, fp8_dtype, amax_out, dy.device)


def _dbias_ct_parts(dev, parts, scale, fp8_dtype, *, amax_out=None):
    if not isinstance(parts, (list, tuple)) or not parts or not _on(parts[0], dev):
        return False
    where = parts[0].device
    if not all([_hp(p, where, sized=False) for p in parts]):
        return False
    return 0 < sum([p.numel() for p in parts]) < MAX_NUMEL and _fp8_cast_ok(scale, fp8_dtype, amax_out, where)


def _rope_fwd(dev, x, freqs, *, tensor_format="sbhd", interleaved=False):
    return _hp(x, dev) and _hp(freqs, x.device, sized=False)


def _rope_bwd(dev, dy, freqs, *, tensor_format="sbhd", interleaved=False):
    return _rope_fwd(dev, dy, freqs)


_TAKES = {
    "layernorm_fwd": _layernorm_fwd,
    "rmsnorm_fwd": _rmsnorm_fwd,
    "layernorm_bwd": _layernorm_bwd,
    "rmsnorm_bwd": _rmsnorm_bwd,
    "layernorm_bwd_add": _layernorm_bwd_add,
    "rmsnorm_bwd_add": _rmsnorm_bwd_add,
    "activation_fwd": _act_fwd,
    "activation_bwd": _act_bwd,
    "dbias": _dbias,
    "activation_bwd_dbias_cast_transpose": _act_bwd_dbias_ct,
    "dbias_cast_transpose_parts": _dbias_ct_parts,
    "rope_fwd": _rope_fwd,
    "rope_bwd": _rope_bwd,
}


# --- te_triton's kernels for delayed scaling's slot-writing calls (traced_kernels) -------------
# A call that maxes its FP8 output's amax into a history slot (amax_out) launches the eager op's
# kernel from the compiled code where traced_kernels takes it: the eager bytes, and no trip
# through torch.library and te-core's dispatch, which the opaque op costs each call.
def _norm_fwd_kernel(dev, x, weight, bias, eps, *, zero_centered_gamma=False, fp8_scale=None, fp8_dtype=None,
                     amax_out=None):
    """(y, mean or None, rstd, amax) through te_triton's norm kernel (RMSNorm where bias is None),
    or NotImplemented where traced_kernels.norm_takes declines the call."""
    where = x.device if isinstance(x, torch.Tensor) else None
    if not (_hp(x, dev) and _slot_cast_ok(fp8_scale, fp8_dtype, amax_out, where)
            and all([_hp(p, where, sized=False) for p in (weight, bias) if p is not None])
            and traced_kernels.norm_takes(x, weight, bias)):
        return NotImplemented
    return traced_kernels.norm_fwd(x, weight, bias, eps, zero_centered_gamma=zero_centered_gamma, fp8_scale=fp8_scale,
                                   fp8_dtype=fp8_dtype, amax_out=amax_out)


def _layernorm_fwd_kernel(dev, x, weight, bias, eps, **kwargs):
    return NotImplemented if bias is None else _norm_fwd_kernel(dev, x, weight, bias, eps, **kwargs)


def _rmsnorm_fwd_kernel(dev, x, weight, eps, **kwargs):
    result = _norm_fwd_kernel(dev, x, weight, None, eps, **kwargs)
    return result if result is NotImplemented else (result[0], result[2], result[3])


def _activation_fwd_kernel(dev, x, kind, *, fp8_scale=None, fp8_dtype=None, amax_out=None, **params):
    """(y, amax) through te_triton's activation kernel, or NotImplemented where
    traced_kernels.activation_takes declines the call."""
    where = x.device if isinstance(x, torch.Tensor) else None
    if not (_hp(x, dev) and _slot_cast_ok(fp8_scale, fp8_dtype, amax_out, where)
            and traced_kernels.activation_takes(x, kind, params)):
        return NotImplemented
    return traced_kernels.activation_fwd(x, kind, fp8_scale=fp8_scale, fp8_dtype=fp8_dtype, amax_out=amax_out)


def _act_bwd_dbias_ct_kernel(dev, dy, x, kind, scale, fp8_dtype, *, amax_out=None, **params):
    """(data, data_t, dbias, amax) through te_triton's kernels, or NotImplemented where
    traced_kernels.epilogue_takes declines dy or x, or the kind has no kernel."""
    where = x.device if isinstance(x, torch.Tensor) else None
    if not (not params and kind in triton_activation.KIND_IDS and _act_bwd(dev, dy, x, kind)
            and _slot_cast_ok(scale, fp8_dtype, amax_out, where)
            and traced_kernels.epilogue_takes(x) and traced_kernels.epilogue_takes(dy)):
        return NotImplemented
    gated = kind in triton_activation.GATED
    if x.shape[1] % 2 and gated or tuple(dy.shape) != (x.shape[0], x.shape[1] // 2 if gated else x.shape[1]):
        return NotImplemented  # (the opaque op names the mismatch)
    return traced_kernels.activation_bwd_dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, amax_out=amax_out)


def _dbias_ct_parts_kernel(dev, parts, scale, fp8_dtype, *, amax_out=None):
    """(data, data_t, dbias, amax) of the joined column blocks through te_triton's kernel, or
    NotImplemented where traced_kernels.parts_takes declines them."""
    if not (amax_out is not None and isinstance(parts, (list, tuple)) and parts and _on(parts[0], dev)):
        return NotImplemented
    where = parts[0].device
    if not (all([_hp(p, where, sized=False) for p in parts]) and _slot_cast_ok(scale, fp8_dtype, amax_out, where)
            and traced_kernels.parts_takes(parts)):
        return NotImplemented
    return traced_kernels.dbias_cast_transpose_parts(parts, scale, fp8_dtype, amax_out=amax_out)


def _norm_bwd_kernel(dev, dy, x, mean, rstd, weight, add, zero_centered_gamma):
    """(dx, dweight, dbias or None) through te_triton's norm backward kernel (RMSNorm where mean
    is None), or NotImplemented where traced_kernels.norm_bwd_takes declines the call. At any
    size: from traced_fused.MAX_NUMEL elements up to the descriptor kernels' the opaque op would
    launch the same kernel."""
    stats = (rstd,) if mean is None else (mean, rstd)
    others = (*stats, weight) if add is None else (*stats, weight, add)
    if not (_hp(dy, dev, sized=False) and _hp(x, dy.device, sized=False)
            and all([isinstance(t, torch.Tensor) for t in others])  # (norm_bwd_takes checks the rest)
            and traced_kernels.norm_bwd_takes(dy, x, stats, weight, add)):
        return NotImplemented
    return traced_kernels.norm_bwd(dy, x, mean, rstd, weight, add, zero_centered_gamma=zero_centered_gamma)


def _layernorm_bwd_kernel(dev, dy, x, mean, rstd, weight, *, zero_centered_gamma=False):
    if mean is None:  # (the math names what is missing)
        return NotImplemented
    return _norm_bwd_kernel(dev, dy, x, mean, rstd, weight, None, zero_centered_gamma)


def _layernorm_bwd_add_kernel(dev, dy, x, mean, rstd, weight, add, *, zero_centered_gamma=False):
    if mean is None or not isinstance(add, torch.Tensor):
        return NotImplemented
    return _norm_bwd_kernel(dev, dy, x, mean, rstd, weight, add, zero_centered_gamma)


def _rmsnorm_bwd_kernel(dev, dy, x, rstd, weight, *, zero_centered_gamma=False):
    return _dx_dweight(_norm_bwd_kernel(dev, dy, x, None, rstd, weight, None, zero_centered_gamma))


def _rmsnorm_bwd_add_kernel(dev, dy, x, rstd, weight, add, *, zero_centered_gamma=False):
    if not isinstance(add, torch.Tensor):
        return NotImplemented
    return _dx_dweight(_norm_bwd_kernel(dev, dy, x, None, rstd, weight, add, zero_centered_gamma))


def _dx_dweight(result):
    """RMSNorm's (dx, dweight) of _norm_bwd_kernel's result, or NotImplemented."""
    return result if result is NotImplemented else result[:2]


# Tried before the traced math, each declining (NotImplemented) what its kernel does not take: the
# forwards and epilogues take only calls that max into a history slot, the norm backwards any call.
_KERNELS = {"layernorm_fwd": _layernorm_fwd_kernel, "rmsnorm_fwd": _rmsnorm_fwd_kernel,
            "activation_fwd": _activation_fwd_kernel,
            "activation_bwd_dbias_cast_transpose": _act_bwd_dbias_ct_kernel,
            "dbias_cast_transpose_parts": _dbias_ct_parts_kernel,
            "layernorm_bwd": _layernorm_bwd_kernel, "layernorm_bwd_add": _layernorm_bwd_add_kernel,
            "rmsnorm_bwd": _rmsnorm_bwd_kernel, "rmsnorm_bwd_add": _rmsnorm_bwd_add_kernel}


def _act_bwd_dbias_ct_math(dy, x, kind, scale, fp8_dtype, *, amax_out=None, **params):
    """The reference's composition (activation_bwd, then dbias_cast_transpose of dx), dx as
    stored in x's dtype; params: clamped_swiglu's."""
    dx = as_stored(ref_act.activation_bwd(dy, x, kind, **params))
    return ref_act.dbias_cast_transpose(dx, scale, fp8_dtype, amax_out=amax_out)


def _math(name: str) -> Callable:
    return _act_bwd_dbias_ct_math if name == "activation_bwd_dbias_cast_transpose" else implementations()[name]


def _twin(name: str, takes: Callable, math: Callable, device_type: str) -> Callable:
    """math as a twin: NotImplemented where `takes` declines; the bfloat16 tensors it reads (the
    positional arguments) and returns as stored (as_stored). A call goes to the op's kernel
    launch first, where _KERNELS has one that takes it (looked up while tracing, so that a
    comparison can take an entry out)."""
    def twin(*args, **kwargs):
        kernel = _KERNELS.get(name)
        if kernel is not None:
            result = kernel(device_type, *args, **kwargs)
            if result is not NotImplemented:
                return result
        if not takes(device_type, *args, **kwargs):
            return NotImplemented
        if kwargs.get("fp8_scale") is not None:  # see hold_scale
            kwargs = {**kwargs, "fp8_scale": hold_scale(kwargs["fp8_scale"])}
        amax_out = kwargs.pop("amax_out", None)  # written by traced's slot op, not by the math
        result = math(*[as_stored(a) for a in args], **kwargs)
        if not isinstance(result, tuple):
            return as_stored(result)
        result = [as_stored(t) for t in result]
        if amax_out is not None:  # the amax is the last output (te_core.ops)
            result[-1] = traced.amax_into(result[-1], amax_out)
        return tuple(result)

    return functools.wraps(math)(twin)


def twins(device_type: str = DEVICE_TYPE) -> Dict[str, Callable]:
    """op name -> twin taking calls on tensors of `device_type` (the tests build CPU ones)."""
    return {name: _twin(name, takes, _math(name), device_type) for name, takes in _TAKES.items()}


TRACED_FUSED = twins()
