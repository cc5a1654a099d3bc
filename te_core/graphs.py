"""make_graphed_callables: capture te_core modules' forward and backward as device graphs
(Transformer Engine's te.make_graphed_callables), so a step costs one graph launch per direction
instead of dozens of kernel launches: what small layers need, whose steps are host-bound.

Capture uses the device's own graph API (`torch.<device type>`'s graph type, capture context and
memory pools) through te-core's capture loop (te_core._graph_capture), in the order
te_core._graph_order gives (Transformer Engine's pipeline schedules included), so there is no
vendor code here; what a replay does around its graphs is te_core._graph_replay's. Delayed
scaling works because its state lives in fixed
device buffers: inside the graphs, casts read the live scales and max their amaxes into the live
histories, and scale_inv is recomputed from the scale on every replay. The scale updates themselves
are not captured: after each replay the graphed callable schedules them like an eager step does
(forward groups at the exit of the enclosing te_core.autocast, backward groups at the end of the
backward pass). Keyword arguments of the captured call (sample_kwargs) are flattened into
extra positional graph inputs (te_core._graph_inputs).

Weight caching (cache_quantized_params=True) captures each module twice: as a first microbatch,
whose graph quantizes the weights into the modules' weight caches (buffers at fixed addresses),
and as a later microbatch, whose graph reads those buffers back. A call replays one of the two
per its is_first_microbatch. Capture needs no device-side flag this way, at the price of a second
pair of graphs (and their activation memory).
"""
from __future__ import annotations

import contextlib
import functools
import gc
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._graph_capture import DeviceGraphs, make_graphed
from ._graph_inputs import InputSignature, KeywordInputs, keyword_inputs
from ._graph_options import GraphOptions, graph_options
from ._graph_order import FORWARD, Schedule, default_schedule, pipeline_schedule, run_hooks, shared_samples
from ._graph_replay import graphed_forward, scaling_groups
from ._graph_warmup import check_iterations, warm_up
from .distributed.random import rng_states_kept
from .modules._delayed_wgrad import DelayedWgradMixin
from .modules._microbatch import forced_first_microbatch
from .quantization.autocast import autocast
from .quantization.scaling import graph_capture


def _graph_api(device: torch.device):
    """The capture for the device (te_core._graph_capture, make_graphed_callables' signature), or
    None where its torch module has no graphs."""
    graphs = DeviceGraphs.of(device.type)
    return None if graphs is None else functools.partial(make_graphed, graphs)


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's cyclic garbage collector paused while graphs are captured. A graphed module is a
    reference cycle (its forward holds it), so one that is replaced or dropped is freed by a
    collection; if that collection runs in the middle of another capture, freeing the old graphs
    and their memory invalidates the capture. Transformer Engine pauses it for the same reason."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _save_scaling_state(module: nn.Module) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    forward, backward = scaling_groups(module)
    return {id(g): (g.amax_history.clone(), g.scale.clone()) for g in forward + backward}


