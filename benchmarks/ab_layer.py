"""A/B of two source trees on one GPU: the FP8 (delayed) TransformerLayer step of PERFORMANCE.md,
timed as bench_modules.py times it, for whichever te_core is first on sys.path.

Sustained layer time is set by the H200's power cap as much as by kernel time, so compare
trees in alternating processes, not one run each. For a tree exported to OLD
(`git archive <commit> te_core backends benchmarks/_layer.py | tar -x -C OLD`):

    for i in 1 2 3; do
      PYTHONPATH=OLD:OLD/backends/triton:OLD/backends/cuda:OLD/benchmarks python benchmarks/ab_layer.py "old $i"
      PYTHONPATH=.:backends/triton:backends/cuda:benchmarks python benchmarks/ab_layer.py "new $i"
    done
"""
from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

import te_core
from _layer import inputs, te_layer, training_step


def main():
    label = sys.argv[1] if len(sys.argv) > 1 else "layer"
    x, dy = inputs(8)
    step = training_step(te_layer(), x, dy, "delayed")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ms = do_bench(step, warmup=100, rep=400, return_mode="median")  # bench_modules' LAYER_REPS
    print(f"{label}: {ms:.2f} ms  ({te_core.__file__})", flush=True)


if __name__ == "__main__":
    main()
