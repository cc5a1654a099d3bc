"""Tensor-wise FP8 casts, the FP8 GEMMs (tensor-wise and block-scaled) and the high-precision
GEMM in plain torch operations: the ops' twins for torch.compile (OpImpl.traced). The block
casts' twin is in traced_block.

Under torch.compile each opaque op costs a trip through torch.library and this backend's
Python on every call, which on a host-bound step makes the compiled step slower than the eager
one. Traced in plain operations instead, the casts become kernels the compiler writes and
fuses (the cast, its amax and its transpose read x once), launched by its own launcher, and
the GEMM is one extern call of torch._scaled_mm, or, for the small tensor-wise GEMMs the eager op
gives te_triton's kernel, that kernel launched by the compiled code.

The math is the Triton kernels': x times the float32 scale, clamped to the format's max (NaN
stays NaN), cast round-to-nearest-even; amax max|x| with NaN winning; divisions rounded once
to float32, as eager CUDA and the kernels round them; a bfloat16 input read as stored
(as_stored), since the compiler keeps a fused producer's bfloat16 result in float32. So the
FP8 bytes, amaxes and scales are the eager ones; a bias gradient sums its rows in another
order. A cast reads a delayed-scaling scale through hold_scale, so that the backward never
re-reads a scale the step has updated since.

Delayed scaling's casts that max their amax into `amax_out` (a history slot) and its update
are te_triton's own kernels launched by the compiled code (traced_kernels, where its DELAYED is
on), at every size: the eager ops' kernels and bytes, each kernel maxing into the slot. As
opaque ops, each costs a trip through torch.library and te-core's dispatch, and a small
compiled delayed-scaling step cost the host more than its eager self. Where those launches
cannot run (a GPU whose convert does not saturate, a strided x, a size the compiler left
symbolic in a fused cast, whose launch branches on the sizes, or in a plain cast with
traced_kernels.SYMBOLIC off, a history too long for one register tile), a cast with a
slot stays the opaque op unless WRITES_SLOTS allows its torch-op twin (see there), and the
update stays the opaque op: written in torch ops, it kept the old scales for a history holding
NaN where the kernel, as Transformer Engine, ignores the NaN. Anything else (row-wise and MXFP8
scales, outputs written into `out`, tensors off this backend's device) returns NotImplemented
and stays the opaque op.
"""
from __future__ import annotations

import torch
from te_core._tracing import run_while_tracing
from te_core.backend.types import BLOCK_1x128_1x128, BLOCK_1x128_128x128, FP8_FORMATS, TENSORWISE
from te_triton import gemm as triton_gemm
from te_triton._common import MAX_NUMEL as KERNEL_MAX_NUMEL  # its kernels index with int32 offsets
from torch._subclasses.fake_tensor import unset_fake_temporarily

# Casts of MAX_NUMEL elements or more stay the Triton kernels (where they switch to descriptors).
# Below that, inductor's cast, amax and transpose take up to twice the Triton kernels' GPU time
# (a 2^25-element cast), which a GPU-bound layer step feels by a few percent; a host-bound step,
# a lone Linear of that size, gains far more from not paying an opaque op per cast. Current
# scaling's casts (and traced_block's) of traced_kernels.KERNEL_MIN_NUMEL elements and up launch
# the Triton kernels from the compiled code instead, which costs neither.
from .configs import TMA_MIN_NUMEL as MAX_NUMEL
from . import capabilities, configs, scaled_mm, traced_kernels
from .scaled_mm import fp8_gemm_layout_reason

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A cast takes no float16 input: inductor keeps a fused float16 producer's result in float32,
# and as_stored restores the stored values of bfloat16 only, so the FP8 bytes could differ
# from eager's; float16 casts stay the opaque ops.
CAST_DTYPES = (torch.float32, torch.bfloat16)
TRACED_SCALINGS = (TENSORWISE, BLOCK_1x128_128x128, BLOCK_1x128_1x128)  # the GEMMs torch._scaled_mm runs here
FLOAT32_MAX = torch.finfo(torch.float32).max
DEVICE_TYPE = "cuda"  # the device whose tensors the twins take (the opaque op handles the rest)
# Casts that max their amax into a delayed-scaling history slot (amax_out) and that te_triton's
# kernels cannot take from the compiled code (traced_kernels.takes) stay the opaque ops unless
# this is on. Traced in torch ops, through max_into below, they compile and replay under
# mode="reduce-overhead", but a compiled or graphed delayed-scaling step is no faster with them
# (a TransformerLayer is slower: inductor's casts take more GPU time and more launches), so the
# opaque ops keep them. The tests check the twins' math with it on.
WRITES_SLOTS = False


