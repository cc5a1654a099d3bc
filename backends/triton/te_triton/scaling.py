"""Delayed-scaling update of every amax history and scale of a step, in one launch.

A table of (history address, scale address, columns, history length, fp8 max) rows lets one
grid of (tensor, column block) programs visit every history. Modules keep long histories with a
handful of columns, so the usual case holds a program's whole (L, columns) block in registers:
one load of the history already rolled (row i reads row i + 1), the amax from it, one store
(_delayed_update_tile_kernel: a few microseconds). Larger blocks read in chunks: an amax pass,
then the roll chunk by chunk (_delayed_update_kernel). Either way a barrier orders the loads
before the stores, since the warps that load a row are not the warps that store it.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import triton
import triton.language as tl

from ._common import Config, as_float32, cdiv, next_power_of_2
from .launch import launcher

SCALING_DEFAULT = Config(block_m=8, block_n=128, num_warps=4)
FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)
FLOAT32_TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal number, 2^-126
TILE_ELEMENTS = 8192  # the largest (L, columns) block one program keeps in registers
TILE_COLUMNS = 16


@triton.jit
def _table_row(table_ptr, fmax_ptr, i):
    """History pointer, scale pointer, columns, length and fp8 max * 2^-margin of table row i."""
    hist = tl.load(table_ptr + i * 4).to(tl.pointer_type(tl.float32))
    scales = tl.load(table_ptr + i * 4 + 1).to(tl.pointer_type(tl.float32))
    return hist, scales, tl.load(table_ptr + i * 4 + 2), tl.load(table_ptr + i * 4 + 3), tl.load(fmax_ptr + i)


@triton.jit
def _new_scale(scales, cols, cmask, amax, scaled_max):
    """(fp8_max * 2^-margin) / amax into `scales` (the margin applied first, as Transformer
    Engine's update: a tiny amax keeps it), keeping the old scale where amax is 0, inf or NaN;
    then clamped to [float32's smallest normal, float32 max], so that 1 / scale stays finite."""
    old = tl.load(scales + cols, mask=cmask, other=1.0)
    new = tl.math.div_rn(scaled_max, amax)
    keep = (amax == 0.0) | (amax == float("inf")) | (amax != amax)
    new = tl.where(keep, old, new)
    new = tl.where(new == float("inf"), FLOAT32_MAX, new)
    tl.store(scales + cols, tl.where(new < FLOAT32_TINY, FLOAT32_TINY, new), mask=cmask)


@triton.jit
def _amax_bits(h):
    """The bits of |h| with NaN as 0, for a max over them (C's fmaxf from 0, as Transformer
    Engine): non-negative floats order as their int32 bits, and a NaN would otherwise win."""
    return tl.where(h != h, 0.0, tl.abs(h)).to(tl.int32, bitcast=True)


@launcher
@triton.jit
def _delayed_update_tile_kernel(table_ptr, fmax_ptr, MOST_RECENT: tl.constexpr,
                                BL: tl.constexpr, BN: tl.constexpr):
    hist, scales, n, L, fmax = _table_row(table_ptr, fmax_ptr, tl.program_id(0))
    _update_tile(hist, scales, n, L, fmax, MOST_RECENT, BL, BN)


ARGS_PER_LAUNCH = 8  # histories _delayed_update_args_kernel takes in one launch


@triton.jit
def _update_listed(i: tl.constexpr, COUNT: tl.constexpr, hist_ptr, scale_ptr, n, L, fmax,
                   MOST_RECENT: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr):
    """The update of the launch's i-th history, by the programs of row i of the grid."""
    if i < COUNT:  # (a constexpr test: the histories not given are None, and never reached)
        if tl.program_id(0) == i:
            _update_tile(hist_ptr, scale_ptr, n, L, as_float32(fmax), MOST_RECENT, BL, BN)


@triton.jit
def _delayed_update_args_kernel(h0, s0, n0, L0, f0, h1, s1, n1, L1, f1, h2, s2, n2, L2, f2,
                                h3, s3, n3, L3, f3, h4, s4, n4, L4, f4, h5, s5, n5, L5, f5,
                                h6, s6, n6, L6, f6, h7, s7, n7, L7, f7, COUNT: tl.constexpr,
                                MOST_RECENT: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr):
    """_delayed_update_tile_kernel's update of up to ARGS_PER_LAUNCH histories of one tile
    height BL, given as arguments rather than table rows: for launches that must name each
    tensor they write (torch.compile's, whose functionalization finds the written tensors in
    the kernel's code). Grid (COUNT, column blocks of the widest history); history i with its
    scales, columns n, length L and fp8 max times 2^-margin (rounded to float32) f; the
    arguments after the COUNT-th history are None."""
    _update_listed(0, COUNT, h0, s0, n0, L0, f0, MOST_RECENT, BL, BN)
    _update_listed(1, COUNT, h1, s1, n1, L1, f1, MOST_RECENT, BL, BN)
    _update_listed(2, COUNT, h2, s2, n2, L2, f2, MOST_RECENT, BL, BN)
    _update_listed(3, COUNT, h3, s3, n3, L3, f3, MOST_RECENT, BL, BN)
    _update_listed(4, COUNT, h4, s4, n4, L4, f4, MOST_RECENT, BL, BN)
    _update_listed(5, COUNT, h5, s5, n5, L5, f5, MOST_RECENT, BL, BN)
    _update_listed(6, COUNT, h6, s6, n6, L6, f6, MOST_RECENT, BL, BN)
    _update_listed(7, COUNT, h7, s7, n7, L7, f7, MOST_RECENT, BL, BN)


@triton.jit
def _update_tile(hist, scales, n, L, fmax, MOST_RECENT: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr):
    """One (L, BN) block of columns of one history, held in registers (see the module docstring)."""
    rows = tl.arange(0, BL)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < n
    m = (rows[:, None] < L) & cmask[None, :]
    # the rolled history: row i takes row i + 1 and the last row takes row 0, the current amax
    src = (rows + 1) % L
    rolled = tl.load(hist + src[:, None] * n + cols[None, :], mask=m, other=0.0)
    row0 = tl.load(hist + cols, mask=cmask, other=0.0)
    stepped = row0 != 0.0  # a column that recorded nothing this step keeps its scale and history
    if MOST_RECENT:
        amax = row0
    else:  # the max over a permutation of the rows is the max over the history
        amax = tl.max(_amax_bits(rolled), axis=0).to(tl.float32, bitcast=True)
    _new_scale(scales, cols, cmask, tl.where(stepped, amax, 0.0), fmax)
    tl.debug_barrier()
    tl.store(hist + rows[:, None] * n + cols[None, :], tl.where(rows[:, None] == 0, 0.0, rolled),
             mask=m & stepped[None, :])


@launcher
@triton.jit
def _delayed_update_kernel(table_ptr, fmax_ptr, MOST_RECENT: tl.constexpr,
                           BR: tl.constexpr, BN: tl.constexpr):
    hist, scales, n, L, fmax = _table_row(table_ptr, fmax_ptr, tl.program_id(0))
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < n
    row0 = tl.load(hist + cols, mask=cmask, other=0.0)
    stepped = row0 != 0.0  # a column that recorded nothing this step keeps its scale and history
    if MOST_RECENT:
        amax = row0
    else:
        bits = tl.zeros([BN], dtype=tl.int32)
        for r in range(0, L, BR):
            rows = r + tl.arange(0, BR)
            m = (rows[:, None] < L) & cmask[None, :]
            h = tl.load(hist + rows[:, None] * n + cols[None, :], mask=m, other=0.0)
            bits = tl.maximum(bits, tl.max(_amax_bits(h), axis=0))
        amax = bits.to(tl.float32, bitcast=True)
    _new_scale(scales, cols, cmask, tl.where(stepped, amax, 0.0), fmax)
    tl.debug_barrier()
    cmask = cmask & stepped
    for r in range(0, L - 1, BR):  # row i takes row i + 1
        rows = r + tl.arange(0, BR)
        m = (rows[:, None] < L - 1) & cmask[None, :]
        h = tl.load(hist + (rows[:, None] + 1) * n + cols[None, :], mask=m, other=0.0)
        tl.debug_barrier()
        tl.store(hist + rows[:, None] * n + cols[None, :], h, mask=m)
    tl.debug_barrier()
    tl.store(hist + (L - 1) * n + cols, row0, mask=cmask)  # the last row takes row 0
    tl.debug_barrier()
    tl.store(hist + cols, tl.zeros([BN], dtype=tl.float32), mask=cmask)


_PLANS: dict = {}


def plan_key(amax_histories, scales, fp8_maxes) -> tuple:
    """Identity and address of every tensor (C-level maps: this runs on every update)."""
    ptr = torch.Tensor.data_ptr
    return (tuple(map(id, amax_histories)), tuple(map(ptr, amax_histories)), tuple(map(id, scales)),
            tuple(map(ptr, scales)), tuple(fp8_maxes))


def planned(amax_histories, scales, fp8_maxes) -> bool:
    """Whether these tensors were checked and tabulated already (a backend's supports() can
    skip its own checks then)."""
    return plan_key(amax_histories, scales, fp8_maxes) in _PLANS


def plan(amax_histories, scales, fp8_maxes, device, place=None, margin: float = 0.0):
    """Checked inputs and the device table of (history, scale, columns, length) rows, cached per
    set of tensors: histories are long-lived buffers and a model updates hundreds of them per
    step, so checking and tabulating each on every call cost more host time than the kernel.
    The plan keeps the tensors alive, so their ids and addresses cannot be reused meanwhile.
    `place` copies a host tensor to the device (default: .to(device)); a backend passes its own
    where the tables must come from a particular memory pool. The row maxes scaled by 2^-margin
    are made here too (_scaled_maxes), since a CUDA-graph capture forbids the copy."""
    key = plan_key(amax_histories, scales, fp8_maxes)
    plan = _PLANS.get(key)
    if plan is None:
        first = amax_histories[0].device  # (the kernel reads the table's addresses on this device)
        for h, s in zip(amax_histories, scales):
            if h.dim() != 2 or h.dtype != torch.float32 or not h.is_contiguous() or h.shape[0] < 1:
                raise ValueError(f"each amax history must be a contiguous float32 (L, n) tensor with L >= 1, got "
                                 f"{h.dtype} {tuple(h.shape)}")
            if h.device != first or s.device != first:
                raise ValueError(f"every history and scale must be on one device, got {h.device} and {s.device} "
                                 f"beside {first}")
            if s.dtype != torch.float32 or s.numel() != h.shape[1] or not s.is_contiguous():
                raise ValueError(f"scales must be contiguous float32 with {h.shape[1]} elements (one per history "
                                 f"column), got {s.dtype} {tuple(s.shape)}")
        if len(_PLANS) > 64:
            _PLANS.clear()
        rows = [[h.data_ptr(), s.data_ptr(), h.shape[1], h.shape[0]] for h, s in zip(amax_histories, scales)]
        place = place or (lambda host: host.to(device))
        table = place(torch.tensor(rows, dtype=torch.int64))
        fmaxes = place(torch.tensor([float(f) for f in fp8_maxes], dtype=torch.float32))
        max_cols = max(max(h.shape[1] for h in amax_histories), 1)
        max_len = max(h.shape[0] for h in amax_histories)
        # (the last entry: fp8_max * 2^-margin per margin seen, _scaled_maxes; kept with the plan,
        # which a captured graph keeps alive while it reads them)
        plan = _PLANS[key] = (list(amax_histories), list(scales), table, fmaxes, max_cols, max_len, {})
    _scaled_maxes(fp8_maxes, plan[3], plan[6], margin, place)
    return plan


def _scaled_maxes(fp8_maxes, fmaxes: torch.Tensor, scaled: dict, margin: float, place) -> torch.Tensor:
    """fp8_max * 2^-margin per table row, in float32 as the reference computes it (2^-margin
    rounded to float32, then the product), computed on the host: for margins above 126, 2^-margin
    is a float32 subnormal, which a GPU's arithmetic may flush to zero. Cached in the plan's
    `scaled`, per margin."""
    if margin == 0:
        return fmaxes
    found = scaled.get(float(margin))
    if found is None:
        host = torch.full((len(fp8_maxes),), 2.0**-margin, dtype=torch.float32)
        host = host * torch.tensor([float(f) for f in fp8_maxes], dtype=torch.float32)
        found = scaled[float(margin)] = (place or (lambda t: t.to(fmaxes.device)))(host)
    return found


def delayed_scaling_update(amax_histories: List[torch.Tensor], scales: List[torch.Tensor],
                           fp8_maxes: Sequence[float], *, margin: float = 0.0, amax_compute_algo: str = "max",
                           cfg: Config = SCALING_DEFAULT, place=None) -> None:
    """In place, as te_core.ops.delayed_scaling_update, for all histories in one launch (`place`:
    as plan())."""
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {amax_compute_algo!r}")
    if not (len(amax_histories) == len(scales) == len(fp8_maxes)):
        raise ValueError(f"got {len(amax_histories)} histories, {len(scales)} scales, {len(fp8_maxes)} fp8_maxes; "
                         "they must pair up one to one")
    if not amax_histories:
        return
    _, _, table, fmaxes, max_cols, max_len, scaled = plan(amax_histories, scales, fp8_maxes,
                                                          amax_histories[0].device, place, margin)
    fmaxes = scaled[float(margin)] if margin else fmaxes  # (made by plan)
    most_recent = amax_compute_algo == "most_recent"
    block_l = next_power_of_2(max_len)
    block_n = min(next_power_of_2(max_cols), TILE_COLUMNS)
    if block_l * block_n <= TILE_ELEMENTS:
        grid = (len(amax_histories), cdiv(max_cols, block_n))
        _delayed_update_tile_kernel[grid](table, fmaxes, MOST_RECENT=most_recent,
                                          BL=block_l, BN=block_n, num_warps=4 if block_l * block_n <= 4096 else 8)
        return
    grid = (len(amax_histories), cdiv(max_cols, cfg.block_n))
    _delayed_update_kernel[grid](table, fmaxes, MOST_RECENT=most_recent,
                                 BR=cfg.block_m, BN=cfg.block_n, num_warps=cfg.num_warps)
