"""te.checkpoint and checkpoint_context: activation recompute that reproduces the FP8 state of
the original forward.

torch.utils.checkpoint (non-reentrant) takes a pair of contexts (`context_fn`), one around the
original forward, one around the recompute; checkpoint_context gives that pair. During the
original forward every QuantizedModule records the quantization step it used, with a copy of
its forward scales; during the recompute each gets the same step back, its scales set to those
copies (delayed scaling has updated them since), and afterwards the forward scaling state of
every module is restored, so the recompute neither changes the quantization nor records amaxes
twice. Modules find the active log through a thread-local (QuantizedModule.quantization_step):
the recompute runs on whatever thread runs the backward, and enters its context there.
torch.utils.checkpoint restores the RNG state (dropout) and torch.autocast itself.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from functools import partial
from typing import Callable, Dict, Tuple

import torch

from ..quantization.autocast import get_autocast_context
from ._base import RECOMPUTE, QuantizedModule


def _forward_state(module: QuantizedModule) -> Dict[str, Dict[str, torch.Tensor]]:
    return {
        slot: {k: v.detach().clone() for k, v in entry.items()}
        for slot, entry in module.quantization_state()["forward"].items()
    }


def _load_forward_state(
    module: QuantizedModule, saved: Dict[str, Dict[str, torch.Tensor]], keys=("scale", "amax_history")
) -> None:
    live = module.quantization_state()["forward"]
    for slot, entry in saved.items():
        for key in keys:
            if slot in live:
                live[slot][key].copy_(entry[key])


def _has_fresh_forward_scales(module: QuantizedModule) -> bool:
    state = module._recipe_state
    return state is not None and any(
        bool(group.fresh) for role, group in state.scaling_groups().items() if role.direction == "forward")


class _StepLog:
    """Per module, the (step, forward scales) of each quantization_step call of the forwards it
    recorded, in call order; then, during a recompute, the same steps handed back (first in,
    first out per module)."""

    def __init__(self):
        self.steps: Dict[int, deque] = {}
        self.unfinished = []  # (module, entry) whose forward scales are taken when the forward ends
        # whether FP8 was on where the last forward region began: its recompute runs in the backward,
        # outside that te.autocast, and still counts as FP8 for is_fp8_activation_recompute_enabled
        self.fp8_at_forward = False

    def record(self, module: QuantizedModule, is_first_microbatch):
        return self.add(module, module.new_quantization_step(is_first_microbatch))

    def add(self, module: QuantizedModule, step):
        """Record `step`, which `module` runs its forward with, and the scales it casts with."""
        entry = [step, None]
        if _has_fresh_forward_scales(module):
            # its first casts set their scales from their own amaxes (QuantizationStep.first_scale):
            # the scales to replay are those after the forward, taken at the region's end
            self.unfinished.append((module, entry))
        else:
            entry[1] = _forward_state(module)
        self.steps.setdefault(id(module), deque()).append(entry)
        return step

    def replay(self, module: QuantizedModule, is_first_microbatch, touched: dict):
        """The recorded step, the module's forward scales set to those it cast with; `touched`
        keeps each module's scaling state from before, put back when the recompute ends (so the
        recompute changes no scale and records no amax twice)."""
        key = id(module)
        if key not in touched:
            touched[key] = (module, _forward_state(module))
        queue = self.steps.get(key)
        if not queue:  # the recompute took a path the forward did not: quantize afresh
            return module.new_quantization_step(is_first_microbatch)
        step, scales = queue.popleft()
        if not queue:
            del self.steps[key]
        _load_forward_state(module, scales, keys=("scale",))
        return step

    @contextlib.contextmanager
    def active(self, replaying: bool):
        if not replaying:
            self.fp8_at_forward = _fp8_on()
        phase = _Phase(self, replaying, RECOMPUTE.log)
        outer, RECOMPUTE.log = RECOMPUTE.log, phase
        try:
            yield
        finally:
            RECOMPUTE.log = outer
            if not replaying:
                for module, entry in self.unfinished:
                    entry[1] = _forward_state(module)
                self.unfinished.clear()
            for module, saved in phase.touched.values():
                _load_forward_state(module, saved)


class _Phase:
    """What a module's quantization_step consults while a log's forward or recompute runs.

    Regions nest (a checkpointed block whose MLP checkpoints itself): a forward phase inside
    another region's phase takes its steps from that one, and records them too. So the outer
    region's forward records the inner modules' steps as well, and the outer recompute, which
    runs the inner region's forward again (outside te.autocast, in the backward), hands them back;
    the inner region then recomputes from what it recorded there."""

    def __init__(self, log: _StepLog, replaying: bool, outer=None):
        self.log, self.replaying, self.outer, self.touched = log, replaying, outer, {}

    def step(self, module: QuantizedModule, is_first_microbatch):
        if self.replaying:
            return self.log.replay(module, is_first_microbatch, self.touched)
        if self.outer is not None:
            return self.log.add(module, self.outer.step(module, is_first_microbatch))
        return self.log.record(module, is_first_microbatch)


def checkpoint_context() -> Tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The (forward, recompute) context pair that makes torch.utils.checkpoint's recompute of
    te-core modules FP8-exact: pass it as `context_fn=te_core.checkpoint_context` with
    `use_reentrant=False` (Hugging Face: `activation_checkpointing_kwargs={"use_reentrant":
    False, "context_fn": te_core.checkpoint_context}`)."""
    log = _StepLog()
    return log.active(replaying=False), log.active(replaying=True)


