"""The fused backward epilogues: dbias + cast-transpose of a gradient, optionally of the
activation backward's dx (dx = g * act'(x), never stored), or of a gradient handed over as its
column blocks; with a given scale, or (current scaling) with the scale the kernel makes from
an amax pass's result.

A program owns one column strip and every `groups`-th row tile of it, so the column sums and
the amax build up element-wise in registers: one reduction and one atomic per program and a
(groups, N) partial-sum buffer, instead of a reduction per tile. Two kernels walk it: one with
pointer loads (optionally loading the next tile before working on the current one), and, when
the config asks (Config.tma_stages) and the tensors allow (tma_ready), one whose tiles go
through TMA descriptors in a loop Triton software-pipelines (NVIDIA sm_90 and later), which
keeps more tiles in flight than the pointer kernel can hold in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, MAX_NUMEL, Config, abs_bits, amax_from_buffer, answered, as_float32, cdiv,
                      check_device, check_scalar, column_blocks, descriptor, fp8_max, launched, max_into,
                      new_amax_buffer, saturating_cast, tma_ready)
from .activation import ELEMENTWISE_DEFAULT, KIND_IDS, _check, _check_dy, _dact, _no_params, activation_bwd
from .cast import (NO_CURRENT, QUANTIZE_DEFAULT, _cast_scale, _cast_transpose_tile, _check_input, _check_x, _quantize,
                   amax, current_slots, transpose_clamps)
from .launch import launcher


@triton.jit
def _dbias_ct_load(g_ptr, x_ptr, tm, cols, M, N, BM: tl.constexpr, ACT: tl.constexpr):
    """Row tile tm of g (and of x when ACT), in their dtype; zeros beyond M."""
    rows = tm * BM + tl.arange(0, BM)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    off = rows[:, None] * N + cols[None, :]
    g = tl.load(g_ptr + off, mask=mask, other=0.0)
    if ACT:
        return g, tl.load(x_ptr + off, mask=mask, other=0.0)
    return g, g


@launcher
@triton.jit
def _dbias_ct_kernel(g_ptr, x_ptr, y_ptr, yt_ptr, scale_ptr, amax_ptr, dbias_ptr, M, N, fmax, groups,
                     g1_ptr, g2_ptr, B1, B2, scale_inv_ptr, eps,
                     ACT: tl.constexpr, KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     CLAMP: tl.constexpr, PREFETCH: tl.constexpr, PARTS: tl.constexpr,
                     FROM_AMAX: tl.constexpr = False, POW2: tl.constexpr = False):
    """Cast-transpose of a gradient with its column sums (dbias). ACT: the gradient is
    dx = g * act'(x) (non-gated), rounded to x's dtype as the unfused ops do; else it is g.
    PREFETCH loads the next tile before working on the current one.

    PARTS > 1: g is not one tensor but the column blocks g_ptr | g1_ptr | g2_ptr, starting at
    columns 0, B1 and B2, each a whole number of strips wide; a strip reads from its block.

    FROM_AMAX (current scaling): the scale is made from the amax an earlier pass left at
    amax_ptr (cast._cast_scale), and no amax is recorded."""
    fmax, eps = as_float32(fmax), as_float32(eps)
    pid = tl.program_id(0)
    tn = pid // groups
    cols = tn * BN + tl.arange(0, BN)
    src, src_cols, src_n = g_ptr, cols, N
    if PARTS > 1:
        if tn * BN >= B2:
            src, src_cols, src_n = g2_ptr, cols - B2, N - B2
        elif tn * BN >= B1:
            src, src_cols, src_n = g1_ptr, cols - B1, B2 - B1
        else:
            src_n = B1
    scale = _cast_scale(scale_ptr, scale_inv_ptr, amax_ptr, fmax, eps, FROM_AMAX, POW2)
    colsum = tl.zeros([BM, BN], dtype=tl.float32)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    if PREFETCH:
        g_next, x_next = _dbias_ct_load(src, x_ptr, pid % groups, src_cols, M, src_n, BM, ACT)
    for tm in range(pid % groups, tl.cdiv(M, BM), groups):
        if PREFETCH:
            g, x = g_next, x_next
            g_next, x_next = _dbias_ct_load(src, x_ptr, tm + groups, src_cols, M, src_n, BM, ACT)
        else:
            g, x = _dbias_ct_load(src, x_ptr, tm, src_cols, M, src_n, BM, ACT)
        if ACT:
            v = (g.to(tl.float32) * _dact(x.to(tl.float32), KIND)).to(x.dtype).to(tl.float32)
        else:
            v = g.to(tl.float32)
        _cast_transpose_tile(y_ptr, yt_ptr, v, tm, tn, M, N, scale, fmax, BM, BN, CLAMP)
        colsum += v
        if not FROM_AMAX:
            acc = tl.maximum(acc, abs_bits(v))
    tl.store(dbias_ptr + (pid % groups) * N + cols, tl.sum(colsum, axis=0), mask=cols < N)
    if not FROM_AMAX:
        max_into(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


# At most this many elements, each column strip is one program: its sums are then the bias
# gradient itself, stored in the output dtype by the kernel, and the two torch ops that reduce
# the partial sums and cast them (host time that exceeds such a small kernel's) are not needed.
ONE_GROUP_NUMEL = 1 << 18


def _groups(M: int, strips: int, cfg: Config) -> int:
    """Row groups per column strip: enough programs to fill the GPU (cfg.max_programs), no more;
    one for a small gradient (ONE_GROUP_NUMEL)."""
    row_tiles = cdiv(M, cfg.block_m)
    if M * strips * cfg.block_n <= ONE_GROUP_NUMEL:
        return 1
    return max(1, min(row_tiles, cfg.max_programs // strips)) if cfg.max_programs > 0 else row_tiles


def _dbias_cast_transpose(g, x, kind, scale, fp8_dtype, cfg: Config, amax_out, parts=None, current=NO_CURRENT):
    """(data, data_t, dbias in x's dtype, amax) of g (x is None) or of activation_bwd(g, x, kind),
    or of the column blocks `parts` of g (at most three, each a whole number of block_n wide).
    `current` as for cast._quantize: then amax_out holds the amax already (see _dbias_ct_kernel)."""
    fmax = fp8_max(fp8_dtype)
    blocks = [g] if parts is None else list(parts)
    g = blocks[0]
    src = g if x is None else x
    widths = [b.shape[1] for b in blocks]
    M, N = src.shape[0], sum(widths)
    y = torch.empty((M, N), dtype=fp8_dtype, device=src.device)
    yt = torch.empty((N, M), dtype=fp8_dtype, device=src.device)
    amax_buf = new_amax_buffer(src.device, amax_out)
    partial = _tma_launch(blocks, x, y, yt, scale, amax_buf, fmax, kind, cfg, current) if M * N else None
    summed = False
    if partial is None:
        starts = [min(sum(widths[:i]), N) for i in (1, 2)]  # where blocks 1 and 2 begin (N: no such block)
        blocks += [blocks[-1]] * (3 - len(blocks))
        n_tn = cdiv(N, cfg.block_n)
        groups = _groups(M, n_tn, cfg)
        summed = groups == 1 and M > 0
        partial = torch.empty((groups, N), dtype=src.dtype if summed else torch.float32, device=src.device)
        scale_inv, eps, pow2 = current
        if M * N:
            _dbias_ct_kernel[(groups * n_tn,)](
                g, src, y, yt, scale, amax_buf, partial, M, N, fmax, groups, blocks[1], blocks[2], starts[0],
                starts[1], scale if scale_inv is None else scale_inv, eps, ACT=x is not None,
                KIND=KIND_IDS.get(kind, 0), BM=cfg.block_m, BN=cfg.block_n, CLAMP=transpose_clamps(cfg, src),
                PREFETCH=cfg.prefetch, PARTS=1 if parts is None else len(parts), FROM_AMAX=scale_inv is not None,
                POW2=pow2, num_warps=cfg.num_warps)
    if summed:  # one group: the kernel wrote the bias gradient itself
        dbias = partial[0]
    else:
        dbias = partial.sum(dim=0).to(src.dtype) if M else torch.zeros(N, dtype=src.dtype, device=src.device)
    return y, yt, dbias, amax_from_buffer(amax_buf, amax_out)


@launcher
@triton.jit
def _dbias_ct_tma_kernel(g_desc, x_desc, y_desc, yt_desc, scale_ptr, amax_ptr, dbias_ptr, M, N, col0, width, fmax,
                         groups, scale_inv_ptr, eps, ACT: tl.constexpr, KIND: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, CLAMP: tl.constexpr, STAGES: tl.constexpr, FROM_AMAX: tl.constexpr = False,
                         POW2: tl.constexpr = False):
    """_dbias_ct_kernel's walk over one column block of the output: g_desc (and x_desc when
    ACT) hold that block, `width` columns wide, which starts at column col0 of the (M, N)
    outputs. Tiles past the block's edge read zeros, which add nothing to the sums or amax.
    FROM_AMAX as in _dbias_ct_kernel."""
    pid = tl.program_id(0)
    c = (pid // groups) * BN
    scale = _cast_scale(scale_ptr, scale_inv_ptr, amax_ptr, fmax, eps, FROM_AMAX, POW2)
    colsum = tl.zeros([BM, BN], dtype=tl.float32)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for tm in tl.range(pid % groups, tl.cdiv(M, BM), groups, num_stages=STAGES):
        g = g_desc.load([tm * BM, c])
        if ACT:
            x = x_desc.load([tm * BM, c])
            v = (g.to(tl.float32) * _dact(x.to(tl.float32), KIND)).to(x.dtype).to(tl.float32)
        else:
            v = g.to(tl.float32)
        q = saturating_cast(v * scale, fmax, y_desc.dtype, CLAMP)
        y_desc.store([tm * BM, col0 + c], q)
        yt_desc.store([col0 + c, tm * BM], tl.trans(q))
        colsum += v
        if not FROM_AMAX:
            acc = tl.maximum(acc, abs_bits(v))
    cols = c + tl.arange(0, BN)
    tl.store(dbias_ptr + (pid % groups) * N + col0 + cols, tl.sum(colsum, axis=0), mask=cols < width)
    if not FROM_AMAX:
        max_into(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


def _tma_launch(blocks, x, y, yt, scale, amax_buf, fmax, kind, cfg: Config, current=NO_CURRENT):
    """The (groups, N) partial column sums after one launch of the descriptor kernel per column
    block, each with as many row groups as fill the GPU for its strips. None, before anything
    is written, when the tensors do not allow descriptors, a block other than the last is not
    a whole number of strips wide (its last strip's stores would reach into the next block),
    or the stages do not fit the GPU's shared memory."""
    bm, bn = cfg.block_m, cfg.block_n
    if cfg.tma_stages < 2 or min(bm, bn) < 16 or any(b.shape[1] % bn for b in blocks[:-1]):
        return None  # (a box's rows must be at least 16 bytes: both tile sides hold FP8 rows)
    if not tma_ready(y, yt, *blocks, *(() if x is None else (x,))):
        return None
    M, N = y.shape
    groups = [_groups(M, cdiv(b.shape[1], bn), cfg) for b in blocks]
    # a block with fewer groups than the buffer's rows leaves the rest of its columns alone
    alloc = torch.empty if len(set(groups)) == 1 else torch.zeros
    partial = alloc((max(groups), N), dtype=torch.float32, device=y.device)
    y_desc, yt_desc = descriptor(y, (bm, bn)), descriptor(yt, (bn, bm))
    scale_inv, eps, pow2 = current
    col0 = 0
    for g, block_groups in zip(blocks, groups):
        width = g.shape[1]
        g_desc = descriptor(g, (bm, bn))
        if not launched(_dbias_ct_tma_kernel, (block_groups * cdiv(width, bn),),
                        g_desc, g_desc if x is None else descriptor(x, (bm, bn)), y_desc, yt_desc, scale, amax_buf,
                        partial, M, N, col0, width, fmax, block_groups, scale if scale_inv is None else scale_inv, eps,
                        ACT=x is not None, KIND=KIND_IDS.get(kind, 0), BM=bm, BN=bn, CLAMP=transpose_clamps(cfg, g),
                        STAGES=cfg.tma_stages, FROM_AMAX=scale_inv is not None, POW2=pow2,
                        num_warps=cfg.num_warps):
            if col0:  # every block runs the same compiled kernel: only the first launch can fail
                raise RuntimeError("dbias cast-transpose: a later column block's launch ran out of shared memory")
            return None
        col0 += width
    return partial


DBIAS_CAST_TRANSPOSE_DEFAULT = Config(block_m=32, block_n=128, num_warps=4, max_programs=1024)


def dbias_cast_transpose(dy, scale, fp8_dtype, cfg: Config = DBIAS_CAST_TRANSPOSE_DEFAULT, *, amax_out=None):
    """(data, data_t, dbias, amax) as te_core.ops.dbias_cast_transpose."""
    _check_input(dy, scale, two_d=True)
    return _dbias_cast_transpose(dy, None, None, scale, fp8_dtype, cfg, amax_out)


def dbias_cast_transpose_parts(parts, scale, fp8_dtype, cfg: Config = DBIAS_CAST_TRANSPOSE_DEFAULT, *,
                               amax_out=None):
    """(data, data_t, dbias, amax) as te_core.ops.dbias_cast_transpose_parts. The kernel reads
    up to three contiguous parts in place when each is a whole number of cfg.block_n columns
    wide (a strip then lies in one part); other parts are concatenated first."""
    parts = column_blocks(parts)
    if not _direct(parts, cfg):
        return dbias_cast_transpose(_joined(parts), scale, fp8_dtype, cfg, amax_out=amax_out)
    _check_blocks(parts)
    check_scalar(scale, parts[0].device, "scale")
    return _dbias_cast_transpose(None, None, None, scale, fp8_dtype, cfg, amax_out, parts=parts)


def _check_blocks(parts) -> None:
    """Each part as the kernels take a tensor, and all of them within int32 indexing."""
    for p in parts:
        _check_x(p, two_d=True)
    if parts[0].shape[0] * sum(p.shape[1] for p in parts) > MAX_NUMEL:
        raise ValueError(f"the parts hold more than {MAX_NUMEL} elements; these kernels index with int32")


def _direct(parts, cfg: Config) -> bool:
    """Whether the kernels read the parts in place (else they are concatenated first)."""
    return 1 < len(parts) <= 3 and all(p.is_contiguous() and p.shape[1] % cfg.block_n == 0 for p in parts)


def _joined(parts) -> torch.Tensor:
    """The parts as one contiguous gradient, for the kernels that read one tensor."""
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=1)


