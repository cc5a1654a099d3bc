"""te_core.pin_host_threads: the CPU it picks, the masks it sets and restores, its refusals.

The masks are per thread, so the tests that set them run in a thread of their own and leave the
test process's main thread as it was."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import te_core as te
from te_core import host_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


def in_thread(fn):
    """fn() run on a fresh thread; its result, or its exception re-raised here."""
    out = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as err:  # re-raised on the test's thread
            out["error"] = err

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def accelerator():
    return torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


@pytest.mark.parametrize("mask, env, expected", [
    ({0, 1, 2, 3, 4, 5, 6, 7}, {}, 7),
    ({0, 1, 2, 3, 4, 5, 6, 7}, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, 3),
    ({0, 1, 2, 3, 4, 5, 6, 7}, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 7),
    ({9, 2, 5, 11}, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, 5),  # sorted: 2 5 9 11; one each
    ({9, 2, 5}, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 9),  # 3 CPUs, 4 ranks: slice 3 is [9]
    ({9, 2, 5}, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, 2),  # slice 0 is empty: its start, shared
    ({7}, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, 7),  # more ranks than CPUs: they share
])
def test_default_cpu_is_the_last_of_the_ranks_share(mask, env, expected):
    assert host_threads.default_cpu(frozenset(mask), env) == expected


@pytest.mark.parametrize("env, match", [
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "does not fit"),
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"}, "does not fit"),
    ({"LOCAL_RANK": "one"}, "must be integers"),
])
def test_default_cpu_rejects_a_rank_outside_the_world(env, match):
    with pytest.raises(ValueError, match=match):
        host_threads.default_cpu(frozenset({0, 1}), env)


def test_default_cpu_rejects_an_empty_mask():
    with pytest.raises(ValueError, match="empty"):
        host_threads.default_cpu(frozenset(), {})


def test_pinning_refuses_the_cpu_device():
    with pytest.raises(ValueError, match="accelerator"):
        te.pin_host_threads(device="cpu")


@pytest.mark.parametrize("cpu, error, match", [
    (True, TypeError, "must be an int"),
    (1.0, TypeError, "must be an int"),
    (10 ** 6, ValueError, "not in this thread's affinity mask"),
])
def test_pinning_rejects_a_bad_cpu(cpu, error, match):
    with pytest.raises(error, match=match):
        te.pin_host_threads(cpu=cpu, device="cpu")
    assert os.sched_getaffinity(0) == in_thread(lambda: os.sched_getaffinity(0))  # nothing was pinned


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_on_autograd_thread_runs_on_the_calling_thread_on_a_cpu(mode):
    marker = torch.randn(3)
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with context():  # the caller's grad mode does not keep the backward from running
        seen = host_threads.on_autograd_thread(torch.device("cpu"), lambda: (threading.get_ident(), marker.sum()))
        assert torch.is_grad_enabled() == (mode == "grad")  # and is left as it was
    assert seen[0] == threading.get_ident() and torch.equal(seen[1], marker.sum())


def test_worker_init_fn_gives_a_worker_its_cpus_back():
    everything = frozenset(os.sched_getaffinity(0))
    one = frozenset({min(everything)})
    pinning = host_threads.HostPinning(min(everything), torch.device("cpu"), everything, everything, 0)

    def worker():
        host_threads._set_mask(one)
        pinned = frozenset(os.sched_getaffinity(0))
        pinning.worker_init_fn(0)
        return pinned, frozenset(os.sched_getaffinity(0))

    assert in_thread(worker) == (one, everything)


def test_restore_must_run_on_the_pinning_thread():
    mask = frozenset(os.sched_getaffinity(0))
    pinning = host_threads.HostPinning(min(mask), torch.device("cpu"), mask, mask, threading.get_ident() + 1)
    with pytest.raises(RuntimeError, match="thread that called pin_host_threads"):
        pinning.restore()


@pytest.mark.skipif(accelerator() is None, reason="needs an accelerator: autograd's backward thread")
@pytest.mark.parametrize("which", ["default", "last"])
def test_pinning_moves_both_threads_and_restore_puts_them_back(which):
    device = accelerator()
    mask = frozenset(os.sched_getaffinity(0))
    cpu = None if which == "default" else max(mask)

    def backward_mask():
        return host_threads.on_autograd_thread(device, lambda: frozenset(os.sched_getaffinity(0)))

    def run():
        before = frozenset(os.sched_getaffinity(0)), backward_mask()
        backward_ident = host_threads.on_autograd_thread(device, threading.get_ident), threading.get_ident()
        with te.pin_host_threads(cpu=cpu, device=device) as pinning:
            during = frozenset(os.sched_getaffinity(0)), backward_mask()
        after = frozenset(os.sched_getaffinity(0)), backward_mask()
        return before, during, after, pinning.cpu, backward_ident

    before, during, after, chosen, backward_ident = in_thread(run)
    assert backward_ident[0] != backward_ident[1]  # the backward ran on autograd's own thread
    assert chosen == (host_threads.default_cpu(mask) if cpu is None else cpu)
    assert during == (frozenset({chosen}), frozenset({chosen}))
    assert after == before


def test_a_platform_without_cpu_affinity_is_told_so(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity")
    for call in (lambda: te.pin_host_threads(device="cpu"), lambda: host_threads.default_cpu(frozenset({0}), {})):
        with pytest.raises(NotImplementedError, match="needs os.sched_setaffinity, which only Linux has"):
            call()
