"""The parts of Transformer Engine's FP8GlobalStateManager that control its process-global state
rather than query it: reset, the graph-capture and high-precision-init queries, and the calls
that drive TE's global amax buffers.

te-core keeps no global FP8 state: an autocast's settings live in its context object for as
long as it is entered, and amax histories and scales live on each module. So resetting is
nothing to do once no context is entered, and is an error inside one (TE's reset would switch
FP8 off mid-context, which a te-core context cannot do); calls that feed TE's global buffers
raise, naming what te-core does in their place.
"""
from __future__ import annotations

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
        """None, TE's value until set_skip_fp8_weight_update_tensor is called (which te-core refuses)."""
        return None

    @staticmethod
    def set_skip_fp8_weight_update_tensor(skip: bool) -> None:
        raise NotImplementedError(
            "FP8GlobalStateManager.set_skip_fp8_weight_update_tensor: te-core has no global flag for skipping "
            "FP8 weight casts. Pass is_first_microbatch to the modules' forward instead (True on a step's first "
            "micro-batch, False on the others, whose cached FP8 weights are reused), also inside "
            "te.make_graphed_callables")

    @staticmethod
    def reduce_and_update_fp8_tensors(forward: bool = True) -> None:
        raise NotImplementedError(f"FP8GlobalStateManager.reduce_and_update_fp8_tensors: {_SCALES_UPDATE_THEMSELVES}")