def _here(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE


def _takes(x, fp8_dtype, scale=None, amax_out=None, symbolic=False) -> bool:
    """Whether the twin takes the call. Not for tensors of MAX_NUMEL elements or more: steps
    with such tensors are GPU-bound, and there the Triton cast-transposes (one read, both
    layouts written, the amax maxed into its slot with one atomic) are faster than the
    compiler's cast, transpose and reduction. `amax_out`, where given, must be the contract's
    1-element float32 slot on x's device (else the opaque op names the problem). symbolic: the
    twin's kernel takes symbolic sizes (traced_kernels.takes)."""
    if not _here(x) or x.numel() == 0 or x.numel() >= MAX_NUMEL:
        return False
    if fp8_dtype not in FP8_FORMATS or x.dtype not in CAST_DTYPES:
        return False
    if amax_out is not None and not (_here(amax_out) and amax_out.device == x.device
                                     and amax_out.dtype == torch.float32 and amax_out.numel() == 1
                                     and (WRITES_SLOTS or _slot_kernel(x, symbolic))):
        return False
    return scale is None or (scale.device == x.device and scale.numel() == 1 and scale.dtype == torch.float32)


def _slot_kernel(x, symbolic=False) -> bool:
    """Whether a cast of x writing a history slot launches te_triton's kernel (every size;
    symbolic sizes where the kernel takes them, see traced_kernels.takes)."""
    return traced_kernels.DELAYED and traced_kernels.takes(x, min_numel=1, symbolic=symbolic)


def _on_kernel(x, amax_out, symbolic=False) -> bool:
    """Whether a cast with a given scale launches te_triton's kernel: one writing a history slot
    as _slot_kernel says, others from traced_kernels.KERNEL_MIN_NUMEL (as current scaling's)."""
    if amax_out is not None:
        return _slot_kernel(x, symbolic)
    return traced_kernels.DELAYED and traced_kernels.takes(x, symbolic=symbolic)


def _as(t, dtype):
    """t in dtype, without a conversion that is a no-op: torch.compile records such a .to() as
    an alias of its input, and an autograd Function whose output is one got a zero gradient
    (torch 2.11)."""
    return t if t.dtype == dtype else t.to(dtype)


def hold_scale(scale):
    """The scale's value at the cast, as a value the backward must keep rather than read again;
    for every twin that casts with a delayed-scaling scale. A compiled step may update the
    scale in place after the cast (delayed scaling's update at the end of the forward), and
    AOTAutograd's min-cut partitioner, which recomputes cheap forward values in the backward,
    would re-read the scale there after the update: an FP8 copy the backward uses would then be
    cast with the next step's scale. The partitioner never recomputes a reduction whose output
    is much smaller than its input, so the scale goes through the max over copies of itself
    (the same value, NaN kept), which it saves. Shape (1,)."""
    return scale.reshape(1).expand(8).amax(0, keepdim=True)


def as_stored(t):
    """A bfloat16 tensor (or a list of them) with the values its storage holds, in a form the
    compiler cannot skip: inductor keeps a bfloat16 intermediate in float32 where it fuses its
    producer with its consumer, and an FP8 cast of it would then round once from float32 where
    eager rounds twice (to bfloat16, then to FP8), moving many elements by one FP8 step. The
    rounding to nearest even is written out on the float32 bits (the compiler keeps integer
    arithmetic); exact, so eager calls get t's own values. Anything else is returned as is."""
    if isinstance(t, (list, tuple)):
        return type(t)([as_stored(p) for p in t])
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16:
        return t
    t32 = t.float()
    bits = t32.view(torch.int32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).view(torch.float32)  # keep the top 16 bits
    return torch.where(torch.isnan(t32), t32, rounded).to(torch.bfloat16)


def fp8_max(fp8_dtype) -> float:
    """The format's largest finite value, as a constant of the trace: read from a module's dict,
    a float becomes a symbolic input under torch.compile(dynamic=True), and a backward whose
    speculation reads it first (the gradient's E5M2 after E4M3 forward casts) cannot lift it
    into the graph. torch.finfo of a dtype is folded."""
    return torch.finfo(fp8_dtype).max


def _cast(x, scale, fp8_dtype):
    fmax = fp8_max(fp8_dtype)
    return torch.clamp(_as(x, torch.float32) * scale.reshape(()), -fmax, fmax).to(fp8_dtype)


def _amax(x):
    """max|x|, NaN if x has one."""
    return _as(x.abs().amax(), torch.float32)


def _max_into(slot, amax) -> None:
    torch.maximum(slot, amax.reshape(slot.shape), out=slot)


# The slot write as a tiny op of its own: written with torch ops, a write into one slot of a
# history becomes a functionalized copy of the whole history (the compiler does not write a
# chain of such slices in place), while a custom op that mutates its argument is called by the
# compiled code on the history's own memory.
_LIB = torch.library.Library("te_backend_cuda", "FRAGMENT")
_LIB.define("max_into(Tensor(a!) slot, Tensor amax) -> ()")
_LIB.impl("max_into", _max_into, "CompositeExplicitAutograd")
torch.library.register_fake("te_backend_cuda::max_into", lambda slot, amax: None, lib=_LIB)


def amax_into(amax, amax_out):
    """amax; with `amax_out`, max(amax_out, amax) written into it (NaN wins) and amax_out
    itself returned, as the contract's delayed-scaling casts do."""
    if amax_out is None:
        return amax
    torch.ops.te_backend_cuda.max_into(amax_out, amax)
    return amax_out


def _div_rn(a, b):
    """a / b of float32 tensors rounded once to float32, as eager CUDA and the Triton kernels
    (div_rn) divide; the compiler's float32 division is an approximate one. In float64: the
    quotient of two float32 values rounded to float64 (53 bits >= 2 * 24 + 2) and then to
    float32 is the correctly rounded float32 quotient."""
    return (a.double() / b.double()).float()


def quantize_fp8(x, scale, fp8_dtype, *, amax_out=None):
    if not _takes(x, fp8_dtype, scale, amax_out, symbolic=True):
        return NotImplemented
    if _on_kernel(x, amax_out, symbolic=True):
        return traced_kernels.quantize_fp8(x, scale, fp8_dtype, amax_out=amax_out)
    x = as_stored(x)
    return _cast(x, hold_scale(scale), fp8_dtype), amax_into(_amax(x), amax_out)


def cast_transpose_fp8(x, scale, fp8_dtype, *, amax_out=None):
    if not _takes(x, fp8_dtype, scale, amax_out, symbolic=True) or x.dim() != 2:
        return NotImplemented
    if _on_kernel(x, amax_out, symbolic=True):
        return traced_kernels.cast_transpose_fp8(x, scale, fp8_dtype, amax_out=amax_out)
    x = as_stored(x)
    data = _cast(x, hold_scale(scale), fp8_dtype)
    return data, data.t().contiguous(), amax_into(_amax(x), amax_out)


def dbias_cast_transpose(dy, scale, fp8_dtype, *, amax_out=None):
    # its launch branches on the row length: symbolic rows only (traced_kernels.rows_symbolic)
    symbolic = isinstance(dy, torch.Tensor) and dy.dim() == 2 and traced_kernels.rows_symbolic(dy)
    if not _takes(dy, fp8_dtype, scale, amax_out, symbolic=symbolic) or dy.dim() != 2:
        return NotImplemented
    if _on_kernel(dy, amax_out, symbolic=symbolic):
        return traced_kernels.dbias_cast_transpose(dy, scale, fp8_dtype, amax_out=amax_out)
    dy = as_stored(dy)
    data = _cast(dy, hold_scale(scale), fp8_dtype)
    dbias = _as(_as(dy, torch.float32).sum(0), dy.dtype)
    return data, data.t().contiguous(), dbias, amax_into(_amax(dy), amax_out)


def _current_scale(amax, fmax, amax_epsilon, force_pow2_scales):
    """The Triton current-scale kernel's rules: fmax / max(amax, eps); inf -> float32 max;
    1 where amax is NaN or inf or the divisor 0; optionally rounded down to a power of two."""
    amax_eff = torch.clamp_min(amax, float(amax_epsilon))
    scale = _div_rn(torch.full_like(amax_eff, fmax), amax_eff)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLOAT32_MAX), scale)
    bad = torch.isnan(amax) | torch.isinf(amax) | (amax_eff == 0)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if force_pow2_scales:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def quantize_fp8_current(x, fp8_dtype, *, with_transpose=False, force_pow2_scales=False, amax_epsilon=0.0):
    if not _takes(x, fp8_dtype) or (with_transpose and x.dim() != 2):
        return NotImplemented
    if traced_kernels.takes(x, symbolic=True):  # te_triton's kernels, launched by the compiled code
        return traced_kernels.quantize_fp8_current(x, fp8_dtype, with_transpose=with_transpose,
                                                   force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon)
    x = as_stored(x)
    amax = _amax(x)
    scale = _current_scale(amax.reshape(1), fp8_max(fp8_dtype), amax_epsilon, force_pow2_scales)
    data = _cast(x, scale, fp8_dtype)
    data_t = data.t().contiguous() if with_transpose else None
    return data, data_t, scale, torch.div(torch.ones_like(scale), scale), amax


