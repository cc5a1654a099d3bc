"""Host cost of one te.Linear training step: what the CPU does per forward+backward, per recipe.

Where a step is bound by the host (small layers, or any eager step on a slow CPU), FP8 pays
only if its Python and launches cost little more than bf16's. Per variant (bf16 nn.Linear, te
bf16, te FP8 per recipe) and shape, after warm-up, one forward+backward with the gradients
dropped between steps:
- wall time per step (the device synchronized at both ends of a timed run of steps), with the
  backward on autograd's device thread (torch's default), on the calling thread
  (`torch.autograd.set_multithreading_enabled(False)` around it), and (on a GPU) on the device
  thread with both threads pinned to one CPU (`te.pin_host_threads` around each timed run);
- torch operations per step (each call that reaches torch's dispatcher, counted by a dispatch mode);
- kernel launches per step (on a GPU: the runtime's launch calls in torch.profiler's trace,
  CUDA-graph launches included);
- Python function calls per step, and those of te-core and its backends with their own time
  (cProfile; the profiler itself slows the step, so its times are shares, not speeds);
- on the smallest shape (not with --smoke), the same step with its forward (te.autocast
  included) under torch.compile, the backward on either thread;
- where te_triton's C launch is on (te-core info says), the te variants' step again with it off
  (te_triton.launch.use_c_launch(False) around each timed run): what the C extension saves;
- te-core's own host time (te variants): the step, backward on the calling thread, with every
  contract op returning what it returned in one recorded step instead of running on the backend
  (OpsReplayed): what remains is the module layer, its tensor bookkeeping and autograd. The step
  time minus this is what the backend's ops cost the host (and the GPU, where it is the bound).
A shape's variants are timed together in interleaved rounds (each variant's median over the
rounds), so that the host's drift during the run falls on all of them alike and their ratios
hold; counts come from a separate instance of each step.
The target: the tiny layer's FP8 step costs at most twice te's own bf16 step.

    python benchmarks/bench_host.py [--results DIR]            # on a GPU (cuda backend)
    python benchmarks/bench_host.py --smoke --results /tmp/r   # CPU, reference backend, tiny

Writes RESULTS/<gpu>/host.json; `python benchmarks/report.py` renders it into docs/performance.md.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import os
import pstats
from functools import partial
from typing import Callable, Dict, Optional

import torch
from _results import add_results_argument, meta, select_device, write_json
from _timing import Interleaved
from torch.utils._python_dispatch import TorchDispatchMode

import te_core as te
from te_core import recipe
from te_core.backend import dispatch
from te_core.ops import CONTRACT

SECTION = "host"
RECIPES = {"delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling}
VARIANTS = ("nn.Linear", "te bf16", *(f"te {name}" for name in RECIPES))
SHAPES = {"full": ((128, 1024, 1024), (8192, 4096, 4096)), "smoke": ((16, 128, 128),)}  # (M, K, N)
OWN_CODE = ("te_core", "te_triton", "te_backend_")  # te-core's Python and its backends'
LAUNCH_EVENTS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def shape_label(shape) -> str:
    m, k, n = shape
    return f"M{m} K{k} N{n}"


def make_step(variant: str, shape, device: str, calling_thread: bool = False,
              compiled: bool = False) -> Callable[[], None]:
    """One forward+backward of `variant` at `shape`, gradients dropped between steps; with
    `calling_thread`, the backward runs on the calling thread instead of autograd's device thread;
    with `compiled`, the forward (te.autocast included) is torch.compile'd."""
    m, k, n = shape
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    if variant == "nn.Linear":
        module = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
        rcp = None
    else:
        module = te.Linear(k, n, params_dtype=torch.bfloat16, device=device)
        rcp = None if variant == "te bf16" else RECIPES[variant.split()[1]]()
    params = list(module.parameters())

    def forward(inp):
        if rcp is None:
            return module(inp)
        with te.autocast(recipe=rcp):
            return module(inp)

    forward = torch.compile(forward) if compiled else forward

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        y = forward(x)
        if calling_thread:
            with torch.autograd.set_multithreading_enabled(False):
                y.sum().backward()
        else:
            y.sum().backward()

    return step


