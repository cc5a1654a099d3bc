"""Delayed-scaling math: amax histories, the scale update, and the amax all-reduce.

A ScalingGroup is the (L, n) amax history and (n,) scales of the slots of one role in one
module. Groups used during a step are collected in a PendingUpdates; at the step's end (the
outermost autocast exit for forward groups, the end of the backward pass for backward ones)
`flush` all-reduces every amax of the step in ONE coalesced all_reduce(MAX) per process group,
then updates every scale through ops.delayed_scaling_update.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .. import ops
from .._torch_fixes import SETS_TRACED_TENSOR_ATTRIBUTES
from ..backend.types import fp8_max
from ..reference.scaling import roll_history, scale_from_amax
from .lent_scales import lend

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


def graph_capture_active() -> bool:
    """Whether te_core.make_graphed_callables is warming up or capturing now."""
    return _CAPTURE.active


def persistent():
    """Where tensors that outlive a step are made: outside inference mode even when the step
    runs in it (torch.inference_mode, as evaluation loops use), since a later training step
    could neither update an inference tensor in place nor save it for backward."""
    return torch.inference_mode(False)


class ScalingGroup:
    """History and scales of `names` (one column each); row 0 of the history is this step's amax."""

    def __init__(self, names: Sequence[str], fp8_dtype: torch.dtype, recipe, device: torch.device):
        self.names = tuple(names)
        self.fp8_dtype = fp8_dtype
        self.fp8_max = fp8_max(fp8_dtype)
        self.recipe = recipe
        n = len(self.names)
        with persistent():
            self.amax_history = torch.zeros(recipe.amax_history_len, n, dtype=torch.float32, device=device)
            self.scale = torch.ones(n, dtype=torch.float32, device=device)
        # Per-column views, made once: slicing on every cast costs host time on a hot path.
        self._column_views: Optional[Tuple[List[Tensor], List[Tensor]]] = None
        # (1 / scale or None until asked for, [its per-column (1,) views]): see scale_inv_snapshot
        self._scale_inv_snapshot: Tuple[Optional[Tensor], List[Tensor]] = (self.scale, [])
        self._scale_inv_version = None  # the first cast takes the first snapshot
        # The columns no cast has scaled from a real amax yet (see QuantizationStep.first_scale): a
        # fresh state's scale is 1, which flushes the first step's output gradients (1e-7..1e-4
        # in a model of any size) to zero in E5M2 and casts small weights to E4M3 subnormals.
        self.fresh = set(range(n))
        # The columns of FP8 primary weights whose scale their own value set (quantized_model_init)
        # and no update has changed since: a new value written into such a weight before training
        # (pretrained weights copied in) takes its scale from its own amax as well, where the init
        # value's scale would saturate a larger one; the first update ends it (delayed scaling then).
        self.init_scaled: set = set()
        # Set (by the module, when torch.compile traces it) once a compiled graph uses the group:
        # in-graph updates write `scale` through kernels that torch's version counter does not
        # see, so eager casts after it take a fresh snapshot each time instead of trusting it.
        self._updated_in_graphs = False
        # Set by make_graphed_callables once graphs cast with the group: a replay computes its
        # scale_inv from `scale` itself, so an update takes no snapshot for it (an eager cast of
        # the group still takes one of its own, as after any update).
        self.captured = False

    def __getstate__(self) -> dict:
        # A copy (pickle, deepcopy) makes its own views of amax_history and scale: pickle copies
        # each cached view's storage apart from the tensor it views, so the copy's casts would
        # record amaxes into orphans its history never sees, and read a stale scale_inv.
        state = self.__dict__.copy()
        state["_column_views"] = None
        state["_scale_inv_snapshot"], state["_scale_inv_version"] = (state["scale"], []), None
        return state

    def scale_inv(self) -> Tensor:
        """1 / scale (n,), recomputed (as a NEW tensor) only after `scale` changed in place, so
        tensors quantized earlier keep their snapshot and a step costs one reciprocal per group,
        not per cast (an update takes its groups' snapshots together: _take_snapshots). The
        casts of a step share their column's snapshot, lent (lent_scales): no write changes it."""
        whole, views = self.scale_inv_snapshot()
        if whole is None:  # a snapshot _take_aligned_snapshots took: its column views, joined
            whole = views[0] if len(views) == 1 else torch.cat(views)
            self._scale_inv_snapshot = (whole, views)
        return whole

    def scale_inv_snapshot(self) -> Tuple[Optional[Tensor], List[Tensor]]:
        """(scale_inv or None, its per-column (1,) views; scale_inv() joins the views where the
        snapshot holds None), each view at a 16-byte aligned address: FP8
        GEMM libraries read scales with vector loads (cuBLASLt refused a scale at an offset of
        4 bytes). One kernel per snapshot, and few torch calls: this runs once per group per step
        on a host-bound path."""
        if torch.compiler.is_compiling():
            # Traced: computed in the graph at each cast, never cached, one fresh (1,) tensor per
            # column (a view made inside an autograd Function cannot outlive it in a weight cache).
            return torch.reciprocal(self.scale), [torch.reciprocal(s) for s in self.column_views()[0]]
        version = self.scale._version
        if version == self._scale_inv_version and not _CAPTURE.active and not self._updated_in_graphs:
            return self._scale_inv_snapshot
        if torch.is_inference_mode_enabled():  # the snapshot is kept for later, training, steps
            with persistent():
                snapshot = self._new_snapshot()
        else:
            snapshot = self._new_snapshot()
        self._scale_inv_snapshot, self._scale_inv_version = snapshot, version
        return snapshot

    def _new_snapshot(self) -> Tuple[Tensor, List[Tensor]]:
        n = len(self.names)
        if n == 1:  # a fresh (1,) tensor is aligned already
            inv = lend(torch.reciprocal(self.scale))
            return inv, [inv]
        slots, views = _aligned_reciprocals(self.scale)
        return slots.select(1, 0), list(views)

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def to_device(self, device: torch.device) -> None:
        """Move the state (e.g. after module.to(...)); values are kept bit for bit. A state made
        on the meta device (a module built there) holds no values: it starts on `device` as a
        new state does, every column fresh."""
        with persistent():
            if self.scale.is_meta and torch.device(device).type != "meta":
                self.amax_history = torch.zeros(self.amax_history.shape, dtype=torch.float32, device=device)
                self.scale = torch.ones(self.scale.shape, dtype=torch.float32, device=device)
                self.fresh = set(range(len(self.names)))
                self.init_scaled = set()
            else:
                self.amax_history = self.amax_history.to(device)
                self.scale = self.scale.to(device)
        self._scale_inv_version = None
        self._column_views = None

    def column_views(self) -> Tuple[List[Tensor], List[Tensor]]:
        """([scale view of each column], [amax slot of each column]): what scale_of and amax_slot
        index, for a cast that needs both in one call."""
        # Traced: sliced in the graph; cached views would enter it as inputs aliasing the state.
        # (is_compiling() first: a trace then never reads the cache, so dynamo puts no guard on it
        # and an eager step that fills the cache does not recompile the graph.)
        traced = torch.compiler.is_compiling()
        if traced or self._column_views is None:
            columns = range(len(self.names))
            views = ([self.scale[i : i + 1] for i in columns], [self.amax_history[0, i : i + 1] for i in columns])
            for i, slot in enumerate(views[1] if SETS_TRACED_TENSOR_ATTRIBUTES or not traced else ()):
                slot.te_slot_column = i  # (what a backend's compiled cast may write through: ops/cast.py)
            if traced:
                return views
            self._column_views = views
        return self._column_views

    def scale_of(self, column: int) -> Tensor:
        """The (1,) view of `column`'s scale (live: updates show through)."""
        return self.column_views()[0][column]

    def amax_slot(self, column: int) -> Tensor:
        """The (1,) view of `column` in history row 0: where a cast maxes this step's amax."""
        return self.column_views()[1][column]

    def scale_inv_of(self, column: int) -> Tensor:
        """The (1,) view of `column` in the current scale_inv snapshot, 16-byte aligned."""
        return self.scale_inv_snapshot()[1][column]

    def settle(self) -> None:
        """Every column's scale is a real one from now on (loaded, calibrated or set by a cast)."""
        self.fresh = set()
        self.init_scaled = set()

    def take_first_scale(self, column: int, amax: Tensor) -> None:
        """Set `column`'s scale from `amax` (a tensor's own, at its first cast): the scale the
        recipe's update would compute from a history holding only that amax. An amax that is 0,
        inf or NaN keeps the scale, as the update does. The caller takes `column` out of `fresh`."""
        scale = self.scale_of(column)
        scale.copy_(_scale_for(self, amax.reshape(1).float(), scale))
        self.scale_changed()

    def scale_changed(self) -> None:
        """Call after writing `scale` through a kernel (which does not bump torch's version counter)."""
        if not torch.compiler.is_compiling():  # traced casts take no snapshot (see scale_inv_snapshot)
            self._scale_inv_version = None

    def rebind(self, recipe, fp8_dtype: torch.dtype) -> None:
        """Serve another DelayedScaling recipe, keeping the state, as Transformer Engine keeps a
        module's across DelayedScaling recipes: scales as they are (the next update applies the
        new format, margin and algorithm), the history resized to the new amax_history_len
        keeping this step's row and the most recent entries (TE keeps the oldest)."""
        self.recipe, self.fp8_dtype, self.fp8_max = recipe, fp8_dtype, fp8_max(fp8_dtype)
        if recipe.amax_history_len != self.amax_history.shape[0]:
            with persistent():
                self.amax_history = fit_history(self.amax_history, recipe.amax_history_len)
            self._column_views = None

    def record(self, column: int, amax: Tensor) -> None:
        """Keep the largest amax of the step, as Transformer Engine's casts (fmaxf): a NaN amax
        is ignored, so the step keeps what its other casts saw; an inf amax wins."""
        row = self.amax_slot(column)
        torch.fmax(row, amax if amax.dtype == torch.float32 else amax.float(), out=row)