def _current_parts_in_place(parts, fp8_dtype) -> bool:
    """Whether te_triton's fused kernel casts these column blocks of a gradient in place, as the
    eager op reads them (traced_kernels.parts_in_place), their joined size one it takes."""
    numel = parts[0].shape[0] * sum([p.shape[1] for p in parts])
    if len(parts) == 1 or not traced_kernels.KERNEL_MIN_NUMEL <= numel < MAX_NUMEL:
        return False
    kernel = traced_kernels.takes
    return (all([_takes(p, fp8_dtype) and kernel(p, min_numel=1, symbolic=traced_kernels.rows_symbolic(p))
                 for p in parts]) and traced_kernels.parts_in_place(parts))


def dbias_cast_transpose_current(parts, fp8_dtype, *, force_pow2_scales=False, amax_epsilon=0.0):
    """quantize_fp8_current's twin on the joined column blocks (the compiler fuses the join
    into the cast), plus their column sums; from traced_kernels.KERNEL_MIN_NUMEL elements
    te_triton's fused kernel with its bias gradient, reading the blocks in place where the eager
    op does (without the join, a pass over the whole gradient)."""
    if not isinstance(parts, (list, tuple)) or not parts or not all(_here(p) and p.dim() == 2 for p in parts):
        return NotImplemented
    first = parts[0]
    if any(p.dtype != first.dtype or p.shape[0] != first.shape[0] or p.device != first.device for p in parts):
        return NotImplemented  # (the opaque op names the mismatch)
    if _current_parts_in_place(parts, fp8_dtype):
        return traced_kernels.dbias_cast_transpose_current(first, fp8_dtype, force_pow2_scales=force_pow2_scales,
                                                           amax_epsilon=amax_epsilon, parts=list(parts))
    dy = torch.cat(list(parts), dim=1) if len(parts) > 1 else first
    # te_triton's fused kernel, as the eager op; its launch branches on the row length (rows_symbolic)
    if _takes(dy, fp8_dtype) and traced_kernels.takes(dy, symbolic=traced_kernels.rows_symbolic(dy)):
        return traced_kernels.dbias_cast_transpose_current(dy, fp8_dtype, force_pow2_scales=force_pow2_scales,
                                                           amax_epsilon=amax_epsilon)
    result = quantize_fp8_current(dy, fp8_dtype, with_transpose=True, force_pow2_scales=force_pow2_scales,
                                  amax_epsilon=amax_epsilon)
    if result is NotImplemented:
        return result
    data, data_t, scale, scale_inv, amax = result
    dy = as_stored(dy)
    return data, data_t, _as(_as(dy, torch.float32).sum(0), dy.dtype), scale, scale_inv, amax


