"""Amax reduction: all amaxes of a step reduced (MAX) in one coalesced all-reduce."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from te_core.modules.linear import Linear
from te_core.quantization import autocast
from te_core.recipe import DelayedScaling

from .conftest import randn


@pytest.fixture
def counted_all_reduce(monkeypatch):
    """Pretend torch.distributed is initialized; record each all_reduce (a world of one: identity)."""
    calls = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append({"numel": tensor.numel(), "op": op, "group": group})

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1 if group == "solo" else 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


def test_one_coalesced_all_reduce_per_step(gen, counted_all_reduce):
    layers = [Linear(16, 16) for _ in range(3)]
    group = object()
    x = randn(gen, 16, 16).requires_grad_()
    reduction = {"op": dist.ReduceOp.MAX, "group": group}
    for step in range(2):
        counted_all_reduce.clear()
        with autocast(recipe=DelayedScaling(amax_history_len=2), amax_reduction_group=group):
            y = x
            for layer in layers:
                y = layer(y)
        # the first step's first casts each reduce their own amax first (3 inputs, 3 weights)
        first = [dict(reduction, numel=1)] * 6 if step == 0 else []
        assert counted_all_reduce == first + [dict(reduction, numel=6)]  # then one for 3 inputs + 3 weights
        counted_all_reduce.clear()
        y.sum().backward()
        first = [dict(reduction, numel=1)] * 3 if step == 0 else []
        assert counted_all_reduce == first + [dict(reduction, numel=3)]  # the 3 grad_outputs, once


def test_reduce_amax_false_or_one_rank_skips_the_reduction(gen, counted_all_reduce):
    layer = Linear(16, 16)
    with autocast(recipe=DelayedScaling(reduce_amax=False), amax_reduction_group=object()):
        layer(randn(gen, 16, 16))
    with autocast(recipe=DelayedScaling(), amax_reduction_group="solo"):
        layer(randn(gen, 16, 16))
    assert counted_all_reduce == []
    assert layer.quantization_state()["forward"]["input"]["scale"] != 1.0  # the update itself still ran


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TE_BACKEND="reference")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same weights on both ranks
        layer = Linear(16, 16)
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(100 + rank)) * (1 + 3 * rank)
        with autocast(recipe=DelayedScaling(amax_history_len=2), amax_reduction_group=dist.group.WORLD):
            layer(x)
        local = x.abs().max()
        state = layer.quantization_state()["forward"]["input"]
        queue.put((rank, local.item(), state["amax_history"][-1].item(), state["scale"].item()))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif("fork" not in mp.get_all_start_methods() or not dist.is_available(),
                    reason="needs fork and torch.distributed (gloo)")
def test_gloo_world_of_two_reduces_max():
    context = mp.get_context("fork")  # fork: no re-import of torch, keeps the test quick
    queue = context.SimpleQueue()
    mp.start_processes(_worker, args=(2, _free_port(), queue), nprocs=2, join=True, start_method="fork")
    results = {}
    for _ in range(2):
        rank, *values = queue.get()
        results[rank] = values
    local_amaxes = [results[r][0] for r in range(2)]
    for rank in range(2):
        _, reduced, scale = results[rank]
        assert reduced == max(local_amaxes)  # every rank sees the global max ...
        assert scale == pytest.approx(448.0 / max(local_amaxes), rel=1.3e-6)  # ... and the same scale
