"""One layer's activations on their way to host memory and back (te.get_cpu_offload_context).

A layer's saved tensors pass through `push` while its forward runs (autograd's pack hook) and
come back through `pop` when its backward reads them (the unpack hook). Between the two a layer
goes through four states:

    kept       its tensors are held as they are (the device memory stays in use)
    offloading copies to pinned host memory are queued on the offload stream
    offloaded  the compute stream has waited for those copies and the device tensors are dropped:
               their memory is free for the rest of the forward and the backward
    reloading  copies back to fresh device tensors are queued on the offload stream; `pop` makes
               the compute stream wait for a tensor's copy before the backward reads it

Each copy to the host waits for the event recorded when its tensor was saved (or marked ready
by `start_offload`), so a copy starts as soon as its tensor is computed, not at the end of the
layer. Device memory is never released before its copy has run: the compute stream waits for the
offload stream's event first, and the caching allocator orders any reuse after that wait.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, NamedTuple, Optional

import torch
from torch import Tensor

from .quantization.roles import Role
from .quantization.tensor import QuantizedTensor

MIN_NUMEL = 256 * 1024  # smaller tensors are kept: their copies would cost more than they free
KEPT, OFFLOADING, OFFLOADED, RELOADING = "kept", "offloading", "offloaded", "reloading"
NOT_OFFLOADED = "_TE_do_not_offload"  # the attribute Transformer Engine's mark_not_offload sets
READY_EVENT = "start_reload_event"  # likewise start_offload's (TE's name for the event)
BASE_OFFLOADED = "offload_base_tensor"


class Runtime:
    """Where tensors live and how they are copied: the accelerator's streams and events through
    torch's device module for the tensor's device (torch.get_device_module), and pinned host
    buffers. Tests substitute one that treats CPU tensors as device tensors."""

    def offloads(self, t: Tensor) -> bool:
        return t.device.type != "cpu"

    def module(self, device: torch.device):
        return torch.get_device_module(device)

    def host_buffer(self, t: Tensor) -> Tensor:
        """A pinned host tensor laid out as t (its strides), so that the copy is one block."""
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=True)


def _fills_storage(t: Tensor) -> bool:
    """Whether t's elements are exactly its storage's bytes, in whatever order (a copy with the
    same strides is then one block copy)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


class _View(NamedTuple):
    """A saved view rebuilt from the copy of its base (see LayerOffload.push)."""

    base: int
    size: tuple
    stride: tuple
    offset: int


class _Quantized(NamedTuple):
    """A saved quantized tensor: its wrapper without data, and the handle of each data tensor."""

    shell: QuantizedTensor
    handles: Dict[str, Any]


