"""Training throughput of the demo GPT on 1 and 2 GPUs: one GPU, data parallel (DDP, DP=2),
tensor parallel (TP=2) and tensor parallel with sequence parallelism (TP=2+SP, the column-parallel
inputs gathered in FP8 under delayed and current scaling), each in BF16 and FP8 per recipe.

Every layout trains the same global batch per step (the data-parallel replicas split it, the
tensor-parallel ranks share it) with te_core.demo's model and parallel training (DDP, the
tensor-parallel shards, the gradient reductions), on random tokens; a cell times whole training
steps (forward, loss, backward, clipping, AdamW) after a few warm-up steps, and its tokens/s are
those of all ranks together (the slowest rank's time). Scaling: tokens/s over the one-GPU
run's in the same precision (2.0 is perfect for 2 GPUs); per GPU: tokens/s divided by the GPUs.

    python benchmarks/bench_distributed.py [--hidden 4096] [--layers 4] [--recipes bf16,delayed,current]
                                           [--layouts 1gpu,dp2,tp2,tp2-sp] [--results DIR]
    python benchmarks/bench_distributed.py --smoke --results /tmp/r   # CPU, gloo, reference backend, tiny

The script launches each layout itself (torchrun for the 2-process ones) and writes
RESULTS/<gpu>/distributed.json; `python benchmarks/report.py` renders it into docs/performance.md.
A layout that fails records its error (its output's tail) and the others still run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

# layout -> (processes, tensor-parallel size, sequence parallel)
LAYOUTS = {"1gpu": (1, 1, False), "dp2": (2, 1, False), "tp2": (2, 2, False), "tp2-sp": (2, 2, True)}
PRECISIONS = ("bf16", "delayed", "current", "block", "mxfp8")
LAUNCH_TIMEOUT_S = 600


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    from _results import add_results_argument

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 128)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per cell")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--recipes", default="bf16,delayed,current", help=f"from {','.join(PRECISIONS)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"from {','.join(LAYOUTS)}")
    ap.add_argument("--smoke", action="store_true", help="CPU processes on gloo, reference backend, a tiny model")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a launched layout: where its JSON goes
    add_results_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.heads, args.seq, args.batch, args.steps, args.warmup = 64, 1, 2, 64, 4, 2, 1
    args.heads = args.heads or max(1, args.hidden // 128)
    unknown = sorted(set(args.recipes.split(",")) - set(PRECISIONS))
    unknown += sorted(set(args.layouts.split(",")) - set(LAYOUTS))
    if unknown:
        ap.error(f"unknown recipe or layout {', '.join(unknown)}")
    return args


def _runner_and_device(layout: str):
    """(this process's te_core.demo runner, its device, its backend)."""
    from te_core import backend
    from te_core.demo import parallel
    from te_core.demo.train import ONE_PROCESS

    be = backend.get_backend()
    nproc, tp, sp = LAYOUTS[layout]
    if nproc == 1:
        return ONE_PROCESS, be.device, be
    parallel.use_local_device(be)
    runner, device = parallel.start(be, be.device, tp, sp)
    return runner, device, be


def _cell(runner, config, device, precision: str, args, synchronize) -> Dict[str, float]:
    """tokens/s (all ranks) and this rank's peak memory of `config` trained in `precision`."""
    from te_core.demo.train import make_recipe

    recipe = None if precision == "bf16" else make_recipe(precision)
    torch.manual_seed(0)
    model = runner.build(config, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1), generator=gen).to(device)
    inputs, targets = runner.local_batch(tokens[:, :-1], tokens[:, 1:])
    if device.type != "cpu":
        torch.get_device_module(device.type).reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize()
            start = time.perf_counter()
        loss = model(inputs, targets, recipe)
        optimizer.zero_grad(set_to_none=True)
        runner.backward(loss)
        runner.clip_grad_norm_(params, 1.0)
        optimizer.step()
    synchronize()
    seconds = runner.slowest(time.perf_counter() - start)
    cell = dict(tokens_per_s=config.tokens_per_step * args.steps / seconds, step_ms=1e3 * seconds / args.steps,
                loss=float(loss))
    if device.type != "cpu":
        cell["peak_memory_gb"] = torch.get_device_module(device.type).max_memory_allocated(device) / 2**30
    return cell


def worker(args, layout: str) -> None:
    """One launched layout: every precision in turn; rank 0 writes the cells to args.worker."""
    from te_core.demo.main import synchronizer
    from te_core.demo.model import GPTConfig

    runner, device, be = _runner_and_device(layout)
    config = GPTConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads, seq_len=args.seq,
                       batch_size=args.batch)
    cells = {}
    for precision in args.recipes.split(","):
        try:
            cells[f"{layout} {precision}"] = _cell(runner, config, device, precision, args, synchronizer(be, device))
        except Exception as err:  # recorded in the JSON; the next precision still runs
            cells[f"{layout} {precision}"] = {"error": f"{type(err).__name__}: {str(err).strip()[:400]}"}
        gc_device(device)
    if runner.is_main:
        with open(args.worker, "w") as f:
            json.dump(cells, f)
    if LAYOUTS[layout][0] > 1:
        runner.close()


def gc_device(device: torch.device) -> None:
    """Free the previous cell's memory before the next cell builds its model."""
    import gc

    gc.collect()
    if device.type != "cpu":
        torch.get_device_module(device.type).empty_cache()


def _worker_argv(args, layout: str, out: str) -> List[str]:
    sizes = ("hidden", "layers", "heads", "seq", "batch", "steps", "warmup")
    argv = [item for name in sizes for item in (f"--{name}", str(getattr(args, name)))]
    return argv + ["--recipes", args.recipes, "--layouts", layout, "--worker", out] + (["--smoke"] if args.smoke else [])


def launch(args, layout: str) -> Dict[str, dict]:
    """Run one layout in fresh processes (torchrun for several); its cells, or its error in each cell."""
    nproc = LAYOUTS[layout][0]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cells.json")
        script = [os.path.abspath(__file__), *_worker_argv(args, layout, out)]
        command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
                   if nproc > 1 else [sys.executable, *script])
        env = dict(os.environ, TE_BACKEND="reference", OMP_NUM_THREADS="1") if args.smoke else dict(os.environ)
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
            failure = None if done.returncode == 0 else (done.stderr or done.stdout)[-1500:]
        except subprocess.TimeoutExpired:
            failure = f"did not finish within {LAUNCH_TIMEOUT_S} s"
        if failure is None and os.path.exists(out):
            with open(out) as f:
                return json.load(f)
    failure = failure or "rank 0 wrote no results"
    return {f"{layout} {p}": {"error": failure} for p in args.recipes.split(",")}


def _summary(cell: dict) -> str:
    return f"{cell['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in cell else cell["error"].strip().splitlines()[-1]


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args, args.layouts)
        return
    from _results import meta, write_json

    cells: Dict[str, dict] = {}
    for layout in args.layouts.split(","):
        measured = launch(args, layout)
        cells.update(measured)
        print(f"{layout}: " + "; ".join(f"{name.split()[1]} {_summary(c)}" for name, c in measured.items()), flush=True)
    settings = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq, batch=args.batch,
                    steps=args.steps, warmup=args.warmup, smoke=args.smoke)
    data = dict(meta=meta("cpu" if args.smoke else "cuda"), settings=settings, cells=cells)
    print(f"wrote {write_json('distributed', data, args.results)}")


if __name__ == "__main__":
    main()
