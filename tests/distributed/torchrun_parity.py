"""The tensor-parallel parity cases of test_tensor_parallel.py and test_attention_parallel.py, and
(with 2 processes) the FP8 all-gather checks of test_fp8_gather.py, on real devices and their collective library (NCCL, MCCL), one process per device, launched with
torchrun:

    torchrun --nproc-per-node 2 -m tests.distributed.torchrun_parity

Each process uses the selected backend (TE_BACKEND, default auto) on device LOCAL_RANK, and runs
every case whose tensor-parallel size equals the number of processes. Exits non-zero, with the
failing case named, on the first mismatch. The pytest suite runs the same cases on gloo CPU ranks.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from te_core import backend

from ._attention_parity import check_attention_parity
from ._parity import check_parity
from ._pool import RankContext
from .test_attention_parallel import CASES as ATTENTION_CASES
from .test_fp8_gather import CHECKS as FP8_GATHER_CHECKS
from .test_tensor_parallel import CASES


def main() -> int:
    selected = backend.get_backend()
    if selected.device_type != "cpu":
        selected.device_module.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    ctx = RankContext(rank, world, {world: dist.group.WORLD})
    try:
        runs = [(check_parity, (c,)) for c in CASES if c.tp == world]
        runs += [(check_attention_parity, (c,)) for c in ATTENTION_CASES if c.tp == world]
        runs += FP8_GATHER_CHECKS if world == 2 else []
        for check, args in runs:
            check(ctx, *args)
            if rank == 0:
                name = " ".join([check.__name__, *map(str, args)])
                print(f"ok  {name}  (backend {selected.name}, collectives {dist.get_backend_config()})", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
