"""`te-core demo`: train the same small GPT in BF16 and then in FP8, and compare the losses."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import sys
import tempfile
from typing import Callable, Iterator, List, Optional

import torch

from . import parallel, threads
from .data import load_corpus, split, stdlib_dir
from .model import ACCELERATOR_DEFAULT, CPU_DEFAULT, GPT, SIZES
from .report import final_gap, output_paths, side_by_side, speed, write_json, write_plot
from .train import ONE_PROCESS, RECIPES, SETTLE, RunConfig, make_recipe, train

DEFAULT_STEPS = {"tiny": 60, "small": 250, "medium": 600, "large": 2000, "xl": 400}
DEFAULT_LR = {"tiny": 2e-3, "small": 2e-3, "medium": 1e-3, "large": 1e-3, "xl": 5e-4}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="te-core demo",
        description="Train a small GPT (te-core modules) on the Python standard library's source, "
        "in BF16 and then in FP8, and compare the loss curves and the speed.",
    )
    p.add_argument(
        "--recipe", choices=RECIPES, default="delayed", help="FP8 recipe of the second run (default: delayed)"
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: by --size)")
    p.add_argument(
        "--size",
        choices=list(SIZES),
        default=None,
        help=f"model size (default: {CPU_DEFAULT} on a CPU, a few minutes on 2 cores; "
        f"{ACCELERATOR_DEFAULT} on an accelerator, large enough for FP8 to pay)",
    )
    p.add_argument("--backend", default=None, help="te-core backend (default: TE_BACKEND or auto)")
    p.add_argument("--device", default=None, help="torch device to train on (default: the backend's device)")
    p.add_argument("--out", default="demo-out", help="directory for loss_curves.png and demo_run.json")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: by --size)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads when training on the CPU (default: the CPUs that other processes leave idle)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each training step: with CUDA graphs (mode reduce-overhead) on an accelerator in one "
        "process, inductor's default mode on a CPU and under torchrun; the whole-run tokens/s include the compilation, the steady-state "
        f"tokens/s (after the first {SETTLE} steps) leave it out",
    )
    p.add_argument(
        "--capture",
        action="store_true",
        help="after the first step, capture each transformer layer's forward and backward as device graphs "
        "(te_core.make_graphed_callables; the embedding, head, loss and optimizer stay eager): for steps bound by "
        "host time. One process on an accelerator with graph capture",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks per model replica when launched with torchrun --nproc-per-node N "
        "(N / tp data-parallel replicas; default 1: data parallelism only)",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: also split the sequence over the tensor-parallel ranks outside the GEMMs",
    )
    p.add_argument(
        "--pin-host-thread",
        action="store_true",
        help="keep the training thread and autograd's backward thread on one CPU (te_core.pin_host_threads; "
        "on an accelerator, Linux only). Off by default: at the demo's sizes the GPU bounds the step",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--verbose", action="store_true", help="also show `te-core info` (backends, op table) and the corpus"
    )
    return p


def synchronizer(be, device: torch.device) -> Callable[[], None]:
    """A function that waits for the work queued on `device`: through the backend's device module
    where it serves this device type, torch's device module otherwise; nothing to wait for on a CPU."""
    if device.type == "cpu":
        return lambda: None
    module = be.device_module if device.type == be.device_type else torch.get_device_module(device.type)
    return lambda: module.synchronize(device)


def compile_options(compile: bool, device: torch.device, processes: int = 1) -> Optional[dict]:
    """torch.compile's arguments for --compile: CUDA graphs, which remove the host time that makes
    small FP8 steps slow, on an accelerator in one process; inductor's default on a CPU and under
    torchrun (capturing DistributedDataParallel's gradient hooks and the layers' collectives in
    CUDA graphs is not verified yet). None without --compile."""
    if not compile:
        return None
    return {} if device.type == "cpu" or processes > 1 else {"mode": "reduce-overhead"}


def default_size(device: torch.device) -> str:
    """The --size default: small on a CPU; on any other device (an accelerator) large enough for FP8 to pay."""
    return CPU_DEFAULT if device.type == "cpu" else ACCELERATOR_DEFAULT


