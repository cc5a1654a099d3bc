"""Where a te.TransformerLayer training step (h4096, ffn 16384, 32 heads, s2048) spends GPU time:
host enqueue against total time per step, then its kernels by CUDA time (torch.profiler), summed
by family (GEMMs, attention, element-wise adds, FP8 casts, norms, activations). Given bf16 and an
FP8 recipe, it also prints what bounds FP8's ratio: the GEMMs' ratio alone, and the ratio FP8
would reach if each of its other kernels cost what bf16's do.

    python benchmarks/tools/profile_layer.py [--recipes delayed,bf16] [--batch 8] [--rows 40] [--grads accumulate|none]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: shared helpers
from _layer import RECIPES, inputs, te_layer, training_step  # noqa: E402
from _timing import host_and_total_ms  # noqa: E402

# Matched in order against the lower-cased kernel name; the first family with a match wins.
# "element-wise add" is torch's add kernel: residual adds and .grad accumulation into gradients
# that were not zeroed (--grads accumulate), which bf16 and FP8 steps pay alike.
FAMILIES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("GEMM", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("attention", ("flash", "fmha", "sdpa", "attention", "cudnn")),
    ("element-wise add", ("functor_add",)),
    ("FP8 casts", ("_cast_transpose", "_quantize", "_dbias_ct", "_transpose", "_blockwise", "_mx", "_delayed_update")),
    ("norms", ("_norm",)),
    ("activations", ("_act",)),
)
OTHER = "other"


def kernel_family(name: str) -> str:
    """The family of the kernel called `name` (see FAMILIES), or "other"."""
    lower = name.lower()
    return next((family for family, patterns in FAMILIES if any(p in lower for p in patterns)), OTHER)


def by_family(kernels: Dict[str, float]) -> Dict[str, float]:
    """{family: summed time} of {kernel name: time}, in FAMILIES order, "other" last."""
    sums = {family: 0.0 for family, _ in FAMILIES}
    sums[OTHER] = 0.0
    for name, t in kernels.items():
        sums[kernel_family(name)] += t
    return sums


def bounds(bf16: Dict[str, float], fp8: Dict[str, float]) -> Tuple[float, float, float]:
    """(kernel-sum ratio, GEMMs-alone ratio, ratio with FP8's non-GEMM kernels costing what bf16's
    do) of bf16's family sums over an FP8 recipe's: the last is what FP8 reaches if everything
    but its GEMMs were as cheap as bf16's, i.e. its casts free."""
    total16, total8 = sum(bf16.values()), sum(fp8.values())
    if not (total8 > 0 and fp8["GEMM"] > 0):
        raise ValueError("the FP8 profile has no GEMM time: was the step profiled on a GPU?")
    return total16 / total8, bf16["GEMM"] / fp8["GEMM"], total16 / (fp8["GEMM"] + total16 - bf16["GEMM"])


def profile_step(step, steps: int = 3) -> Dict[str, float]:
    """{kernel name: GPU microseconds per step} over `steps` profiled steps."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {e.key: e.self_device_time_total / steps for e in events}


def report(name: str, kernels: Dict[str, float], rows: int) -> List[str]:
    total = sum(kernels.values())
    lines = [f"GPU time per step {total / 1e3:.2f} ms; by family:"]
    for family, t in by_family(kernels).items():
        if t:
            lines.append(f"  {t / 1e3:7.3f} ms  {100 * t / total:4.1f}%  {family}")
    lines.append(f"{name}: kernels by time per step:")
    for key, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"  {t / 1e3:7.3f} ms  {key[:110]}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="delayed", help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--grads", default="accumulate", choices=("accumulate", "none"),
                        help="accumulate into .grad across steps (the benchmarks' step), or drop it first")
    args = parser.parse_args()
    names = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in names if r not in RECIPES]
    if unknown or not names:
        parser.error(f"--recipes: unknown {unknown or names}; choose from {', '.join(RECIPES)}")
    if not torch.cuda.is_available():
        parser.error("profile_layer.py profiles CUDA kernels: run it on a machine with an NVIDIA GPU")
    x, dy = inputs(args.batch)
    families = {}
    for name in names:
        step = training_step(te_layer(), x, dy, name, grads=args.grads)
        host, total = host_and_total_ms(step, n=5, warmup=3)
        print(f"layer {name} b{args.batch}: host {host:.2f} ms, total {total:.2f} ms per step")
        kernels = profile_step(step)
        families[name] = by_family(kernels)
        print("\n".join(report(name, kernels, args.rows)))
    for name in names:
        if name != "bf16" and "bf16" in families:
            sums, gemms, free = bounds(families["bf16"], families[name])
            print(f"{name} over bf16, by GPU time: kernel sums {sums:.2f}x; GEMMs alone {gemms:.2f}x; "
                  f"with its other kernels as bf16's {free:.2f}x")


if __name__ == "__main__":
    main()
