"""Wall-clock timing for host-bound work (tiny layers, launch-bound steps), shared by the scripts."""
from __future__ import annotations

import time
from typing import Tuple

import torch


def host_and_total_ms(step, n: int = 30, warmup: int = 5) -> Tuple[float, float]:
    """(host ms to enqueue one step, wall ms per step after the GPU finished): equal when the
    step is host-bound."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return host * 1e3, (time.perf_counter() - t0) / n * 1e3


def python_profile(fn, n: int, rows: int) -> None:
    """Print the top `rows` Python functions by own time over `n` calls of `fn` (cProfile)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(rows)


def wall_us(fn, n: int = 300, warmup: int = 20) -> float:
    """Microseconds per call of `fn`, GPU work included."""
    return host_and_total_ms(fn, n, warmup)[1] * 1e3