class OpsReplayed:
    """A step whose contract ops replay their outputs: make() builds the step, warms it up and
    records what each op returns in one more call; within active(), each op returns those
    outputs again in the order it returned them, running nothing on the backend. The ops'
    runners (the cached dispatch, te_core.backend.dispatch) are swapped for the recording and
    the replay and restored after each."""

    def __init__(self, make: Callable[[], Callable[[], None]]):
        self._make = make
        self._outputs: Dict[str, list] = collections.defaultdict(list)

    def make(self) -> Callable[[], None]:
        step = self._make()
        for _ in range(3):  # scaling state made, kernels compiled
            step()
        outputs = self._outputs

        def recording(op, run):
            def record(*args, **kwargs):
                out = run(*args, **kwargs)
                outputs[op.name].append(out)
                return out
            return record

        with _runners(recording):
            step()
        return step

    @contextlib.contextmanager
    def active(self):
        calls: Dict[str, int] = collections.Counter()

        def replaying(op, run):
            outs = self._outputs.get(op.name)
            if not outs:
                return run

            def replay(*args, **kwargs):
                i = calls[op.name]
                calls[op.name] = i + 1
                return outs[i % len(outs)]
            return replay

        with _runners(replaying):
            yield


@contextlib.contextmanager
def _runners(wrap):
    """Every contract op's eager runner replaced by wrap(op, runner), restored on exit."""
    saved = {op: dispatch._cached(op) for op in CONTRACT.values()}
    try:
        for op, (generation, resolution, run) in saved.items():
            op._cache = (generation, resolution, wrap(op, run))
        yield
    finally:
        for op, cached in saved.items():
            op._cache = cached


def _c_launch_on() -> bool:
    """Whether te_triton's repeated launches go through its C extension in this process."""
    try:
        from te_triton import launch
    except ImportError:
        return False
    return launch.c_launch_on()


@contextlib.contextmanager
def _python_launches():
    """te_triton's launches kept in Python (its C launch off) inside, as they were after."""
    from te_triton import launch

    previous = launch.use_c_launch(False)
    try:
        yield
    finally:
        launch.use_c_launch(previous)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def launches_per_step(step, device: str, steps: int) -> Optional[float]:
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCH_EVENTS) / steps


def python_calls(step, steps: int) -> Dict[str, float]:
    """Python function calls per step, and te-core's (and its backends') calls and share of the
    profiled time. Backward runs on the calling thread here, so that cProfile sees it too."""
    previous = torch.autograd.is_multithreading_enabled()
    torch.autograd.set_multithreading_enabled(False)
    profiler = cProfile.Profile()
    try:
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
    finally:
        torch.autograd.set_multithreading_enabled(previous)
    stats = pstats.Stats(profiler).stats
    total_calls = sum(nc for (_, _, _), (_, nc, _, _, _) in stats.items())
    total_time = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items()) or 1.0
    own = [(nc, tt) for (path, _, _), (_, nc, tt, _, _) in stats.items() if _is_own(path)]
    return {"python_calls": total_calls / steps, "own_python_calls": sum(nc for nc, _ in own) / steps,
            "own_python_share": sum(tt for _, tt in own) / total_time}