def fit_history(history: Tensor, length: int) -> Tensor:
    """`history` (L, n) as a new (length, n) amax history: row 0 (this step's amax) kept, then
    its most recent length - 1 entries (rows 1.. run oldest to newest), zeros (no amax
    recorded) in front where it has fewer. The rule for every change of amax_history_len: a
    recipe with another length, a checkpoint saved with another."""
    kept = history[1:][max(0, history.shape[0] - length):]
    pad = history.new_zeros(length - 1 - kept.shape[0], *history.shape[1:])
    return torch.cat([history[:1], pad, kept])


class PendingUpdates:
    """Groups used since the last update, each with the process group its amax is reduced over."""

    def __init__(self, locked: bool = False):
        """`locked`: for the one shared by every backward pass (autograd runs backwards on its
        own threads); an autocast's forward updates are its forward thread's alone."""
        self._groups: Dict[int, Tuple[ScalingGroup, object]] = {}
        self._lock = threading.Lock() if locked else None
        self._backward_claimed: Set[int] = set()  # ids of the backward groups claimed (claim_backward_update)

    def claim_backward_update(self, group: ScalingGroup) -> bool:
        """For traced steps, which have no end-of-backward callback: whether this is the first
        use of the backward group `group` under this autocast, whose backward (which autograd
        runs after those of the later uses) then updates the group once, as an eager backward
        pass does at its end."""
        first = id(group) not in self._backward_claimed
        self._backward_claimed.add(id(group))
        return first

    def _locked(self):
        """The lock, or none (dynamo cannot trace a lock; a traced step runs its updates in
        program order on one thread)."""
        if self._lock is None or torch.compiler.is_compiling():
            return contextlib.nullcontext()
        return self._lock

    def add(self, group: ScalingGroup, process_group) -> None:
        if self._lock is None:  # (no context manager then: every cast's group comes through here)
            self._groups.setdefault(id(group), (group, process_group))
            return
        with self._locked():
            self._groups.setdefault(id(group), (group, process_group))

    def clear(self) -> None:
        with self._locked():
            self._groups.clear()

    def flush(self) -> None:
        with self._locked():
            entries = list(self._groups.values())
            self._groups.clear()
        update_now(entries)


