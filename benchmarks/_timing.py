"""Timing shared by the benchmarks: median GPU time (triton's do_bench), wall time for host-bound
work (tiny layers, launch-bound steps), peak memory of a step, and a Python profile.

Every function takes the device the work runs on; on a CPU (the sweep's --smoke mode) the
GPU-only measurements fall back to plain wall-clock loops and peak memory is not measured.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Optional, Tuple

import torch


def synchronize(device: str = "cuda") -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device: str = "cuda", warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds per call of `fn`: triton.testing.do_bench on a GPU (it flushes L2 and
    times each call with CUDA events); on a CPU, a timed loop of about `rep_ms`."""
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    fn()
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while not times or (time.perf_counter() < deadline and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_and_total_ms(step, n: int = 30, warmup: int = 5, device: str = "cuda") -> Tuple[float, float]:
    """(host ms to enqueue one step, wall ms per step after the device finished): equal when the
    step is host-bound."""
    for _ in range(warmup):
        step()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t0) / n
    synchronize(device)
    return host * 1e3, (time.perf_counter() - t0) / n * 1e3


def wall_us(fn, n: int = 300, warmup: int = 20, device: str = "cuda", repeats: int = 1) -> float:
    """Microseconds per call of `fn`, device work included: the median over `repeats` timed runs
    of `n` calls each. Host-bound work varies with whatever else the CPU does; the median of a
    few runs is steadier than one long run."""
    for _ in range(warmup):
        fn()
    return statistics.median(host_and_total_ms(fn, n, 0, device)[1] * 1e3 for _ in range(repeats))


class Interleaved:
    """Host-bound cells measured together, so that the host's drift during the run falls on all
    of them alike: every cell's step is built and warmed up, then timed in rounds that visit the
    cells in turn; a cell's result is the median over its rounds of the wall microseconds per
    call. cell(make_step, around) registers a step and returns its measurement (all cells are
    measured at the first one's call); `around()`, where given, is a context manager entered for
    the cell's warm-up and each of its timed runs (a setting that holds for that cell alone); a
    step that raises fails its own cell only."""

    def __init__(self, calls: int, device: str = "cuda", rounds: int = 5):
        self.calls, self.device, self.rounds = calls, device, rounds
        self._makers: list = []
        self._results: Optional[list] = None

    def cell(self, make_step, around=None):
        index = len(self._makers)
        self._makers.append((make_step, around or contextlib.nullcontext))
        return lambda: self._result(index)

    def _result(self, index: int) -> dict:
        if self._results is None:
            self._results = self._measure()
        outcome = self._results[index]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _measure(self) -> list:
        per_round, warmup = max(1, self.calls // self.rounds), max(3, self.calls // 10)
        steps = [self._warm(make, around, warmup) for make, around in self._makers]
        times: list = [[] for _ in steps]
        for _ in range(self.rounds):
            for i, step in enumerate(steps):
                if isinstance(step, Exception):
                    continue
                try:
                    with self._makers[i][1]():
                        times[i].append(host_and_total_ms(step, per_round, 0, self.device)[1] * 1e3)
                except Exception as exc:  # noqa: BLE001 - recorded as that cell's error
                    steps[i] = exc
        return [step if isinstance(step, Exception) else {"us": statistics.median(t)} for step, t in zip(steps, times)]

    @staticmethod
    def _warm(make_step, around, warmup: int):
        try:
            step = make_step()
            with around():
                for _ in range(warmup):
                    step()
            return step
        except Exception as exc:  # noqa: BLE001 - recorded as that cell's error
            return exc


def peak_mib(fn, device: str = "cuda") -> Optional[float]:
    """MiB allocated at the peak of one call of `fn`, above what was allocated before it;
    None on a device whose allocator keeps no statistics (CPU)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def python_profile(fn, n: int, rows: int, device: str = "cuda") -> None:
    """Print the top `rows` Python functions by own time over `n` calls of `fn` (cProfile)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        fn()
    synchronize(device)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(rows)