_FRAMEWORK_LOG = _StepLog()  # the queues of activation_recompute_forward, shared by every region


@contextlib.contextmanager
def activation_recompute_forward(activation_recompute: bool = False, recompute_phase: bool = False):
    """Transformer Engine's context for activation recompute written outside te.checkpoint
    (Megatron-LM's own checkpoint functions): around the original forward with
    activation_recompute=True, te-core modules record the quantization step and forward scales
    they use; around the recompute with recompute_phase=True as well, each gets them back, first
    in first out per module, as Transformer Engine queues them (microbatches recompute in the
    order they ran forward). A recorded forward that is never recomputed stays queued, as in
    Transformer Engine. activation_recompute=False changes nothing."""
    if not activation_recompute:
        yield
        return
    with _FRAMEWORK_LOG.active(replaying=recompute_phase):
        yield


def _fp8_on() -> bool:
    context = get_autocast_context()
    return bool(context is not None and context.enabled)


def is_fp8_activation_recompute_enabled() -> bool:
    """Whether this thread runs inside an activation-recompute region (te.checkpoint, checkpoint_context,
    activation_recompute_forward(activation_recompute=True)) with FP8 on: in its forward, under
    te.autocast(enabled=True); in its recompute, also when its forward began under one (Transformer
    Engine re-enters that autocast for the recompute). Transformer Engine's query of the same name."""
    log = RECOMPUTE.log
    if log is None:
        return False
    return _fp8_on() or (log.replaying and log.log.fp8_at_forward)


def in_fp8_activation_recompute_phase() -> bool:
    """Whether the innermost such region on this thread is running its recompute (in the backward),
    FP8 on or not, as Transformer Engine's query answers."""
    log = RECOMPUTE.log
    return bool(log is not None and log.replaying)


