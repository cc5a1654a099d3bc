"""te_triton's own kernels launched by the compiled code (torch.library.wrap_triton), for the
twins of traced and traced_block: current-scaling and block-scaled casts (and the gradient's
cast with its bias gradient) of KERNEL_MIN_NUMEL elements and up, and delayed scaling's casts
into its amax histories at every size, with its scale update (see the section below).

Written in torch ops, such a cast becomes kernels the compiler writes: an amax reduction, the
cast, a transpose. For a 2^25-element cast with its transpose these took twice (current
scaling) and over four times (1x128 blocks) the GPU time of te_triton's kernels, which read the
input once per pass and write both layouts from one tile, so a GPU-bound compiled layer step
ran slower than its eager self. Left as the opaque ops, each cast would cost the
compiled step a trip through torch.library and this backend's Python. Launched from the
compiled code, the kernels cost neither, and give the eager op's bytes (the same kernels with
the same tiles). Below KERNEL_MIN_NUMEL current and block scaling keep the compiler's casts:
there the cast can fuse with the op that produces its input, which saves a launch on a
host-bound step.

Each pointer a kernel writes is a tensor of its own here (the eager launches pass one tensor
for pointers a variant never touches): wrap_triton finds the tensors a kernel writes from its
code and functionalizes those, so no written tensor may stand for two arguments.
"""
from __future__ import annotations

import torch
from te_core._tracing import run_while_tracing
from torch.fx.experimental.symbolic_shapes import statically_known_true
from te_triton import activation as triton_activation
from te_triton import blockwise as triton_blockwise
from te_triton import cast as triton_cast
from te_triton import dbias as triton_dbias
from te_triton import norm as triton_norm
from te_triton import scaling as triton_scaling
from te_triton._common import cdiv, next_power_of_2

from . import configs

KERNEL_MIN_NUMEL = 1 << 20
DEVICE_TYPE = "cuda"  # the device whose tensors the kernels take
_WRAP_TRITON = getattr(torch.library, "wrap_triton", None)  # torch 2.6 and later


def static_sizes(*tensors) -> bool:
    """Whether every size of the tensors is a plain int, not a size the compiler left symbolic
    (dynamic=True, or its automatic dynamic shapes after a size changed). Inside dynamo's trace
    a symbolic size passes for an int (type() and isinstance() say int), so the test asks the
    compiler what it knows: a plain int's remainder modulo 3 is known, a symbolic size's is not."""
    return all(static_int(d) for t in tensors for d in t.shape)


def static_int(d) -> bool:
    """Whether the size `d` is a plain int (static_sizes, for one size)."""
    return (statically_known_true(d % 3 == 0) or statically_known_true(d % 3 == 1)
            or statically_known_true(d % 3 == 2))


# Whether the plain casts (_cast_pass, _current_slots) launch te_triton's kernels for sizes the
# compiler leaves symbolic (dynamic=True, or its automatic dynamic shapes once a token count
# changes): their grids are arithmetic on the sizes (_programs), which the compiled code works
# out on each call, so one graph serves every shape (backends/cuda/tests/test_cuda_traced_symbolic.py)
# with the eager op's bytes and history slots. Off, such a size keeps the compiler's cast
# (current scaling: more GPU time than the eager op) or the opaque op (delayed scaling's casts
# into its histories: a trip through torch.library and te-core's dispatch per cast). Kept as a
# switch to tell a compiled step's cost from these kernels' in a profile.
SYMBOLIC = True

# Whether the block casts (quantize_blockwise, dbias_cast_transpose_blockwise: grids of cdiv's of
# the sizes, scale grids sized from them) do the same while SYMBOLIC is on, in place of the
# compiler's block casts, which took several times te_triton's GPU time. Their launches at
# symbolic sizes are checked against the eager op's on any machine
# (backends/cuda/tests/test_cuda_traced_symbolic.py), their bytes on a GPU
# (test_block_casts_with_symbolic_sizes_launch_te_triton_kernels).
SYMBOLIC_BLOCK = True

# Whether the launches whose configuration depends on the row length do the same while SYMBOLIC
# is on, where the row count is symbolic and the row length a plain int (a token count that
# changes under a fixed hidden size): delayed scaling's norm and activation forwards with FP8
# output (traced_fused), the bias-gradient casts (dbias_cast_transpose, alone, after an
# activation's backward or of joined column blocks) and every recipe's norm backwards. Their
# tiles follow from the row length, their grids are arithmetic on the rows; a norm forward's
# unmasked variant (EVEN) is taken where the compiler knows the row count a multiple of its rows
# per step (a batch size that is), else the masked one, whose bytes are the same; a bias
# gradient of so few rows that one group of them writes it is a graph of its own (a guard). Each
# launch is checked against the eager op's on any machine
# (backends/cuda/tests/test_cuda_traced_symbolic.py), the bytes on a GPU
# (backends/cuda/tests/test_cuda_traced_kernels.py).
# With the compiler's transposes of the forwards' FP8 outputs, one-dimensional copies, a compiled
# LayerNormMLP step at symbolic sizes took more GPU time than with the opaque ops; with
# te_triton's transposes (traced.transpose_fp8) it takes about as much and saves the host the
# opaque ops' dispatch (docs/performance.md, "Known limits"). Off, such calls stay the opaque
# ops (the same kernels, launched by the op), the norm backwards the traced math.
SYMBOLIC_FUSED = True


