"""Delayed-scaling math: amax histories, the scale update, and the amax all-reduce.

A ScalingGroup is the (L, n) amax history and (n,) scales of the slots of one role in one
module. Groups used during a step are collected in a PendingUpdates; at the step's end (the
outermost autocast exit for forward groups, the end of the backward pass for backward ones)
`flush` all-reduces every amax of the step in ONE coalesced all_reduce(MAX) per process group,
then updates every scale through ops.delayed_scaling_update.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import ops
from ..backend.types import fp8_max

FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOATS_PER_16_BYTES = 4


class _Capture:
    active = False  # process-wide, not per thread: autograd runs the backward on its own threads


_CAPTURE = _Capture()


class graph_capture:
    """While active (te_core.make_graphed_callables' warm-up and capture): every scale_inv is
    recomputed from the live scale, so a captured graph recomputes it on each replay, and
    backward scale updates are not queued, so none is captured; the graphed callable schedules
    both directions' updates itself, eagerly, on every replay."""

    def __enter__(self):
        self._outer = _CAPTURE.active
        _CAPTURE.active = True

    def __exit__(self, *exc):
        _CAPTURE.active = self._outer
        return False


class ScalingGroup:
    """History and scales of `names` (one column each); row 0 of the history is this step's amax."""

    def __init__(self, names: Sequence[str], fp8_dtype: torch.dtype, recipe, device: torch.device):
        self.names = tuple(names)
        self.fp8_dtype = fp8_dtype
        self.fp8_max = fp8_max(fp8_dtype)
        self.recipe = recipe
        n = len(self.names)
        self.amax_history = torch.zeros(recipe.amax_history_len, n, dtype=torch.float32, device=device)
        self.scale = torch.ones(n, dtype=torch.float32, device=device)
        # Per-column views, made once: slicing on every cast costs host time on a hot path.
        self._column_views: Optional[Tuple[List[Tensor], List[Tensor]]] = None
        self._scale_inv_snapshot: Tuple[Tensor, List[Tensor]] = (self.scale, [])
        self._scale_inv_version = None  # the first cast takes the first snapshot

    def scale_inv(self) -> Tensor:
        """1 / scale (n,), recomputed (as a NEW tensor) only after `scale` changed in place, so
        tensors quantized earlier keep their snapshot and a step costs one reciprocal per group,
        not per cast."""
        return self._snapshot()[0]

    def _snapshot(self) -> Tuple[Tensor, List[Tensor]]:
        """(scale_inv, its per-column (1,) views), each view at a 16-byte aligned address: FP8
        GEMM libraries read scales with vector loads (cuBLASLt refused a scale at an offset of
        4 bytes). One kernel per snapshot, and few torch calls: this runs once per group per step
        on a host-bound path."""
        version = self.scale._version
        if version != self._scale_inv_version or _CAPTURE.active:
            n = len(self.names)
            if n == 1:  # a fresh (1,) tensor is aligned already
                inv = torch.reciprocal(self.scale)
                self._scale_inv_snapshot = (inv, [inv])
            else:  # 1 / scale[i] in every float of row i of an (n, 4) tensor: one 16-byte slot each
                slots = torch.reciprocal(self.scale.unsqueeze(1).expand(n, _FLOATS_PER_16_BYTES))
                self._scale_inv_snapshot = (slots.select(1, 0), list(slots.narrow(1, 0, 1).unbind(0)))
            self._scale_inv_version = version
        return self._scale_inv_snapshot

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def to_device(self, device: torch.device) -> None:
        """Move the state (e.g. after module.to(...)); values are kept bit for bit."""
        self.amax_history = self.amax_history.to(device)
        self.scale = self.scale.to(device)
        self._scale_inv_version = None
        self._column_views = None

    def _views(self) -> Tuple[List[Tensor], List[Tensor]]:
        if self._column_views is None:
            columns = range(len(self.names))
            self._column_views = ([self.scale[i : i + 1] for i in columns],
                                  [self.amax_history[0, i : i + 1] for i in columns])
        return self._column_views

    def scale_of(self, column: int) -> Tensor:
        """The (1,) view of `column`'s scale (live: updates show through)."""
        return self._views()[0][column]

    def amax_slot(self, column: int) -> Tensor:
        """The (1,) view of `column` in history row 0: where a cast maxes this step's amax."""
        return self._views()[1][column]

    def scale_inv_of(self, column: int) -> Tensor:
        """The (1,) view of `column` in the current scale_inv snapshot, 16-byte aligned."""
        return self._snapshot()[1][column]

    def scale_changed(self) -> None:
        """Call after writing `scale` through a kernel (which does not bump torch's version counter)."""
        self._scale_inv_version = None

    def record(self, column: int, amax: Tensor) -> None:
        """Keep the largest amax of the step (torch.maximum keeps a NaN, so the update skips it)."""
        row = self.amax_slot(column)
        torch.maximum(row, amax if amax.dtype == torch.float32 else amax.float(), out=row)


class PendingUpdates:
    """Groups used since the last update, each with the process group its amax is reduced over."""

    def __init__(self):
        self._groups: Dict[int, Tuple[ScalingGroup, object]] = {}
        self._lock = threading.Lock()

    def add(self, group: ScalingGroup, process_group) -> None:
        with self._lock:
            self._groups.setdefault(id(group), (group, process_group))

    def clear(self) -> None:
        with self._lock:
            self._groups.clear()

    def flush(self) -> None:
        with self._lock:
            entries = list(self._groups.values())
            self._groups.clear()
        if entries:
            reduce_amaxes(entries)
            update_scales([group for group, _ in entries])


def _distributed_ready() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def reduce_amaxes(entries: Sequence[Tuple[ScalingGroup, object]]) -> None:
    """One all_reduce(MAX) per process group (None: the default group) over the concatenated
    row 0 of its groups; skipped when torch.distributed is not initialized or the group has one rank."""
    if not _distributed_ready():
        return
    by_process_group: Dict[int, Tuple[object, List[ScalingGroup]]] = {}
    for group, process_group in entries:
        if group.recipe.reduce_amax:
            by_process_group.setdefault(id(process_group), (process_group, []))[1].append(group)
    for process_group, groups in by_process_group.values():
        if torch.distributed.get_world_size(group=process_group) == 1:
            continue  # as Transformer Engine: nothing to agree on
        rows = [g.amax_history[0] for g in groups]
        flat = torch.cat(rows)
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=process_group)
        for row, reduced in zip(rows, torch.split(flat, [r.numel() for r in rows])):
            row.copy_(reduced)


