"""The size sweep: te-core's modules against bf16 PyTorch and torchao, eager and torch.compile'd,
every cell fwd+bwd in one process, so each ratio compares runs of the same machine state.

Sections (--only picks some):
  big     TransformerLayer h4096 ffn16384 32 heads s2048 b8: ms and peak memory, plain-torch bf16
          layer and te bf16 / FP8 delayed / current / block, eager;
  tiny    te.Linear(1024, 1024) on 128 tokens: wall microseconds per fwd+bwd call, nn.Linear,
          te bf16 and te FP8 per recipe, eager and compiled (the host-bound case; the eager
          cells are timed together in interleaved rounds, their medians compared);
  linear  te.Linear over bf16 nn.Linear at 4096^3, M8192 K4096 N4096, M16384 K8192 N8192 and
          M16384 K8192 N28672: te FP8 per recipe eager and compiled, nn.Linear compiled, torchao
          Float8Linear tensorwise + torch.compile (when torchao imports);
  layer   te.TransformerLayer s2048 b4 at hidden 1024 / 2048 / 4096 (ffn 4x, heads hidden/128):
          te bf16 and FP8 per recipe, plain-torch bf16 layer, eager and compiled.

GPU times are triton's do_bench medians; "compiled" is torch.compile of the forward ("graphed" with
--mode reduce-overhead: CUDA graphs; te's under
te.autocast), backward through AOTAutograd; "captured" (--mode captured) is te.make_graphed_callables
for te's modules and torch.cuda.make_graphed_callables for the peers (torchao's Float8Linear
uncompiled), one graph replay per direction. The eager cells of every section run first, then
the compiled ones; a cell that raises records the error and the sweep goes on; cells reached
after --budget-s are recorded as skipped, so the sweep ends in bounded time. A compiled cell
also records its graphs, graph breaks (the first one's reason) and the graphs CUDA graphs
skipped; a compiled te cell is timed in alternating rounds with the same module's eager step
(recorded as eager_ms / eager_us), whose ratio the compiled-never-slower target reads:
host-bound cells follow the host's speed, which drifts between the eager and the compiled pass.
The JSON is rewritten after every cell: a run stopped from outside keeps what it measured.

    python benchmarks/bench_sweep.py [--only big,tiny,linear,layer] [--quick] [--no-compile] [--results DIR]
    python benchmarks/bench_sweep.py --smoke --results /tmp/r   # CPU, reference backend, tiny sizes
    python benchmarks/bench_sweep.py --only tiny,layer --mode reduce-overhead --merge   # CUDA graphs,
                                                    # into the existing sweep.json (split long sweeps)
    python benchmarks/bench_sweep.py --only linear --cells "M8192 .*te current compiled" --merge   # re-measure one
    python benchmarks/bench_sweep.py --only tiny,linear,layer --mode captured --merge   # whole-step graph capture

Writes RESULTS/<gpu>/sweep.json; `python benchmarks/report.py` renders it into docs/performance.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import re
import statistics
import time
from functools import partial
from typing import Callable, Dict, List, NamedTuple, Optional

import torch
import torch.nn as nn
from _results import (DEFAULT_ROOT, add_pin_argument, add_results_argument, gpu_slug, meta, pin_host,
                      select_device, write_json)
from _timing import Interleaved, median_ms, peak_mib, wall_us
from bench_modules import TorchLayer, fwd_bwd, te_layer, torchao_float8

import te_core as te
from te_core import recipe

SECTIONS = ("big", "tiny", "linear", "layer")
RECIPES: Dict[str, Optional[Callable[[], recipe.Recipe]]] = {
    "bf16": None, "delayed": recipe.DelayedScaling, "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling}
FP8 = ("delayed", "current", "block")


@dataclasses.dataclass(frozen=True)
class Sizes:
    layer_hidden: tuple = (1024, 2048, 4096)
    layer_seq_batch: tuple = (2048, 4)
    head_dim: int = 128
    linear: tuple = ((4096, 4096, 4096), (8192, 4096, 4096), (16384, 8192, 8192), (16384, 8192, 28672))
    tiny: tuple = (1024, 1024, 128)  # in features, out features, tokens
    big: tuple = (4096, 16384, 32, 2048, 8)  # hidden, ffn, heads, seq, batch
    warmup_ms: float = 25
    rep_ms: float = 150
    tiny_calls: int = 200


FULL = Sizes()
QUICK = Sizes(layer_hidden=(1024,), linear=((8192, 4096, 4096),), big=(4096, 16384, 32, 2048, 2),
              warmup_ms=10, rep_ms=40, tiny_calls=50)
SMOKE = Sizes(layer_hidden=(64,), layer_seq_batch=(16, 2), head_dim=32, linear=((64, 64, 32),), tiny=(64, 64, 16),
              big=(64, 256, 2, 16, 2), warmup_ms=1, rep_ms=5, tiny_calls=3)


class Cell(NamedTuple):
    section: str
    size: str  # the row's label, e.g. "M8192 K4096 N4096"
    name: str  # "<implementation> <eager|compiled>", e.g. "te delayed compiled"
    measure: Callable[[], dict]


def torch_layer(h, ffn, heads, device):
    """The plain-PyTorch bf16 pre-LN layer (bench_modules.TorchLayer) on `device`."""
    return TorchLayer(h, ffn, heads).to(device, torch.bfloat16)


def torchao_linear(k, n, device):
    """A bias-free bf16 nn.Linear converted to torchao's Float8Linear (tensorwise)."""
    return torchao_float8(nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)))


