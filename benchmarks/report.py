"""The generated tables of docs/performance.md, from one GPU's latest results.

    python benchmarks/report.py [RESULTS_DIR] [--doc docs/performance.md] [--print]

RESULTS_DIR is one GPU's folder, e.g. benchmarks/results/h200 (the default when it is the only
one). From its modules.json and kernels.json (bench_modules.py, bench_kernels.py) come the
targets table, each target checked against the measurement, and the FP8 GEMM table; from its
sweep.json (bench_sweep.py) the sweep tables. They replace the text between their markers in the
doc (or are printed); RESULTS_DIR/table.md gets them and every kernel's figures. A missing file
or measurement is reported as such.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from typing import Dict, List, Optional, Tuple

from _distributed_table import render as render_distributed
from _hf_table import render as render_hf
from _results import host_note
from _host_table import render as render_host
from _sweep_table import render as render_sweep

BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"
SWEEP_BEGIN, SWEEP_END = "<!-- sweep:begin -->", "<!-- sweep:end -->"
HF_BEGIN, HF_END = "<!-- hf:begin -->", "<!-- hf:end -->"
HOST_BEGIN, HOST_END = "<!-- host:begin -->", "<!-- host:end -->"
DIST_BEGIN, DIST_END = "<!-- distributed:begin -->", "<!-- distributed:end -->"
RESULTS_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# (benchmark, target text, kernel op names, minimum GB/s); several ops: each must meet it
KERNEL_TARGETS = [
    ("Quantize + amax (into a history slot, as modules call it)", "≥ 3.9 TB/s",
     ["quantize_fp8 into history slot"], 3900.0),
    ("Quantize + amax (own amax buffer)", "≥ 3.9 TB/s", ["quantize_fp8 (amax+cast)"], 3900.0),
    ("Quantize + amax + transpose (into a history slot)", "≥ 3.6 TB/s", ["cast_transpose_fp8 into history slot"], 3600.0),
    ("Quantize + amax + transpose (own amax buffer)", "≥ 3.6 TB/s", ["cast_transpose_fp8"], 3600.0),
    ("LayerNorm / RMSNorm forward, FP8 out", "≥ 3.6 TB/s", ["layernorm_fwd fp8 out", "rmsnorm_fwd fp8 out"], 3600.0),
    ("LayerNorm / RMSNorm backward", "≥ 3.2 TB/s", ["layernorm_bwd", "rmsnorm_bwd"], 3200.0),
    ("gelu / swiglu forward, FP8 out", "≥ 3.4 TB/s", ["gelu fwd fp8 out", "swiglu fwd fp8 out"], 3400.0),
    ("gelu / swiglu backward", "≥ 3.4 TB/s", ["gelu bwd", "swiglu bwd"], 3400.0),
]
LINEAR_TARGETS = {"M16384 K8192 N8192": 1.65, "M8192 K4096 N4096": 1.35}  # plus >= torchao on every shape
LAYER_MS, LAYER_OVER_TORCH, LAYER_OVER_TORCHAO, TINY_RATIO = 20.0, 1.74, 1.2, 3.0


def _verdict(ok: bool, shortfall: str) -> str:
    return "met" if ok else f"**missed** {shortfall}".rstrip()


def _pct(measured: float, target: float) -> str:
    short = 100 * (target - measured) / target
    return f"by {short:.1f}%" if short < 1 else f"by {short:.0f}%"


def kernel_rows(kernels: dict) -> List[Tuple[str, str, str, str]]:
    """Verdicts on the eager timings (do_bench, as the peers are timed); where a run also timed
    the kernels as CUDA graph replays (GPU time alone), those figures follow, and a miss that
    the replays meet says the shortfall is the eager calls' launch and host time."""
    timings = {t["op"]: t for t in kernels.get("timings", []) if t.get("GBps")}
    rows = []
    for name, target, ops, need in KERNEL_TARGETS:
        if any(op not in timings for op in ops):
            rows.append((name, target, "not measured in this run", "–"))
            continue
        eager = [timings[op]["GBps"] for op in ops]
        graphed = [timings[op].get("graphed_GBps") for op in ops]
        measured = " / ".join(f"{v:.0f} GB/s" for v in eager)
        verdict = _verdict(min(eager) >= need, _pct(min(eager), need))
        if all(graphed):
            measured += "; graphed " + " / ".join(f"{v:.0f}" for v in graphed)
            if min(eager) < need <= min(graphed):
                verdict += "; replayed as a graph the kernels meet it: the shortfall is launch and host time"
        rows.append((name, target, measured, verdict))
    return rows


