"""Forward intermediates that a backward reads once and can drop as it goes.

ctx.save_for_backward keeps a tensor until the node's whole backward has returned, so the
pre-activation, the FP8 column-wise copies and the like would all still be alive at the end
of a fused backward, on top of the gradients it builds: that is what set an FP8 layer step's
peak memory. `save` holds such intermediates on ctx instead, and `restore` hands them to the
backward; when the graph will not be used again (no retain_graph) ctx lets go of them, so the
backward's locals are the only references and each tensor is freed as soon as the backward
deletes its local. Under saved-tensor hooks (CPU offload, checkpointing by hooks) everything
goes through save_for_backward as usual, so the hooks see every tensor; so it does under
torch.compile.

`save_holding_quantized` applies this to the quantized operands a GEMM's backward reads: they
are the Function's own fresh copies, which nothing else writes, and autograd's saving and
unpacking of a tensor subclass runs its Python dispatch, host time on every step. Plain tensors
among them (an input in high precision) still go through save_for_backward, whose version check
catches an in-place change of the input before the backward.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..quantization.tensor import QUANTIZED

_RELEASED = object()  # held intermediates a backward without retain_graph has taken


# torch 2.7 has no way to ask whether saved-tensor hooks are active: there te-core keeps torch's
# own saving and holds nothing on ctx
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
HOLDS_INTERMEDIATES = _TOP_HOOKS is not None


def _saved_tensor_hooks_active() -> bool:
    top = _TOP_HOOKS
    if top is None:
        return True  # cannot tell: keep torch's own saving
    try:
        return top(True) is not None
    except TypeError:  # older signature without ignore_is_tracing
        return top() is not None


def _graph_kept() -> bool:
    """Whether the running backward keeps the graph (retain_graph=True); True when unknown."""
    return getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)()


def save(ctx, tensors: Sequence[Optional[Tensor]], intermediates: Sequence[Optional[Tensor]]) -> None:
    ctx.n_saved = len(tensors)
    # torch.compile traces save_for_backward (and plans the backward's memory itself)
    if torch.compiler.is_compiling() or _saved_tensor_hooks_active():
        ctx.save_for_backward(*tensors, *intermediates)
        ctx.held_intermediates = None
    else:
        ctx.save_for_backward(*tensors)
        ctx.held_intermediates = list(intermediates)


def restore(ctx, name: str) -> Tuple[Tuple[Optional[Tensor], ...], List[Optional[Tensor]]]:
    """(tensors, intermediates) as given to `save`."""
    saved = ctx.saved_tensors  # raises torch's own error on a second backward without retain_graph
    held = ctx.held_intermediates
    if held is None:
        return saved[: ctx.n_saved], list(saved[ctx.n_saved:])
    if held is _RELEASED:
        raise RuntimeError(f"{name}: backward ran through this graph a second time, but the first backward freed "
                           "its saved activations; pass retain_graph=True to the first backward")
    if not _graph_kept():
        ctx.held_intermediates = _RELEASED
    return saved, list(held)


def save_holding_quantized(ctx, tensors: Sequence[Optional[Tensor]]) -> None:
    """`tensors` for the backward: quantized ones held on ctx (as `save`'s intermediates), the
    others through save_for_backward; restore_held gives them back in order."""
    quantized = [isinstance(t, QUANTIZED) for t in tensors]
    save(ctx, [None if q else t for t, q in zip(tensors, quantized)],
         [t if q else None for t, q in zip(tensors, quantized)])


def restore_held(ctx, name: str) -> List[Optional[Tensor]]:
    """The tensors given to save_holding_quantized, in order."""
    plain, held = restore(ctx, name)
    return [h if h is not None else p for p, h in zip(plain, held)]
