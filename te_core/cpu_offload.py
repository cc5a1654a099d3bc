"""Transformer Engine's CPU offloading of activations: `get_cpu_offload_context`.

A model's layers run their forwards inside the returned context, and each layer's output goes
through the returned synchronization function:

    context, sync = te.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4)
    for layer in layers:
        with context:
            x = layer(x)
        x = sync(x)

Inside the context every tensor autograd saves for the backward passes through saved-tensor
hooks (any module's, not only te-core's). With the default schedule the first `num_layers`
layers are offloaded: layer i's tensors start copying to pinned host memory when layer i + 1
begins, their device memory is released when layer model_layers - num_layers + i begins, and
their copy back starts when the backward reaches layer model_layers - 1 - num_layers + i; so
with layers of equal footprint T the saved activations peak at (model_layers - num_layers) x T,
as in Transformer Engine. With manual_synchronization=True the caller decides per layer
(start_offload_layer, release_activation_forward_gpu_memory, start_reload_layer on the returned
controller). Offloaded: tensors of at least 256Ki elements on an accelerator, not parameters,
not marked by `mark_not_offload`; a quantized tensor's data tensors are copied one by one.

The copies run on a stream of their own and are ordered with the compute stream by events, so
they overlap the layers' compute; the results are those of a run without offloading, bit for bit.
"""
from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from typing import Dict, List, Optional

import torch
from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks

from ._offload_layer import BASE_OFFLOADED, NOT_OFFLOADED, READY_EVENT, LayerOffload, Runtime
from .quantization.tensor import QuantizedTensor

__all__ = ["get_cpu_offload_context", "mark_not_offload", "start_offload", "is_cpu_offload_enabled",
           "mark_activation_offload", "OffloadSynchronizer", "DefaultOffloadSynchronizer", "ManualOffloadSynchronizer"]

_RUNTIME = Runtime()
_ACTIVE: List[Optional["OffloadSynchronizer"]] = [None]  # the synchronizer of the offload context entered now


def is_cpu_offload_enabled() -> bool:
    """Whether a forward runs inside an enabled offload context now (Transformer Engine's query:
    its modules ask it to decide what to mark for offloading)."""
    return _ACTIVE[0] is not None


def mark_activation_offload(*tensors: Optional[Tensor]) -> None:
    """Nothing to do: every tensor saved inside the context is offloaded unless marked by
    mark_not_offload, as in Transformer Engine's current offloading (where this marking only
    served its older, NVTE_CPU_OFFLOAD_V1 path)."""


def _data_tensors(tensors):
    """The tensors given, each quantized one followed by its data tensors."""
    for t in tensors:
        if isinstance(t, QuantizedTensor):
            yield t
            yield from (v for v in t._payload().values() if isinstance(v, Tensor))
        elif isinstance(t, Tensor):
            yield t


def mark_not_offload(*tensors: Optional[Tensor]) -> None:
    """Keep these tensors on the device when they are saved inside an offload context."""
    for t in _data_tensors(tensors):
        setattr(t, NOT_OFFLOADED, True)


def start_offload(*tensors: Optional[Tensor], offload_base_tensor: bool = False) -> None:
    """Mark the point on the compute stream where these tensors are final: their copies to the
    host may start from here rather than from where they are saved. With offload_base_tensor=True
    a view's base is copied instead and the view rebuilt from it (views of one buffer, as q, k and
    v of an interleaved projection, then cost one copy)."""
    for t in _data_tensors(tensors):
        if isinstance(t, QuantizedTensor) or not _RUNTIME.offloads(t):
            continue
        module = _RUNTIME.module(t.device)
        event = module.Event()
        event.record(module.current_stream(t.device))
        setattr(t, READY_EVENT, event)
        if offload_base_tensor and t._base is not None:
            setattr(t, BASE_OFFLOADED, True)