class LayerOffload:
    """The saved tensors of one layer and their copies (see the module docstring)."""

    def __init__(self, runtime: Runtime, stream_of, retain_host_buffers: bool):
        self._runtime = runtime
        self._stream_of = stream_of  # device -> the offload stream on it
        self._retain = retain_host_buffers
        self.state = KEPT
        self._saved: List[Tensor] = []  # pushed tensors to offload, by handle (an int)
        self._ready: List[Any] = []  # the event after which each can be copied
        self._index: Dict[int, int] = {}  # id(tensor) -> handle: a tensor saved twice is copied once
        self._host: List[Tensor] = []
        self._back: List[Tensor] = []  # reloaded device tensors, by handle
        self._back_events: List[Any] = []
        self._done = None  # the offload stream's event after the last copy to the host
        self._device: Optional[torch.device] = None
        self._copies = 0  # tensors copied to the host this iteration

    # --- pack and unpack
    def push(self, t: Tensor):
        """What autograd keeps for t: t itself, or a handle to its copy."""
        if self.state != KEPT:
            raise RuntimeError(f"cpu offload: a tensor was saved for backward into a layer whose offload has "
                               f"started (state {self.state!r}); enter the offload context for each layer's forward "
                               "and call the synchronization function on its output before the next layer")
        if isinstance(t, QuantizedTensor):
            # A weight's FP8 copy stays, as Transformer Engine keeps it: it is often cached across
            # microbatches or a primary FP8 weight itself, whose copy would free nothing.
            if (getattr(t, NOT_OFFLOADED, False) or isinstance(t, torch.nn.Parameter)
                    or getattr(t._quantizer, "role", None) is Role.WEIGHT):
                return t
            shell = t._same_kind()
            handles = {}
            for name, value in t._payload().items():
                handles[name] = self.push(value) if isinstance(value, Tensor) else value
                setattr(shell, name, None)  # the shell must not keep the device data alive
            return _Quantized(shell, handles)
        if not self._offloadable(t):
            return t
        base = t._base
        # Copied as it is: a contiguous tensor, or one that fills its storage in another order (a
        # permuted output). A view of a whole storage otherwise (a transpose; q, k and v sliced from one
        # projection), or one marked by start_offload(offload_base_tensor=True), is rebuilt from its
        # copied base: the view keeps the base alive, so the base is what there is to free, and views of
        # one base share its copy.
        if base is not None and (getattr(t, BASE_OFFLOADED, False) or not (t.is_contiguous() or _fills_storage(t))):
            if _fills_storage(base) and self._offloadable(base):
                return _View(self._add(base, getattr(t, READY_EVENT, None)), tuple(t.shape), tuple(t.stride()),
                             t.storage_offset())
        if not (t.is_contiguous() or _fills_storage(t)):
            warnings.warn(f"cpu offload: a saved tensor {tuple(t.shape)} stride {tuple(t.stride())} that covers part "
                          "of a storage it does not fill stays on the device", stacklevel=3)
            return t
        return self._add(t, getattr(t, READY_EVENT, None))

    def _offloadable(self, t: Tensor) -> bool:
        return (t.numel() >= MIN_NUMEL and not isinstance(t, torch.nn.Parameter)
                and not getattr(t, NOT_OFFLOADED, False) and not isinstance(t, torch._subclasses.FakeTensor)
                and self._runtime.offloads(t))

    def _add(self, t: Tensor, ready) -> int:
        handle = self._index.get(id(t))
        if handle is not None:
            return handle
        if ready is None:
            module = self._runtime.module(t.device)
            ready = module.Event()
            ready.record(module.current_stream(t.device))
        self._index[id(t)] = handle = len(self._saved)
        self._saved.append(t)
        self._ready.append(ready)
        return handle

    def pop(self, handle) -> Tensor:
        if isinstance(handle, Tensor):
            return handle
        if isinstance(handle, _Quantized):
            twin = handle.shell._same_kind()
            for name, value in handle.handles.items():
                setattr(twin, name, None if value is None else self.pop(value))  # (a data tensor unset: None)
            return twin
        if isinstance(handle, _View):
            return self.pop(handle.base).as_strided(handle.size, handle.stride, handle.offset)
        if self.state in (KEPT, OFFLOADING):  # never released: the tensor itself
            return self._saved[handle]
        if self.state != RELOADING:
            raise RuntimeError("cpu offload: the backward reads a layer whose activations are still in host memory "
                               "(no reload was started); with manual_synchronization=True call "
                               "start_reload_layer(layer) before its backward")
        tensor = self._back[handle]
        module = self._runtime.module(tensor.device)
        module.current_stream(tensor.device).wait_event(self._back_events[handle])
        return tensor

    # --- the copies
    def start_offload(self) -> None:
        self._expect("start_offload", KEPT)
        self.state = OFFLOADING
        self._copies = len(self._saved)  # (retained buffers beyond these belong to no tensor this time)
        if not self._saved:
            return
        reuse = self._retain and len(self._host) == len(self._saved)
        if not reuse:
            self._host = []
        device = self._saved[0].device
        module, stream = self._runtime.module(device), self._stream_of(device)
        with module.stream(stream):
            for i, (t, ready) in enumerate(zip(self._saved, self._ready)):
                stream.wait_event(ready)
                if reuse:
                    host = self._host[i]
                    if host.shape != t.shape or host.stride() != t.stride() or host.dtype != t.dtype:
                        raise ValueError(
                            f"cpu offload: retain_pinned_cpu_buffers=True needs the same saved tensors every "
                            f"iteration, but a buffer of {tuple(host.shape)} {host.dtype} meets a tensor of "
                            f"{tuple(t.shape)} {t.dtype} (or other strides); keep shapes fixed or pass "
                            "retain_pinned_cpu_buffers=False")
                else:
                    host = self._runtime.host_buffer(t)
                    self._host.append(host)
                host.copy_(t, non_blocking=True)
            self._done = module.Event()
            self._done.record(stream)

    def release(self) -> None:
        """Drop the device tensors once their copies have run (ordered on the compute stream)."""
        self._expect("release_activation_forward_gpu_memory", OFFLOADING)
        self.state = OFFLOADED
        if self._saved:
            device = self._saved[0].device
            self._runtime.module(device).current_stream(device).wait_event(self._done)
            self._device = device
        self._saved, self._ready, self._index, self._done = [], [], {}, None

    def start_reload(self) -> None:
        self._expect("start_reload", OFFLOADED)
        self.state = RELOADING
        if not self._copies:
            return
        device = self._device
        module, stream = self._runtime.module(device), self._stream_of(device)
        compute = module.current_stream(device)
        self._back, self._back_events = [], []
        for host in self._host[:self._copies]:
            # allocated on the compute stream, whose pool the backward frees it into
            back = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
            stream.wait_stream(compute)
            with module.stream(stream):
                back.copy_(host, non_blocking=True)
                done = module.Event()
                done.record(stream)
            self._back.append(back)
            self._back_events.append(done)

    def reset(self) -> None:
        """Forget this layer's tensors (its backward is over, or a new forward begins)."""
        self._saved, self._ready, self._index, self._done = [], [], {}, None
        self._back, self._back_events = [], []
        if not self._retain:
            self._host = []
        self.state = KEPT

    def _expect(self, what: str, state: str) -> None:
        if self.state != state:
            raise RuntimeError(f"cpu offload: {what} needs a layer in state {state!r}, but this layer is "
                               f"{self.state!r}; each layer goes offload -> release -> reload once per iteration "
                               "(with get_cpu_offload_context's own synchronization, run exactly model_layers "
                               "layers in its contexts per iteration, each once)")

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host)

    def device_tensors(self) -> List[Tensor]:
        """The device tensors this layer keeps alive now (for tests and accounting)."""
        return list(self._saved) + list(self._back)