def checkpoint(
    function: Callable,
    *args,
    distribute_saved_activations: bool = False,
    get_rng_state_tracker=None,
    tp_group=None,
    use_reentrant: bool = True,
    **kwargs,
):
    """Run function(*args, **kwargs) without keeping its activations; recompute them in backward,
    FP8-exact for every recipe (checkpoint_context). The recompute is always non-reentrant
    (use_reentrant is accepted for Transformer Engine compatibility and ignored). With
    `get_rng_state_tracker` (a callable returning the tracker), the recompute starts from the
    tracker's states as the forward found them, so dropout inside `tracker.fork()` draws the same
    masks. `tp_group` only serves distribute_saved_activations in Transformer Engine. Under
    torch.compile, the compiler's own recompute: every recipe but delayed scaling.
    `context_fn` (torch's: a (forward, recompute) context pair) runs inside te-core's own pair;
    the other options of torch.utils.checkpoint pass through. Transformer Engine's older form,
    those three options given positionally before the tensors, is taken with its warning."""
    if (len(args) > 3 and isinstance(args[0], bool) and callable(args[1])
            and (args[2] is None or _is_process_group(args[2]))):
        warnings.warn("checkpoint: passing distribute_saved_activations, get_rng_state_tracker and tp_group "
                      "positionally is deprecated (as in Transformer Engine); pass them as keyword arguments",
                      DeprecationWarning, stacklevel=2)
        distribute_saved_activations, get_rng_state_tracker, tp_group = args[:3]
        args = args[3:]
    if distribute_saved_activations and use_reentrant is False:  # (Transformer Engine's warning, and it runs)
        warnings.warn("checkpoint: distribute_saved_activations=True has no effect with use_reentrant=False (the "
                      "saved activations are autograd's, not the checkpoint's own)", UserWarning, stacklevel=2)
    elif distribute_saved_activations:
        raise NotImplementedError(
            "checkpoint: distribute_saved_activations=True (the saved input split over the tensor-parallel ranks) "
            "is not implemented by te-core; pass distribute_saved_activations=False (each rank keeps its input)")
    if get_rng_state_tracker is not None and not callable(get_rng_state_tracker):
        raise TypeError("checkpoint: get_rng_state_tracker must be a callable returning the RNG states tracker "
                        f"(as Transformer Engine takes it), got {type(get_rng_state_tracker).__name__}")
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if torch.compiler.is_compiling():
        # The compiler recomputes the region from the graph's own values: exact for recipes whose
        # casts keep no state. Delayed scaling's casts write amax histories, which a recompute
        # region cannot hold (and would write twice).
        context = get_autocast_context()
        if context is not None and (context.enabled or context.calibrating) and context.recipe.keeps_state:
            raise NotImplementedError(
                f"te_core.checkpoint under torch.compile with {type(context.recipe).__name__}: its casts write amax "
                "histories, which a compiled recompute cannot replay. Compile without fullgraph=True (the region then "
                "runs eagerly between graphs, FP8-exact), or use Float8CurrentScaling, Float8BlockScaling or "
                "MXFP8BlockScaling")
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    contexts = checkpoint_context if get_rng_state_tracker is None else partial(
        _with_tracker_states, get_rng_state_tracker())
    user_contexts = kwargs.pop("context_fn", None)
    if user_contexts is not None:
        contexts = partial(_both, contexts, user_contexts)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _both(ours: Callable, theirs: Callable):
    """The (forward, recompute) pair entering te-core's contexts, then the user's, in each phase."""
    (forward, recompute), (user_forward, user_recompute) = ours(), theirs()

    @contextlib.contextmanager
    def stacked(first, second):
        with first, second:
            yield

    return stacked(forward, user_forward), stacked(recompute, user_recompute)


def _is_process_group(group) -> bool:
    dist = torch.distributed
    return dist.is_available() and isinstance(group, dist.ProcessGroup)


def _with_tracker_states(tracker):
    """checkpoint_context's pair, the recompute also run from the tracker states of the forward
    (the states after the recompute are put back: the forward already advanced them)."""
    forward, recompute = checkpoint_context()
    found = {}

    @contextlib.contextmanager
    def forward_with_states():
        found.update(tracker.get_states())
        with forward:
            yield

    @contextlib.contextmanager
    def recompute_with_states():
        after = tracker.get_states()
        tracker.set_states(dict(found))
        try:
            with recompute:
                yield
        finally:
            tracker.set_states(after)

    return forward_with_states(), recompute_with_states()