def dbias_cast_transpose_current(parts, fp8_dtype, cfg: Config = DBIAS_CAST_TRANSPOSE_DEFAULT, *,
                                 force_pow2_scales=False, amax_epsilon=0.0, amax_cfg: Config = QUANTIZE_DEFAULT,
                                 amax_out=None, scale_out=None, scale_inv_out=None):
    """(data, data_t, dbias, scale, scale_inv, amax) as te_core.ops.dbias_cast_transpose_current:
    an amax pass over each part, then the dbias cast-transpose pass making its scale from that
    amax on the device (cast._cast_scale). Parts as for dbias_cast_transpose_parts; `amax_out`,
    `scale_out`, `scale_inv_out` as for cast.quantize_fp8_current (a zeroed 0-dim amax)."""
    parts = column_blocks(parts)
    if not _direct(parts, cfg):
        parts = [_joined(parts)]
    _check_blocks(parts)
    first = parts[0]
    device = first.device
    scale, scale_inv = current_slots(device, scale_out, scale_inv_out)
    amax_buf = new_amax_buffer(device, amax_out)
    for p in parts:
        amax(p, amax_cfg, amax_out=amax_buf)
    current = (scale_inv, float(amax_epsilon), bool(force_pow2_scales))
    if first.numel() == 0:  # no dbias pass to make the scale: the empty cast pass makes it
        _quantize(first, scale, amax_buf, fp8_dtype, fp8_max(fp8_dtype), amax_cfg, current)
    y, yt, dbias, _ = _dbias_cast_transpose(first, None, None, scale, fp8_dtype, cfg, amax_buf,
                                            parts=parts if len(parts) > 1 else None, current=current)
    return y, yt, dbias, scale, scale_inv, amax_buf