def update_scales(groups: Sequence[ScalingGroup]) -> None:
    """The delayed-scaling update of each group, batched per (margin, algo) into one op call."""
    batches: Dict[tuple, List[ScalingGroup]] = {}
    for group in groups:
        recipe = group.recipe
        if callable(recipe.amax_compute_algo) or recipe.scaling_factor_compute_algo is not None:
            _custom_update(group)
            continue
        batches.setdefault((float(recipe.margin), recipe.amax_compute_algo), []).append(group)
    for (margin, algo), batch in batches.items():
        ops.delayed_scaling_update(
            [g.amax_history for g in batch], [g.scale for g in batch], [g.fp8_max for g in batch],
            margin=margin, amax_compute_algo=algo,
        )
    for group in groups:
        group.scale_changed()


def _custom_update(group: ScalingGroup) -> None:
    """The update with a user amax_compute_algo / scaling_factor_compute_algo (TE's callables)."""
    recipe, history, scale = group.recipe, group.amax_history, group.scale
    algo = recipe.amax_compute_algo
    if callable(algo):
        amax = algo(history).reshape(scale.shape).float()
    elif algo == "max":
        amax = history.amax(dim=0)
    else:
        amax = history[0].clone()
    if recipe.scaling_factor_compute_algo is not None:
        new_scale = recipe.scaling_factor_compute_algo(amax, scale, group.fp8_max, recipe)
    else:
        new_scale = default_scale(amax, scale, group.fp8_max, recipe.margin)
    scale.copy_(new_scale.reshape(scale.shape))
    history.copy_(torch.roll(history, shifts=-1, dims=0))
    history[0].zero_()


def default_scale(amax: Tensor, scale: Tensor, fmax: float, margin: float) -> Tensor:
    """fp8_max / amax / 2^margin; keeps `scale` where amax is 0/inf/NaN; inf -> float32 max."""
    new = (fmax / amax) / (2.0 ** margin)
    new = torch.where(torch.isinf(new), torch.full_like(new, FLOAT32_MAX), new)
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, new, scale)


# ------------------------------------------------------------- end-of-backward updates

_BACKWARD_PENDING = PendingUpdates()


def schedule_backward_update(group: ScalingGroup, process_group) -> None:
    """Queue `group`'s update for the end of the running backward pass. Must be called from inside
    a backward. Every call queues a callback; the first to run flushes all, the rest find nothing
    (robust to a backward that raised before its callbacks ran)."""
    if _CAPTURE.active:
        return
    _BACKWARD_PENDING.add(group, process_group)
    torch.autograd.Variable._execution_engine.queue_callback(_BACKWARD_PENDING.flush)


def flush_backward_updates() -> None:
    """Run pending backward updates now (for code that computes gradients without autograd)."""
    _BACKWARD_PENDING.flush()


def forward_amax_of(x: Tensor) -> Tensor:
    """max|x| for calibration (records statistics only; the GEMM runs in high precision)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def group_state(group: Optional[ScalingGroup]) -> Dict[str, Dict[str, Tensor]]:
    if group is None:
        return {}
    return {name: {"scale": group.scale[i : i + 1], "amax_history": group.amax_history[:, i]}
            for i, name in enumerate(group.names)}