def delayed_scaling_update(amax_histories, scales, fp8_maxes, *, margin=0.0, amax_compute_algo="max"):
    """te_triton's update kernel launched by the compiled code, per history (traced_kernels);
    NotImplemented (the opaque op) where it cannot take them."""
    if (not isinstance(amax_compute_algo, str) or amax_compute_algo not in ("max", "most_recent")
            or len(fp8_maxes) != len(amax_histories) or not traced_kernels.update_takes(amax_histories, scales)):
        return NotImplemented
    traced_kernels.delayed_scaling_update(amax_histories, scales, fp8_maxes, margin=float(margin),
                                          amax_compute_algo=amax_compute_algo)
    return None


def transpose_fp8(data):
    """te_triton's transpose launched by the compiled code from traced_kernels.KERNEL_MIN_NUMEL
    elements (plain or symbolic sizes; see traced_kernels.transpose_fp8 for why), else the
    compiler's: a small step's host pays less for a kernel the compiler launches itself."""
    if data.dtype not in FP8_FORMATS or data.dim() != 2 or not _here(data):
        return NotImplemented
    if traced_kernels.takes(data, symbolic=True) and data.numel() <= KERNEL_MAX_NUMEL:
        return traced_kernels.transpose_fp8(data)
    return data.t().contiguous()


