"""The delayed-scaling update replayed as a captured CUDA graph, per set of tensors.

The update is one small kernel, yet launching it through Triton's Python launcher costs
several times the host time of replaying a graph of the same launch. At the end of each
autocast the same histories and scales are updated again (te_triton.scaling keeps a plan per
set of them, by identity and address, and that plan holds the tensors and the device table
the kernel reads), so the second update of a set captures its launch and later ones replay it.
Inside someone else's capture (a graphed step) the launch goes into their graph instead.
"""
from __future__ import annotations

import gc
import warnings
from typing import Callable, Dict, Tuple

import torch

MAX_GRAPHS = 64
DIRECT = "direct"  # a set whose capture failed: its updates launch directly
_GRAPHS: Dict[tuple, Tuple[object, object]] = {}  # key -> (graph, DIRECT or None for "seen once", plan)


def _capture(launch: Callable[[], None]) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    collecting = gc.isenabled()
    gc.disable()  # a collection here could free another graph's memory, which would end the capture
    try:
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch()
            finally:
                graph.capture_end()
    finally:
        if collecting:
            gc.enable()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def run(key: tuple, plan: Callable[[], object], launch: Callable[[], None]) -> None:
    """Run `launch` once on the current stream: the update of the tensors `key` names, whose
    te_triton plan `plan()` returns (kept alive with the graph: the graph reads its table)."""
    entry = _GRAPHS.get(key)
    graph = entry[0] if entry else None
    if graph is DIRECT or torch.cuda.is_current_stream_capturing():  # a capture records the launch itself
        launch()
    elif graph is not None:
        graph.replay()
    elif entry is None:  # the first launch compiles the kernel and builds the plan
        launch()
        if len(_GRAPHS) >= MAX_GRAPHS:
            _GRAPHS.clear()
        _GRAPHS[key] = (None, plan())
    else:
        # The plan first: te_triton's plan cache may have dropped it since the first launch (it
        # is bounded too), and building one copies a table to the device, which a capture forbids.
        kept = plan()
        try:
            graph = _capture(launch)
        except RuntimeError as exc:  # nothing ran: the capture only records
            warnings.warn(f"te-backend-cuda: the delayed-scaling update could not be captured into a CUDA graph "
                          f"({exc}); it launches directly", RuntimeWarning, stacklevel=2)
            _GRAPHS[key] = (DIRECT, kept)
            launch()
            return
        _GRAPHS[key] = (graph, kept)
        graph.replay()


def clear() -> None:
    _GRAPHS.clear()