def main(argv: Optional[List[str]] = None) -> int:
    """`te-core demo [options]`: returns the process exit status."""
    args = build_parser().parse_args(argv)
    error = _check_args(args)
    if error:
        print(f"te-core demo: {error}", file=sys.stderr)
        return 2
    from .. import backend

    try:
        be = backend.set_backend(args.backend) if args.backend else backend.get_backend()
    except backend.BackendError as err:
        print(f"te-core demo: {'--backend ' + args.backend if args.backend else 'backend'}: {err}", file=sys.stderr)
        return 2
    if parallel.launched_world() > 1:  # before anything touches the first device
        parallel.use_local_device(be)
    device, error = _device(args.device, be)
    if error:
        print(f"te-core demo: {error}", file=sys.stderr)
        return 2
    if args.pin_host_thread and device.type == "cpu":
        print("te-core demo: --pin-host-thread is for training on an accelerator: on the CPU the model's own "
              "threads need the cores", file=sys.stderr)
        return 2
    args.size = args.size or default_size(device)
    world = parallel.launched_world()
    error = _check_capture(args, device, world)
    if error:
        print(f"te-core demo: {error}", file=sys.stderr)
        return 2
    if world > 1 or args.tp > 1 or args.sequence_parallel:
        return run_parallel(args, be, device, world)
    with _cpu_threads(args, device) as thread_choice, _host_pinning(args, device):
        run_both(args, be, device, thread_choice)
    return 0


def run_parallel(args, be, device: torch.device, world: int) -> int:
    """This rank's part of a torchrun launch: the same two runs, with data and tensor parallelism;
    only rank 0 prints and writes the report."""
    error = parallel.check_layout(world, args.tp, args.sequence_parallel, args.size, SIZES[args.size])
    if error:
        print(f"te-core demo: {error}", file=sys.stderr)
        return 2
    runner, device = parallel.start(be, device, args.tp, args.sequence_parallel)
    if device.type == "cpu" and args.threads is None:  # the ranks share the CPUs
        args.threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    try:
        with contextlib.ExitStack() as stack:
            if not runner.is_main:
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
            thread_choice = stack.enter_context(_cpu_threads(args, device))
            stack.enter_context(_host_pinning(args, device))
            run_both(args, be, device, thread_choice, runner)
    finally:
        runner.close()
    return 0