class OffloadSynchronizer:
    """Which layer's forward or backward runs, and each layer's saved tensors (LayerOffload).
    `fwd_step` runs when a layer's forward begins (the layer count wraps after `num_layers`,
    where a new iteration drops what the last one kept), `bwd_step(layer)` when the backward
    reaches a layer's output, `finish_part_of_bwd` when a backward pass ends."""

    def __init__(self, num_layers: int, retain_pinned_cpu_buffers: bool = False, offload_stream=None, *,
                 runtime: Optional[Runtime] = None):
        self.num_layers = num_layers
        self._runtime = runtime or _RUNTIME
        self._given_stream = offload_stream
        self._streams: Dict[tuple, object] = {}
        self.layer_states = {i: LayerOffload(self._runtime, self._stream_of, retain_pinned_cpu_buffers)
                             for i in range(num_layers)}
        self.num_of_fwds: Optional[int] = None
        self.previous_bwd_layer_id: Optional[int] = None
        self.current_layer_id: Optional[int] = None

    def _stream_of(self, device: torch.device):
        if self._given_stream is not None:
            return self._given_stream
        key = (device.type, device.index)
        if key not in self._streams:
            self._streams[key] = self._runtime.module(device).Stream(device=device)
        return self._streams[key]

    def fwd_step(self) -> int:
        if self.num_of_fwds is None or self.num_of_fwds == self.num_layers - 1:
            for state in self.layer_states.values():
                state.reset()
            self.num_of_fwds = 0
        else:
            self.num_of_fwds += 1
        self.current_layer_id = self.num_of_fwds
        return self.current_layer_id

    def bwd_step(self, layer_num: int) -> None:
        if self.previous_bwd_layer_id is not None:
            self.layer_states[self.previous_bwd_layer_id].reset()
        self.previous_bwd_layer_id = self.current_layer_id = layer_num

    def finish_part_of_bwd(self) -> None:
        if self.previous_bwd_layer_id is not None:
            self.layer_states[self.previous_bwd_layer_id].reset()
        self.previous_bwd_layer_id = None

    def push_tensor(self, tensor: Tensor):
        return self.layer_states[self.num_of_fwds].push(tensor)

    def pop_tensor(self, handle) -> Tensor:
        return self.layer_states[self.current_layer_id].pop(handle)

    def get_offloaded_total_size_mb(self) -> float:
        """The host memory holding offloaded tensors, in MiB."""
        return sum(state.host_bytes() for state in self.layer_states.values()) / 2**20


class DefaultOffloadSynchronizer(OffloadSynchronizer):
    """The schedule of the module docstring: layers 0 .. num_offloaded_layers - 1 offloaded."""

    def __init__(self, num_layers: int, num_offloaded_layers: int, retain_pinned_cpu_buffers: bool = False,
                 offload_stream=None, *, runtime: Optional[Runtime] = None):
        super().__init__(num_layers, retain_pinned_cpu_buffers, offload_stream, runtime=runtime)
        self.offloaded = set(range(num_offloaded_layers))
        self.release_at: Dict[int, List[int]] = defaultdict(list)  # forward of layer -> layers to release
        self.reload_at: Dict[int, List[int]] = defaultdict(list)  # backward of layer -> layers to reload
        for layer in self.offloaded:
            self.release_at[num_layers - num_offloaded_layers + layer].append(layer)
            self.reload_at[num_layers - 1 - num_offloaded_layers + layer].append(layer)

    def fwd_step(self) -> int:
        layer = super().fwd_step()
        if layer - 1 in self.offloaded:
            self.layer_states[layer - 1].start_offload()
        for done in self.release_at[layer]:
            self.layer_states[done].release()
        return layer

    def bwd_step(self, layer_num: int) -> None:
        super().bwd_step(layer_num)
        for layer in self.reload_at[layer_num]:
            self.layer_states[layer].start_reload()

    def push_tensor(self, tensor: Tensor):
        if self.num_of_fwds not in self.offloaded:  # (no per-tensor work for the layers kept)
            return tensor
        return super().push_tensor(tensor)


class ManualOffloadSynchronizer(OffloadSynchronizer):
    """Offloading driven by the caller, layer by layer (pipeline schedules and the like)."""

    def start_offload_layer(self, layer_id: int) -> None:
        """Queue the copies of the layer's saved tensors to host memory."""
        self._layer(layer_id).start_offload()

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Free the layer's device copies once the copies to the host have run."""
        self._layer(layer_id).release()

    def start_reload_layer(self, layer_id: int) -> None:
        """Queue the copies back to the device; its backward waits for each tensor's copy."""
        self._layer(layer_id).start_reload()

    def _layer(self, layer_id: int) -> LayerOffload:
        if layer_id not in self.layer_states:
            raise ValueError(f"cpu offload: layer {layer_id} does not exist; layers are 0 .. {self.num_layers - 1} "
                             "(model_layers of get_cpu_offload_context)")
        return self.layer_states[layer_id]


