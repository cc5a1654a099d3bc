"""te.checkpoint: activation recompute that reproduces the FP8 state of the original forward.

Built on torch.utils.checkpoint (non-reentrant) with a context pair: during the original
forward every QuantizedModule inside records the quantization step it used, with a copy of
its forward scales; during the recompute it gets the same step back, its scales are set to
those copies (delayed scaling has updated them since), and afterwards its forward scaling
state is restored, so the recompute neither changes the quantization nor records amaxes twice.
torch.utils.checkpoint restores the RNG state (dropout) and torch.autocast itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict, deque
from typing import Callable, Dict, Iterable, List

import torch
from torch import nn

from ._base import QuantizedModule


def _modules_reachable(function: Callable, args: Iterable, kwargs: dict) -> List[QuantizedModule]:
    """QuantizedModules in `function` (a module, a bound method of one, a partial, or a closure
    over modules) and in its arguments."""
    roots = list(args) + list(kwargs.values())
    fn = function
    while isinstance(fn, functools.partial):
        roots += list(fn.args) + list(fn.keywords.values())
        fn = fn.func
    roots.append(fn)
    roots.append(getattr(fn, "__self__", None))
    roots += [cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ()) if _cell_filled(cell)]
    found: Dict[int, QuantizedModule] = {}
    for root in roots:
        if isinstance(root, nn.Module):
            found.update((id(m), m) for m in root.modules() if isinstance(m, QuantizedModule))
    return list(found.values())


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


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


class _StepLog:
    """Per module, the (step, forward scales) of each quantization_step call, in call order."""

    def __init__(self, modules: List[QuantizedModule]):
        self.modules = modules
        self.steps: Dict[int, deque] = defaultdict(deque)

    @contextlib.contextmanager
    def recording(self):
        def record(module):
            def quantization_step(is_first_microbatch=None):
                step = type(module).quantization_step(module, is_first_microbatch)
                self.steps[id(module)].append((step, _forward_state(module)))
                return step

            return quantization_step

        with _instance_override(self.modules, record):
            yield

    @contextlib.contextmanager
    def replaying(self):
        current = {id(m): _forward_state(m) for m in self.modules}
        pending = {key: deque(entries) for key, entries in self.steps.items()}

        def replay(module):
            def quantization_step(is_first_microbatch=None):
                queue = pending.get(id(module))
                if not queue:  # the recompute took a path the forward did not: quantize afresh
                    return type(module).quantization_step(module, is_first_microbatch)
                step, scales = queue.popleft()
                _load_forward_state(module, scales, keys=("scale",))
                return step

            return quantization_step

        try:
            with _instance_override(self.modules, replay):
                yield
        finally:
            for module in self.modules:
                _load_forward_state(module, current[id(module)])


@contextlib.contextmanager
def _instance_override(modules: List[QuantizedModule], make: Callable):
    """Give each module its own quantization_step for the duration (instance attribute; the
    class is untouched)."""
    for module in modules:
        module.quantization_step = make(module)
    try:
        yield
    finally:
        for module in modules:
            module.__dict__.pop("quantization_step", None)


def checkpoint(
    function: Callable,
    *args,
    distribute_saved_activations: bool = False,
    get_rng_state_tracker=None,
    tp_group=None,
    use_reentrant: bool = True,
    **kwargs,
):
    """Run function(*args, **kwargs) without keeping its activations; recompute them in backward.

    FP8-exact for every recipe when the te-core modules it runs are reachable from `function`
    (an nn.Module, a bound method of one, a functools.partial or a closure over modules) or
    from its arguments. The recompute is always non-reentrant (use_reentrant is accepted for
    Transformer Engine compatibility and ignored)."""
    if distribute_saved_activations or tp_group is not None:
        raise NotImplementedError(
            "checkpoint: distribute_saved_activations / tp_group need tensor parallelism, "
            "which te-core does not implement"
        )
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    log = _StepLog(_modules_reachable(function, args, kwargs))
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, context_fn=lambda: (log.recording(), log.replaying()), **kwargs
    )