def run_both(args, be, device: torch.device, thread_choice, runner=ONE_PROCESS) -> None:
    """Train in BF16, then FP8, with the same model, data and steps; print and write the report."""
    fp8_recipe = make_recipe(args.recipe)
    steps = args.steps or DEFAULT_STEPS[args.size]
    cfg = RunConfig(model=SIZES[args.size], steps=steps, lr=args.lr or DEFAULT_LR[args.size], seed=args.seed)
    tokens, files = load_corpus(max_bytes=max(2_000_000, 40 * steps * cfg.model.tokens_per_step // 100))
    corpus = dict(bytes=tokens.numel(), files=files, root=stdlib_dir())
    _print_header(args, be.name, device, cfg, thread_choice, corpus)
    layout = runner.layout
    if layout is not None:
        print(f"  ranks  {layout.describe()}; the global batch is the single-process run's")
    train_tokens, val_tokens = split(tokens)
    runs = []
    for name, rec in (("bf16", None), ("fp8", fp8_recipe)):
        run = train(name, cfg, train_tokens, val_tokens, device, rec, runner.is_main and not args.no_progress,
                    synchronizer(be, device), compile_options(args.compile, device, parallel.launched_world()), runner,
                    capture=args.capture)
        ranks = "" if layout is None else f" ({layout.world} ranks, {run.tokens_per_s / layout.world:,.0f} per rank)"
        print(f"{name}: {run.seconds:.1f}s, {run.tokens_per_s:,.0f} tokens/s ({_rate(run.steady_tokens_per_s)} after "
              f"the first {SETTLE} steps){ranks}, final loss {run.losses[-1]:.4f}, "
              f"val loss {run.val_loss:.4f}")  # fmt: skip
        runs.append(run)
    if runner.is_main:
        report(args, cfg, be.name, device, fp8_recipe, runs, corpus, thread_choice, layout)


def speed_line(rates) -> str:
    """The speed, the steady state first: the first SETTLE steps hold one-time costs (compilation,
    the kernels' first-call tuning) that swing a short run's whole-run ratio either way, so the
    steady ratio is the one that says what FP8 buys."""
    def both(prefix: str) -> str:
        return (f"bf16 {_rate(rates[prefix.format('bf16')])} tokens/s, fp8 {_rate(rates[prefix.format('fp8')])} "
                f"tokens/s")

    whole = f"{both('{}_tokens_per_s')}, fp8/bf16 {_times(rates['fp8_over_bf16'])}"
    if not math.isfinite(rates["fp8_over_bf16_steady"]):
        return f"speed over the whole run: {whole} (no steady state: a run of {SETTLE} steps or fewer)"
    return (f"speed after the first {SETTLE} steps (compilation, warm-up): {both('{}_steady_tokens_per_s')}, "
            f"fp8/bf16 {_times(rates['fp8_over_bf16_steady'])}; over the whole run: {whole}")


def _rate(tokens_per_s: float) -> str:
    """'12,345', or 'n/a' for a run too short to have a steady state (NaN)."""
    return f"{tokens_per_s:,.0f}" if math.isfinite(tokens_per_s) else "n/a"


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "n/a"


def _device(name: Optional[str], be):
    """(device, None) for --device (default: the backend's device), or (None, what is wrong with it)."""
    if name is None:
        return be.device, None
    try:
        device = torch.device(name)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as err:  # a malformed name, or a device this torch build cannot use
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None, f"--device {name}: not usable here ({first}); leave it out to use the backend's device"
    if device.type == "meta":  # (tensors without data: nothing to train)
        return None, f"--device {name}: meta tensors hold no data to train on; leave it out to use the backend's device"
    return device, None


def _check_args(args) -> Optional[str]:
    """What is wrong with the arguments argparse accepted, or None."""
    if args.steps is not None and args.steps < 2:
        return f"--steps must be at least 2, got {args.steps}"
    if args.threads is not None and args.threads < 1:
        return f"--threads must be at least 1, got {args.threads}"
    if args.tp < 1:
        return f"--tp must be at least 1, got {args.tp}"
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        return f"--lr must be a positive finite number, got {args.lr}"
    out_problem = _check_out(args.out)
    if out_problem:
        return out_problem
    if args.capture and args.compile:
        return ("--capture and --compile are two ways to take the host out of the step (te_core.make_graphed_callables "
                "over the layers, torch.compile with CUDA graphs over the whole step); choose one")
    if args.pin_host_thread and not hasattr(os, "sched_setaffinity"):
        return "--pin-host-thread needs CPU affinity (os.sched_setaffinity), which only Linux has"
    return None


def _check_out(out: str) -> Optional[str]:
    """What would keep the demo from writing its results into `out` after training, found before
    it trains (nothing is made here), or None."""
    fix = "give a directory you can write to, for loss_curves.png and demo_run.json"
    path = os.path.abspath(out)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"--out {out!r} is a file; {fix}"
        try:  # (only writing tells: os.access answers yes to root for /proc and /sys)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as error:
            return f"--out {out!r} is not writable ({error.strerror}); {fix}"
        return None
    made = []  # the directories the run would make, made and removed again: only trying tells (root, /proc)
    try:
        head = path
        while not os.path.exists(head):
            made.append(head)
            head = os.path.dirname(head)
        os.makedirs(path)
    except OSError as error:
        return f"--out {out!r} cannot be made ({error.strerror}); {fix}"
    finally:
        for directory in made:
            if os.path.isdir(directory):
                os.rmdir(directory)
    return None


def _check_capture(args, device: torch.device, world: int) -> Optional[str]:
    """What keeps --capture from running here, or None."""
    if not args.capture:
        return None
    if world > 1 or args.tp > 1 or args.sequence_parallel:
        return "--capture runs in one process; under torchrun or with --tp, leave it out (or use --compile)"
    from ..graphs import _graph_api  # the device's graph capture, as make_graphed_callables finds it

    if _graph_api(device) is None:
        return (f"--capture needs an accelerator whose torch module captures graphs; {device} has none, so leave "
                "--capture out there")
    return None


@contextlib.contextmanager
def _host_pinning(args, device: torch.device) -> Iterator[None]:
    """With --pin-host-thread, the training and backward threads pinned to one CPU while the demo
    runs (te_core.host_threads says why; under torchrun, each rank to a CPU of its own share).
    Sets args.pinned_cpu (None: not pinned)."""
    args.pinned_cpu = None
    if not args.pin_host_thread:
        yield
        return
    from ..host_threads import pin_host_threads

    with pin_host_threads(device=device) as pinning:
        args.pinned_cpu = pinning.cpu
        yield


@contextlib.contextmanager
def _cpu_threads(args, device: torch.device) -> Iterator[Optional[threads.ThreadChoice]]:
    """On a CPU, torch's intra-op threads set for the demo (te_core.demo.threads says why) and
    restored after it; None elsewhere."""
    if device.type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    choice = threads.pick(args.threads)
    torch.set_num_threads(choice.threads)
    try:
        yield choice
    finally:
        torch.set_num_threads(before)


def _print_header(args, backend_name: str, device, cfg: RunConfig, thread_choice, corpus: dict) -> None:
    """A few lines on what runs where; --verbose adds `te-core info` and the corpus."""
    if args.verbose:
        from .. import info

        print(info.render(info.collect()), end="\n\n")
    m = cfg.model
    params = GPT(m, torch.device("meta")).num_parameters()
    where = f"{device}" + (f", {thread_choice.describe()}" if thread_choice else "")
    print(f"te-core demo: backend {backend_name} on {where}")
    print(f"  model  {args.size}: {params / 1e6:.1f}M parameters, hidden {m.hidden_size}, layers {m.num_layers}, "
          f"heads {m.num_heads}, seq {m.seq_len}, batch {m.batch_size} "
          f"({m.tokens_per_step:,} tokens/step)")  # fmt: skip
    if getattr(args, "pinned_cpu", None) is not None:
        print(f"  host   training and backward threads pinned to CPU {args.pinned_cpu}")
    mode = (", compiled (torch.compile)" if args.compile else
            ", layers captured as graphs after the first step (te_core.make_graphed_callables)" if args.capture else "")
    print(f"  runs   bf16, then fp8 with recipe {args.recipe}; {cfg.steps} steps each, peak lr {cfg.lr:g}{mode}")
    if _fp8_emulated():
        print("  note   the reference backend emulates the FP8 GEMMs (exact FP8 casts, float32 GEMMs): the loss gap\n"
              "         is FP8's, the speed is not (FP8 only adds work here; FP8 hardware is what makes it pay)")
    if thread_choice is not None and thread_choice.oversubscribed:
        print(f"  note   --threads {thread_choice.threads} is more than the {thread_choice.cpus} CPUs this process may "
              "run on: threads\n         share cores and each op waits for the slowest (fewer threads are faster)")
    if thread_choice is not None and thread_choice.reduced:
        print(f"  note   other processes keep CPUs busy, so fewer threads than torch's {thread_choice.default} "
              "(--threads N to choose); speeds vary with the load")  # fmt: skip
    if args.verbose:
        print(f"  data   {corpus['bytes'] / 1e6:.1f} MB from {corpus['files']} files under {corpus['root']}")


def _fp8_emulated() -> bool:
    """Whether the FP8 GEMMs run on the reference implementation (selected, pinned by
    TE_BACKEND_OVERRIDES, or the fallback of a backend without them), which computes them in float32."""
    from ..backend.registry import REFERENCE, REGISTRY

    selection = REGISTRY.selection()
    backend = selection.overrides.get("gemm_fp8", selection.backend)
    return backend.name == REFERENCE or "gemm_fp8" not in backend.ops


def report(args, cfg: RunConfig, backend_name: str, device, fp8_recipe, runs, corpus: dict, thread_choice,
           layout: Optional[parallel.Layout] = None) -> None:
    """Print the curves side by side, the gap and the speeds; write the PNG and the JSON of the run."""
    hp, fp8 = runs
    gap = final_gap(hp.losses, fp8.losses)
    gap["val_gap"] = fp8.val_loss - hp.val_loss
    rates = speed(hp.tokens_per_s, fp8.tokens_per_s, hp.steady_tokens_per_s, fp8.steady_tokens_per_s)
    print(side_by_side(hp.losses, fp8.losses))
    print(
        f"loss over the last {gap['steps_averaged']} steps: bf16 {gap['bf16']:.4f}, fp8 {gap['fp8']:.4f}, "
        f"gap {gap['gap']:+.4f} ({100 * gap['relative_gap']:+.2f}%); val gap {gap['val_gap']:+.4f}"
    )
    print(speed_line(rates))
    paths = output_paths(args.out)
    write_plot(paths["png"], hp.losses, fp8.losses, args.recipe)
    config = dict(size=args.size, model=cfg.model.as_dict(), steps=cfg.steps, lr=cfg.lr, seed=cfg.seed,
                  recipe=args.recipe, recipe_repr=repr(fp8_recipe),
                  threads=thread_choice.threads if thread_choice else None,
                  pinned_cpu=getattr(args, "pinned_cpu", None),
                  mode="compiled" if args.compile else "captured" if args.capture else "eager")  # fmt: skip
    if layout is not None:  # tokens/s are then those of all ranks together
        config["parallel"] = layout.as_dict()
    record = dict(
        config=config, backend=backend_name, device=str(device), recipe=args.recipe,
        versions=dict(python=platform.python_version(), torch=torch.__version__), corpus=corpus,
        runs={run.name: run.as_dict() for run in runs}, final_gap=gap, speed=rates, plot=dict(path=paths["png"]),
    )  # fmt: skip
    write_json(paths["json"], record)
    print(f"wrote {paths['png']} and {paths['json']}")
