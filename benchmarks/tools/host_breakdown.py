"""Where the host time of an eager te.Linear step goes: each traced function's EXCLUSIVE wall
time per step (its own time, callees that are also traced subtracted), so the rows add up to
the step. "untraced" is everything else: te_core's own Python between the traced calls.

Traced: every contract op call, split into the backend's supports() and its implementation;
Triton launches; the torch calls te_core and the backends make on the hot path; autocast
enter/exit; the scale update; the autograd engine.

--counts prints, per recipe, what one fwd+bwd step of te.Linear(1024, 1024) on 128 tokens
does on the host: contract-op calls, supports() calls, capability checks, Triton launches, torch
calls made from Python (a TorchFunctionMode) and the aten ops they run (a TorchDispatchMode; on
the GPU, roughly the kernels torch launches).

It wraps te_core's private dispatch (te_core.ops._spec, te_core.backend.dispatch) and so
follows its internals.

    python benchmarks/tools/host_breakdown.py                # cuda backend, on the GPU
    python benchmarks/tools/host_breakdown.py --device cpu   # the reference backend on the CPU
    python benchmarks/tools/host_breakdown.py --counts [--device cpu]
"""
from __future__ import annotations

import argparse
import sys
import functools
import time
from collections import defaultdict

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import te_core as te
from te_core import recipe
from te_core.backend import dispatch as te_dispatch
from te_core.ops import _spec
from te_core.quantization import scaling

TORCH_CALLS = ("_scaled_mm", "reciprocal", "empty", "empty_like", "zeros", "ones", "maximum", "full")


class Tracer:
    def __init__(self):
        self.own = defaultdict(float)
        self.calls = defaultdict(int)
        self.stack = []  # [name, start, time spent in traced callees]
        self.enabled = False

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            frame = [name, time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - frame[1]
                self.stack.pop()
                self.own[name] += elapsed - frame[2]
                self.calls[name] += 1
                if self.stack:
                    self.stack[-1][2] += elapsed

        return traced


class _OpView:
    """What dispatch.runner reads of an op: its name and its capability check (here traced)."""

    def __init__(self, name, capability_check):
        self.name, self.capability_check = name, capability_check


def install(tracer: Tracer) -> None:
    # each op's cached runner (what an eager op call runs: checks, fallback, implementation),
    # wrapped with the resolved backend functions inside it (ops resolve on their first call)
    for op in _spec.CONTRACT.values():
        cached = op._cache
        if cached is None:
            continue
        res = cached[1]
        replaced = res._replace(
            fn=None if res.fn is None else tracer.wrap(f"op {op.name}: implementation", res.fn),
            supports=None if res.supports is None else tracer.wrap(f"op {op.name}: supports()", res.supports))
        view = _OpView(op.name, tracer.wrap(f"op {op.name}: capability check", op.capability_check)
                       if op.capability_check is not None else None)
        op._cache = (cached[0], replaced, tracer.wrap(f"op {op.name}: dispatch", te_dispatch.runner(view, replaced)))
    for name in TORCH_CALLS:
        setattr(torch, name, tracer.wrap(f"torch.{name}", getattr(torch, name)))
    try:
        from triton.runtime.jit import JITFunction
        JITFunction.run = tracer.wrap("triton JITFunction.run", JITFunction.run)
        from te_triton.launch import Launcher  # a launch from te_triton's cache skips JITFunction.run
        launch_of = Launcher.__getitem__
        Launcher.__getitem__ = lambda self, grid: tracer.wrap("te_triton launch", launch_of(self, grid))
    except ImportError:
        pass
    cls = sys.modules["te_core.quantization.autocast"].autocast
    cls.__enter__ = tracer.wrap("autocast.__enter__", cls.__enter__)
    cls.__exit__ = tracer.wrap("autocast.__exit__", cls.__exit__)
    scaling.update_scales = tracer.wrap("scaling.update_scales", scaling.update_scales)
    scaling.ScalingGroup.scale_inv_of = tracer.wrap("ScalingGroup.scale_inv_of", scaling.ScalingGroup.scale_inv_of)
    torch.autograd.backward = tracer.wrap("torch.autograd.backward", torch.autograd.backward)
    if torch.cuda.is_available():
        torch.cuda.CUDAGraph.replay = tracer.wrap("CUDAGraph.replay", torch.cuda.CUDAGraph.replay)
        from torch.utils import _pytree
        for name in ("arg_tree_leaves", "tree_unflatten"):
            setattr(_pytree, name, tracer.wrap(f"torch pytree.{name}", getattr(_pytree, name)))
        function = torch.autograd.function.Function
        function.apply = classmethod(tracer.wrap("autograd Function.apply", function.apply.__func__))
        from te_backend_cuda import update_graph
        update_graph.run = tracer.wrap("te_backend_cuda update_graph.run", update_graph.run)


def measure(name, step, tracer, n, device):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(30):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    plain = (time.perf_counter() - t0) / n * 1e6
    sync()
    tracer.own.clear()
    tracer.calls.clear()
    tracer.enabled = True
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    traced = (time.perf_counter() - t0) / n * 1e6
    tracer.enabled = False
    sync()
    print(f"\n{name}: {plain:.1f} us per step untraced (host enqueue), {traced:.1f} us traced")
    rows = sorted(tracer.own.items(), key=lambda kv: -kv[1])
    accounted = 0.0
    for key, total in rows:
        us = total / n * 1e6
        accounted += us
        if us >= 0.5:
            print(f"  {us:8.1f} us  x{tracer.calls[key] / n:4.1f}  {key}")
    print(f"  {traced - accounted:8.1f} us        untraced Python (te_core glue, module call, ...)")


RECIPES = {"bf16": None, "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
           "block": recipe.Float8BlockScaling, "mxfp8": recipe.MXFP8BlockScaling}


class _TorchCalls(TorchFunctionMode):
    """Counts the torch functions and Tensor methods called from Python."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


class _AtenOps(TorchDispatchMode):
    """Counts the aten ops run (on the GPU, about the kernels and allocations torch issues)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def linear_step(dev, rcp, m=128, k=1024, n_out=1024):
    """One fwd+bwd of te.Linear(k, n_out) on m tokens under `rcp` (None: BF16)."""
    lin = te.Linear(k, n_out, params_dtype=torch.bfloat16, device=dev)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n_out, device=dev, dtype=torch.bfloat16)

    def train():
        with te.autocast(enabled=rcp is not None, recipe=rcp):
            y = lin(x)
        y.backward(dy)

    return train