def _graph_safe(step, mode, x, module):
    """Under CUDA graphs (mode "graphed"), each call starts a new graph step and drops the previous
    step's gradients: accumulating into a gradient that a replay produced reads memory the next
    replay overwrites. (A training loop gets the same from optimizer.zero_grad(set_to_none=True).)"""
    if mode != "graphed":
        return step
    params = list(module.parameters())

    def graphed_step():
        torch.compiler.cudagraph_mark_step_begin()
        x.grad = None
        for p in params:
            p.grad = None
        step()

    return graphed_step


def _graph_api(device):
    """torch.<device>.make_graphed_callables (the peers' capture), or a clear error where the
    device has none."""
    api = getattr(getattr(torch, torch.device(device).type, None), "make_graphed_callables", None)
    if api is None:
        raise RuntimeError(f"captured cells need graph capture, which torch has not for {device!r}; run them on a GPU")
    return api


def _zeroed_grads(module, x):
    """Gradients that exist before capture: a replay's gradients live in the graph's buffers, and
    a .grad that autograd first set to one of them would be overwritten by the next replay."""
    for t in [x, *module.parameters()]:
        if t.requires_grad and t.grad is None:
            t.grad = torch.zeros_like(t)


class Sweep:
    """Builds the cells; each measures into {"ms": ...}, {"us": ...} or {"ms": ..., "peak_mib": ...}.
    Modules are built inside the cell, fresh for each, so no cell inherits another's FP8 state."""

    def __init__(self, sizes: Sizes, device: str, compile_kw: Optional[dict], capture: bool = False):
        """compile_kw: torch.compile's arguments for the second pass, None for eager cells only;
        capture: the second pass captures whole steps as graphs instead of compiling."""
        self.sizes, self.device, self.compile_kw, self.capture = sizes, device, compile_kw, capture

    def _randn(self, *shape, grad=False):
        return torch.randn(*shape, device=self.device, dtype=torch.bfloat16, requires_grad=grad)

    def _compile(self, fn, compiled: bool):
        return torch.compile(fn, **self.compile_kw) if compiled else fn

    def _modes(self):
        if self.compile_kw is None:
            return ("eager",)
        if self.capture:
            return ("eager", "captured")
        return ("eager", "graphed" if self.compile_kw.get("mode") == "reduce-overhead" else "compiled")

    def te_step(self, make_module, rcp_name, mode, x, dy, with_eager=False):
        """The cell's step; with_eager: (it, the same module's eager step), for a compiled cell
        timed beside its eager twin."""
        make = RECIPES[rcp_name]
        rcp, module = (make() if make else None), make_module()
        if mode == "captured":  # what docs/graphs.md recommends for host-bound steps of fixed shapes
            _zeroed_grads(module, x)
            # (gradients allocated above: autograd adds the graphs' buffers into them, as the peers' do)
            module = te.make_graphed_callables(module, (x,), enabled=rcp is not None, recipe=rcp,
                                               clone_param_grads_on_return=False)

        def forward(inp):
            with te.autocast(enabled=rcp is not None, recipe=rcp):
                return module(inp)

        # (a captured cell is the capture alone: no compiler around its replays)
        step = _graph_safe(fwd_bwd(self._compile(forward, mode in ("compiled", "graphed")), x, dy), mode, x, module)
        if not with_eager:
            return step
        eager = fwd_bwd(forward, x, dy)
        if mode == "graphed":  # never accumulate into gradients a replay wrote
            params, plain = list(module.parameters()), eager

            def eager_step():
                x.grad = None
                for p in params:
                    p.grad = None
                plain()

            eager = eager_step
        return step, eager

    def torch_step(self, make_module, mode, x, dy):
        module = make_module()
        if mode == "captured":
            _zeroed_grads(module, x)
            return fwd_bwd(_graph_api(self.device)(module, (x,)), x, dy)
        return _graph_safe(fwd_bwd(self._compile(module, mode in ("compiled", "graphed")), x, dy), mode, x, module)

    def _ms(self, make_step):
        return {"ms": median_ms(make_step(), self.device, self.sizes.warmup_ms, self.sizes.rep_ms)}

    def _ms_and_peak(self, make_step):
        step = make_step()
        ms = median_ms(step, self.device, self.sizes.warmup_ms, 2 * self.sizes.rep_ms)
        return {"ms": ms, "peak_mib": peak_mib(step, self.device)}

    def _wall_us(self, step, repeats=1):
        calls = self.sizes.tiny_calls
        return wall_us(step, max(1, calls // 5), max(3, calls // 10), self.device, repeats=repeats)

    def _us(self, make_step):
        return {"us": self._wall_us(make_step(), repeats=5)}  # the median of five runs: host-bound cells are noisy

    def _paired(self, unit, make_pair, rounds=3):
        """A compiled te cell and the same module's eager step, timed in alternating rounds (each
        the median of its rounds): their ratio is the compiled-never-slower target's, so the host's
        drift between the sweep's eager and compiled passes cannot decide it. {unit: compiled,
        "eager_" + unit: eager}."""
        compiled, eager = make_pair()
        times = {"c": [], "e": []}
        for r in range(rounds):
            for key, step in (("c", compiled), ("e", eager)) if r % 2 == 0 else (("e", eager), ("c", compiled)):
                times[key].append(self._wall_us(step) if unit == "us" else
                                  median_ms(step, self.device, self.sizes.warmup_ms, self.sizes.rep_ms))
        return {unit: statistics.median(times["c"]), f"eager_{unit}": statistics.median(times["e"])}

    def _cells(self, section, label, measure, peer, te_module, recipes, x, dy, modes=None):
        """Cells of one row: the peer `peer` = (name, module factory), then te per recipe, per mode."""
        cells = []
        for mode in modes or self._modes():
            cells.append(Cell(section, label, f"{peer[0]} {mode}",
                              partial(measure, partial(self.torch_step, peer[1], mode, x, dy))))
            for name in recipes:
                if mode in ("eager", "captured"):  # a captured module has no eager step left to pair with
                    how = partial(measure, partial(self.te_step, te_module, name, mode, x, dy))
                else:  # beside the same module's eager step (the compiled-never-slower target)
                    how = partial(self._paired, "us" if measure == self._us else "ms",
                                  partial(self.te_step, te_module, name, mode, x, dy, with_eager=True))
                cells.append(Cell(section, label, f"te {name} {mode}", how))
        return cells

    def big(self) -> List[Cell]:
        h, ffn, heads, s, b = self.sizes.big
        x, dy = self._randn(s, b, h, grad=True), self._randn(s, b, h)
        return self._cells("big", f"h{h} ffn{ffn} nh{heads} s{s} b{b}", self._ms_and_peak,
                           ("torch bf16", partial(torch_layer, h, ffn, heads, self.device)),
                           partial(te_layer, h, ffn, heads, self.device), RECIPES, x, dy, modes=("eager",))

    def tiny(self) -> List[Cell]:
        k, n, tokens = self.sizes.tiny
        x, dy = self._randn(tokens, k, grad=True), self._randn(tokens, n)
        ref = partial(nn.Linear, k, n, device=self.device, dtype=torch.bfloat16)
        ours = partial(te.Linear, k, n, params_dtype=torch.bfloat16, device=self.device)
        label = f"te.Linear({k}, {n}), {tokens} tokens"
        cells = []
        for mode in self._modes():
            if mode != "eager":
                cells += self._cells("tiny", label, self._us, ("nn.Linear", ref), ours, RECIPES, x, dy, modes=(mode,))
                continue
            # the eager cells, whose ratios are the host-cost target, in interleaved rounds
            group = Interleaved(self.sizes.tiny_calls, self.device)
            cells.append(Cell("tiny", label, "nn.Linear eager", group.cell(partial(self.torch_step, ref, mode, x, dy))))
            cells += [Cell("tiny", label, f"te {name} eager", group.cell(partial(self.te_step, ours, name, mode, x, dy)))
                      for name in RECIPES]
        return cells

    def linear(self) -> List[Cell]:
        cells = []
        for m, k, n in self.sizes.linear:
            x, dy = self._randn(m, k, grad=True), self._randn(m, n)
            label = f"M{m} K{k} N{n}"
            ref = partial(nn.Linear, k, n, bias=False, device=self.device, dtype=torch.bfloat16)
            ours = partial(te.Linear, k, n, bias=False, params_dtype=torch.bfloat16, device=self.device)
            cells += self._cells("linear", label, self._ms, ("nn.Linear", ref), ours, FP8, x, dy)
            if self.compile_kw is not None:
                ao, mode = partial(torchao_linear, k, n, self.device), self._modes()[-1]
                cells.append(Cell("linear", label, f"torchao tensorwise {mode}",
                                  partial(self._ms, partial(self.torch_step, ao, mode, x, dy))))
        return cells

    def layer(self) -> List[Cell]:
        cells = []
        s, b = self.sizes.layer_seq_batch
        for h in self.sizes.layer_hidden:
            heads = h // self.sizes.head_dim
            x, dy = self._randn(s, b, h, grad=True), self._randn(s, b, h)
            cells += self._cells("layer", f"h{h} ffn{4 * h} nh{heads} s{s} b{b}", self._ms,
                                 ("torch bf16", partial(torch_layer, h, 4 * h, heads, self.device)),
                                 partial(te_layer, h, 4 * h, heads, self.device), RECIPES, x, dy)
        return cells


def compile_stats() -> dict:
    """What dynamo and inductor did since the counters were cleared: the graphs, the graph
    breaks (with the first one's reason) and the graphs CUDA graphs skipped, so that a slow
    compiled or graphed cell shows whether it compiled whole."""
    counters = torch._dynamo.utils.counters
    breaks = counters["graph_break"]
    stats = {"graphs": counters["stats"].get("unique_graphs", 0), "graph_breaks": sum(breaks.values())}
    if breaks:
        stats["first_graph_break"] = " ".join(next(iter(breaks)).split())[:240]  # its reason and explanation
    skips = counters["inductor"].get("cudagraph_skips", 0)
    if skips:
        stats["cudagraph_skips"] = skips
    return stats


def run_cell(cell: Cell, deadline: float, device: str) -> dict:
    """The cell's measurement (a compiled cell's with compile_stats()), or {"error": ...} when
    it raised or the time budget is spent."""
    if time.monotonic() > deadline:
        return {"error": SKIPPED}
    compiled = cell.name.endswith(("compiled", "graphed"))
    try:
        if compiled:
            torch._dynamo.utils.counters.clear()
        result = cell.measure()
        return {**result, **compile_stats()} if compiled else result
    except Exception as exc:  # one failing cell must not hide the others: recorded, shown in the table
        return {"error": f"{type(exc).__name__}: {exc}".strip()[:400]}
    finally:
        if compiled:
            torch._dynamo.reset()  # frees the graphs; the next cell compiles afresh
        if not cell.name.endswith("eager"):
            gc.collect()  # a captured module's forward refers to the module: its graphs go with the cycle
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()


def run(cells: List[Cell], budget_s: float, device: str, save: Optional[Callable[[dict], None]] = None) -> dict:
    """Eager cells first, then compiled: what the budget cuts is compile time, not the baselines.
    `save(results)` after each cell, so a run killed at its time limit keeps what it measured."""
    results: Dict[str, Dict[str, Dict[str, Optional[dict]]]] = {}
    for cell in cells:  # rows and columns in the sections' order, whatever order they run in
        results.setdefault(cell.section, {}).setdefault(cell.size, {})[cell.name] = None
    deadline = time.monotonic() + budget_s
    for cell in sorted(cells, key=lambda c: not c.name.endswith("eager")):
        result = run_cell(cell, deadline, device)
        results[cell.section][cell.size][cell.name] = result
        print(json.dumps({"section": cell.section, "size": cell.size, "cell": cell.name, **result}), flush=True)
        if save is not None:
            save(results)
    return results


def previous_results(meta_now: dict, root: Optional[str]) -> dict:
    """The sections of this GPU's existing sweep.json ({} when there is none)."""
    path = os.path.join(root or DEFAULT_ROOT, gpu_slug(meta_now["gpu"]), "sweep.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return {k: v for k, v in data.items() if k in SECTIONS or k == "settings"}


SKIPPED = "skipped: the sweep's time budget (--budget-s) was spent"


def selected(cells: List[Cell], pattern: Optional[str]) -> List[Cell]:
    """The cells whose "<size> <cell name>" matches `pattern` (re.search); all of them without one.
    Raises ValueError when a pattern matches none: a run that measures nothing is a typo."""
    if pattern is None:
        return cells
    chosen = [c for c in cells if re.search(pattern, f"{c.size} {c.name}")]
    if not chosen:
        example = f", e.g. {cells[0].size + ' ' + cells[0].name!r}" if cells else ""
        raise ValueError(f"--cells {pattern!r} matches none of the {len(cells)} cells of the chosen sections "
                         f"(each is matched as '<size> <cell>'{example})")
    return chosen


def merged_settings(earlier: Optional[dict]) -> dict:
    """The settings of the run merged into, without its own merge history: one level is what
    the report reads, and a chain of merges would nest without end."""
    return {k: v for k, v in (earlier or {}).items() if k != "merged_with"}


def merged(earlier: dict, results: dict) -> dict:
    """earlier's cells, with every cell of `results` in place of its namesake, except a cell this
    run skipped for its time budget (or has not reached yet), which keeps its earlier measurement."""
    out = {section: {size: dict(row) for size, row in rows.items()} for section, rows in earlier.items()}
    for section, rows in results.items():
        for size, row in rows.items():
            kept = out.setdefault(section, {}).setdefault(size, {})
            for name, result in row.items():
                if name in kept and (result is None or (result.get("error") == SKIPPED)):
                    continue
                kept[name] = result
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="one size per section, short timing: a GPU smoke run")
    size.add_argument("--smoke", action="store_true", help="CPU, reference backend, tiny sizes (for the unit test)")
    ap.add_argument("--no-compile", action="store_true", help="eager cells only")
    ap.add_argument("--fullgraph", action="store_true", help="torch.compile(fullgraph=True): graph breaks are errors")
    ap.add_argument("--mode", default=None, help="torch.compile mode of the compiled cells, e.g. reduce-overhead "
                    "(CUDA graphs), or 'captured' for te.make_graphed_callables (the peers: "
                    "torch.cuda.make_graphed_callables) instead of compiling; default: inductor's default")
    ap.add_argument("--merge", action="store_true", help="keep the cells of an existing sweep.json that this run "
                    "does not measure or skips for its budget (to split a sweep over several runs)")
    ap.add_argument("--cells", default=None, metavar="REGEX", help="only the cells whose '<size> <cell>' "
                    "matches REGEX, e.g. 'M8192.*(current|block) compiled' (with --merge, to re-measure a few)")
    ap.add_argument("--budget-s", type=float, default=360.0, help="cells reached after this many seconds are skipped")
    add_pin_argument(ap)
    add_results_argument(ap)
    args = ap.parse_args(argv)
    if args.cells is not None:
        try:
            re.compile(args.cells)
        except re.error as exc:
            ap.error(f"--cells: {args.cells!r} is not a regular expression ({exc})")
    if args.mode == "captured" and args.no_compile:
        ap.error("--mode captured measures captured cells beside the eager ones; drop --no-compile")
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        ap.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = select_device(args.smoke, "bench_sweep.py")
    sizes = SMOKE if args.smoke else QUICK if args.quick else FULL
    capture = args.mode == "captured"
    compile_kw = None if args.no_compile else {"fullgraph": args.fullgraph}
    if compile_kw is not None and args.mode and not capture:
        compile_kw["mode"] = args.mode
    if args.smoke and compile_kw is not None:
        compile_kw["backend"] = "eager"  # dynamo's tracing without inductor's code generation: fast on a CPU
    pinned = pin_host(args, device)
    torch.manual_seed(0)
    sweep = Sweep(sizes, device, compile_kw, capture)
    only = args.only.split(",")
    try:
        cells = selected([c for section in SECTIONS if section in only for c in getattr(sweep, section)()], args.cells)
    except ValueError as exc:
        raise SystemExit(f"bench_sweep.py: error: {exc}") from None
    t0 = time.monotonic()
    settings = {"sizes": dataclasses.asdict(sizes), "compile": None if capture else compile_kw, "capture": capture,
                "backend": te.get_backend().name,
                "budget_s": args.budget_s, "pinned_cpu": pinned}
    head = {"meta": meta(device), "settings": settings}
    earlier = previous_results(head["meta"], args.results) if args.merge else {}
    if earlier:
        settings["merged_with"] = merged_settings(earlier.pop("settings", None))

    def save(results):
        settings["seconds"] = round(time.monotonic() - t0, 1)
        return write_json("sweep", {**head, **merged(earlier, results)}, args.results)

    results = run(cells, args.budget_s, device, save)
    print(f"wrote {save(results)} in {settings['seconds']} s")
    return {**head, **results}


if __name__ == "__main__":
    main()