class _OffloadContext(contextlib.ContextDecorator):
    """One layer's forward at a time: `with context:` around it, then sync(output)."""

    def __init__(self, synchronizer: OffloadSynchronizer):
        self.offload_synchronizer = synchronizer
        self.current_layer: Optional[int] = None
        self.inside_context = False
        self._hooks = None
        self._outer: Optional[OffloadSynchronizer] = None

    def __enter__(self):
        if self.inside_context:
            raise RuntimeError("cpu offload: the context was entered again before the synchronization function was "
                               "called on the previous layer's output; call sync(output) after each layer")
        self.inside_context = True
        self._hooks = saved_tensors_hooks(self.offload_synchronizer.push_tensor, self.offload_synchronizer.pop_tensor)
        self._hooks.__enter__()
        self._outer, _ACTIVE[0] = _ACTIVE[0], self.offload_synchronizer
        self.current_layer = self.offload_synchronizer.fwd_step()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        self._hooks = None
        _ACTIVE[0], self._outer = self._outer, None
        self.inside_context = False
        return False

    def synchronization_function(self, tensor: Tensor) -> Tensor:
        """The layer's output, unchanged; its backward tells the synchronizer which layer runs."""
        if self.inside_context:
            raise RuntimeError("cpu offload: the synchronization function was called inside the context; call it "
                               "on the layer's output after the `with` block")
        if self.current_layer is None:
            raise RuntimeError("cpu offload: the synchronization function was called before any layer ran inside "
                               "the context")
        if not isinstance(tensor, Tensor) or not tensor.requires_grad or tensor.grad_fn is None:
            raise ValueError("cpu offload: the synchronization function needs the layer's output, a tensor made by "
                             "autograd (requires_grad with a grad_fn) so that its backward can be followed; got "
                             f"{type(tensor).__name__} with requires_grad={getattr(tensor, 'requires_grad', None)}")
        synchronizer, layer = self.offload_synchronizer, self.current_layer

        def backward_reaches_layer(_grad_outputs):
            torch.autograd.Variable._execution_engine.queue_callback(synchronizer.finish_part_of_bwd)
            synchronizer.bwd_step(layer)

        tensor.grad_fn.register_prehook(backward_reaches_layer)
        return tensor


def _identity(tensor):
    return tensor


def get_cpu_offload_context(enabled: bool = False, num_layers: Optional[int] = 1, model_layers: int = 1,
                            offload_activations: bool = True, offload_weights: bool = False,
                            double_buffering: bool = False, manual_synchronization: bool = False,
                            retain_pinned_cpu_buffers: bool = False, offload_stream=None):
    """(context, synchronization function), and with manual_synchronization=True the controller
    (ManualOffloadSynchronizer) third, as Transformer Engine returns them (see the module
    docstring). `num_layers`: how many of the `model_layers` layers run inside the context are
    offloaded (the first ones). `offload_weights` (deprecated in Transformer Engine) and
    `double_buffering` change nothing. `retain_pinned_cpu_buffers`: keep the host buffers for the
    next iteration (the saved tensors must keep their shapes). `offload_stream`: the stream the
    copies run on (only with manual synchronization; else one is made per device)."""
    disabled = (contextlib.nullcontext(), _identity) + ((None,) if manual_synchronization else ())
    if not enabled:
        return disabled
    if not offload_activations and not offload_weights:
        raise ValueError("get_cpu_offload_context: enabled=True but neither offload_activations nor offload_weights "
                         "is set; pass offload_activations=True (the default)")
    if offload_weights:
        warnings.warn("get_cpu_offload_context: offload_weights is deprecated (as in Transformer Engine) and has no "
                      "effect", DeprecationWarning, stacklevel=2)
        if not offload_activations:
            return disabled
    if isinstance(model_layers, bool) or not isinstance(model_layers, int) or model_layers < 1:
        raise ValueError(f"get_cpu_offload_context: model_layers must be a positive int, got {model_layers!r}")
    if offload_stream is not None and not manual_synchronization:
        raise ValueError("get_cpu_offload_context: offload_stream can only be given with manual_synchronization=True")
    if manual_synchronization:
        synchronizer = ManualOffloadSynchronizer(model_layers, retain_pinned_cpu_buffers, offload_stream)
        context = _OffloadContext(synchronizer)
        return context, context.synchronization_function, synchronizer
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ValueError(f"get_cpu_offload_context: num_layers must be an int >= 0, got {num_layers!r}")
    if num_layers > model_layers - 1:
        raise ValueError(f"get_cpu_offload_context: num_layers={num_layers} of model_layers={model_layers}: without "
                         "manual synchronization the last layer is never offloaded (its backward comes first); "
                         f"offload at most {model_layers - 1} layers")
    if num_layers == model_layers - 1 and num_layers > 0:
        warnings.warn("get_cpu_offload_context: offloading model_layers - 1 layers leaves no layer to overlap the "
                      "last reload with; offload fewer for overlap", stacklevel=2)
    synchronizer = DefaultOffloadSynchronizer(model_layers, num_layers, retain_pinned_cpu_buffers)
    context = _OffloadContext(synchronizer)
    return context, context.synchronization_function