def _is_own(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return any(part.startswith(OWN_CODE) for part in parts[:-1])


ROUNDS = 5


def counts(variant: str, shape, device: str, steps: int) -> dict:
    """torch operations, launches and Python calls of one step of `variant`."""
    step = make_step(variant, shape, device)
    for _ in range(max(3, steps // 4)):  # warm-up: kernels compiled, scaling state made
        step()
    counter = _CountOps()
    with counter:
        step()
    cell = {"torch_ops": counter.count, "launches": launches_per_step(step, device, steps)}
    cell.update({k: round(v, 3) for k, v in python_calls(step, steps).items()})
    return cell


def _once(make: Callable[[], Callable[[], None]]) -> Callable[[], Callable[[], None]]:
    """`make`, called once: cells that time one step in two settings share it (one compile)."""
    made = []

    def get():
        if not made:
            made.append(make())
        return made[0]

    return get


def measure_row(shape, device: str, steps: int, compiled: bool = False) -> Dict[str, dict]:
    """Every variant at `shape`: wall time (interleaved with the others, `steps` calls per round)
    and counts; with `compiled`, also the compiled step with the backward on either thread; a
    variant that fails is reported, the rest still measured."""
    group = Interleaved(steps * ROUNDS, device, rounds=ROUNDS)
    walls = {(variant, calling): group.cell(partial(make_step, variant, shape, device, calling))
             for variant in VARIANTS for calling in (False, True)}
    replayed = {}
    for variant in VARIANTS[1:]:  # te's: nn.Linear calls no te-core op
        ops = OpsReplayed(partial(make_step, variant, shape, device, True))
        replayed[variant] = group.cell(ops.make, around=ops.active)
    compiled_cells = {}
    for variant in VARIANTS if compiled else ():
        make = _once(partial(make_step, variant, shape, device, False, True))
        compiled_cells[variant] = (group.cell(make), group.cell(
            make, around=partial(torch.autograd.set_multithreading_enabled, False)))
    python_launch = {}
    if _c_launch_on():  # the same step with every te_triton launch kept in Python
        python_launch = {variant: group.cell(partial(make_step, variant, shape, device), around=_python_launches)
                         for variant in VARIANTS[1:]}
    pinned = {}
    if torch.device(device).type != "cpu":  # on a CPU the model's own threads need the cores
        pinned = {variant: group.cell(partial(make_step, variant, shape, device),
                                      around=partial(te.pin_host_threads, device=device)) for variant in VARIANTS}
    row = {}
    for variant in VARIANTS:
        try:
            row[variant] = {"us": round(walls[(variant, False)]()["us"], 1),
                            "us_calling_thread": round(walls[(variant, True)]()["us"], 1),
                            **({"us_pinned": round(pinned[variant]()["us"], 1)} if pinned else {}),
                            **({"us_ops_replayed": round(replayed[variant]()["us"], 1)} if variant in replayed else {}),
                            **({"us_python_launch": round(python_launch[variant]()["us"], 1)}
                               if variant in python_launch else {}),
                            **({"us_compiled": round(compiled_cells[variant][0]()["us"], 1),
                                "us_compiled_calling_thread": round(compiled_cells[variant][1]()["us"], 1)}
                               if variant in compiled_cells else {}),
                            **counts(variant, shape, device, steps)}
        except Exception as exc:  # noqa: BLE001 - that variant's error, in its cell
            row[variant] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(shape_label(shape), variant, row[variant], flush=True)
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, reference backend, one tiny shape (for the unit test)")
    ap.add_argument("--steps", type=int, default=None, help="steps per timed run (default: 200; 5 with --smoke)")
    ap.add_argument("--no-compile", action="store_true",
                    help="leave out the compiled steps (measured on the smallest shape, not with --smoke)")
    add_results_argument(ap)
    args = ap.parse_args(argv)
    args.steps = args.steps or (5 if args.smoke else 200)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = select_device(args.smoke, "bench_host.py")
    shapes = SHAPES["smoke" if args.smoke else "full"]
    # the compiled steps on the smallest shape only: the host-bound one, and each compile takes time
    results = {shape_label(shape): measure_row(shape, device, args.steps,
                                               compiled=i == 0 and not (args.smoke or args.no_compile))
               for i, shape in enumerate(shapes)}
    data = {"meta": meta(device), "settings": {"steps": args.steps, "rounds": ROUNDS, "backend": te.get_backend().name,
                                               "cpu_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                                               "pinned_cpu": None if device == "cpu" else te.host_threads.default_cpu()},
            SECTION: results}
    print(f"wrote {write_json(SECTION, data, args.results)}")
    return data


if __name__ == "__main__":
    main()
