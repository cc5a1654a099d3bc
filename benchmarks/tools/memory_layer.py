"""What is alive at the peak of one training step of the benchmark layer (h4096, ffn 16384, 32
heads, s2048): replays the CUDA caching allocator's trace (torch.cuda.memory._record_memory_history)
and groups the blocks allocated during the step and alive at its peak by the innermost te_core /
benchmark source line that allocated them.

    python benchmarks/tools/memory_layer.py [--variants te-delayed,te-current,te-bf16,torch] [--batch 8]
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: shared helpers
from _layer import inputs, te_layer, torch_layer, training_step  # noqa: E402

OURS = ("te_core/", "benchmarks/")
PLUMBING = ("te_core/backend/", "te_core/ops/")  # every op passes through these: not informative


def site(frames):
    """The two innermost te_core (or benchmark) frames outside the op-dispatch plumbing."""
    ours = [f for f in frames if any(k in f.get("filename", "") for k in OURS)
            and not any(k in f.get("filename", "") for k in PLUMBING)]
    if not ours:
        return "(no te_core frame: autograd engine / torch internals)"
    return " < ".join(f"{f['filename'].split('/')[-1]}:{f.get('line')} {f.get('name')}" for f in ours[:2])


def peak_breakdown(step, rows=14):
    step()
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() - base
    live, total, best, best_live, at = {}, 0, 0, {}, ""
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], site(ev.get("frames", [])))
            total += ev["size"]
            if total > best:
                best, best_live, at = total, dict(live), live[ev["addr"]][1]
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]
    by_site = defaultdict(int)
    for size, where in best_live.values():
        by_site[where] += size
    print(f"  peak above the step's start {peak / 2**20:.0f} MiB; the step's own blocks at their peak "
          f"{best / 2**20:.0f} MiB (the rest: blocks from before the step), reached at {at}")
    for where, size in sorted(by_site.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"  {size / 2**20:8.0f} MiB  {where}")
    print("  largest blocks at the peak:", ", ".join(f"{size / 2**20:.0f}" for size, _ in
                                                    sorted(best_live.values(), key=lambda v: -v[0])[:16]), "MiB")


def make_step(variant, x, dy):
    if variant == "torch":
        return training_step(torch_layer(), x, dy, "bf16")
    return training_step(te_layer(), x, dy, variant.removeprefix("te-"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="te-delayed,te-bf16,torch")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    x, dy = inputs(args.batch)
    for variant in args.variants.split(","):
        print(f"{variant}:")
        peak_breakdown(make_step(variant, x, dy))
        x.grad = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