def _speedups(row: dict) -> Dict[str, float]:
    base = row["bf16_ms"]
    return {k[:-3]: base / v for k, v in row.items() if k.endswith("_ms") and k != "bf16_ms" and v}


def module_rows(modules: dict) -> List[Tuple[str, str, str, str]]:
    rows = []
    for row in modules.get("linear", []):
        x = _speedups(row)
        best = max(x.get("te_delayed", 0.0), x.get("te_delayed_graphed", 0.0))
        peer = x.get("torchao_tensorwise")
        need = LINEAR_TARGETS.get(row["shape"])
        target = " ".join(filter(None, [f"≥ {need}x," if need else "", "≥ torchao"]))
        eager = x.get("te_delayed", 0.0)
        ok = (need is None or best >= need) and (peer is None or best >= peer)
        measured = (f"eager {eager:.2f}x, graphed {x.get('te_delayed_graphed', 0):.2f}x"
                    + (f", torchao {peer:.2f}x" if peer else ", torchao not run"))
        verdict = _verdict(ok, _pct(best, need) if need and best < need else "")
        if ok and ((need and eager < need) or (peer and eager < peer)):
            verdict = "met with graphs only (eager is host-bound)"
        rows.append((f"te.Linear {row['shape']} (over bf16)", target, measured, verdict))
    layer = {r["variant"]: r for r in modules.get("layer", [])}
    te, torch_row = layer.get("te fp8 delayed"), layer.get("torch bf16 eager + SDPA")
    if te and te.get("ms") and torch_row and torch_row.get("ms"):
        ao = layer.get("torchao tensorwise + compile", {}).get("ms")
        over_torch = torch_row["ms"] / te["ms"]
        over_ao = ao / te["ms"] if ao else None
        ok = te["ms"] <= LAYER_MS and over_torch >= LAYER_OVER_TORCH and (over_ao is None or over_ao >= LAYER_OVER_TORCHAO)
        measured = (f"{te['ms']:.2f} ms: {over_torch:.2f}x over torch ({torch_row['ms']:.2f} ms)"
                    + (f", {over_ao:.2f}x over torchao ({ao:.2f} ms)" if over_ao else ""))
        rows.append(("TransformerLayer FP8 delayed", f"≤ {LAYER_MS:g} ms, ≥ {LAYER_OVER_TORCH}x torch, "
                     f"≥ {LAYER_OVER_TORCHAO}x torchao", measured,
                     _verdict(ok, f"by {te['ms'] - LAYER_MS:.2f} ms" if te["ms"] > LAYER_MS else "")))
        bf16 = [r.get("peak_mib") for r in (torch_row, layer.get("te bf16", {})) if r.get("peak_mib")]
        if te.get("peak_mib") and bf16:
            ok = te["peak_mib"] <= max(bf16)
            rows.append(("Peak memory, FP8 layer step", "≤ the bf16 step's",
                         f"{te['peak_mib']:.0f} MiB against bf16 " + " / ".join(f"{b:.0f}" for b in bf16) + " MiB",
                         _verdict(ok, "")))
    for tiny in modules.get("tiny", []):
        ref = tiny.get("nn.Linear bf16 us")
        graphed, eager = tiny.get("te.Linear fp8 graphed us"), tiny.get("te.Linear fp8 us")
        if ref and graphed:
            ratio = graphed / ref
            rows.append(("Tiny te.Linear FP8 forward (graphed)", f"≤ {TINY_RATIO:g}x nn.Linear",
                         f"{graphed:.1f} µs against {ref:.1f} µs ({ratio:.2f}x); eager {eager:.0f} µs",
                         _verdict(ratio <= TINY_RATIO, f"({ratio:.2f}x)")))
    return rows