def update_now(entries: Sequence[Tuple[ScalingGroup, object]]) -> None:
    """Reduce the amaxes of (group, process group) `entries`, then update their scales."""
    if entries:
        if _DISTRIBUTED and torch.distributed.is_initialized():  # (reduce_amaxes' own test, inline)
            reduce_amaxes(entries)
        update_scales([group for group, _ in entries])


_DISTRIBUTED = torch.distributed.is_available()


def _distributed_ready() -> bool:
    return _DISTRIBUTED and torch.distributed.is_initialized()


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
        if _reduction_group_size(process_group) == 1:
            continue  # as Transformer Engine: nothing to agree on
        rows = [g.amax_history[0] for g in groups]
        flat = _all_reduce_fmax(torch.cat(rows), process_group)
        for row, reduced in zip(rows, torch.split(flat, [r.numel() for r in rows])):
            row.copy_(reduced)


def reduce_first_amax(group: ScalingGroup, amax: Tensor, process_group) -> Tensor:
    """A first cast's own amax (QuantizationStep.first_scale), all-reduced (MAX) over the ranks
    that reduce `group`'s amaxes, so every rank casts with the same scale from the first step on,
    as the updates keep them afterwards."""
    return _all_reduce_fmax(amax.reshape(1), process_group) if reduces_first_amax(group, process_group) else amax


