"""Transformer Engine's `delay_wgrad_compute=True`: the backward computes the input gradient only
and leaves the weight-gradient GEMMs for `module.backward_dw()`.

Pipeline schedules (zero-bubble) run the dgrad of every micro-batch first, so the next stage gets
its gradient early, and fill the bubbles with the wgrad GEMMs later. The backward records, per
weight, the work that computes its gradient; the GEMM operands it captures are the ones the
immediate path would read (FP8 column-wise copies stay quantized, their scale_inv snapshots do
not follow later scale updates), so the deferred gradient is bit for bit the immediate one.

`backward_dw()` runs the work of the oldest backward not yet processed (one call per backward, as
Transformer Engine's queue) and accumulates each result as autograd would: added into
`weight.grad` (set when None), or with fuse_wgrad_accumulation=True into `weight.main_grad`.
Transformer Engine instead overwrites `weight.grad`; te-core keeps autograd's accumulation so
micro-batches sum whichever path they take. Bias gradients come out of the gradient cast in the
backward itself and reach `bias.grad` through autograd then.
"""
from __future__ import annotations

import collections
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ._common import check_bool
from ._wgrad import main_grad_placeholder

WgradWork = Callable[[], Optional[Tensor]]  # the weight gradient, or None once added into main_grad


class WeightGradStore:
    """The deferred weight-gradient work of one module: one batch per backward, oldest first."""

    def __init__(self, module: str):
        self._module = module
        self._batches: Deque[Dict[str, WgradWork]] = collections.deque()

    def new_batch(self) -> Dict[str, WgradWork]:
        """The batch a backward fills: parameter name -> work."""
        batch: Dict[str, WgradWork] = {}
        self._batches.append(batch)
        return batch

    def pop(self) -> Dict[str, WgradWork]:
        if not self._batches:
            raise RuntimeError(f"{self._module}.backward_dw(): no weight gradient is pending; call it once after each "
                               "backward of a module built with delay_wgrad_compute=True")
        return self._batches.popleft()

    def __len__(self) -> int:
        return len(self._batches)


def new_batch(store: Optional[WeightGradStore]) -> Optional[Dict[str, WgradWork]]:
    """The batch one backward records its weight-gradient work in; None for the immediate path."""
    return None if store is None else store.new_batch()


def weight_grad_or_defer(batch: Optional[Dict[str, WgradWork]], name: str, work: WgradWork,
                         fused_weight: Optional[Tensor] = None) -> Optional[Tensor]:
    """`work()` now (batch None: the immediate path), or recorded in the backward's batch under
    the parameter `name` for backward_dw, returning None for autograd. `fused_weight`: the
    weight whose main_grad the work adds into, for the gradient autograd then gets on the
    immediate path (_wgrad.main_grad_placeholder)."""
    if batch is None:
        grad = work()
        return main_grad_placeholder(fused_weight) if grad is None and fused_weight is not None else grad
    batch[name] = work
    return None


class DelayedWgradMixin:
    """For a QuantizedModule whose forward hands `self.delayed_wgrad_store()` to its autograd
    Function, whose backward passes `new_batch(store)` to weight_grad_or_defer."""

    def init_delayed_wgrad(self, delay_wgrad_compute: bool, module: str) -> None:
        """Call after the parameters exist."""
        delay_wgrad_compute = check_bool(delay_wgrad_compute, name="delay_wgrad_compute", module=module)
        self.wgrad_store = WeightGradStore(module) if delay_wgrad_compute else None
        self.wgrad_accumulation_and_reduce_hooks: List[Callable[[], None]] = []
        if delay_wgrad_compute:
            # Megatron-style DDP skips its per-parameter gradient hook for these and relies on the
            # hooks registered here, which backward_dw runs once the gradients exist (as in TE)
            for name, param in self.named_parameters():
                if not name.startswith("layer_norm_"):  # the GEMMs' weights and biases, not the norm's
                    param.skip_backward_post_hook = True
                    if "weight" not in name:  # a bias: its gradient still comes from the backward itself
                        param.te_grad_from_backward = True

    def delayed_wgrad_store(self) -> Optional[WeightGradStore]:
        """What a forward hands its autograd Function: the store, or None for the immediate path."""
        store = self.__dict__.get("wgrad_store")
        if store is not None and torch.compiler.is_compiling():
            raise NotImplementedError(f"{type(self).__name__}: delay_wgrad_compute=True is not supported under "
                                      "torch.compile (the backward would record work outside the graph); compile "
                                      "without it or run the module eagerly")
        return store

    def need_backward_dw(self) -> bool:
        """Whether backward_dw has work to do at all (the module delays its weight gradients)."""
        return self.__dict__.get("wgrad_store") is not None

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """`hook()` runs at the end of each backward_dw, after the weight gradients are in place
        (data-parallel reduction of delayed gradients)."""
        if not callable(hook):
            raise TypeError(f"{type(self).__name__}: the wgrad accumulation and reduce hook must be callable, "
                            f"got {hook!r}")
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        """Compute the weight gradients the oldest backward left pending and accumulate them
        into .grad (or main_grad under fuse_wgrad_accumulation). A no-op for a module built
        without delay_wgrad_compute; a RuntimeError when no backward is pending."""
        if not self.need_backward_dw():
            return
        accumulate(self.pending_weight_grads())
        self.run_wgrad_hooks()

    def pending_weight_grads(self) -> List[Tuple[Tensor, Optional[Tensor]]]:
        """The weight gradients the oldest pending backward left, computed now, as (parameter,
        gradient) pairs, not yet accumulated (a gradient added into main_grad already is None).
        make_graphed_callables captures this as a graph of its own."""
        pairs = []
        with torch.no_grad():  # (the GEMMs may read tensors that require grad: no graph for them)
            for name, work in self.wgrad_store.pop().items():
                grad = work()
                if grad is not None:
                    pairs.extend(_split(self, name, grad))
                del grad
        return pairs

    def run_wgrad_hooks(self) -> None:
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


def _split(module: torch.nn.Module, name: str, grad: Tensor) -> List[Tuple[Tensor, Tensor]]:
    """(parameter, gradient) for the parameter `name`; under parameters_split, the named parts,
    each with its rows."""
    param = module._parameters.get(name)
    if param is not None:
        return [(param, grad)]
    splits = module.__dict__["_parameters_split"]
    parts = grad.split([rows for _, rows in splits])
    return [(module._parameters[f"{part}_{name}"], g.clone()) for (part, _), g in zip(splits, parts)]


def accumulate(pairs, copy: bool = False) -> None:
    """Add each gradient into its parameter's .grad as autograd would (set where None: a copy
    with `copy`, for gradients in buffers that are written again, a graph's)."""
    with torch.no_grad():
        for param, g in pairs:
            if g is None:
                continue
            if param.grad is None:
                param.grad = g.clone() if copy else g
            else:
                param.grad += g