def table(modules: dict, kernels: dict) -> str:
    meta = modules.get("meta") or kernels.get("meta") or {}
    checks = kernels.get("checks", [])
    # the module and kernel benchmarks run separately (gpu_run.sh parts): name each run's date when they differ
    dates = {name: (part.get("meta") or {}).get("date") for name, part in (("modules", modules), ("kernels", kernels))}
    dated = {name: date for name, date in dates.items() if date}
    if len(set(dated.values())) <= 1:
        runs, when = "one run", meta.get("date", "?")
    else:
        runs, when = "two runs", "; ".join(f"{name} {date[:10]}" for name, date in dated.items())
    lines = [f"Generated by `benchmarks/report.py` from {runs} on {meta.get('gpu', '?')} (torch {meta.get('torch', '?')}, "
             f"triton {meta.get('triton', '?')}, {when}{host_note(meta)}); kernel correctness checks: "
             f"{sum(c['ok'] for c in checks)}/{len(checks)} OK.", "",
             "| Benchmark | Target | Measured | Verdict |", "| --- | --- | --- | --- |"]
    for row in module_rows(modules) + kernel_rows(kernels):
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + gemm_table(kernels))


def _num(value, fmt="{:.0f}") -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "–"


def kernel_table(kernels: dict) -> List[str]:
    """Every timed kernel: GB/s eager (do_bench) and as a graph replay, beside the reference op
    run eagerly by torch (the peer a backend without the kernel gets)."""
    rows = [t for t in kernels.get("timings", []) if t.get("GBps")]
    if not rows:
        return []
    lines = ["", "All kernels of this run (GB/s; 16384x8192 bf16 unless named; each input read and each output "
             "written once):", "", "| Kernel | te-backend-cuda | graphed | reference op in torch eager |",
             "| --- | --- | --- | --- |"]
    for t in rows:
        peer = t.get("eager_GBps") or t.get("torch_F.layer_norm_GBps")
        lines.append(f"| {t['op']} | {_num(t['GBps'])} | {_num(t.get('graphed_GBps'))} | {_num(peer)} |")
    other = [t for t in kernels.get("timings", []) if not t.get("GBps") and t.get("ms")]
    for t in other:
        peers = ", ".join(f"{k[:-3]} {v:.3f} ms" for k, v in t.items() if k.endswith("_ms") and k != "ms" and v)
        lines.append(f"| {t['op']} | {t['ms']:.3f} ms | – | {peers or '–'} |")
    return lines


def gemm_table(kernels: dict) -> List[str]:
    gemms = kernels.get("gemm", [])
    if not gemms:
        return []
    modes = sorted({k[:-7] for g in gemms for k in g if k.endswith("_TFLOPs") and k != "bf16_TFLOPs"})
    lines = ["", "FP8 GEMMs through torch._scaled_mm (TFLOP/s, float32 accumulation), bf16 torch.mm beside them:", "",
             "| M K N | bf16 | " + " | ".join(modes) + " |", "| --- " * (len(modes) + 2) + "|"]
    for g in gemms:
        lines.append(f"| {g['M']} {g['K']} {g['N']} | {_num(g.get('bf16_TFLOPs'))} | "
                     + " | ".join(_num(g.get(f"{m}_TFLOPs")) for m in modes) + " |")
    return lines


