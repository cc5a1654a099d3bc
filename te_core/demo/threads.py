"""How many intra-op threads the demo trains with on a CPU that other processes share.

torch's CPU kernels split work over a team of threads that meet at a barrier after each op,
and the team waits spinning. When other processes hold cores, a team member loses its core
for a whole time slice, every barrier waits for it, and the spinning members burn the CPU the
others need: a step takes several times longer than with fewer threads. The demo therefore
leaves out of its team the cores that other processes keep busy when it starts, measured over
a short sample of the system's CPU counters.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional, Tuple

SAMPLE_S = 0.5


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    cpus: int
    busy: Optional[float]  # CPUs kept busy by other processes at the start; None where unknown
    default: int  # torch's own thread count before the choice
    requested: bool = False  # given by the user (--threads) rather than chosen

    @property
    def reduced(self) -> bool:
        """Whether busy CPUs made the choice lower than torch's own default."""
        return not self.requested and self.threads < self.default

    @property
    def oversubscribed(self) -> bool:
        """Whether the requested team is larger than the CPUs this process may run on: its members
        then share cores, and every barrier waits for one that lost its core (module docstring)."""
        return self.requested and self.threads > self.cpus

    def describe(self) -> str:
        if self.requested:
            why = "as requested"
        else:
            why = "other load unknown" if self.busy is None else f"{self.busy:.1f} busy with other work"
        return f"{self.threads} thread{'s' if self.threads > 1 else ''} ({self.cpus} cpus, {why})"


def _torch_default() -> int:
    import torch

    return torch.get_num_threads()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _cpu_times() -> Optional[Tuple[int, int]]:
    """(idle, total) jiffies of all CPUs from /proc/stat, or None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):  # not Linux, or a format this does not know: load unknown
        return None
    if len(fields) < 5:
        return None
    return fields[3] + fields[4], sum(fields)  # idle + iowait; user..steal


def busy_cpus(interval: float = SAMPLE_S) -> Optional[float]:
    """How many CPUs other processes keep busy: sampled over `interval` seconds while this one sleeps."""
    before = _cpu_times()
    if before is None:
        return None
    time.sleep(interval)
    after = _cpu_times()
    if after is None or after[1] <= before[1]:
        return None
    idle_share = (after[0] - before[0]) / (after[1] - before[1])
    return (os.cpu_count() or 1) * (1.0 - idle_share)


def choose_threads(cpus: int, busy: Optional[float], default: int) -> int:
    """The idle CPUs (cpus minus the busy ones, rounded), at least 1 and at most torch's default."""
    if cpus < 1 or default < 1:
        raise ValueError(f"cpus and default threads must be >= 1, got cpus={cpus}, default={default}")
    idle = cpus if busy is None else cpus - int(busy + 0.5)
    return max(1, min(default, idle))


def pick(requested: Optional[int] = None) -> ThreadChoice:
    """The thread count to train with: `requested` if given (>= 1), else choose_threads now."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be at least 1, got {requested}")
        return ThreadChoice(requested, usable_cpus(), None, _torch_default(), requested=True)
    cpus, busy, default = usable_cpus(), busy_cpus(), _torch_default()
    return ThreadChoice(choose_threads(cpus, busy, default), cpus, busy, default)
