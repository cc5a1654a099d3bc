"""Current-scaling and block-scaled casts of mid-sized tensors (and the block-scaled gradient's
cast with its bias gradient) as te_triton's own kernels, launched by the compiled code
(torch.library.wrap_triton): what the twins of traced and traced_block run for tensors of
KERNEL_MIN_NUMEL elements and up.

Written in torch ops, such a cast becomes kernels the compiler writes: an amax reduction, the
cast, a transpose. For a 2^25-element cast with its transpose these took twice (current
scaling) and over four times (1x128 blocks) the GPU time of te_triton's kernels, which read the
input once per pass and write both layouts from one tile, so a GPU-bound compiled layer step
ran slower than its eager self. Left as the opaque ops, each cast would cost the
compiled step a trip through torch.library and this backend's Python. Launched from the
compiled code, the kernels cost neither, and give the eager op's bytes (the same kernels with
the same tiles). Below KERNEL_MIN_NUMEL the compiler's casts stay: there the cast can fuse with
the op that produces its input, which saves a launch on a host-bound step.

Each pointer a kernel writes is a tensor of its own here (the eager launches pass one tensor
for pointers a variant never touches): wrap_triton finds the tensors a kernel writes from its
code and functionalizes those, so no written tensor may stand for two arguments.
"""
from __future__ import annotations

import torch
from te_core._tracing import run_while_tracing
from te_triton import blockwise as triton_blockwise
from te_triton import cast as triton_cast
from te_triton._common import cdiv, grid_size

from . import configs

KERNEL_MIN_NUMEL = 1 << 20
_WRAP_TRITON = getattr(torch.library, "wrap_triton", None)  # torch 2.6 and later


def takes(x) -> bool:
    """Whether the cast of x (which the traced twin already took) launches te_triton's kernel:
    wrap_triton there, a contiguous x on a CUDA device whose convert saturates, at least
    KERNEL_MIN_NUMEL elements and every size a plain int (a symbolic size under dynamic=True
    keeps the compiler's cast: the grid would be symbolic too)."""
    return (_WRAP_TRITON is not None and x.device.type == "cuda" and x.is_contiguous()
            and all(type(d) is int for d in x.shape) and x.numel() >= KERNEL_MIN_NUMEL
            and _kernels_run_on(x.device.index))


@run_while_tracing
def _kernels_run_on(index: int) -> bool:
    """Whether GPU `index` runs te_triton's FP8-output kernels: the check the eager ops make in
    supports() (the kernels leave saturation to the convert, which saturates from compute
    capability 8.9 on), which a twin, run without supports(), makes itself. Elsewhere the
    compiler's cast, which clamps, stays."""
    from .ops.checks import fp8_convert_ok  # (not at import: ops imports this module's importers)

    return fp8_convert_ok(index)[0]


@run_while_tracing
def _quantize_launch(index: int, n: int) -> tuple:
    """(programs, block, num_warps, hw_saturate) of GPU `index`'s quantize launches over n elements."""
    cfg = configs.for_device(index).quantize
    return grid_size(cdiv(n, cfg.block), cfg), cfg.block, cfg.num_warps, cfg.hw_saturate


@run_while_tracing
def _cast_transpose_launch(index: int, m: int, k: int) -> tuple:
    """(programs, block_m, block_n, num_warps, hw_saturate) of its cast-transposes of an (m, k) x."""
    cfg = configs.for_device(index).cast_transpose
    programs = grid_size(cdiv(m, cfg.block_m) * cdiv(k, cfg.block_n), cfg)
    return programs, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.hw_saturate


@run_while_tracing
def _blockwise_config(index: int, with_transpose: bool, block_2d: bool) -> tuple:
    """(block_m, num_warps, hw_saturate) of its block casts, as ops.cast.quantize_blockwise picks."""
    t = configs.for_device(index)
    cfg = t.blockwise_1d_transpose if with_transpose and not block_2d else t.blockwise
    return cfg.block_m, cfg.num_warps, cfg.hw_saturate


def quantize_fp8_current(x, fp8_dtype, *, with_transpose, force_pow2_scales, amax_epsilon):
    """(data, data_t or None, scale, scale_inv, amax) as te_triton.cast.quantize_fp8_current
    launches them: the amax pass, then the cast pass that makes the scale from it."""
    fmax = torch.finfo(fp8_dtype).max
    dev, n = x.device, x.numel()
    programs, block, warps, hw_saturate = _quantize_launch(dev.index, n)
    amax = torch.zeros((), dtype=torch.float32, device=dev)
    scale = torch.empty(1, dtype=torch.float32, device=dev)
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    eps, pow2 = float(amax_epsilon), bool(force_pow2_scales)
    # the amax pass writes amax alone (its y, scale and scale_inv pointers are never written)
    _WRAP_TRITON(triton_cast._quantize_kernel.kernel)[(programs,)](
        x, x, scale, amax, n, 1.0, scale_inv, 0.0, BLOCK=block, STORE=False, CLAMP=True, FROM_AMAX=False,
        POW2=False, num_warps=warps)
    if with_transpose:
        m, k = x.shape
        ct_programs, bm, bn, ct_warps, ct_hw_saturate = _cast_transpose_launch(dev.index, m, k)
        data = torch.empty((m, k), dtype=fp8_dtype, device=dev)
        data_t = torch.empty((k, m), dtype=fp8_dtype, device=dev)
        _WRAP_TRITON(triton_cast._cast_transpose_kernel.kernel)[(ct_programs,)](
            x, data, data_t, scale, amax, m, k, fmax, scale_inv, eps, BM=bm, BN=bn,
            CLAMP=not ct_hw_saturate or x.dtype != torch.bfloat16, FROM_AMAX=True, POW2=pow2, num_warps=ct_warps)
        return data, data_t, scale, scale_inv, amax
    data = torch.empty(x.shape, dtype=fp8_dtype, device=dev)
    _WRAP_TRITON(triton_cast._quantize_kernel.kernel)[(programs,)](
        x, data, scale, amax, n, fmax, scale_inv, eps, BLOCK=block, STORE=True, CLAMP=not hw_saturate,
        FROM_AMAX=True, POW2=pow2, num_warps=warps)
    return data, None, scale, scale_inv, amax