def dequantize_fp8(data, scale_inv, out_dtype):
    if data.dtype not in FP8_FORMATS or out_dtype not in HP_DTYPES or not _here(data) or scale_inv.numel() != 1:
        return NotImplemented
    return _as(data.float() * _as(scale_inv.reshape(()), torch.float32), out_dtype)


@run_while_tracing
def _gpu_runs(index: int, scaling: str) -> bool:
    """Whether GPU `index` runs FP8 GEMMs with `scaling` natively: the backend's capability
    probe, which the dispatcher checks before an opaque call and a twin must check itself. The
    probe launches kernels, so it runs while dynamo traces and its answer is a constant."""
    with unset_fake_temporarily():  # real kernels (and a real cached answer) even while tracing
        return scaling in capabilities.capabilities_for(index).scaling_modes


def _block_gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, scaling, bias):
    """The block-scaled GEMM as the eager op runs it: one torch._scaled_mm with the block scales
    laid out as cuBLASLt reads them (accumulating in float32), the bias in its epilogue where the
    eager op puts it there, else added after. A symbolic inner size (the weight gradient's
    token count under automatic dynamic shapes) stays the opaque op: inductor's lowering of
    torch._scaled_mm checks the scale grid against ceil(K / 128), which it cannot prove equal to
    the casts' K // 128 for a symbolic K, and fails the compile."""
    if not traced_kernels.static_int(a.shape[1]):
        return NotImplemented
    expected = scaled_mm.block_scale_shapes(a, b, scaling)
    if (tuple(a_scale_inv.shape), tuple(b_scale_inv.shape)) != expected or not (_here(a_scale_inv) and _here(b_scale_inv)):
        return NotImplemented  # (the opaque op names a bad scale)
    sa, sb = scaled_mm._scale_args(a, b, a_scale_inv, b_scale_inv, scaling)
    epilogue = scaled_mm._epilogue_bias(bias, out_dtype, scaling)
    kwargs = dict(bias=bias) if epilogue else {}
    y = torch._scaled_mm(a, b.t(), sa, sb, out_dtype=out_dtype, use_fast_accum=False, **kwargs)
    return y if bias is None or epilogue else _add_bias(y, bias, out_dtype)


def gemm_fp8(a, b, a_scale_inv, b_scale_inv, *, out_dtype, scaling=TENSORWISE, bias=None, out=None,
             accumulate=False, fast_accumulation=False):
    if scaling not in TRACED_SCALINGS or out is not None or accumulate or not (_here(a) and _here(b)):
        return NotImplemented
    a, b = a.contiguous(), b.contiguous()
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or fp8_gemm_layout_reason(a, b, out_dtype, scaling):
        return NotImplemented  # (a K mismatch: the opaque op's reference names it)
    if a.device.type == "cuda" and not _gpu_runs(a.device.index, scaling):
        return NotImplemented  # (the opaque op's dispatch sends it to the reference)
    if scaling != TENSORWISE:
        return _block_gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, scaling, bias)
    if _on_small_kernel(a, b, scaling, out, bias):
        return _small_gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accumulation)
    kwargs = dict(out_dtype=out_dtype, use_fast_accum=bool(fast_accumulation))
    epilogue = scaled_mm._epilogue_bias(bias, out_dtype, scaling)
    if epilogue:
        kwargs["bias"] = bias
    # fresh 0-dim scales: cuBLASLt reads them with aligned loads
    y = torch._scaled_mm(a, b.t(), _as(a_scale_inv.reshape(()), torch.float32).clone(),
                         _as(b_scale_inv.reshape(()), torch.float32).clone(), **kwargs)
    if bias is not None and not epilogue:
        y = _add_bias(y, bias, out_dtype)
    return y


