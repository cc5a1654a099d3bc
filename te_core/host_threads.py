"""Keep the host threads of a training step on one CPU.

A training step on an accelerator is run by two host threads in turn: the calling thread runs
the forward, then hands the backward to autograd's worker thread for the device and sleeps until
it is done. Where the step is host-bound (small and medium layers, FP8 most of all, whose casts
add Python around every GEMM), the operating system's placement of these two threads costs time:
each handoff can wake the other thread on another core whose caches hold none of the
interpreter's state, and a thread that the scheduler moves loses its caches as well. Both
threads on one core keep those caches warm. The gain is the host's: nothing changes on the
device, and a GPU-bound step gains nothing.

Pinning is the caller's choice, made once per process (training script, launcher): child
processes inherit it (`HostPinning.worker_init_fn` gives a DataLoader's workers their CPUs back),
and so do threads started later, which then share the one core.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable, FrozenSet, Mapping, Optional, TypeVar, Union

import torch

__all__ = ["HostPinning", "default_cpu", "pin_host_threads"]

T = TypeVar("T")


def _check_platform() -> None:
    if not hasattr(os, "sched_setaffinity"):
        raise NotImplementedError(
            "pinning host threads needs os.sched_setaffinity, which only Linux has; on this platform "
            "leave thread placement to the operating system")


def default_cpu(mask: Optional[FrozenSet[int]] = None, env: Mapping[str, str] = os.environ) -> int:
    """The CPU to pin to: the last of this process's share of its affinity mask (`mask`, default the
    calling thread's). Under torchrun (LOCAL_RANK r of LOCAL_WORLD_SIZE n) the share is the r-th of n
    equal slices, so the ranks of one node land on different cores. The last rather than the first:
    Linux keeps housekeeping work and many interrupts on the lowest CPUs, CPU 0 above all."""
    _check_platform()
    cpus = sorted(os.sched_getaffinity(0) if mask is None else mask)
    if not cpus:
        raise ValueError("the affinity mask is empty: there is no CPU to pin to")
    try:
        rank, world = int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError as err:
        raise ValueError(f"LOCAL_RANK / LOCAL_WORLD_SIZE must be integers ({err}); unset them or pass cpu=") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"LOCAL_RANK={rank} does not fit LOCAL_WORLD_SIZE={world}: need 0 <= LOCAL_RANK < "
                         "LOCAL_WORLD_SIZE; unset them or pass cpu=")
    return cpus[max(rank * len(cpus) // world, (rank + 1) * len(cpus) // world - 1)]


def on_autograd_thread(device: torch.device, fn: Callable[[], T]) -> T:
    """fn() run on the thread that runs backward passes on `device`: autograd's worker thread for an
    accelerator (started here if it was not yet), the calling thread on a CPU. It runs as the hook
    of a one-element backward, the way a training step's backward reaches that thread."""
    result = []

    def hook(grad):
        result.append(fn())
        return grad

    # whatever grad mode the caller is in (no_grad, inference_mode), this backward must run
    with torch.inference_mode(False), torch.enable_grad(), torch.autograd.set_multithreading_enabled(True):
        out = torch.ones(1, device=device, requires_grad=True) * 2.0
        out.register_hook(hook)
        out.sum().backward()
    return result[0]


def _set_mask(mask: FrozenSet[int]) -> FrozenSet[int]:
    """Set the calling thread's affinity (pid 0 is the calling thread on Linux); returns the old one."""
    before = frozenset(os.sched_getaffinity(0))
    os.sched_setaffinity(0, mask)
    return before


@dataclass(frozen=True)
class HostPinning:
    """What pin_host_threads did: the CPU, the device whose backward thread followed, and the two
    threads' masks before, which restore() puts back (from the thread that pinned)."""

    cpu: int
    device: torch.device
    previous: FrozenSet[int]
    previous_backward: FrozenSet[int]
    thread_id: int

    def restore(self) -> None:
        if threading.get_ident() != self.thread_id:
            raise RuntimeError("restore() must run on the thread that called pin_host_threads: the calling "
                               "thread's mask is per thread")
        on_autograd_thread(self.device, lambda: _set_mask(self.previous_backward))
        _set_mask(self.previous)

    def worker_init_fn(self, worker_id: int) -> None:
        """A DataLoader worker_init_fn: the worker process gets back the CPUs the process had before
        pinning, instead of sharing the training thread's one core."""
        _set_mask(self.previous)

    def __enter__(self) -> "HostPinning":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def pin_host_threads(cpu: Optional[int] = None, device: Union[None, str, torch.device] = None) -> HostPinning:
    """Pin the calling thread and autograd's backward thread for `device` (default: the te-core
    backend's device) to one CPU (default: default_cpu()). Call it from the thread that runs the
    training loop, before the loop; use the result as a context manager, or call restore(), to undo.

    For training on an accelerator: on a CPU device the model's own compute needs the cores, and
    this raises ValueError. Threads and processes started afterwards inherit the one CPU.
    """
    _check_platform()
    mask = frozenset(os.sched_getaffinity(0))
    if cpu is None:
        cpu = default_cpu(mask)
    elif isinstance(cpu, bool) or not isinstance(cpu, int):
        raise TypeError(f"cpu must be an int (a CPU number), got {type(cpu).__name__}")
    elif cpu not in mask:
        raise ValueError(f"CPU {cpu} is not in this thread's affinity mask {sorted(mask)}: pick one of those, "
                         "or leave cpu out")
    if device is None:
        from .backend import get_backend

        device = get_backend().device
    device = torch.device(device)
    if device.type == "cpu":
        raise ValueError("pin_host_threads is for training on an accelerator: on the CPU, torch's intra-op "
                         "threads run the model and need all the cores")
    previous = _set_mask(frozenset({cpu}))
    try:
        previous_backward = on_autograd_thread(device, lambda: _set_mask(frozenset({cpu})))
    except BaseException:
        _set_mask(previous)
        raise
    return HostPinning(cpu, device, previous, previous_backward, threading.get_ident())