def reduces_first_amax(group: ScalingGroup, process_group) -> bool:
    """Whether reduce_first_amax all-reduces over other ranks (which must then all call it)."""
    return bool(group.recipe.reduce_amax) and _distributed_ready() and _reduction_group_size(process_group) > 1


def check_reduction_member(process_group) -> None:
    """A clear error where te.autocast's amax_reduction_group is the placeholder that
    torch.distributed.new_group returns on the ranks it leaves out: this rank's amaxes would
    silently never be reduced (torch skips a collective on a group the rank is not in)."""
    dist = torch.distributed
    if dist.is_available() and process_group is dist.GroupMember.NON_GROUP_MEMBER:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise ValueError(f"autocast: amax_reduction_group does not contain this rank ({rank}): "
                         "torch.distributed.new_group returned its placeholder for the ranks it leaves out; pass each "
                         "rank a group it belongs to (or None, the default group)")


def _reduction_group_size(process_group) -> int:
    """The number of ranks of the amax_reduction_group, or a clear error for what is no group."""
    check_reduction_member(process_group)
    try:
        return torch.distributed.get_world_size(group=process_group)
    except AttributeError:  # (torch reads group.size() of whatever it is given)
        raise TypeError("autocast: amax_reduction_group must be a torch.distributed ProcessGroup (e.g. from "
                        "torch.distributed.new_group) or None for the default group, got "
                        f"{type(process_group).__name__}") from None


def _all_reduce_fmax(flat: Tensor, process_group) -> Tensor:
    """all_reduce(MAX) with C's fmaxf semantics whatever the collective library does with NaN
    (libraries differ, and some answer by rank order): a NaN amax travels as -inf, which any
    real amax beats, and comes back as NaN only where every rank had NaN. So one rank's NaN
    never hides the other ranks' amaxes, and all ranks agree on the result."""
    flat = torch.where(torch.isnan(flat), float("-inf"), flat)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=process_group)
    return torch.where(flat == float("-inf"), float("nan"), flat)


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
    if not torch.compiler.is_compiling():  # each group's scale_changed(), inline
        for group in groups:
            group._scale_inv_version = None
            if group.init_scaled:
                group.init_scaled = set()
        _take_snapshots(groups)


def _take_snapshots(groups: Sequence[ScalingGroup]) -> None:
    """The next scale_inv snapshot of every updated group, taken now rather than by each group's
    first cast in a launch of its own (a model of Linear layers updates three one-column groups
    per layer, each step): one-column groups alone in one foreach launch; with groups of several
    columns among them (a LayerNormMLP's), all in one aligned layout per device
    (_take_aligned_snapshots). Groups take their own snapshot at their first cast while a CUDA
    graph is captured, under inference mode, or once a compiled graph updates them
    (scale_inv_snapshot trusts no cached snapshot then)."""
    if _CAPTURE.active or torch.is_inference_mode_enabled():
        return
    singles, multis = [], []
    for g in groups:
        if not g._updated_in_graphs and not g.captured:
            (singles if len(g.names) == 1 else multis).append(g)
    if multis:  # then every group's columns in one aligned layout, one reciprocal per device
        by_device: Dict[torch.device, List[ScalingGroup]] = {}
        for g in singles + multis:
            by_device.setdefault(g.scale.device, []).append(g)
        for on_device in by_device.values():
            _take_aligned_snapshots(on_device)
    elif len(singles) >= 2:  # (one group: one reciprocal either way, left to its cast)
        for group, inv in zip(singles, torch._foreach_reciprocal([g.scale for g in singles])):
            group._scale_inv_snapshot, group._scale_inv_version = (lend(inv), [inv]), group.scale._version