def takes(x, min_numel: int = KERNEL_MIN_NUMEL, symbolic: bool = False) -> bool:
    """Whether the cast of x (which the traced twin already took) launches te_triton's kernel:
    wrap_triton there, a contiguous x on a CUDA device whose convert saturates, at least
    `min_numel` elements, and every size a plain int (static_sizes) unless `symbolic` (a twin
    whose launch takes symbolic sizes) and SYMBOLIC. Launches whose configuration branches on
    the row length need it a plain int (rows_symbolic): the fused norm and activation forwards'
    and the bias-gradient casts'."""
    return (_WRAP_TRITON is not None and x.device.type == DEVICE_TYPE and x.is_contiguous()
            and ((symbolic and SYMBOLIC) or static_sizes(x)) and x.numel() >= max(min_numel, 1)
            and _kernels_run_on(x.device.index))


@run_while_tracing
def _kernels_run_on(index: int) -> bool:
    """Whether GPU `index` runs te_triton's FP8-output kernels: the check the eager ops make in
    supports() (the kernels leave saturation to the convert, which saturates from compute
    capability 8.9 on), which a twin, run without supports(), makes itself. Elsewhere the
    compiler's cast, which clamps, stays."""
    from .ops.checks import fp8_convert_ok  # (not at import: ops imports this module's importers)

    return fp8_convert_ok(index)[0]


def _programs(work_items, max_programs: int):
    """te_triton's grid_size for a plain or a symbolic number of work items: a symbolic one stays
    an expression of the sizes (torch.sym_min / sym_max), which the compiled code evaluates on
    each call, rather than a comparison dynamo would guard on."""
    if static_int(work_items):
        return max(1, min(work_items, max_programs)) if max_programs > 0 else max(1, work_items)
    if max_programs > 0:
        return torch.sym_max(1, torch.sym_min(work_items, max_programs))
    return torch.sym_max(1, work_items)


def _tile_programs(m, n, bm: int, bn: int, max_programs: int):
    """_programs over the (bm, bn) tiles of an (m, n) tensor, m and n plain or symbolic."""
    return _programs(cdiv(m, bm) * cdiv(n, bn), max_programs)


@run_while_tracing
def _quantize_config(index: int) -> tuple:
    """(block, num_warps, hw_saturate, max_programs) of GPU `index`'s quantize launches."""
    cfg = configs.for_device(index).quantize
    return cfg.block, cfg.num_warps, cfg.hw_saturate, cfg.max_programs


def _quantize_launch(index: int, n) -> tuple:
    """(programs, block, num_warps, hw_saturate) of its quantize launches over n elements."""
    block, warps, hw_saturate, max_programs = _quantize_config(index)
    return _programs(cdiv(n, block), max_programs), block, warps, hw_saturate


@run_while_tracing
def _cast_transpose_config(index: int) -> tuple:
    """(block_m, block_n, num_warps, hw_saturate, max_programs) of its cast-transposes."""
    cfg = configs.for_device(index).cast_transpose
    return cfg.block_m, cfg.block_n, cfg.num_warps, cfg.hw_saturate, cfg.max_programs


def _cast_transpose_launch(index: int, m, k) -> tuple:
    """(programs, block_m, block_n, num_warps, hw_saturate) of its cast-transposes of an (m, k) x."""
    bm, bn, warps, hw_saturate, max_programs = _cast_transpose_config(index)
    return _tile_programs(m, k, bm, bn, max_programs), bm, bn, warps, hw_saturate


@run_while_tracing
def _blockwise_config(index: int, with_transpose: bool, block_2d: bool) -> tuple:
    """(block_m, num_warps, hw_saturate) of its block casts, as ops.cast.quantize_blockwise picks."""
    t = configs.for_device(index)
    cfg = t.blockwise_1d_transpose if with_transpose and not block_2d else t.blockwise
    return cfg.block_m, cfg.num_warps, cfg.hw_saturate


@run_while_tracing
def _dbias_ct_tiles(index: int, k: int) -> tuple:
    """(column strips, block_m, block_n, num_warps, prefetch, hw_saturate, max_programs) of its dbias
    cast-transposes of a gradient of k columns: the pointer kernel's config, as the eager op
    picks for tensors below TMA_MIN_NUMEL (the twins take none larger)."""
    cfg = configs.for_device(index).dbias_cast_transpose
    return (cdiv(k, cfg.block_n), cfg.block_m, cfg.block_n, cfg.num_warps, cfg.prefetch, cfg.hw_saturate,
            cfg.max_programs)


def _dbias_ct_launch(index: int, m, k: int) -> tuple:
    """(row groups, column strips, block_m, block_n, num_warps, prefetch, hw_saturate) of those
    over an (m, k) gradient, m a plain or a symbolic count (te_triton.dbias._groups' arithmetic).
    Whether the gradient is small enough for one group is a comparison dynamo guards on: so few
    rows make a graph of their own, whose kernel writes the bias gradient itself."""
    strips, bm, bn, warps, prefetch, hw_saturate, max_programs = _dbias_ct_tiles(index, k)
    if m * strips * bn <= triton_dbias.ONE_GROUP_NUMEL:
        groups = 1
    elif max_programs <= 0:
        groups = cdiv(m, bm)
    else:
        cap = max_programs // strips
        groups = _programs(cdiv(m, bm), cap) if cap > 0 else 1
    return groups, strips, bm, bn, warps, prefetch, hw_saturate


@run_while_tracing
def _transpose_config(index: int) -> tuple:
    """(block_m, block_n, num_warps) of its FP8 transposes."""
    cfg = configs.for_device(index).transpose
    return cfg.block_m, cfg.block_n, cfg.num_warps


