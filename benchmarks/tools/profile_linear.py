"""Where an FP8 te.Linear training step spends its time on the GPU: host (Python, launches)
versus device. Prints host and wall time per step for bf16 nn.Linear and te.Linear per recipe,
then torch.profiler tables (by GPU and by CPU time) and the top Python functions (cProfile) of the
FP8 delayed-scaling step.

    python benchmarks/tools/profile_linear.py [M K N]      # default M8192 K4096 N4096
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: shared helpers
from _timing import host_and_total_ms, python_profile  # noqa: E402

import te_core as te
from te_core import recipe

M, K, N = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 4096, 4096)
DEV = "cuda"


def main():
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    ref = torch.nn.Linear(K, N, bias=False, device=DEV, dtype=torch.bfloat16)
    lin = te.Linear(K, N, bias=False, params_dtype=torch.bfloat16)

    def bf16_step():
        ref(x).backward(dy)

    def fp8_step(rcp):
        def step():
            with te.autocast(recipe=rcp):
                y = lin(x)
            y.backward(dy)
        return step

    print(f"shape M{M} K{K} N{N}: host ms (enqueue) / total ms per step")
    print("bf16 nn.Linear", host_and_total_ms(bf16_step))
    steps = {name: fp8_step(r) for name, r in (("delayed", recipe.DelayedScaling()),
                                               ("current", recipe.Float8CurrentScaling()),
                                               ("block", recipe.Float8BlockScaling()))}
    for name, step in steps.items():
        try:
            print(f"te.Linear {name}", host_and_total_ms(step))
        except Exception as exc:  # keep profiling the others
            print(f"te.Linear {name} failed: {type(exc).__name__}: {exc}")
    step = steps["delayed"]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    # backward on this thread, so cProfile sees its Python too (autograd runs CUDA backward on its own thread)
    torch.autograd.set_multithreading_enabled(False)
    python_profile(step, 20, 30)
    torch.autograd.set_multithreading_enabled(True)


if __name__ == "__main__":
    main()