def _restore_scaling_state(module: nn.Module, saved: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Undo what warm-up and capture did to the scaling state (their backward passes run on
    uninitialized gradients), in place: the graphs keep pointing at these buffers. State the
    warm-up created starts from zero history and unit scale, and no cast of a graph takes its
    first scale from its own amax (a replay runs no Python to choose): a graphed module starts
    from scale 1 as Transformer Engine's does (see QuantizationStep.first_scale)."""
    forward, backward = scaling_groups(module)
    with torch.no_grad():
        for group in forward + backward:
            group.settle()
            history, scale = saved.get(id(group), (None, None))
            if history is None:
                group.amax_history.zero_()
                group.scale.fill_(1.0)
            else:
                group.amax_history.copy_(history)
                group.scale.copy_(scale)


class _Variant(nn.Module):
    """What one graph captures: `module`'s own forward, with FP8 on or off, and (with weight
    caching) every te_core module inside told whether this is a step's first microbatch."""

    def __init__(self, module: nn.Module, forward, enabled: bool, options: GraphOptions, first: Optional[bool],
                 n_args: int, keywords: KeywordInputs):
        super().__init__()
        self.module = module  # registered: its parameters are the graph's inputs
        self.training = module.training  # (not .train(), which would recurse into the module)
        self._module_forward = forward  # the module's own: its forward attribute becomes the replay
        self._enabled, self._options, self._first = enabled, options, first
        self._n_args, self._keywords = n_args, keywords  # the inputs after n_args are keyword tensors

    def forward(self, *inputs):
        options, n = self._options, self._n_args
        kwargs = self._keywords.rebuild(inputs[n:])
        with autocast(enabled=self._enabled, calibrating=options.calibrating, recipe=options.recipe,
                      amax_reduction_group=options.amax_reduction_group):
            with forced_first_microbatch(self._first):
                return self._module_forward(*inputs[:n], **kwargs)


def _eager_forward(module: nn.Module):
    """The module's own forward, also where an earlier make_graphed_callables replaced it with
    its replay: capturing a graphed module again (for another recipe, or other shapes) captures
    the module, not the old replay, which would refuse the new recipe or sizes."""
    return getattr(module.forward, "te_eager_forward", module.forward)


def _checked_inputs(modules, sample_args) -> Tuple[Sequence[nn.Module], Sequence[tuple]]:
    """(modules, their sample args: one tuple per call captured), or a clear error."""
    single = not isinstance(modules, (tuple, list))
    mods: Sequence = (modules,) if single else tuple(modules)
    # tuple() of a bare tensor would split it into its rows, one positional input each
    _check_tuple(sample_args, "sample_args", _ONE_CALL if single else
                 "a tuple with one tuple of tensors per module or sample (e.g. ((x,), (y,)))")
    for i, sample in enumerate(() if single else sample_args):
        _check_tuple(sample, f"sample_args[{i}]", _ONE_CALL)
    args: Sequence = (tuple(sample_args),) if single else tuple(tuple(a) for a in sample_args)
    for module in mods:
        if not isinstance(module, nn.Module):
            raise TypeError(f"make_graphed_callables takes torch.nn.Module objects, got {type(module).__name__}")
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            raise RuntimeError(f"make_graphed_callables: {type(module).__name__} has hooks registered; a replay would "
                               "skip them. Register hooks after make_graphed_callables, as with torch's (hooks that "
                               "must run while capturing go in capture_time_hooks)")
        trainable = [name for name, buffer in module.named_buffers() if buffer.requires_grad]
        if trainable:
            raise RuntimeError(f"make_graphed_callables: {type(module).__name__} has buffers that require grad "
                               f"({', '.join(trainable)}); a replay gives buffers no gradient, so only parameters "
                               "may be trainable (as in torch's and Transformer Engine's): make them parameters")
    for sample in args:
        if not sample or not all(isinstance(a, torch.Tensor) for a in sample):
            raise TypeError("make_graphed_callables: sample_args must be tensors (the positional inputs of one call)")
    _check_torch_autocast(args[0][0].device.type)
    return mods, args


_ONE_CALL = "a tuple of tensors, the positional inputs of one call (e.g. (x,))"


def _check_tuple(sample, where: str, what: str) -> None:
    if not isinstance(sample, (tuple, list)):
        got = "a bare tensor" if isinstance(sample, torch.Tensor) else type(sample).__name__
        raise TypeError(f"make_graphed_callables: {where} must be {what}, got {got}")


def _check_torch_autocast(device_type: str) -> None:
    """torch.autocast with its cast cache on would capture casts cached before the capture (as
    torch's and Transformer Engine's make_graphed_callables refuse it)."""
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # a torch whose is_autocast_enabled takes no device type (CUDA's)
        enabled = torch.is_autocast_enabled()
    except RuntimeError:  # a device type autocast does not know: no autocast to be on
        return
    if enabled and torch.is_autocast_cache_enabled():
        raise RuntimeError("make_graphed_callables: torch.autocast is on with its cast cache, which a capture cannot "
                           "take; capture under torch.autocast(..., cache_enabled=False)")


def _delaying(module: nn.Module) -> List[nn.Module]:
    """The modules inside `module` built with delay_wgrad_compute=True (their backward leaves the
    weight gradients for backward_dw, which gets graphs of its own)."""
    return [m for m in module.modules() if isinstance(m, DelayedWgradMixin) and m.need_backward_dw()]


def _schedule(options: GraphOptions, mods, args, delays) -> Schedule:
    if options.order is None:
        if len(args) != len(mods):
            raise ValueError(f"make_graphed_callables: {len(mods)} modules but {len(args)} sets of sample_args")
        return default_schedule(len(mods), delays)
    return pipeline_schedule(options.order, options.layers_per_chunk, len(mods), len(args), delays)


def _check_devices(mods, args, schedule: Schedule) -> None:
    for sample, index in zip(args, schedule.callable_of):
        module = mods[index]
        for param in module.parameters():
            if param.device != sample[0].device:
                raise ValueError(f"make_graphed_callables: {type(module).__name__} has a parameter on {param.device} "
                                 f"but its sample input is on {sample[0].device}; move one of them")


def _share_inputs(args, keywords, schedule: Schedule):
    """_reuse_graph_input_output_buffers: samples whose passes never overlap in the schedule
    take the same input tensors (te_core._graph_order.shared_samples)."""
    def key(sample, kw):
        return (tuple((t.shape, t.dtype, t.layout, t.device, t.requires_grad) for t in (*sample, *kw.tensors)),
                kw.keys, repr(kw.constants))

    source = shared_samples(schedule, [key(a, kw) for a, kw in zip(args, keywords)])
    return [args[i] for i in source], [keywords[i] for i in source]


def _variant_steps(steps, copies: int):
    """The schedule's steps over the variants: each sample's `copies` variants (weight caching's
    first and later microbatch), forwards in order, backwards (and weight gradients) in reverse."""
    for kind, sample in steps:
        variants = range(sample * copies, (sample + 1) * copies)
        yield from ((kind, v) for v in (variants if kind == FORWARD else reversed(variants)))


# Transformer Engine's parameters after sample_kwargs, in its order, with its defaults: TE code
# may pass any of them positionally
_TE_POSITIONAL = (("fp8_enabled", None), ("fp8_calibrating", None), ("fp8_recipe", None), ("fp8_group", None),
                  ("fp8_weight_caching", None), ("enabled", None), ("calibrating", None), ("recipe", None),
                  ("amax_reduction_group", None), ("cache_quantized_params", None), ("_order", None),
                  ("_num_layers_per_chunk", None), ("pool", None), ("retain_graph_in_backward", False),
                  ("_reuse_graph_input_output_buffers", False), ("clone_param_grads_on_return", True),
                  ("pre_warmup_hook", None), ("post_warmup_hook", None), ("capture_time_hooks", None))


def _positional_arguments(positional: tuple, named: dict) -> dict:
    """`named` (the keyword arguments) with TE's parameters given positionally added by name; a
    value left at TE's default adds nothing (so a positional None never counts as a deprecated
    fp8_* name given)."""
    if len(positional) > len(_TE_POSITIONAL):
        raise TypeError(f"make_graphed_callables takes at most {5 + len(_TE_POSITIONAL)} positional arguments "
                        f"(Transformer Engine's), got {5 + len(positional)}")
    named = dict(named)
    for (name, default), value in zip(_TE_POSITIONAL, positional):
        if named.get(name) is not None:
            raise TypeError(f"make_graphed_callables got multiple values for argument {name!r}")
        if value is not default:
            named[name] = value
    return named


def make_graphed_callables(
    modules,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs=None,
    *positional,
    enabled=None,
    recipe=None,
    amax_reduction_group=None,
    cache_quantized_params: Optional[bool] = None,
    **te_arguments,
):
    """Capture each module's forward and backward as graphs; returns the module(s) with forward
    replaced by the replay (as torch's own make_graphed_callables does), in TE's signature
    (TE's older fp8_enabled, fp8_recipe, fp8_group and fp8_weight_caching names work too, and every
    argument may be given positionally in TE's order).

    `modules` is one nn.Module (a whole model works: all its layers land in one graph per
    direction) or a tuple of them called in that order; `sample_args` the positional inputs of
    one call (a tuple per module), `sample_kwargs` its keyword arguments (a dict, or one per
    module): their tensors become graph inputs, their other values are baked in. Replays must
    get tensors of the same shapes, dtypes and devices (an input requiring grad needs a sample that
    did) and the same keywords, and run each call's backward before the module's next forward;
    errors say where a call does not. `enabled`
    (one bool, or one per module): the graphs bake in FP8 per `recipe`
    (default DelayedScaling()), and every call must then run under an enabled te_core.autocast
    with that recipe; the scales keep updating. cache_quantized_params=True captures each module
    twice, as a first microbatch (weights quantized into the weight cache) and as a later one
    (the cache read back); each call then passes is_first_microbatch=True or False. `pool`: a
    graph memory pool handle shared with other graphs, which must then be replayed in the order
    they were captured. `clone_param_grads_on_return` (default True as in TE): a replay's
    parameter gradients reach autograd as copies; False hands over the graph's own buffers (one
    copy less per parameter and step), which the next replay overwrites: only for loops that
    consume `.grad` before then, or that allocate `.grad` beforehand (autograd then adds into it). `num_warmup_iters` warm-up steps run real forward and backward passes, as
    in TE: on a side stream, every forward in order, then every backward in reverse order, after
    `pre_warmup_hook()` and before `post_warmup_hook()` (as in TE); the scaling state is
    put back as it was afterwards. TE's `retain_graph_in_backward` and `capture_time_hooks` (per
    module, hooks run around each warm-up and captured pass, outside the capture) work as in TE.
    With TE's `_order` (and `_num_layers_per_chunk`, `_reuse_graph_input_output_buffers`) the
    modules are a pipeline stage's layers and `sample_args` holds one sample per chunk, microbatch
    and layer: each sample gets graphs of its own, captured in the schedule's order, and a tuple
    of one callable per sample comes back (te_core._graph_order; docs/graphs.md).
    """
    mods, args = _checked_inputs(modules, sample_args)
    iterations = check_iterations(num_warmup_iters)
    options = graph_options(len(mods), _positional_arguments(positional, te_arguments | dict(
        enabled=enabled, recipe=recipe, amax_reduction_group=amax_reduction_group,
        cache_quantized_params=cache_quantized_params)))
    delaying = [_delaying(module) for module in mods]
    schedule = _schedule(options, mods, args, [bool(d) for d in delaying])
    _check_devices(mods, args, schedule)
    owner = schedule.callable_of  # per sample, its module
    keywords = keyword_inputs(sample_kwargs, len(args), [type(mods[m]).__name__ for m in owner])
    device = args[0][0].device
    graph_api = _graph_api(device)
    if graph_api is None:
        raise NotImplementedError(f"make_graphed_callables: torch has no graph capture for device type "
                                  f"{device.type!r}; run the modules eagerly")
    if options.reuse_buffers:
        args, keywords = _share_inputs(args, keywords, schedule)
    flags = (True, False) if options.cache_quantized_params else (None,)
    eager_forwards = [_eager_forward(module) for module in mods]
    variants = [_Variant(mods[m], eager_forwards[m], options.enabled[m], options, flag, len(a), kw)
                for m, a, kw in zip(owner, args, keywords) for flag in flags]
    inputs = tuple(a + kw.tensors for a, kw in zip(args, keywords) for _ in flags)
    steps = tuple(_variant_steps(schedule.steps, len(flags)))

    def hook(point, variant):
        module_index = owner[variant // len(flags)]
        run_hooks(options.capture_time_hooks, module_index, point, mods[module_index])

    def warm_up_wgrad(variant):  # the deferred work done and dropped (its output gradients were uninitialized)
        for module in delaying[owner[variant // len(flags)]]:
            module.pending_weight_grads()

    def capture_wgrad(variant):
        return [pair for module in delaying[owner[variant // len(flags)]] for pair in module.pending_weight_grads()]

    # (only what a call asks for: a capture of another signature, a test's, then serves the rest)
    extras = {name: value for name, value in (
        ("pool", options.pool), ("steps", steps if schedule.pipelined or any(delaying) else None),
        ("retain_graph", options.retain_graph), ("hook", hook if options.capture_time_hooks else None),
        ("share_grad_outputs", options.reuse_buffers), ("wgrad", capture_wgrad if any(delaying) else None))
        if value is not None and value is not False}
    saved = [_save_scaling_state(module) for module in mods]
    with autocast(enabled=any(options.enabled), calibrating=options.calibrating, recipe=options.recipe,
                  amax_reduction_group=options.amax_reduction_group), graph_capture(), rng_states_kept():
        warm_up(device, variants, inputs, iterations, allow_unused_input, options.pre_warmup_hook,
                options.post_warmup_hook, steps=steps, hook=hook if options.capture_time_hooks else None,
                wgrad=warm_up_wgrad)
        with _no_garbage_collection():
            graphed = graph_api(tuple(variants), inputs, num_warmup_iters=0, allow_unused_input=allow_unused_input,
                                **extras)
    for module, before in zip(mods, saved):
        _restore_scaling_state(module, before)
        for group in sum(scaling_groups(module), []):
            group.captured = True  # the graphs take their own scale_inv: updates skip the snapshot
    replays = iter(graphed)
    forwards = [graphed_forward(mods[m], eager_forwards[m], {flag: next(replays) for flag in flags}, options.enabled[m],
                                 options, kw, InputSignature((*a, *kw.tensors), type(mods[m]).__name__), delaying[m])
                for m, a, kw in zip(owner, args, keywords)]
    if schedule.pipelined:  # one callable per sample, the modules left as they were (Transformer Engine's)
        return tuple(forwards)
    for module, forward, delays in zip(mods, forwards, delaying):
        module.forward = forward
        if delays:  # (as Transformer Engine's: the module's backward_dw now replays)
            module.backward_dw = forward.backward_dw
        if "reset" in vars(module) or not hasattr(module, "reset"):  # (never over a method of the module's own)
            module.reset = forward.reset
    return mods if isinstance(modules, (tuple, list)) else mods[0]