def transpose_fp8(data):
    """data.t().contiguous() of a 2-D FP8 tensor as te_triton.cast.transpose_fp8 launches it (its
    grid arithmetic on the sizes, so plain or symbolic). The compiler's own copy of the transpose
    is slower where it reads the output of a kernel launched from the compiled code (a fused norm
    or activation forward's FP8 data): its tiling analysis loses track of a buffer such a launch
    wrote and writes a one-dimensional copy whose reads are strided, several times the time of a
    tiled one (torch 2.11)."""
    m, n = data.shape
    bm, bn, warps = _transpose_config(data.device.index)
    out = torch.empty((n, m), dtype=data.dtype, device=data.device)
    _WRAP_TRITON(triton_cast._transpose_kernel.kernel)[(_tile_programs(m, n, bm, bn, 0),)](
        data, out, m, n, BM=bm, BN=bn, num_warps=warps)
    return out


def _cast_pass(x, fp8_dtype, scale, amax, scale_inv, eps, *, from_amax, pow2, with_transpose):
    """(data, data_t or None): the cast pass as te_triton.cast launches it (_quantize, or
    _cast_transpose with the transpose). from_amax (current scaling): the kernel makes the scale
    from the amax an earlier pass left, and writes it with scale_inv; else it casts with `scale`
    and maxes |x| into `amax` (delayed scaling, whose eager launch passes scale as scale_inv and
    eps 0)."""
    fmax = torch.finfo(fp8_dtype).max
    dev = x.device
    if with_transpose:
        m, k = x.shape
        programs, bm, bn, warps, hw_saturate = _cast_transpose_launch(dev.index, m, k)
        data = torch.empty((m, k), dtype=fp8_dtype, device=dev)
        data_t = torch.empty((k, m), dtype=fp8_dtype, device=dev)
        _WRAP_TRITON(triton_cast._cast_transpose_kernel.kernel)[(programs,)](
            x, data, data_t, scale, amax, m, k, fmax, scale_inv, eps, BM=bm, BN=bn,
            CLAMP=not hw_saturate or x.dtype != torch.bfloat16, FROM_AMAX=from_amax, POW2=pow2, num_warps=warps)
        return data, data_t
    programs, block, warps, hw_saturate = _quantize_launch(dev.index, x.numel())
    data = torch.empty(x.shape, dtype=fp8_dtype, device=dev)
    _WRAP_TRITON(triton_cast._quantize_kernel.kernel)[(programs,)](
        x, data, scale, amax, x.numel(), fmax, scale_inv, eps, BLOCK=block, STORE=True, CLAMP=not hw_saturate,
        FROM_AMAX=from_amax, POW2=pow2, num_warps=warps)
    return data, None


def _dbias_pass(dy, fp8_dtype, scale, amax, scale_inv, eps, *, from_amax, pow2, act=None, parts=None):
    """(data, data_t, dbias) of a 2-D gradient as te_triton.dbias launches its pointer kernel for
    one part (from_amax as for _cast_pass), then the sum of its row groups' column sums (none
    for one group, whose sums are the bias gradient). act: (x, kind) of a plain (not gated)
    activation whose gradient the kernel forms on the way, dy * act'(x), read from x. parts: the
    gradient as up to three column blocks the kernel reads in place (parts_in_place; dy is the
    first), as te_triton.dbias.dbias_cast_transpose_parts launches it."""
    dev = dy.device
    blocks = [dy] if parts is None else list(parts)
    widths = [b.shape[1] for b in blocks]
    m, k = dy.shape[0], sum(widths)
    src = dy if act is None else act[0]
    groups, strips, bm, bn, warps, prefetch, hw_saturate = _dbias_ct_launch(dev.index, m, k)
    data = torch.empty((m, k), dtype=fp8_dtype, device=dev)
    data_t = torch.empty((k, m), dtype=fp8_dtype, device=dev)
    summed = groups == 1
    partial = torch.empty((groups, k), dtype=src.dtype if summed else torch.float32, device=dev)
    # where the second and third column blocks start; past the last column (k) a block is never read
    starts = [min(sum(widths[:i]), k) for i in (1, 2)]
    blocks += [blocks[-1]] * (3 - len(blocks))
    _WRAP_TRITON(triton_dbias._dbias_ct_kernel.kernel)[(groups * strips,)](
        dy, src, data, data_t, scale, amax, partial, m, k, torch.finfo(fp8_dtype).max, groups, blocks[1], blocks[2],
        starts[0], starts[1], scale_inv, eps, ACT=act is not None,
        KIND=0 if act is None else triton_activation.KIND_IDS[act[1]], BM=bm, BN=bn,
        CLAMP=not hw_saturate or src.dtype != torch.bfloat16, PREFETCH=prefetch,
        PARTS=1 if parts is None else len(parts), FROM_AMAX=from_amax, POW2=pow2, num_warps=warps)
    return data, data_t, partial[0] if summed else partial.sum(dim=0).to(src.dtype)


def _current_slots(blocks):
    """(amax, scale, scale_inv) of a current-scaling cast of the tensors `blocks` (one tensor, or
    a gradient's column blocks), after an amax pass over each, all maxed into one amax (the
    passes write the amax alone; the cast pass writes the scales)."""
    dev = blocks[0].device
    amax = torch.zeros((), dtype=torch.float32, device=dev)
    scale = torch.empty(1, dtype=torch.float32, device=dev)
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    for x in blocks:
        programs, block, warps, _ = _quantize_launch(dev.index, x.numel())
        _WRAP_TRITON(triton_cast._quantize_kernel.kernel)[(programs,)](
            x, x, scale, amax, x.numel(), 1.0, scale_inv, 0.0, BLOCK=block, STORE=False, CLAMP=True,
            FROM_AMAX=False, POW2=False, num_warps=warps)
    return amax, scale, scale_inv


