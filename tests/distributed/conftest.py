"""Multi-process tests: one pool of 4 gloo CPU processes per test file (see _pool.py); tests
with 2 tensor-parallel ranks run on the pair of ranks 0 and 1."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from te_core import backend

from ._pool import pool_of


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    for var in ("TE_BACKEND", "TE_BACKEND_STRICT", "TE_BACKEND_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    backend.set_backend("reference")


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(4)


def _fsdp2_averages_gradients(ctx) -> bool:
    """Whether torch's FSDP2 averages a gradient over the gloo ranks, as DDP does: rank r's
    gradient of sum(w @ x_r) is 2 (r + 1) in every entry, their mean (world + 1)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    layer = torch.nn.Linear(4, 4, bias=False)
    fully_shard(layer, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    layer(torch.full((2, 4), float(ctx.rank + 1))).sum().backward()
    grad = layer.weight.grad.full_tensor()
    return bool(torch.allclose(grad, torch.full_like(grad, float(ctx.world + 1))))


@pytest.fixture(scope="module")
def fsdp2_training(pool):
    """The pool, for tests that train under FSDP2 against DDP or one process: skipped where
    torch's own FSDP2 sums the ranks' gradients over gloo instead of averaging them, so that no
    model, te-core's or plain torch's, can match."""
    if not all(pool.run(_fsdp2_averages_gradients)):
        pytest.skip(f"torch {torch.__version__}'s FSDP2 sums gradients over a gloo (CPU) group instead of "
                    "averaging them as DDP does, for plain torch modules too; run these tests with a newer torch")
    return pool