def _total(tracer, suffix):
    return sum(n for key, n in tracer.calls.items() if key.endswith(suffix))


def _launches(tracer) -> int:
    """Triton launches: te_triton's own (which call JITFunction.run only on a cache miss), else
    Triton's."""
    return _total(tracer, "te_triton launch") or _total(tracer, "JITFunction.run")


def counts(dev):
    """Print the host ops of one tiny Linear fwd+bwd per recipe (see the module docstring)."""
    steps = {}
    for name, cls in RECIPES.items():
        step = linear_step(dev, cls() if cls is not None else None)
        try:
            step()
            step()
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            print(f"{name}: skipped ({type(exc).__name__}: {exc})")
            continue
        steps[name] = step
    tracer = Tracer()
    install(tracer)
    print(f"# host ops per te.Linear(1024, 1024) fwd+bwd on 128 tokens, {dev}, torch {torch.__version__}")
    print("recipe   contract-ops  supports()  capability-checks  triton-launches  torch-calls  aten-ops")
    for name, step in steps.items():
        tracer.calls.clear()
        tracer.enabled = True
        with _TorchCalls() as fn_mode, _AtenOps() as aten_mode:
            step()
        tracer.enabled = False
        print(f"{name:8s} {_total(tracer, ': dispatch'):12d} {_total(tracer, 'supports()'):11d} "
              f"{_total(tracer, 'capability check'):18d} {_launches(tracer):16d} "
              f"{fn_mode.n:12d} {aten_mode.n:9d}")
        ops_called = sorted((key[3:-10], n) for key, n in tracer.calls.items() if key.endswith(": dispatch"))
        print("         " + ", ".join(f"{op} x{n}" for op, n in ops_called))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument("--counts", action="store_true", help="count host ops per recipe instead of timing")
    args = parser.parse_args()
    dev = args.device
    if args.counts:
        counts(dev)
        return
    torch.manual_seed(0)
    rcp = recipe.DelayedScaling()
    cases = {}
    for label, (m, k, n_out) in {"tiny 16x64x64": (16, 64, 64), "M8192 K4096 N4096": (8192, 4096, 4096)}.items():
        if dev == "cpu" and m > 16:
            continue
        lin = te.Linear(k, n_out, params_dtype=torch.bfloat16, device=dev)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n_out, device=dev, dtype=torch.bfloat16)

        def fwd(lin=lin, x=x):
            with torch.no_grad(), te.autocast(recipe=rcp):
                lin(x)

        def train(lin=lin, x=x, dy=dy):
            with te.autocast(recipe=rcp):
                y = lin(x)
            y.backward(dy)

        if m == 16:
            cases[f"{label} forward (no grad)"] = fwd
            if dev == "cuda":
                graphed = te.make_graphed_callables(te.Linear(k, n_out, params_dtype=torch.bfloat16, device=dev),
                                                    (x,), fp8_enabled=True, fp8_recipe=rcp)

                def graphed_fwd(graphed=graphed, x=x):
                    with torch.no_grad(), te.autocast(recipe=rcp):
                        graphed(x)

                cases[f"{label} graphed forward (no grad)"] = graphed_fwd
                ref = torch.nn.Linear(k, n_out, device=dev, dtype=torch.bfloat16)

                def ref_fwd(ref=ref, x=x):
                    with torch.no_grad():
                        ref(x)

                cases[f"{label} nn.Linear bf16 forward (no grad)"] = ref_fwd
        cases[f"{label} forward+backward"] = train
    for step in cases.values():  # resolve every op before install() wraps the resolutions
        step()
    tracer = Tracer()
    install(tracer)
    print(f"# host_breakdown on {dev}: torch {torch.__version__}")
    for name, step in cases.items():
        measure(name, step, tracer, args.n if "tiny" in name else max(20, args.n // 10), dev)


if __name__ == "__main__":
    main()