def quantize_fp8_current(x, fp8_dtype, *, with_transpose, force_pow2_scales, amax_epsilon):
    """(data, data_t or None, scale, scale_inv, amax) as te_triton.cast.quantize_fp8_current
    launches them: the amax pass, then the cast pass that makes the scale from it."""
    amax, scale, scale_inv = _current_slots([x])
    data, data_t = _cast_pass(x, fp8_dtype, scale, amax, scale_inv, float(amax_epsilon), from_amax=True,
                              pow2=bool(force_pow2_scales), with_transpose=with_transpose)
    return data, data_t, scale, scale_inv, amax


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
        scale_inv.stride(0), scale_inv.stride(1), st.stride(0), st.stride(1), 0, fmax, float(amax_epsilon), 0,
        BM=bm, BLOCK_2D=bool(block_2d), TRANSPOSE=bool(with_transpose), POW2=bool(force_pow2_scales),
        SUB=min(block_m, block), num_warps=warps,
        CLAMP=not hw_saturate or (bool(with_transpose) and x.dtype != torch.bfloat16), DBIAS=False)
    return data, scale_inv, data_t, scale_inv_t


def dbias_cast_transpose_blockwise(dy, fp8_dtype, *, force_pow2_scales, amax_epsilon, parts=None):
    """(data, scale_inv, data_t, scale_inv_t, dbias) of a 2-D gradient as
    te_triton.blockwise.dbias_cast_transpose_blockwise launches them: both 1x128 casts and each
    row block's column sums in one kernel per column block, each into its place in the outputs,
    then their sum (none for one row block, whose sums are the bias gradient). parts: the
    gradient as column blocks the eager op reads in place (blockwise_parts_in_place; dy is the
    first), else dy is the whole gradient."""
    parts = [dy] if parts is None else list(parts)
    block = triton_blockwise.BLOCK
    fmax = torch.finfo(fp8_dtype).max
    dev = dy.device
    m, k = dy.shape[0], sum([p.shape[1] for p in parts])
    mb, kb = cdiv(m, block), cdiv(k, block)
    block_m, warps, hw_saturate = _blockwise_config(dev.index, True, False)
    data = torch.empty((m, k), dtype=fp8_dtype, device=dev)
    data_t = torch.empty((k, m), dtype=fp8_dtype, device=dev)
    scale_inv, scale_inv_t = triton_blockwise._scales(m, kb, True, dev), triton_blockwise._scales(k, mb, True, dev)
    one = mb == 1
    partial = torch.empty((mb, k), dtype=dy.dtype if one else torch.float32, device=dev)
    off = 0
    for part in parts:
        width = part.shape[1]
        _WRAP_TRITON(triton_blockwise._blockwise_kernel.kernel)[(mb, cdiv(width, block))](
            part, data, scale_inv, data_t, scale_inv_t, partial, m, width, mb, cdiv(width, block), k,
            scale_inv.stride(0), scale_inv.stride(1), scale_inv_t.stride(0), scale_inv_t.stride(1), k, fmax,
            float(amax_epsilon), off, BM=block, BLOCK_2D=False, TRANSPOSE=True, POW2=bool(force_pow2_scales),
            SUB=min(block_m, block), num_warps=warps, CLAMP=not hw_saturate or dy.dtype != torch.bfloat16, DBIAS=True)
        off += width
    dbias = partial[0] if one else partial.sum(dim=0).to(dy.dtype)
    return data, scale_inv, data_t, scale_inv_t, dbias


def blockwise_parts_in_place(parts) -> bool:
    """Whether te_triton's block-scaled bias-gradient cast reads these column blocks of a gradient
    in place, as the eager op decides it (te_triton.blockwise.parts_in_place): two or more, their
    widths plain ints, none empty (eagerly an empty block launches nothing; the join of such
    blocks is one launch writing the same bytes)."""
    return (len(parts) > 1 and all([static_int(p.shape[1]) and p.shape[1] > 0 for p in parts])
            and triton_blockwise.parts_in_place(parts))


def dbias_cast_transpose_current(dy, fp8_dtype, *, force_pow2_scales, amax_epsilon, parts=None):
    """(data, data_t, dbias, scale, scale_inv, amax) of a 2-D gradient as
    te_triton.dbias.dbias_cast_transpose_current launches them: an amax pass over each part, then
    the dbias cast-transpose that makes its scale from that amax. parts: the gradient as column
    blocks the kernel reads in place (parts_in_place; dy is the first), as the eager op reads them;
    other blocks are joined by the caller first (each column's sums run over the same rows in the
    same order either way, so the bytes are the same)."""
    amax, scale, scale_inv = _current_slots([dy] if parts is None else parts)
    data, data_t, dbias = _dbias_pass(dy, fp8_dtype, scale, amax, scale_inv, float(amax_epsilon), from_amax=True,
                                      pow2=bool(force_pow2_scales), parts=parts)
    return data, data_t, dbias, scale, scale_inv, amax


# --- delayed scaling: casts that max their amax into a history slot, and the update -------------
# Whether the twins take delayed scaling's slot-writing casts and its update here (traced.py);
# off, they stay the opaque ops, each a trip through torch.library and te-core's dispatch that
# made a small compiled delayed-scaling step cost the host more than its eager self.
DELAYED = True