def _take_aligned_snapshots(groups: Sequence[ScalingGroup]) -> None:
    """The next scale_inv snapshot of `groups` (on one device), in one (columns, 4)
    float32 tensor: each column's 1 / scale in a 16-byte slot of its own, which its (1,) view
    reads (the layout ScalingGroup._new_snapshot gives one group). A few torch calls for all
    the groups of an update, where a group of several columns took six at its first cast."""
    scales = [g.scale for g in groups]
    views = _aligned_reciprocals(scales[0] if len(scales) == 1 else torch.cat(scales))[1]
    start = 0
    for group in groups:
        n = len(group.names)
        # the whole (n,) vector only on request (scale_inv()): casts read the column views
        group._scale_inv_snapshot = (None, list(views[start:start + n]))
        group._scale_inv_version = group.scale._version
        start += n


def _aligned_reciprocals(scale: Tensor) -> Tuple[Tensor, Tuple[Tensor, ...]]:
    """(slots, views): 1 / scale[i] in every float of row i of an (n, 4) tensor, one 16-byte slot
    each, and the (1,) view of each slot's first float (what FP8 GEMM libraries read), lent to
    the casts (lent_scales)."""
    slots = torch.reciprocal(scale.unsqueeze(1).expand(scale.shape[0], _FLOATS_PER_16_BYTES))
    return slots, tuple(lend(view) for view in slots.narrow(1, 0, 1).unbind(0))


def _custom_update(group: ScalingGroup) -> None:
    """The update with a user amax_compute_algo / scaling_factor_compute_algo (TE's callables),
    as Transformer Engine's own update for them (its unfused one, not the fused kernel of
    ops.delayed_scaling_update): the amax from the history as it is, NaN included (the user's
    algo, or "max" / "most_recent" over it); every column's history rolls each step, one that
    recorded nothing (an all-zero tensor) too; under the default scale formula an amax that is
    0, inf or NaN keeps the old scale, and a scale from scaling_factor_compute_algo that is not
    finite and positive does too (te-core's guard: such a scale would make every cast NaN)."""
    recipe, history, scale = group.recipe, group.amax_history, group.scale
    algo = recipe.amax_compute_algo
    if callable(algo):
        amax = _user_result(algo(history), scale, "amax_compute_algo", "the (L, n) amax history").float()
    elif algo == "max":
        amax = history.max(dim=0).values  # (NaN wins, as torch.max in TE's update)
    else:
        amax = history[0].clone()
    scale.copy_(_scale_for(group, amax, scale))
    roll_history(history, torch.ones_like(scale, dtype=torch.bool))


def _scale_for(group: ScalingGroup, amax: Tensor, scale: Tensor) -> Tensor:
    """The recipe's scale for `amax` (the default formula, or its scaling_factor_compute_algo),
    `scale` kept where the result would not be finite and positive; never below float32's
    smallest normal number, whose reciprocal (the cast's scale_inv) is still finite."""
    recipe = group.recipe
    if recipe.scaling_factor_compute_algo is None:
        return scale_from_amax(amax, scale, group.fp8_max, recipe.margin)
    new_scale = _user_result(recipe.scaling_factor_compute_algo(amax, scale, group.fp8_max, recipe),
                             scale, "scaling_factor_compute_algo", "(amax, scale, fp8_max, recipe)").float()
    kept = torch.where(torch.isfinite(new_scale) & (new_scale > 0), new_scale, scale)
    return kept.clamp_min(torch.finfo(torch.float32).tiny)


def _user_result(result, scale: Tensor, name: str, given: str) -> Tensor:
    """A user callable's per-column result as an (n,) tensor, or a clear error."""
    n = scale.numel()
    if not isinstance(result, Tensor) or result.numel() != n:
        got = f"a tensor of shape {tuple(result.shape)}" if isinstance(result, Tensor) else type(result).__name__
        raise ValueError(
            f"DelayedScaling.{name} must return a tensor with one value per scaled tensor of the group "
            f"(shape ({n},)) when called with {given}; it returned {got}"
        )
    return result.reshape(scale.shape)


# ------------------------------------------------------------- end-of-backward updates

_BACKWARD_PENDING = PendingUpdates(locked=True)


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


def amax_of_parts(x) -> Tensor:
    """max|x| as a float32 scalar; x may be a list of a gradient's column blocks."""
    if isinstance(x, (list, tuple)):
        return torch.stack([forward_amax_of(part) for part in x]).amax()
    return forward_amax_of(x)


def group_state(group: Optional[ScalingGroup]) -> Dict[str, Dict[str, Tensor]]:
    if group is None:
        return {}
    return {name: {"scale": group.scale[i : i + 1], "amax_history": group.amax_history[:, i]}
            for i, name in enumerate(group.names)}