# The GEMMs the eager op gives te_triton's kernel (scaled_mm._small) launch it from the compiled
# code too, as a user-defined Triton kernel of the graph: an extern torch._scaled_mm call costs
# the host cuBLASLt's setup, several times such a kernel's GPU time, and the kernel gives the
# eager op's bytes. (torch.library.wrap_triton: torch 2.6 and later; before, torch._scaled_mm.)
_WRAP_TRITON = getattr(torch.library, "wrap_triton", None)


def _on_small_kernel(a, b, scaling, out, bias) -> bool:
    """Whether the compiled code launches te_triton's kernel for this GEMM: the eager op runs it
    there (scaled_mm._small), on a CUDA device, every size a plain int (traced_kernels.static_sizes:
    a symbolic size keeps torch._scaled_mm, as the kernel's grid and the size limits would be
    symbolic too)."""
    return (_WRAP_TRITON is not None and a.device.type == "cuda" and traced_kernels.static_sizes(a, b)
            and scaled_mm._small(a, b, scaling, out, bias))


@run_while_tracing
def _small_gemm_config(index: int) -> tuple:
    """(block_m, block_n, block_k, num_warps, num_stages) of GPU `index`'s small GEMM, read at
    trace time (the tuning table reads the device's properties)."""
    cfg = configs.for_device(index).small_gemm
    return cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages


def _small_gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accumulation):
    """te_triton's small tensor-wise GEMM, as the eager op launches it (same kernel, same tiles)."""
    block_m, block_n, block_k, num_warps, num_stages = _small_gemm_config(a.device.index)
    (m, k), n = a.shape, b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    sa = _as(a_scale_inv.reshape(()), torch.float32)
    sb = _as(b_scale_inv.reshape(()), torch.float32)
    _WRAP_TRITON(triton_gemm._gemm_kernel.kernel)[((m + block_m - 1) // block_m, (n + block_n - 1) // block_n)](
        a, b, out, sa, sb, sa if bias is None else bias,  # (no bias: a pointer the kernel never reads)
        m, n, k, bias is not None, bool(fast_accumulation), block_m, block_n, block_k,
        num_warps=num_warps, num_stages=num_stages)
    return out


def gemm(a, b, *, bias=None, out=None, accumulate=False, out_dtype=None):
    """The high-precision GEMM as the eager op runs it (torch.mm / addmm, extern calls the
    compiler keeps), for results in the operands' dtype. A result in another dtype (a float32
    weight gradient of bf16 operands) or written into `out` stays the opaque op."""
    if out is not None or accumulate or not (_here(a) and _here(b)) or a.dim() != 2 or b.dim() != 2:
        return NotImplemented
    if a.dtype != b.dtype or a.dtype not in HP_DTYPES or out_dtype not in (None, a.dtype) or a.shape[1] != b.shape[1]:
        return NotImplemented
    return scaled_mm.gemm(a, b, bias=bias)


def _add_bias(y, bias, out_dtype):
    """y + bias in float32, rounded once to out_dtype."""
    return _as(torch.add(_as(y, torch.float32), _as(bias, torch.float32)), out_dtype)


TRACED = {
    "quantize_fp8": quantize_fp8,
    "cast_transpose_fp8": cast_transpose_fp8,
    "dbias_cast_transpose": dbias_cast_transpose,
    "quantize_fp8_current": quantize_fp8_current,
    "dbias_cast_transpose_current": dbias_cast_transpose_current,
    "delayed_scaling_update": delayed_scaling_update,
    "transpose_fp8": transpose_fp8,
    "dequantize_fp8": dequantize_fp8,
    "gemm_fp8": gemm_fp8,
    "gemm": gemm,
}
