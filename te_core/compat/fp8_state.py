"""The parts of Transformer Engine's FP8GlobalStateManager that control its process-global state
rather than query it: reset, the graph-capture and high-precision-init queries, and the calls
that drive TE's global amax buffers.

te-core keeps no global FP8 state: an autocast's settings live in its context object for as
long as it is entered, and amax histories and scales live on each module. So resetting is
nothing to do once no context is entered, and is an error inside one (TE's reset would switch
FP8 off mid-context, which a te-core context cannot do).

Code that replays graphs it captured itself (Megatron-LM's `cuda_graph_impl=local`) runs no
module Python on a replay, so it tells the scale updates which modules ran, through TE's calls:
add_fp8_tensors_to_global_buffer(module.fp8_meta) at each forward replay schedules the module's
forward groups on the active te.autocast (updated at its outermost exit, as an eager forward's)
and marks its backward groups; reduce_and_update_fp8_tensors(forward=False) after a backward
replay queues the marked groups' update for the end of that backward pass (one update per group
and pass, as eager te-core and TE's own eager modules do, where TE updates every registered
module at each call). set_skip_fp8_weight_update_tensor sets the device flag its captured graphs
read to keep or refresh the cached FP8 weights (te_core.quantization.weight_refresh).
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

_SCALES_UPDATE_THEMSELVES = (
    "te-core updates delayed scales itself, at the exit of the outermost te.autocast (forward) and at the "
    "end of each backward pass (backward), reducing amaxes over the autocast's amax_reduction_group; there "
    "are no global amax buffers to reduce by hand. Drop this call"
)


class GlobalStateControls:
    """Mixed into the stand-in FP8GlobalStateManager (te_core.compat.transformer_engine)."""

    @staticmethod
    def reset() -> None:
        """Nothing to reset outside te.autocast and te.quantized_model_init (te-core's state lives
        in their contexts and on the modules, as TE's per-module scales do); inside one, an error."""
        from ..quantization.autocast import get_autocast_context, model_init_recipe

        active = [name for name, on in (("te.autocast", get_autocast_context() is not None),
                                        ("te.quantized_model_init", model_init_recipe() is not None)) if on]
        if active:
            raise RuntimeError(
                f"FP8GlobalStateManager.reset() inside {' and '.join(active)}: te-core keeps FP8 settings in the "
                "entered context, which a reset cannot end; call reset() after the with-block exits (there it "
                "has nothing to do), or use te.autocast(enabled=False) for a region without FP8")

    @staticmethod
    def with_high_precision_init_val() -> bool:
        """Whether the innermost te.quantized_model_init keeps each weight's value from before
        quantization (preserve_high_precision_init_val=True)."""
        from ..quantization.autocast import model_init_preserves_high_precision, model_init_recipe

        return model_init_recipe() is not None and model_init_preserves_high_precision()

    @staticmethod
    def fp8_graph_capturing() -> bool:
        """Whether te.make_graphed_callables is capturing, or the selected backend's device
        module says its current stream is capturing a graph."""
        from ..backend import get_backend
        from ..quantization.scaling import graph_capture_active

        if torch.compiler.is_compiling():  # as in TE: torch.compile traces no capture
            return False
        if graph_capture_active():
            return True
        query = getattr(get_backend().device_module, "is_current_stream_capturing", None)
        return bool(query()) if callable(query) else False

    @staticmethod
    def get_skip_fp8_weight_update_tensor() -> Optional[torch.Tensor]:
        """The (1,) float32 flag set_skip_fp8_weight_update_tensor fills, None before its first call."""
        from ..quantization.weight_refresh import skip_weight_refresh_flag

        return skip_weight_refresh_flag()

    @staticmethod
    def set_skip_fp8_weight_update_tensor(skip: bool) -> None:
        """Fill the flag that graphs captured while it is set (between set_capture_start and
        set_capture_end) read at each replay: 1 keeps each module's cached FP8 weight, 0 casts it
        afresh into the cache. Made on the selected backend's device at the first call, then kept
        at that address. Outside such graphs te-core's modules follow is_first_microbatch."""
        from ..backend import get_backend
        from ..quantization.weight_refresh import set_skip_weight_refresh

        set_skip_weight_refresh(skip, get_backend().device)

    @staticmethod
    def add_fp8_tensors_to_global_buffer(fp8_meta) -> None:
        """For a module whose graph was just replayed: its forward delayed-scaling groups update at
        the exit of the outermost te.autocast, and its backward groups at the end of the backward
        pass in which reduce_and_update_fp8_tensors(forward=False) is next called. Nothing to do for
        a module without delayed-scaling state (other recipes, high precision), as in TE."""
        from .._graph_replay import scaling_groups
        from ..modules._te_base import FP8MetaView
        from ..quantization.autocast import get_autocast_context

        if not isinstance(fp8_meta, FP8MetaView):
            raise TypeError("FP8GlobalStateManager.add_fp8_tensors_to_global_buffer takes a te-core module's "
                            f"fp8_meta (module.fp8_meta), got {type(fp8_meta).__name__}")
        forward, backward = scaling_groups(fp8_meta.module)
        if not forward and not backward:
            return
        context = get_autocast_context()
        if context is None or not (context.enabled or context.calibrating):
            raise RuntimeError(
                "FP8GlobalStateManager.add_fp8_tensors_to_global_buffer outside te.autocast: te-core updates "
                "forward scales when the outermost te.autocast exits, so call it inside the autocast the graph's "
                f"forward runs under ({type(fp8_meta.module).__name__} holds delayed-scaling state)")
        for group in forward:
            context.schedule_forward_update(group)
        with _MARKED_LOCK:
            for group in backward:
                _MARKED_BACKWARD.setdefault(id(group), (group, context.amax_reduction_group))

    @staticmethod
    def reduce_and_update_fp8_tensors(forward: bool = True) -> None:
        """forward=False: the backward groups marked by add_fp8_tensors_to_global_buffer update
        (amaxes all-reduced over their autocast's amax_reduction_group) at the end of the running
        backward pass, or now outside one. forward=True is refused: forward updates run themselves
        at the outermost te.autocast exit."""
        from ..quantization.scaling import schedule_backward_update, update_now

        if forward:
            raise NotImplementedError(
                f"FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=True): {_SCALES_UPDATE_THEMSELVES}")
        with _MARKED_LOCK:
            entries = list(_MARKED_BACKWARD.values())
            _MARKED_BACKWARD.clear()
        if torch._C._current_graph_task_id() == -1:
            update_now(entries)
            return
        for group, process_group in entries:
            schedule_backward_update(group, process_group)


# the backward groups of replayed graphs awaiting their update (id -> (group, amax reduction
# group)): emptied by every reduce_and_update_fp8_tensors(forward=False)
_MARKED_BACKWARD: dict = {}
_MARKED_LOCK = threading.Lock()