def quantize_blockwise(x, fp8_dtype, *, block_2d, with_transpose, force_pow2_scales, amax_epsilon):
    """(data, scale_inv, data_t, scale_inv_t) as te_triton.blockwise.quantize_blockwise launches
    them (1x128 scale grids column by column)."""
    block = triton_blockwise.BLOCK
    fmax = torch.finfo(fp8_dtype).max
    dev = x.device
    m, k = x.shape
    mb, kb = cdiv(m, block), cdiv(k, block)
    block_m, warps, hw_saturate = _blockwise_config(dev.index, bool(with_transpose), bool(block_2d))
    bm = block if (block_2d or with_transpose) else block_m
    data = torch.empty((m, k), dtype=fp8_dtype, device=dev)
    scale_inv = triton_blockwise._scales(mb if block_2d else m, kb, not block_2d, dev)
    if with_transpose:
        data_t = torch.empty((k, m), dtype=fp8_dtype, device=dev)
        scale_inv_t = triton_blockwise._scales(kb if block_2d else k, mb, not block_2d, dev)
        yt, st = data_t, scale_inv_t
    else:  # pointers the variant never writes: tensors of their own (see the module docstring)
        data_t = scale_inv_t = None
        yt = torch.empty(1, dtype=fp8_dtype, device=dev)
        st = torch.empty((1, 1), dtype=torch.float32, device=dev)
    unused_dbias = torch.empty(1, dtype=torch.float32, device=dev)
    _WRAP_TRITON(triton_blockwise._blockwise_kernel.kernel)[(cdiv(m, bm), kb)](
        x, data, scale_inv, yt, st, unused_dbias, m, k, mb, kb, k,
        scale_inv.stride(0), scale_inv.stride(1), st.stride(0), st.stride(1), 0, fmax, float(amax_epsilon),
        BM=bm, BLOCK_2D=bool(block_2d), TRANSPOSE=bool(with_transpose), POW2=bool(force_pow2_scales),
        SUB=min(block_m, block), num_warps=warps,
        CLAMP=not hw_saturate or (bool(with_transpose) and x.dtype != torch.bfloat16), DBIAS=False)
    return data, scale_inv, data_t, scale_inv_t


def dbias_cast_transpose_blockwise(dy, fp8_dtype, *, force_pow2_scales, amax_epsilon):
    """(data, scale_inv, data_t, scale_inv_t, dbias) of a 2-D gradient as
    te_triton.blockwise.dbias_cast_transpose_blockwise launches them for one part: both 1x128
    casts and each row block's column sums in one kernel, then their sum (none for one row
    block, whose sums are the bias gradient)."""
    block = triton_blockwise.BLOCK
    fmax = torch.finfo(fp8_dtype).max
    dev = dy.device
    m, k = dy.shape
    mb, kb = cdiv(m, block), cdiv(k, block)
    block_m, warps, hw_saturate = _blockwise_config(dev.index, True, False)
    data = torch.empty((m, k), dtype=fp8_dtype, device=dev)
    data_t = torch.empty((k, m), dtype=fp8_dtype, device=dev)
    scale_inv, scale_inv_t = triton_blockwise._scales(m, kb, True, dev), triton_blockwise._scales(k, mb, True, dev)
    one = mb == 1
    partial = torch.empty((mb, k), dtype=dy.dtype if one else torch.float32, device=dev)
    _WRAP_TRITON(triton_blockwise._blockwise_kernel.kernel)[(mb, kb)](
        dy, data, scale_inv, data_t, scale_inv_t, partial, m, k, mb, kb, k,
        scale_inv.stride(0), scale_inv.stride(1), scale_inv_t.stride(0), scale_inv_t.stride(1), k, fmax,
        float(amax_epsilon), BM=block, BLOCK_2D=False, TRANSPOSE=True, POW2=bool(force_pow2_scales),
        SUB=min(block_m, block), num_warps=warps, CLAMP=not hw_saturate or dy.dtype != torch.bfloat16, DBIAS=True)
    dbias = partial[0] if one else partial.sum(dim=0).to(dy.dtype)
    return data, scale_inv, data_t, scale_inv_t, dbias
