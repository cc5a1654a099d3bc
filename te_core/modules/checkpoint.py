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
from collections import deque
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
    """Per module, the (step, forward scales) of each quantization_step call of one checkpointed
    region, in call order; then, during the recompute, the same steps handed back."""

    def __init__(self):
        self.modules: Dict[int, QuantizedModule] = {}
        self.steps: Dict[int, deque] = {}
        self.replaying = False
        self.unfinished = []  # (module, entry) whose forward scales are taken when the forward ends

    def step(self, module: QuantizedModule, is_first_microbatch):
        key = id(module)
        if not self.replaying:
            step = module.new_quantization_step(is_first_microbatch)
            self.modules[key] = module
            entry = [step, None]
            if _has_fresh_forward_scales(module):
                # its first casts set their scales from their own amaxes (QuantizationStep.first_scale):
                # the scales to replay are those after the forward, taken at the region's end
                self.unfinished.append((module, entry))
            else:
                entry[1] = _forward_state(module)
            self.steps.setdefault(key, deque()).append(entry)
            return step
        queue = self.steps.get(key)
        if not queue:  # the recompute took a path the forward did not: quantize afresh
            return module.new_quantization_step(is_first_microbatch)
        step, scales = queue.popleft()
        _load_forward_state(module, scales, keys=("scale",))
        return step

    @contextlib.contextmanager
    def active(self, replaying: bool):
        outer, RECOMPUTE.log = RECOMPUTE.log, self
        self.replaying = replaying
        current = {key: _forward_state(m) for key, m in self.modules.items()} if replaying else {}
        try:
            yield
        finally:
            RECOMPUTE.log = outer
            for module, entry in self.unfinished:
                entry[1] = _forward_state(module)
            self.unfinished.clear()
            for key, saved in current.items():
                _load_forward_state(self.modules[key], saved)


def checkpoint_context() -> Tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """The (forward, recompute) context pair that makes torch.utils.checkpoint's recompute of
    te-core modules FP8-exact: pass it as `context_fn=te_core.checkpoint_context` with
    `use_reentrant=False` (Hugging Face: `activation_checkpointing_kwargs={"use_reentrant":
    False, "context_fn": te_core.checkpoint_context}`)."""
    log = _StepLog()
    return log.active(replaying=False), log.active(replaying=True)


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
    (use_reentrant is accepted for Transformer Engine compatibility and ignored). Under
    torch.compile, the compiler's own recompute: every recipe but delayed scaling."""
    if distribute_saved_activations or tp_group is not None:
        raise NotImplementedError(
            "checkpoint: distribute_saved_activations / tp_group need tensor parallelism, "
            "which te-core does not implement"
        )
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
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=checkpoint_context,
                                             **kwargs)