# Whether a cast's kernel maxes its amax into the history slot itself, as the eager op's does.
# The slot is a view of its history, which the compiler copies for the kernel and scatters back
# (_slot_memory hands column 0's kernels the history itself, written in place); CUDA graph trees
# (mode="reduce-overhead") replay either. Off: the kernel maxes into a zero of its own and the
# max_into op (traced.py) writes the slot, one more op call per cast for the host of every
# compiled step and a zero's fill on the GPU.
SLOT_IN_KERNEL = True


def _slot_memory(amax_out):
    """What a kernel maxing into the slot `amax_out` is handed: its history where the slot is
    te-core's column 0 (te_slot_column, see te_core/ops/cast.py: row 0 of the history's column
    0, the history's first element), else the slot. A kernel's write through a view of a graph
    input costs the compiled step three more kernels (a copy of the slot for the kernel, its
    scatter into a copy of the history, that copy written back at the end); a write to the input
    itself is done in place. (LayerNormMLP's second GEMM has column 1 of its histories.)"""
    base = amax_out._base
    if getattr(amax_out, "te_slot_column", None) == 0 and base is not None and base.dtype == amax_out.dtype:
        return base
    return amax_out


def _amax_buffer(amax_out, dev):
    """(what the kernel maxes |x| into, whether max_into must then write amax_out)."""
    if amax_out is not None and SLOT_IN_KERNEL:
        return _slot_memory(amax_out), False
    return torch.zeros((), dtype=torch.float32, device=dev), amax_out is not None


def _into_slot(amax, amax_out, write: bool):
    """The amax the cast returns: amax_out, maxed with amax where the kernel did not write it."""
    if write:
        torch.ops.te_backend_cuda.max_into(amax_out, amax)
    return amax_out if amax_out is not None else amax


def quantize_fp8(x, scale, fp8_dtype, *, amax_out):
    """(data, amax) of a delayed-scaling cast as te_triton.cast.quantize_fp8 launches it; its
    amax maxed into `amax_out` (a history slot) where given (see SLOT_IN_KERNEL)."""
    amax, write = _amax_buffer(amax_out, x.device)
    data, _ = _cast_pass(x, fp8_dtype, scale, amax, scale, 0.0, from_amax=False, pow2=False, with_transpose=False)
    return data, _into_slot(amax, amax_out, write)


def cast_transpose_fp8(x, scale, fp8_dtype, *, amax_out):
    """(data, data_t, amax) as te_triton.cast.cast_transpose_fp8 launches them (amax as
    quantize_fp8's)."""
    amax, write = _amax_buffer(amax_out, x.device)
    data, data_t = _cast_pass(x, fp8_dtype, scale, amax, scale, 0.0, from_amax=False, pow2=False,
                              with_transpose=True)
    return data, data_t, _into_slot(amax, amax_out, write)


def dbias_cast_transpose(dy, scale, fp8_dtype, *, amax_out, parts=None):
    """(data, data_t, dbias, amax) as te_triton.dbias.dbias_cast_transpose launches them (amax as
    quantize_fp8's); `parts` as for _dbias_pass."""
    amax, write = _amax_buffer(amax_out, dy.device)
    data, data_t, dbias = _dbias_pass(dy, fp8_dtype, scale, amax, scale, 0.0, from_amax=False, pow2=False,
                                      parts=parts)
    return data, data_t, dbias, _into_slot(amax, amax_out, write)


def rows_symbolic(x) -> bool:
    """Whether a launch over the rows of x whose configuration depends on the row length (a fused
    forward, a bias-gradient cast) may take a symbolic row count: SYMBOLIC_FUSED, and the row
    length (x's last size) a plain int."""
    return SYMBOLIC_FUSED and static_int(x.shape[-1])


def norm_takes(x, weight, bias) -> bool:
    """Whether a norm forward with FP8 output into a history slot launches te_triton's norm kernel
    (`bias` None: RMSNorm): as takes() at any size below the descriptor kernels' (whose launch
    the compiled code does not repeat), rows that fit the kernel, weight and bias contiguous and
    one per column on x's device; a symbolic row count as rows_symbolic allows."""
    if not (DELAYED and x.dim() >= 1):
        return False
    n = x.shape[-1]
    params = (weight,) if bias is None else (weight, bias)
    return (rows_symbolic(x) or static_sizes(x)) and (
        0 < n <= triton_norm.MAX_N and x.numel() < configs.TMA_MIN_NUMEL
        and all([p.is_contiguous() and p.numel() == n and p.device == x.device for p in params])
        and takes(x, min_numel=1, symbolic=True))


_NORM_FWD_KEYWORDS = ("BLOCK_N", "ROWS", "AMAX_MODE", "CHUNK", "HOIST", "CLAMP", "EVEN", "num_warps")


@run_while_tracing
def _norm_fwd_tiles(index: int, n: int, rms: bool) -> tuple:
    """(max_programs, then te_triton.norm.fwd_launch's keywords in _NORM_FWD_KEYWORDS' order, EVEN
    as if the row count were a multiple of ROWS) of GPU `index`'s norm forwards with FP8 output
    over rows of n, the pointer kernel's, as te-backend-cuda's layernorm_fwd / rmsnorm_fwd
    launch it: what depends on the row length alone (plain values, a constant of the trace)."""
    from .ops.norm import fp8_pointer_cfg  # (not at import: ops imports this module's importers)

    cfg = fp8_pointer_cfg(configs.for_device(index), n, rms)
    _, keywords = triton_norm.fwd_launch(0, n, cfg)
    return (cfg.max_programs, *(keywords[k] for k in _NORM_FWD_KEYWORDS))


