"""Where a te.TransformerLayer training step (h4096, ffn 16384, 32 heads, s2048) spends GPU time:
host enqueue against total time per step, then the kernels by CUDA time (torch.profiler).

    python benchmarks/tools/profile_layer.py [--recipe delayed|current|bf16] [--batch 8] [--rows 40]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: shared helpers
from _layer import inputs, te_layer, training_step  # noqa: E402
from _timing import host_and_total_ms  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="delayed", choices=("delayed", "current", "block", "bf16"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rows", type=int, default=40)
    args = parser.parse_args()
    b = args.batch
    x, dy = inputs(b)
    step = training_step(te_layer(), x, dy, args.recipe)
    host, total = host_and_total_ms(step, n=5, warmup=3)
    print(f"layer {args.recipe} b{b}: host {host:.2f} ms, total {total:.2f} ms per step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.self_device_time_total)
    total_us = sum(e.self_device_time_total for e in events) / 3
    print(f"GPU time per step {total_us / 1e3:.2f} ms; kernels by time per step:")
    for e in events[: args.rows]:
        print(f"  {e.self_device_time_total / 3 / 1e3:7.3f} ms  x{e.count // 3:<3} {e.key[:110]}")


if __name__ == "__main__":
    main()