def replace_section(doc: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in doc or end not in doc:
        raise ValueError(f"the doc has no {begin} ... {end} section to replace; add the two markers where the table goes")
    return re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{body}\n{end}", doc, flags=re.S)


def _load(folder: str, kind: str) -> Optional[dict]:
    path = os.path.join(folder, f"{kind}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def tables(folder: str) -> Tuple[str, str, str]:
    """(targets and GEMM tables, sweep tables, every kernel's figures) of one GPU's results folder."""
    modules, kernels, sweep = (_load(folder, k) for k in ("modules", "kernels", "sweep"))
    name = os.path.basename(os.path.normpath(folder))
    if modules is None and kernels is None:
        targets = (f"No modules.json or kernels.json for {name} yet: run `bash benchmarks/gpu_run.sh modules kernels` "
                   "on that GPU.")
    else:
        targets = table(modules or {}, kernels or {})
    sweep_text = (render_sweep(sweep) if sweep is not None else
                  f"No sweep.json for {name} yet: run `bash benchmarks/gpu_run.sh sweep` on that GPU.")
    return targets, sweep_text, "\n".join(kernel_table(kernels or {})).strip()


def _optional_text(folder: str, kind: str, render, command: str, where: str) -> str:
    """render(kind.json) of one GPU's results folder, or how to get that file."""
    data = _load(folder, kind)
    if data is None:
        return f"No {kind}.json for {os.path.basename(os.path.normpath(folder))} yet: run `{command}` {where}."
    return render(data)


def hf_text(folder: str) -> str:
    """The Hugging Face training table of one GPU's results folder (bench_hf.py's hf.json)."""
    return _optional_text(folder, "hf", render_hf, "python benchmarks/bench_hf.py", "on that GPU")


def host_text(folder: str) -> str:
    """The host-cost table of one GPU's results folder (bench_host.py's host.json)."""
    return _optional_text(folder, "host", render_host, "python benchmarks/bench_host.py", "on that GPU")


def distributed_text(folder: str) -> str:
    """The 1-GPU / 2-GPU training table of one GPU's results folder (bench_distributed.py's distributed.json)."""
    return _optional_text(folder, "distributed", render_distributed,
                          "python benchmarks/bench_distributed.py", "on a 2-GPU machine")


def default_folder(root: str = RESULTS_ROOT) -> str:
    gpus = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))) if os.path.isdir(root) else []
    if len(gpus) != 1:
        raise SystemExit(f"name the results folder to report on: {root} holds {', '.join(gpus) or 'none'}")
    return os.path.join(root, gpus[0])


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", help="one GPU's results, e.g. benchmarks/results/h200")
    ap.add_argument("--doc", default="docs/performance.md")
    ap.add_argument("--print", action="store_true", help="print the tables instead of writing the doc")
    args = ap.parse_args(argv)
    folder = args.folder or default_folder()
    if not os.path.isdir(folder):
        raise SystemExit(f"{folder} is not a results folder; the benchmarks write benchmarks/results/<gpu>/")
    targets, sweep, kernels = tables(folder)
    hf = hf_text(folder)
    host = host_text(folder)
    distributed = distributed_text(folder)
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write(f"# Targets\n\n{targets}\n\n# Sweep\n\n{sweep}\n\n# Host cost of a te.Linear step\n\n{host}\n\n"
                f"# Hugging Face Llama training\n\n{hf}\n\n"
                f"# Two GPUs: data and tensor parallelism\n\n{distributed}\n\n# Kernels\n\n{kernels}\n")
    if args.print:
        print(f"{targets}\n\n{sweep}\n\n{host}\n\n{hf}\n\n{distributed}")
        return
    with open(args.doc) as f:
        doc = f.read()
    doc = replace_section(replace_section(doc, targets), sweep, SWEEP_BEGIN, SWEEP_END)
    doc = replace_section(doc, hf, HF_BEGIN, HF_END)
    doc = replace_section(doc, host, HOST_BEGIN, HOST_END)
    doc = replace_section(doc, distributed, DIST_BEGIN, DIST_END)
    with open(args.doc, "w") as f:
        f.write(doc)
    print(f"wrote the tables into {args.doc} and {os.path.join(folder, 'table.md')}")


if __name__ == "__main__":
    main()
