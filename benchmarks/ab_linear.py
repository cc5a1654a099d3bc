"""A/B of two source trees on the host-bound rows: te.Linear M8192 K4096 N4096 fwd+bwd (FP8
delayed and current, eager) and the tiny forward (eager and graphed, bench_modules' row), each
beside torch's bf16 nn.Linear in the same process, for whichever te_core is first on sys.path. Host speed differs between machines and
drifts within a session, so alternate the trees in separate processes, as for ab_layer.py:

    for i in 1 2 3; do
      PYTHONPATH=OLD:OLD/backends/triton:OLD/backends/cuda:OLD/benchmarks python benchmarks/ab_linear.py "old $i"
      PYTHONPATH=.:backends/triton:backends/cuda:benchmarks python benchmarks/ab_linear.py "new $i"
    done
"""
from __future__ import annotations

import sys

import torch
from torch import nn
from triton.testing import do_bench

import te_core as te
from te_core import recipe
from _timing import host_and_total_ms
from bench_modules import tiny_rows


def fwd_bwd(module, x, dy, rcp=None):
    def step():
        with te.autocast(enabled=rcp is not None, recipe=rcp):
            y = module(x)
        y.backward(dy)

    return step


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else "linear"
    M, K, N = 8192, 4096, 4096
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    ref = nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    cells = [f"bf16 {do_bench(fwd_bwd(ref, x, dy), warmup=25, rep=200):.3f} ms"]
    for name, make in (("delayed", recipe.DelayedScaling), ("current", recipe.Float8CurrentScaling)):
        step = fwd_bwd(te.Linear(K, N, bias=False, params_dtype=torch.bfloat16), x, dy, make())
        ms = do_bench(step, warmup=25, rep=200)
        host_ms, _ = host_and_total_ms(step, n=30)
        cells.append(f"{name} {ms:.3f} ms (host {host_ms:.3f})")
    tiny = tiny_rows()[0]  # bench_modules' tiny forward: nn.Linear, te eager, te graphed
    cells.append(f"tiny {tiny['te.Linear fp8 us']:.1f} us, graphed {tiny['te.Linear fp8 graphed us']:.1f} us "
                 f"vs nn.Linear {tiny['nn.Linear bf16 us']:.1f}")
    import te_backend_cuda

    print(f"{label}: " + " | ".join(cells) + f"  ({te.__file__}, {te_backend_cuda.__file__})", flush=True)


if __name__ == "__main__":
    main()