def _norm_fwd_launch(index: int, m, n: int, rms: bool) -> tuple:
    """(programs, then the keywords in _NORM_FWD_KEYWORDS' order) of those forwards over m rows
    (a plain or a symbolic count; see SYMBOLIC_FUSED for EVEN)."""
    max_programs, block_n, rows, *middle, even, warps = _norm_fwd_tiles(index, n, rms)
    even = even and statically_known_true(m % rows == 0)
    return (_programs(cdiv(m, rows), max_programs), block_n, rows, *middle, even, warps)


def norm_fwd(x, weight, bias, eps, *, zero_centered_gamma, fp8_scale, fp8_dtype, amax_out):
    """(y, mean or None, rstd, amax) of a LayerNorm (RMSNorm where bias is None) forward with FP8
    output, as te_triton.norm.norm_fwd launches its kernel (amax as quantize_fp8's)."""
    rms, n, dev = bias is None, x.shape[-1], x.device
    m = x.numel() // n
    programs, block_n, rows, amax_mode, chunk, hoist, clamp, even, warps = _norm_fwd_launch(dev.index, m, n, rms)
    y = torch.empty(x.shape, dtype=fp8_dtype, device=dev)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=dev)
    mean = None if rms else torch.empty(x.shape[:-1], dtype=torch.float32, device=dev)
    amax, write = _amax_buffer(amax_out, dev)
    unused = torch.empty(1, dtype=torch.float32, device=dev) if rms else mean  # (RMSNorm writes no mean)
    _WRAP_TRITON(triton_norm._norm_fwd_kernel.kernel)[(programs,)](
        x, weight, weight if rms else bias, y, unused, rstd, fp8_scale, amax, m, n, float(eps),
        torch.finfo(fp8_dtype).max, BLOCK_N=block_n, ROWS=rows, RMS=rms, ZERO_CENTERED=bool(zero_centered_gamma),
        FP8_OUT=True, AMAX_MODE=amax_mode, CHUNK=chunk, HOIST=hoist, CLAMP=clamp, EVEN=even, num_warps=warps)
    return y, mean, rstd, _into_slot(amax, amax_out, write)


# --- norm backward: te_triton's pointer kernel wherever the traced twin would run ---------------
# Written in torch ops, a norm backward becomes the compiler's row reductions and, in passes of
# their own over the rows, the column sums of the weight's (and bias's) gradient; te_triton's
# kernel forms dx and per-program partial column sums in one pass, so it takes less GPU time
# (docs/performance.md, "Known limits"), and every recipe's layer step runs two. Launched from
# the compiled code, the eager op's kernel runs at every size below the descriptor kernels'
# (where the op runs the same pointer kernel): dx is the eager op's, bit for bit; the column sums
# of the programs' partial rows are the compiler's. Off: the traced math below
# traced_fused.MAX_NUMEL elements, the opaque op from there on.
NORM_BWD = True


def norm_bwd_takes(dy, x, stats, weight, add) -> bool:
    """Whether a LayerNorm or RMSNorm backward launches te_triton's norm backward kernel: wrap_triton
    there, x a contiguous tensor on a CUDA device below the descriptor kernels' size, of at least
    one row no longer than the kernel takes; dy (and `add`) of x's shape and dtype, contiguous;
    the statistics (mean and rstd, or rstd) contiguous float32, one per row; weight contiguous,
    one per column; every size plain, or a symbolic row count as rows_symbolic allows."""
    if not (NORM_BWD and _WRAP_TRITON is not None and x.dim() >= 1 and x.device.type == DEVICE_TYPE):
        return False
    if not (static_sizes(x) or (SYMBOLIC and rows_symbolic(x))):
        return False
    n, rows = x.shape[-1], x.shape[:-1]
    like_x = [dy] if add is None else [dy, add]
    return (0 < n <= triton_norm.MAX_N and 0 < x.numel() < configs.TMA_MIN_NUMEL and x.is_contiguous()
            and all([t.shape == x.shape and t.dtype == x.dtype and t.is_contiguous() for t in like_x])
            and all([s.shape == rows and s.dtype == torch.float32 and s.is_contiguous() for s in stats])
            and weight.numel() == n and weight.is_contiguous()
            and all([t.device == x.device for t in (*like_x, *stats, weight)]))


@run_while_tracing
def _norm_bwd_tiles(index: int, n: int, rms: bool) -> tuple:
    """(max_programs, num_warps) of GPU `index`'s norm backwards over rows of n, the pointer
    kernel's, as te-backend-cuda's layernorm_bwd / rmsnorm_bwd launch it."""
    from .ops.norm import pointer_bwd_cfg  # (not at import: ops imports this module's importers)

    cfg = pointer_bwd_cfg(configs.for_device(index), n, rms)
    return cfg.max_programs, cfg.num_warps


