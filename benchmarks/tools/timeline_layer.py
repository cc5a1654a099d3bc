"""Where the wall time of an FP8 te.TransformerLayer step goes beyond its kernels: per-step
wall time by CUDA events, then a torch.profiler trace of a few steps read as a timeline, i.e.
GPU busy time, the idle gaps between kernels, and for each gap whether the next kernel had
not been launched yet (the host was late) or was already queued (the GPU waited on something
else). Also counts synchronising and allocating runtime calls per step.

    python benchmarks/tools/timeline_layer.py [--recipe delayed|current|block|bf16] [--steps 6] [--grads accumulate|none]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: shared helpers
from _layer import inputs, te_layer, training_step  # noqa: E402

GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")
SYNCING = ("Synchronize", "cudaMemcpy", "cudaFree", "cudaMalloc", "cudaHostAlloc", "cudaEventSynchronize")


def _busy(gpu):
    busy, end = 0.0, None
    for e in gpu:
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is None or t > end:
            busy += t - (s if end is None else max(s, end))
            end = t
    return busy


def event_times(step, n):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        step()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def read_trace(prof):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def analyse(events, steps):
    """Timeline of the profiled steps; each step starts with a marker kernel (torch.cuda._sleep),
    so every step is also reported on its own (the first one starts from an idle GPU)."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS and "dur" in e), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e]
    starts = [e["ts"] for e in gpu if "spin" in e["name"]] + [gpu[-1]["ts"] + gpu[-1]["dur"]]
    for i in range(len(starts) - 1):
        inside = [e for e in gpu if starts[i] <= e["ts"] < starts[i + 1] and "spin" not in e["name"]]
        busy_i = _busy(inside)
        print(f"  step {i}: span {(starts[i + 1] - starts[i]) / 1e3:.2f} ms, busy {busy_i / 1e3:.2f} ms, "
              f"{len(inside)} GPU ops")
    gpu = [e for e in gpu if "spin" not in e["name"]]
    launch_end = {e["args"].get("correlation"): e["ts"] + e["dur"] for e in runtime if "args" in e}
    busy, gaps, end, prev = 0.0, [], None, None
    for e in gpu:
        s, t = e["ts"], e["ts"] + e["dur"]
        if end is not None and s > end:
            launched = launch_end.get(e.get("args", {}).get("correlation"))
            gaps.append((s - end, launched is not None and launched > end, prev["name"][:60], e["name"][:60]))
        if end is None or t > end:
            busy += t - (s if end is None else max(s, end))
            end, prev = t, e
    span = end - gpu[0]["ts"]
    idle = sum(g[0] for g in gaps)
    late = sum(g[0] for g in gaps if g[1])
    print(f"timeline of {steps} steps: span {span / steps / 1e3:.2f} ms per step, GPU busy "
          f"{busy / steps / 1e3:.2f} ms, idle {idle / steps / 1e3:.3f} ms ({late / steps / 1e3:.3f} ms of it "
          f"with the next kernel not yet launched), {len(gaps) / steps:.0f} gaps per step")
    calls = Counter(e["name"] for e in runtime if any(k in e["name"] for k in SYNCING))
    print("syncing/allocating runtime calls per step:",
          {k: round(v / steps, 2) for k, v in calls.items()} or "none")
    print("largest gaps (us, host late?, after -> before):")
    for g in sorted(gaps, reverse=True)[:15]:
        print(f"  {g[0]:8.1f}  {'host' if g[1] else 'gpu '}  {g[2]}  ->  {g[3]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="delayed", choices=("delayed", "current", "block", "bf16"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--grads", default="accumulate", choices=("accumulate", "none"))
    args = parser.parse_args()
    x, dy = inputs(args.batch)
    step = training_step(te_layer(), x, dy, args.recipe, args.grads)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    times = event_times(step, 20)
    ts = sorted(times)
    print(f"layer {args.recipe}, grads {args.grads}: CUDA-event ms per step over 20 steps: median {ts[10]:.2f}, min {ts[0]:.2f}, "
          f"max {ts[-1]:.2f}; first 5: {', '.join(f'{t:.2f}' for t in times[:5])}")
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            torch.cuda._sleep(1)  # a marker kernel: where each step starts on the timeline
            step()
        torch.cuda.synchronize()
    analyse(read_trace(prof), args.steps)


if __name__ == "__main__":
    main()
