"""The setup of a test file's `main()` under torchrun: one process per GPU on NCCL (gloo on
CPU when there is no GPU), a rank context shaped like the pool's, and a printer for rank 0."""
from __future__ import annotations

import datetime
import os
from types import SimpleNamespace
from typing import Callable, Tuple

import torch
import torch.distributed as dist


def start() -> Tuple[SimpleNamespace, Callable[..., None]]:
    """(ctx with rank and world, report: print on rank 0, silent elsewhere)."""
    nccl = torch.cuda.is_available()
    if nccl:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(seconds=120))
    ctx = SimpleNamespace(rank=dist.get_rank(), world=dist.get_world_size())
    return ctx, (print if ctx.rank == 0 else (lambda *_: None))