def norm_bwd(dy, x, mean, rstd, weight, add, *, zero_centered_gamma):
    """(dx, dweight, dbias or None) of a LayerNorm (RMSNorm where mean is None) backward, `add`
    (or None) added to dx, as te_triton.norm.norm_bwd launches its pointer kernel: each program
    writes a partial row of the weight's (and bias's) gradient, summed over the programs here."""
    rms, n, dev = mean is None, x.shape[-1], x.device
    m = x.numel() // n
    max_programs, warps = _norm_bwd_tiles(dev.index, n, rms)
    programs = _programs(m, max_programs)
    dx = torch.empty_like(x)
    dw_part = torch.empty((programs, n), dtype=torch.float32, device=dev)
    db_part = torch.empty((1,) if rms else (programs, n), dtype=torch.float32, device=dev)  # (RMSNorm writes none)
    _WRAP_TRITON(triton_norm._norm_bwd_kernel.kernel)[(programs,)](
        dy, x, rstd if rms else mean, rstd, weight, dx, dw_part, db_part, x if add is None else add, m, n,
        BLOCK_N=next_power_of_2(n), RMS=rms, ZERO_CENTERED=bool(zero_centered_gamma), ADD=add is not None,
        num_warps=warps)
    dweight = dw_part.sum(dim=0).to(weight.dtype)
    return dx, dweight, None if rms else db_part.sum(dim=0).to(weight.dtype)


def activation_takes(x, kind: str, params: dict) -> bool:
    """Whether an activation forward with FP8 output into a history slot launches te_triton's
    activation kernel: as takes() at any size, a kind the kernel has (without parameters: those
    are clamped_swiglu's, which it has not), a gated one over an even last dimension."""
    if not (DELAYED and not params and kind in triton_activation.KIND_IDS and x.dim() >= 1):
        return False
    return ((kind not in triton_activation.GATED or x.shape[-1] % 2 == 0)
            and (rows_symbolic(x) or static_sizes(x)) and takes(x, min_numel=1, symbolic=True))


@run_while_tracing
def _act_fwd_tiles(index: int, kind: str) -> tuple:
    """(max_programs, block_m, block_n, clamp, num_warps) of GPU `index`'s activation forwards of
    `kind`, as te-backend-cuda's activation_fwd launches them."""
    from .ops.activation import fwd_cfg  # (not at import: ops imports this module's importers)

    cfg = fwd_cfg(configs.for_device(index), kind)
    return cfg.max_programs, cfg.block_m, cfg.block_n, not cfg.hw_saturate, cfg.num_warps


def _act_fwd_launch(index: int, r, h: int, kind: str) -> tuple:
    """(programs, block_m, block_n, clamp, num_warps) of those forwards over an (r, h) output, r a
    plain or a symbolic count (te_triton.activation._grid's arithmetic)."""
    max_programs, bm, bn, clamp, warps = _act_fwd_tiles(index, kind)
    return _tile_programs(r, h, bm, bn, max_programs), bm, bn, clamp, warps


def activation_fwd(x, kind, *, fp8_scale, fp8_dtype, amax_out):
    """(y, amax) of an activation forward with FP8 output, as te_triton.activation.activation_fwd
    launches its kernel (amax as quantize_fp8's)."""
    gated, dev = kind in triton_activation.GATED, x.device
    h = x.shape[-1] // 2 if gated else x.shape[-1]
    r = x.numel() // x.shape[-1]
    programs, bm, bn, clamp, warps = _act_fwd_launch(dev.index, r, h, kind)
    y = torch.empty((*x.shape[:-1], h), dtype=fp8_dtype, device=dev)
    amax, write = _amax_buffer(amax_out, dev)
    _WRAP_TRITON(triton_activation._act_fwd_kernel.kernel)[(programs,)](
        x, y, fp8_scale, amax, r, h, torch.finfo(fp8_dtype).max, KIND=triton_activation.KIND_IDS[kind], GATED=gated,
        FP8_OUT=True, BM=bm, BN=bn, CLAMP=clamp, num_warps=warps)
    return y, _into_slot(amax, amax_out, write)


def epilogue_takes(x) -> bool:
    """Whether a backward epilogue into a history slot (a fused dbias cast-transpose of a
    gradient, after an activation's backward or of column blocks joined) launches te_triton's
    kernels: as takes() for the 2-D tensor it reads, below the descriptor kernels' size."""
    return (DELAYED and x.dim() == 2 and x.numel() < configs.TMA_MIN_NUMEL
            and takes(x, min_numel=1, symbolic=rows_symbolic(x)))


@run_while_tracing
def _act_bwd_tiles(index: int) -> tuple:
    """(max_programs, block_m, block_n, num_warps) of GPU `index`'s activation backwards, as
    te-backend-cuda launches them (its elementwise config)."""
    cfg = configs.for_device(index).elementwise
    return cfg.max_programs, cfg.block_m, cfg.block_n, cfg.num_warps


def _act_bwd_launch(index: int, r, h: int) -> tuple:
    """(programs, block_m, block_n, num_warps) of those over an (r, h) output, r a plain or a
    symbolic count (te_triton.activation._grid's arithmetic)."""
    max_programs, bm, bn, warps = _act_bwd_tiles(index)
    return _tile_programs(r, h, bm, bn, max_programs), bm, bn, warps


def activation_bwd_dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, *, amax_out):
    """(data, data_t, dbias, amax) of dx = activation_bwd(dy, x, kind), as te_triton.dbias launches
    them: one pass forming dx for a plain kind; for a gated one, the activation's backward kernel
    and then the dbias cast-transpose of its dx (amax as quantize_fp8's)."""
    amax, write = _amax_buffer(amax_out, x.device)
    if kind in triton_activation.GATED:
        r, h = dy.shape
        programs, bm, bn, warps = _act_bwd_launch(x.device.index, r, h)
        dx = torch.empty_like(x)
        _WRAP_TRITON(triton_activation._act_bwd_kernel.kernel)[(programs,)](
            dy, x, dx, r, h, KIND=triton_activation.KIND_IDS[kind], GATED=True, BM=bm, BN=bn, num_warps=warps)
        data, data_t, dbias = _dbias_pass(dx, fp8_dtype, scale, amax, scale, 0.0, from_amax=False, pow2=False)
    else:
        data, data_t, dbias = _dbias_pass(dy, fp8_dtype, scale, amax, scale, 0.0, from_amax=False, pow2=False,
                                          act=(x, kind))
    return data, data_t, dbias, _into_slot(amax, amax_out, write)


