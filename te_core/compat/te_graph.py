"""Transformer Engine's `pytorch.graph` module as ported code imports it (Megatron-LM's CUDA-graph
code imports make_graphed_callables, set_capture_start / set_capture_end and save_fp8_tensors /
restore_fp8_tensors from it in one block, with `utils.make_weak_ref`, and uses none of them unless
all import), on te-core's graph capture (te_core.graphs).

set_capture_start / set_capture_end bracket graphs the caller captures itself: te-core's modules
then run as inside te.make_graphed_callables (te_core.quantization.scaling.graph_capture): no
host reads, no cast shared between graphs, no scale update queued inside a captured backward;
and once FP8GlobalStateManager.set_skip_fp8_weight_update_tensor has made its flag, each weight
cast captured is kept or refreshed per that device flag (te_core.quantization.weight_refresh).
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional

import torch
from torch import nn

from ..graphs import _restore_scaling_state, _save_scaling_state, make_graphed_callables
from ..quantization.scaling import graph_capture, graph_capture_active
from ..quantization.weight_refresh import set_caller_capture

__all__ = ["make_graphed_callables", "set_capture_start", "set_capture_end", "is_graph_capturing",
           "graph_pool_handle", "save_fp8_tensors", "restore_fp8_tensors"]

_STARTED: List[graph_capture] = []  # the capture mode set_capture_start entered, until set_capture_end


def set_capture_start() -> None:
    """From now until set_capture_end, te-core's modules run as under graph capture (calling it
    again changes nothing, as in Transformer Engine)."""
    if not _STARTED:
        mode = graph_capture()
        mode.__enter__()
        _STARTED.append(mode)
        set_caller_capture(True)  # FP8GlobalStateManager.set_skip_fp8_weight_update_tensor's flag decides weight casts


def set_capture_end() -> None:
    """End what set_capture_start began (nothing to do when it was not called)."""
    if _STARTED:
        set_caller_capture(False)
        _STARTED.pop().__exit__(None, None, None)


def is_graph_capturing() -> bool:
    """Whether graphs are being captured: between set_capture_start and set_capture_end, and
    inside te.make_graphed_callables."""
    return graph_capture_active()


def graph_pool_handle():
    """A memory-pool handle of the selected backend's device, for graphs captured to share one."""
    from .._graph_capture import DeviceGraphs
    from ..backend import get_backend

    device_type = torch.device(get_backend().device).type
    graphs = DeviceGraphs.of(device_type)
    if graphs is None:
        raise NotImplementedError(f"graph_pool_handle: torch has no graph capture for device type {device_type!r} "
                                  "(the selected backend's); run the modules eagerly")
    return graphs.api.graph_pool_handle()


def _modules(modules: Iterable[nn.Module], caller: str) -> List[nn.Module]:
    modules = list(modules) if not isinstance(modules, nn.Module) else [modules]
    bad = [type(m).__name__ for m in modules if not isinstance(m, nn.Module)]
    if bad:
        raise TypeError(f"{caller}: modules must be torch.nn.Modules (an iterable of them), got {', '.join(bad)}")
    return modules


def save_fp8_tensors(modules: Iterable[nn.Module], recipe) -> Optional[List[Any]]:
    """The delayed-scaling state (amax histories and scales) of every te-core module inside
    `modules`, copied, for restore_fp8_tensors to put back after warm-up passes; None unless
    `recipe` is a DelayedScaling (the other recipes keep no such state), as in Transformer Engine.
    The list is opaque: one entry per module given, in order."""
    from ..recipe import DelayedScaling, Recipe

    if recipe is not None and not isinstance(recipe, Recipe):
        if isinstance(recipe, int) and not isinstance(recipe, bool):  # TE before 1.13 took amax_history_len
            raise TypeError("save_fp8_tensors: pass the recipe (Transformer Engine >= 1.13's signature), not an amax "
                            f"history length ({recipe})")
        raise TypeError(f"save_fp8_tensors: recipe must be a te_core recipe or None, got {type(recipe).__name__}")
    modules = _modules(modules, "save_fp8_tensors")
    if not isinstance(recipe, DelayedScaling):
        return None
    return [_save_scaling_state(module) for module in modules]


def restore_fp8_tensors(modules: Iterable[nn.Module], fp8_tensors: Optional[List[Any]]) -> None:
    """Put back, in place, the state save_fp8_tensors saved of the same modules; a scaling state
    made since (by the warm-up) starts from a zero history and scale 1, as Transformer Engine's
    reset does. None (what save_fp8_tensors returns for other recipes): nothing to do."""
    if fp8_tensors is None:
        return
    modules = _modules(modules, "restore_fp8_tensors")
    if not isinstance(fp8_tensors, list) or len(fp8_tensors) != len(modules) \
            or not all(isinstance(saved, dict) for saved in fp8_tensors):
        got = f"a list of {len(fp8_tensors)}" if isinstance(fp8_tensors, list) else type(fp8_tensors).__name__
        raise RuntimeError(f"restore_fp8_tensors: fp8_tensors must be what save_fp8_tensors returned for these "
                           f"{len(modules)} module(s), got {got}; pass the same modules to both calls")
    for module, saved in zip(modules, fp8_tensors):
        _restore_scaling_state(module, saved)


def make_weak_ref(x):
    """`x` as Transformer Engine's make_weak_ref takes it (a tensor, or tuples, lists and dicts of
    them, numbers, None), returned as it is: a tensor that does not keep its memory alive needs a
    raw device pointer, which torch has no device-independent way to wrap; Transformer Engine too
    returns tensors other than its GPU's unchanged. Callers keep a strong reference (more memory
    held, nothing freed early)."""
    if isinstance(x, (tuple, list)):
        return type(x)(make_weak_ref(item) for item in x)
    if isinstance(x, dict):
        return {key: make_weak_ref(value) for key, value in x.items()}
    if x is None or isinstance(x, (torch.Tensor, int, float, bool)):
        return x
    raise TypeError(f"make_weak_ref: got a {type(x).__name__}; it takes a torch.Tensor, a tuple, list or dict of "
                    "them, an int, float or bool, or None")
