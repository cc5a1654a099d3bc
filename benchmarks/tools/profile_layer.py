"""Where a te.TransformerLayer training step (h4096, ffn 16384, 32 heads, s2048; --hidden scales it) spends GPU time:
host enqueue against total time per step, then its kernels by CUDA time (torch.profiler), summed
by family (GEMMs, attention, element-wise adds, FP8 casts, norms, activations). Given bf16 and an
FP8 recipe, it also prints what bounds FP8's ratio: the GEMMs' ratio alone, and the ratio FP8
would reach if each of its other kernels cost what bf16's do.

With --modes eager,compiled it profiles each recipe's step eagerly and with the forward under
torch.compile as well, and prints where the compiled step's kernels differ from the eager one's
(family by family: GPU time and kernel count).

    python benchmarks/tools/profile_layer.py [--recipes delayed,bf16] [--modes eager,compiled] [--batch 8] [--rows 40]
                                             [--grads accumulate|none] [--hidden 4096]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: shared helpers
from _layer import H, RECIPES, inputs, te_layer, training_step  # noqa: E402
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
MODES = ("eager", "compiled")


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


def profile_step(step, steps: int = 3) -> Tuple[Dict[str, float], Dict[str, float]]:
    """({kernel name: GPU microseconds per step}, {kernel name: launches per step}) over `steps`
    profiled steps."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return ({e.key: e.self_device_time_total / steps for e in events}, {e.key: e.count / steps for e in events})


def report(name: str, kernels: Dict[str, float], rows: int, counts: Optional[Dict[str, float]] = None) -> List[str]:
    total = sum(kernels.values())
    launches = by_family(counts) if counts is not None else None
    lines = [f"GPU time per step {total / 1e3:.2f} ms" + (f", {sum(counts.values()):.0f} kernels" if counts else "")
             + "; by family:"]
    for family, t in by_family(kernels).items():
        if t:
            n = f"  {launches[family]:5.0f} kernels" if launches is not None else ""
            lines.append(f"  {t / 1e3:7.3f} ms  {100 * t / total:4.1f}%{n}  {family}")
    lines.append(f"{name}: kernels by time per step:")
    for key, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"  {t / 1e3:7.3f} ms  {key[:110]}")
    return lines


def compared(eager: Tuple[Dict[str, float], Dict[str, float]],
             compiled: Tuple[Dict[str, float], Dict[str, float]]) -> List[str]:
    """Family by family, where the compiled step's kernels differ from the eager step's: GPU time
    and kernel count of each, from their profile_step results."""
    (et, en), (ct, cn) = [(by_family(times), by_family(counts)) for times, counts in (eager, compiled)]
    lines = [f"  compiled over eager: GPU time {sum(ct.values()) / max(sum(et.values()), 1e-9):.3f}x, "
             f"{sum(cn.values()):.0f} against {sum(en.values()):.0f} kernels"]
    for family in et:
        if et[family] or ct[family]:
            lines.append(f"  {family:17s} {et[family] / 1e3:7.3f} -> {ct[family] / 1e3:7.3f} ms, "
                         f"{en[family]:5.0f} -> {cn[family]:5.0f} kernels")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="delayed", help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--modes", default="eager", help="comma-separated, of eager, compiled (the forward, "
                        "te.autocast included, under torch.compile)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=H, help="hidden size (ffn 4x, 128 per head; default %(default)s)")
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--grads", default="accumulate", choices=("accumulate", "none"),
                        help="accumulate into .grad across steps (the benchmarks' step), or drop it first")
    args = parser.parse_args()
    names = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in names if r not in RECIPES]
    if unknown or not names:
        parser.error(f"--recipes: unknown {unknown or names}; choose from {', '.join(RECIPES)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        unknown = [m for m in modes if m not in MODES] or modes
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if not torch.cuda.is_available():
        parser.error("profile_layer.py profiles CUDA kernels: run it on a machine with an NVIDIA GPU")
    x, dy = inputs(args.batch, args.hidden)
    profiles = {}
    for name in names:
        for mode in modes:
            step = training_step(te_layer(args.hidden), x, dy, name, grads=args.grads, compiled=mode == "compiled")
            host, total = host_and_total_ms(step, n=5, warmup=3)
            print(f"layer {name} {mode} b{args.batch}: host {host:.2f} ms, total {total:.2f} ms per step")
            kernels, counts = profile_step(step)
            profiles[name, mode] = kernels, counts
            print("\n".join(report(f"{name} {mode}", kernels, args.rows, counts)))
    for mode in modes:
        for name in names:
            if name != "bf16" and ("bf16", mode) in profiles:
                bf16, fp8 = by_family(profiles["bf16", mode][0]), by_family(profiles[name, mode][0])
                sums, gemms, free = bounds(bf16, fp8)
                print(f"{name} over bf16 ({mode}), by GPU time: kernel sums {sums:.2f}x; GEMMs alone {gemms:.2f}x; "
                      f"with its other kernels as bf16's {free:.2f}x")
    if "compiled" in modes and "eager" in modes:
        for name in names:
            print(f"{name}:")
            print("\n".join(compared(profiles[name, "eager"], profiles[name, "compiled"])))


if __name__ == "__main__":
    main()
