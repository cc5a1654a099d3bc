"""A pool of CPU processes joined in one gloo process group, kept for a whole test file.

`pool.run(fn, *args)` calls fn(ctx, *args) on every rank (ctx: rank, world size, and the
tensor-parallel groups of 2 and 4 ranks) and returns the ranks' results in rank order. A rank
that raises fails the test with its traceback; a rank that does not answer within the timeout
(a hang in a collective, a crash) fails it with a message naming the ranks. After a failure the
processes are torn down, never left hanging, and the next task starts fresh ones. Processes are
forked: the parent's imports are reused.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# the longest a task may run, and (shorter) the gloo timeout, so that a rank stuck in a collective
# raises inside its process before the pool gives up on it
TASK_TIMEOUT_S = 60
COLLECTIVE_TIMEOUT_S = 30


def fork_available() -> bool:
    return "fork" in mp.get_all_start_methods() and dist.is_available() and dist.is_gloo_available()


@dataclass
class RankContext:
    rank: int
    world: int
    groups: Dict[int, Any]  # group size -> this rank's group of that size (see _make_groups)

    def group(self, size: int):
        return self.groups[size]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_groups(world: int) -> Dict[int, Any]:
    """{size: this rank's group}: the world, and consecutive pairs ({0, 1}, {2, 3}, ...)."""
    groups = {world: dist.group.WORLD}
    if world > 2:
        for first in range(0, world, 2):  # every rank takes part in creating every group
            pair = dist.new_group([first, first + 1])
            if dist.get_rank() in (first, first + 1):
                groups[2] = pair
    return groups


def _serve(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TE_BACKEND="reference")
    torch.set_num_threads(1)
    from te_core import backend

    backend.set_backend("reference")
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    ctx = RankContext(rank, world, _make_groups(world))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args = task
            try:
                results.put((rank, True, fn(ctx, *args)))
            except BaseException:  # reported to the parent, which fails the test with it
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int):
        self.world = world
        self._procs = None
        self._start()

    def _start(self) -> None:
        world = self.world
        context = mp.get_context("fork")
        self._tasks = [context.SimpleQueue() for _ in range(world)]
        self._results = context.Queue()
        port = _free_port()
        self._procs = [context.Process(target=_serve, args=(r, world, port, self._tasks[r], self._results),
                                       daemon=True) for r in range(world)]
        for proc in self._procs:
            proc.start()

    def run(self, fn, *args, timeout: float = TASK_TIMEOUT_S) -> List[Any]:
        if self._procs is None:  # torn down after a failure: the ranks' group may be unusable, start afresh
            self._start()
        for q in self._tasks:
            q.put((fn, args))
        answers = self._collect(fn.__name__, timeout)
        failed = [(r, value) for r, (ok, value) in sorted(answers.items()) if not ok]
        if failed:
            self.close()
            rank, tb = failed[0]
            pytest.fail(f"{fn.__name__} failed on ranks {[r for r, _ in failed]}; rank {rank}:\n{tb}", pytrace=False)
        return [answers[r][1] for r in range(self.world)]

    def _collect(self, name: str, timeout: float) -> Dict[int, tuple]:
        """{rank: (ok, value)}; once a rank has failed, the others get a few seconds more (they may
        be waiting for it in a collective), and are then given up on."""
        answers: Dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < self.world:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
                answers[rank] = (ok, value)
                if not ok:
                    deadline = min(deadline, time.monotonic() + 3)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in answers]
            if any(not ok for ok, _ in answers.values()) and time.monotonic() > deadline:
                break  # the failure is reported, not the ranks left waiting for the failed one
            if dead or time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - set(answers))
                self.close()
                why = f"died (ranks {dead})" if dead else f"did not answer within {timeout:.0f} s"
                pytest.fail(f"{name}: ranks {missing} {why}; a collective is probably waiting for a rank that never "
                            "joined it", pytrace=False)
        return answers

    def close(self) -> None:
        if self._procs is None:
            return
        for proc, q in zip(self._procs, self._tasks):
            if proc.is_alive():
                q.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs = None


def pool_of(world: int):
    """Fixture body: a pool of `world` ranks, closed afterwards; the test is skipped where fork
    or gloo is missing."""
    if not fork_available():
        pytest.skip("needs the fork start method and torch.distributed with gloo")
    ranks = RankPool(world)
    yield ranks
    ranks.close()
