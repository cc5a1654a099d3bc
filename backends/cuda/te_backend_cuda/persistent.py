"""Device buffers that outlive the call making them, allocated outside CUDA-graph memory pools.

torch.compile's CUDA graphs (mode="reduce-overhead") route every allocation made by the thread
that warms up or records a graph into that graph's private pool, and refuse to run once a tensor
in the pool outlives the graph's outputs. The backend's caches (the pooled amax zeros, the
delayed-scaling update's device tables) would be such tensors when first built inside a compiled
step. The routing is per thread, so these buffers are built on a short-lived thread of their
own, from the ordinary pool. Each is built once and reused for many calls, so the thread's cost
does not recur.
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def build(make: Callable[[], T], device: torch.device) -> T:
    """make() run on a thread of its own and a stream of its own, finished before this returns;
    the caller's stream is recorded on each tensor built, so freeing it later waits for the
    caller's kernels."""
    done: list = []

    def work() -> None:
        try:
            stream = torch.cuda.Stream(device)
            with torch.cuda.device(device), torch.cuda.stream(stream):
                value = make()
            stream.synchronize()
            done.append((value, None))
        except BaseException as exc:  # re-raised in the caller's thread
            done.append((None, exc))

    thread = threading.Thread(target=work, name="te-backend-cuda-persistent")
    thread.start()
    thread.join()
    value, error = done[0]
    if error is not None:
        raise error
    caller = torch.cuda.current_stream(device)
    for t in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(caller)
    return value


def zeros(numel: int, device: torch.device) -> torch.Tensor:
    return build(lambda: torch.zeros(numel, dtype=torch.float32, device=device), device)


def placer(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function copying a host tensor to `device` through build()."""
    return lambda host: build(lambda: host.to(device), device)
