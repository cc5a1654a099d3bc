"""The order in which make_graphed_callables warms up and captures its graphs.

By default each module gets one pair of graphs; every forward is warmed up and captured in the
order the modules were given, then every backward in reverse order, as a training step runs them.

With Transformer Engine's pipeline-parallel arguments the modules are the layers of a pipeline
stage, grouped into model chunks (`_num_layers_per_chunk` layers each), and every microbatch's
pass through a layer gets graphs of its own, with its own sample inputs. `_order` is the stage's
schedule as Megatron-LM's interleaved pipeline runs it: chunk numbers from 1, positive for a
forward pass of that chunk (all its layers in order), negative for a backward pass (its layers
in reverse order), each chunk appearing once per microbatch in each direction; an entry -k - 0.5
captures the weight gradients that layers built with delay_wgrad_compute=True left pending in a
backward pass of chunk k. Graphs that share
a memory pool must be replayed in the order they were captured, so capture follows that
schedule. Samples (and the returned callables) are numbered chunk by chunk, within a chunk
microbatch by microbatch, within a microbatch layer by layer: Transformer Engine's numbering.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Callable, Dict, List, Optional, Sequence, Tuple

FORWARD, BACKWARD, WGRAD = "forward", "backward", "wgrad"  # a pass; WGRAD: the deferred weight gradients
Step = Tuple[str, int]  # (the pass, the sample it runs on)


@dataclass(frozen=True)
class Schedule:
    """callable_of[s]: the module sample s runs through; steps: (pass, sample) in the order of
    warm-up and capture; pipelined: whether _order gave it (one callable returned per sample)."""

    callable_of: Tuple[int, ...]
    steps: Tuple[Step, ...]
    pipelined: bool = False


def default_schedule(n_modules: int, delays_wgrad: Sequence[bool] = ()) -> Schedule:
    """Forwards in order, then backwards in reverse; a module that delays its weight gradients
    (delay_wgrad_compute) has them right after its backward, as Transformer Engine captures them."""
    steps = [(FORWARD, i) for i in range(n_modules)]
    for i in reversed(range(n_modules)):
        steps.append((BACKWARD, i))
        if i < len(delays_wgrad) and delays_wgrad[i]:
            steps.append((WGRAD, i))
    return Schedule(tuple(range(n_modules)), tuple(steps))


def _checked_order(order) -> List[Tuple[str, int]]:
    """(pass, chunk index from 0) per _order entry: k forward, -k backward, -k - 0.5 the deferred
    weight gradients of a backward of chunk k (Transformer Engine's encoding; the n-th such entry
    belongs to the chunk's n-th backward, as the modules' own backward_dw queue takes them)."""
    if not isinstance(order, (list, tuple)) or not order:
        raise TypeError(f"make_graphed_callables: _order must be a non-empty list of chunk numbers (positive: a "
                        f"forward pass, negative: a backward pass), got {order!r}")
    passes = []
    for c in order:
        if isinstance(c, bool) or not isinstance(c, (Integral, float)) or c == 0 or c != c:
            raise ValueError(f"make_graphed_callables: _order entries are non-zero chunk numbers (from 1; negative "
                             f"for a backward pass), got {c!r}")
        if float(c).is_integer():
            passes.append((FORWARD if c > 0 else BACKWARD, abs(int(c)) - 1))
        elif c < 0 and float(c - 0.5).is_integer() and c <= -1.5:
            passes.append((WGRAD, int(-c - 0.5) - 1))
        else:
            raise ValueError(f"make_graphed_callables: _order entry {c} is neither a chunk number nor -k-0.5 (the "
                             "weight gradients of chunk k's latest backward)")
    return passes


def _layers_per_chunk(layers, n_chunks: int, n_microbatches: int, n_samples: int) -> List[int]:
    if layers is None:
        per_chunk, left = divmod(n_samples, n_chunks * n_microbatches)
        if left or not per_chunk:
            raise ValueError(f"make_graphed_callables: {n_samples} sample_args do not split into {n_chunks} model "
                             f"chunk(s) of {n_microbatches} microbatch(es) with the same number of layers; give "
                             "_num_layers_per_chunk")
        return [per_chunk] * n_chunks
    if isinstance(layers, Integral) and not isinstance(layers, bool):
        layers = [int(layers)] * n_chunks
    if not isinstance(layers, (list, tuple)) or len(layers) != n_chunks \
            or not all(isinstance(n, Integral) and not isinstance(n, bool) and n > 0 for n in layers):
        raise ValueError(f"make_graphed_callables: _num_layers_per_chunk must be a positive int or a list of "
                         f"{n_chunks} positive ints (one per model chunk in _order), got {layers!r}")
    return [int(n) for n in layers]


def pipeline_schedule(order, layers_per_chunk, n_modules: int, n_samples: int,
                      delays_wgrad: Sequence[bool] = ()) -> Schedule:
    """The schedule of `_order` over `n_modules` layers and `n_samples` samples, or a clear error.
    `delays_wgrad[m]`: whether layer m defers its weight gradients (delay_wgrad_compute), which
    then need their own entries in the order."""
    passes = _checked_order(order)
    n_chunks = max(chunk for _, chunk in passes) + 1
    n_microbatches = sum(kind == FORWARD for kind, _ in passes) // n_chunks
    for chunk in range(n_chunks):
        forwards = passes.count((FORWARD, chunk))
        backwards = passes.count((BACKWARD, chunk))
        if forwards != n_microbatches or backwards != n_microbatches or not forwards:
            raise ValueError(f"make_graphed_callables: _order has {forwards} forward and {backwards} backward "
                             f"pass(es) of chunk {chunk + 1}; every chunk from 1 to {n_chunks} needs one of each per "
                             f"microbatch (the same number for every chunk)")
    layers = _layers_per_chunk(layers_per_chunk, n_chunks, n_microbatches, n_samples)
    if n_modules != sum(layers):
        raise ValueError(f"make_graphed_callables: _num_layers_per_chunk {layers} makes {sum(layers)} layers, but "
                         f"{n_modules} modules were given (one per layer of the pipeline stage)")
    if n_samples != sum(layers) * n_microbatches:
        raise ValueError(f"make_graphed_callables: {n_samples} sample_args given; {sum(layers)} layers over "
                         f"{n_microbatches} microbatches need {sum(layers) * n_microbatches} (one per layer and "
                         "microbatch, chunk by chunk, microbatch by microbatch)")
    first_layer = [0]
    for n in layers:
        first_layer.append(first_layer[-1] + n)
    callable_of = [first_layer[chunk] + layer for chunk, n in enumerate(layers)
                   for _ in range(n_microbatches) for layer in range(n)]
    delays = [bool(delays_wgrad[m]) if m < len(delays_wgrad) else False for m in range(n_modules)]
    done = {FORWARD: [0] * n_chunks, BACKWARD: [0] * n_chunks, WGRAD: [0] * n_chunks}
    steps: List[Step] = []
    for kind, chunk in passes:
        microbatch = done[kind][chunk]
        before = FORWARD if kind == BACKWARD else BACKWARD if kind == WGRAD else None
        if before is not None and microbatch >= done[before][chunk]:
            what = "backward pass" if kind == BACKWARD else "weight-gradient pass (-k-0.5)"
            raise ValueError(f"make_graphed_callables: _order runs {what} {microbatch + 1} of chunk {chunk + 1} "
                             f"before its {before} pass; each must follow the pass it completes")
        done[kind][chunk] += 1
        first = first_layer[chunk] * n_microbatches + microbatch * layers[chunk]
        samples = range(first, first + layers[chunk])
        if kind == WGRAD and not any(delays[callable_of[s]] for s in samples):
            raise ValueError(f"make_graphed_callables: _order has a weight-gradient pass of chunk {chunk + 1}, but "
                             "none of its layers was built with delay_wgrad_compute=True")
        steps.extend((kind, s) for s in (samples if kind == FORWARD else reversed(samples)))
    for chunk in range(n_chunks):
        delaying = any(delays[first_layer[chunk] + layer] for layer in range(layers[chunk]))
        if delaying and done[WGRAD][chunk] != n_microbatches:
            raise ValueError(f"make_graphed_callables: chunk {chunk + 1} has layers built with delay_wgrad_compute="
                             f"True, whose weight gradients need an _order entry {-(chunk + 1) - 0.5} after each of "
                             f"its backward passes ({done[WGRAD][chunk]} of {n_microbatches} given)")
    return Schedule(tuple(callable_of), tuple(steps), True)


def shared_samples(schedule: Schedule, keys: Sequence[object]) -> List[int]:
    """For `_reuse_graph_input_output_buffers`: per sample, the sample whose input tensors its
    graphs take. A forward pass takes over the inputs of an earlier sample with the same key
    (shapes, dtypes and layouts of its tensors) whose backward pass has already run, so two
    graphs share input buffers only where their passes never overlap in the schedule."""
    source = list(range(len(keys)))
    free: Dict[object, List[int]] = {}  # key -> samples whose backward has run
    for kind, sample in schedule.steps:
        if kind == FORWARD:
            if free.get(keys[sample]):
                source[sample] = source[free[keys[sample]].pop(0)]
        elif kind == BACKWARD:
            free.setdefault(keys[sample], []).append(sample)
    return source


HookPoint = str
HOOK_POINTS = ("forward_pre_hooks", "forward_hooks", "backward_pre_hooks", "backward_hooks")
# the hook points around each pass (a weight-gradient pass has none, as in Transformer Engine)
HOOKS_OF = {FORWARD: ("forward_pre_hooks", "forward_hooks"), BACKWARD: ("backward_pre_hooks", "backward_hooks")}


def capture_time_hooks(hooks, n_modules: int) -> Optional[List[Dict[str, Dict[object, Callable]]]]:
    """Transformer Engine's capture_time_hooks checked: None, or one entry per module, each None
    or a dict from hook points (HOOK_POINTS) to {name: hook(module)} dicts."""
    if hooks is None:
        return None
    if not isinstance(hooks, (list, tuple)) or len(hooks) != n_modules:
        raise ValueError(f"make_graphed_callables: capture_time_hooks must be a list with one entry per module "
                         f"({n_modules}), each None or a dict of hooks, got {hooks!r}")
    checked = []
    for i, entry in enumerate(hooks):
        entry = {} if entry is None else entry
        if not isinstance(entry, dict) or set(entry) - set(HOOK_POINTS):
            raise ValueError(f"make_graphed_callables: capture_time_hooks[{i}] must be a dict with keys among "
                             f"{', '.join(HOOK_POINTS)}, got {entry!r}")
        for point, named in entry.items():
            if not isinstance(named, dict) or not all(callable(h) for h in named.values()):
                raise TypeError(f"make_graphed_callables: capture_time_hooks[{i}][{point!r}] must be a dict of "
                                f"{{name: hook(module)}}, got {named!r}")
        checked.append({point: dict(entry.get(point, {})) for point in HOOK_POINTS})
    return checked


def run_hooks(hooks: Optional[List[Dict[str, Dict[object, Callable]]]], module_index: int, point: HookPoint,
              module) -> None:
    """The capture-time hooks of one module at one point, outside any capture: called with the
    module, each must return None (as in Transformer Engine, where a value is an error)."""
    if hooks is None:
        return
    for name, hook in hooks[module_index][point].items():
        if hook(module) is not None:
            raise RuntimeError(f"make_graphed_callables: capture_time_hooks {point} {name!r} returned a value; "
                               "capture-time hooks must return None")