def parts_takes(parts) -> bool:
    """Whether column blocks of one gradient (2-D, equal rows, one dtype and CUDA device) are
    joined and cast by te_triton's kernel, as takes() for the joined gradient."""
    first = parts[0]
    if not (DELAYED and _WRAP_TRITON is not None and first.device.type == DEVICE_TYPE
            and (static_sizes(*parts) or (SYMBOLIC and all([rows_symbolic(p) for p in parts])))):
        return False
    if not all([p.dim() == 2 and p.shape[0] == first.shape[0] and p.dtype == first.dtype and p.device == first.device
                for p in parts]):
        return False
    numel = first.shape[0] * sum([p.shape[1] for p in parts])
    return 0 < numel < configs.TMA_MIN_NUMEL and _kernels_run_on(first.device.index)


def parts_in_place(parts) -> bool:
    """Whether te_triton's kernel reads these column blocks of a gradient in place, as the eager
    op decides it (te_triton.dbias._direct, with the config it launches below TMA_MIN_NUMEL): two
    or three contiguous blocks, each a whole number of the kernel's column strips wide."""
    return triton_dbias._direct(parts, configs.for_device(parts[0].device.index).dbias_cast_transpose)


def dbias_cast_transpose_parts(parts, scale, fp8_dtype, *, amax_out):
    """(data, data_t, dbias, amax) of column blocks of one gradient as the eager op launches its
    kernel: blocks it reads in place (parts_in_place) are read in place here, without the
    compiler's join, a pass over the whole gradient; other blocks are joined first, as the eager
    op joins them (amax as quantize_fp8's)."""
    if parts_in_place(parts):
        return dbias_cast_transpose(parts[0], scale, fp8_dtype, amax_out=amax_out, parts=parts)
    joined = parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=1)
    return dbias_cast_transpose(joined.contiguous(), scale, fp8_dtype, amax_out=amax_out)


@run_while_tracing
def _scaled_max(fp8_max: float, margin: float) -> float:
    """fp8_max * 2^-margin as te_triton.scaling computes it on the host: 2^-margin rounded to
    float32, then the product in float32."""
    f32 = torch.float32
    return float(torch.tensor(2.0 ** -float(margin), dtype=f32) * torch.tensor(float(fp8_max), dtype=f32))


def update_takes(amax_histories, scales) -> bool:
    """Whether the compiled code can launch the update of these histories: wrap_triton there,
    each history a contiguous float32 (L, n) tensor with its n contiguous float32 scales, all on
    one CUDA device, each small enough for te_triton's register-tile kernel (the eager op's
    for the usual histories; longer ones keep the opaque op)."""
    if not DELAYED or _WRAP_TRITON is None or not amax_histories or len(amax_histories) != len(scales):
        return False
    device = amax_histories[0].device
    for h, s in zip(amax_histories, scales):
        if not (isinstance(h, torch.Tensor) and isinstance(s, torch.Tensor) and h.device == device == s.device
                and device.type == DEVICE_TYPE and h.dim() == 2 and h.dtype == s.dtype == torch.float32
                and h.is_contiguous() and s.is_contiguous() and h.shape[0] >= 1 and s.numel() == h.shape[1]
                and static_sizes(h)):
            return False
        bl, bn = _update_blocks(*h.shape)
        if bl * bn > triton_scaling.TILE_ELEMENTS:
            return False
    return True


def _update_blocks(length: int, columns: int) -> tuple:
    """(BL, BN) of te_triton's register-tile update of an (length, columns) history."""
    return next_power_of_2(length), min(next_power_of_2(max(columns, 1)), triton_scaling.TILE_COLUMNS)


def delayed_scaling_update(amax_histories, scales, fp8_maxes, *, margin, amax_compute_algo):
    """In place, as te_triton.scaling.delayed_scaling_update updates them: histories of one tile
    height, up to te_triton's ARGS_PER_LAUNCH of them, in one launch (the eager op's one launch
    reads the histories' addresses from a table, which the compiled code's functionalization
    cannot see, so each launch names its tensors). A compiled layer updates a history per cast
    of its forward and per gradient, where a launch each cost the host more than the eager step's
    one. The same math on the same tiles, column by column, so the same bytes."""
    by_height = {}
    for h, s, fp8_max in zip(amax_histories, scales, fp8_maxes):
        by_height.setdefault(next_power_of_2(h.shape[0]), []).append((h, s, fp8_max))
    per_launch = triton_scaling.ARGS_PER_LAUNCH
    for bl, listed in by_height.items():
        for start in range(0, len(listed), per_launch):
            chunk = listed[start:start + per_launch]
            columns = max(h.shape[1] for h, _, _ in chunk)
            bn = _update_blocks(bl, columns)[1]
            args = []
            for h, s, fp8_max in chunk:
                args += [h, s, h.shape[1], h.shape[0], _scaled_max(fp8_max, margin)]
            args += [None] * (5 * (per_launch - len(chunk)))
            _WRAP_TRITON(triton_scaling._delayed_update_args_kernel)[(len(chunk), cdiv(columns, bn))](
                *args, COUNT=len(chunk), MOST_RECENT=amax_compute_algo == "most_recent", BL=bl, BN=bn,
                num_warps=4 if bl * bn <= 4096 else 8)