def dbias_cast_transpose_parts_supports(parts, *args, **kwargs):
    """For backends binding the launcher generically: the parts' first tensor decides."""
    first = parts[0] if isinstance(parts, (list, tuple)) and parts else None
    if not isinstance(first, torch.Tensor) or first.dtype not in FLOAT_DTYPES:
        return False, "parts must be a non-empty list of float32, bfloat16 or float16 tensors"
    return True, ""


dbias_cast_transpose_current_supports = dbias_cast_transpose_parts_supports


def activation_bwd_dbias_cast_transpose_supports(dy, x, kind, scale, fp8_dtype, *, amax_out=None, **params):
    """For backends binding the launcher generically: its own checks, answered instead of raised."""
    def check():
        _no_params(kind, params)
        if x.dim() != 2:
            raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
        _check_dy(dy, x, kind)
        _check_input(dy, scale, two_d=True)

    return answered(check)


def activation_bwd_dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, cfg: Config = DBIAS_CAST_TRANSPOSE_DEFAULT,
                                        act_cfg: Config = ELEMENTWISE_DEFAULT, *, amax_out=None):
    """(data, data_t, dbias, amax) of dx = activation_bwd(dy, x, kind); one pass for
    non-gated kinds, activation_bwd then dbias_cast_transpose for gated ones."""
    gated, _, _ = _check(x, kind)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if gated:
        return dbias_cast_transpose(activation_bwd(dy, x, kind, act_cfg), scale, fp8_dtype, cfg, amax_out=amax_out)
    if dy.shape != x.shape or not dy.is_contiguous():
        raise ValueError(f"dy must be contiguous with x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    _check_input(dy, scale, two_d=True)
    check_device(dy, x, "dy")
    return _dbias_cast_transpose(dy, x, kind, scale, fp8_dtype, cfg, amax_out)

