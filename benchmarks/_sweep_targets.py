"""The FP8 speed targets checked against one bench_sweep.py run: a row per target with what was
measured and a verdict. A target whose cells are missing or hold errors is "not measured"; a
target holds at its own size only (a --quick or --smoke run checks fewer)."""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

LAYER_SPEEDUP = {1024: 1.0, 2048: 1.3, 4096: 1.75}  # FP8 delayed over te bf16, same mode, s2048 b4 by hidden
LINEAR_EAGER = ("M8192 K4096 N4096", 1.2)  # te delayed eager over nn.Linear eager
BIG = ("h4096 ffn16384 nh32 s2048 b8", {"delayed": 19.0, "current": 20.0, "block": 21.0})
TINY = ("te.Linear(1024, 1024), 128 tokens", 2.0)  # te FP8 eager time at most this many times te bf16 eager
FP8 = ("delayed", "current", "block")
# graphed: torch.compile(mode="reduce-overhead"); captured: te.make_graphed_callables (the peers:
# torch.cuda.make_graphed_callables)
MODES = ("eager", "compiled", "graphed", "captured")
Row = Tuple[str, str, str]


def _v(cells: dict, name: str, unit: str = "ms") -> Optional[float]:
    value = (cells.get(name) or {}).get(unit)
    return value if isinstance(value, (int, float)) and value > 0 else None


def _verdict(ok: Optional[bool]) -> str:
    return "not measured" if ok is None else ("met" if ok else "**missed**")


def _best_mode(cells: dict, ours: str, base_of) -> Optional[Tuple[float, str]]:
    """(best base/ours ratio over the modes, that mode), the base cell chosen per mode."""
    ratios = [(_v(cells, base_of(mode)) / _v(cells, f"{ours} {mode}"), mode) for mode in MODES
              if _v(cells, base_of(mode)) and _v(cells, f"{ours} {mode}")]
    return max(ratios) if ratios else None


def layer_rows(layer: Dict[str, dict]) -> List[Row]:
    rows = []
    for size, cells in layer.items():
        hidden = re.fullmatch(r"h(\d+) ffn\d+ nh\d+ s2048 b4", size)
        need = LAYER_SPEEDUP.get(int(hidden.group(1))) if hidden else None
        if need is None:
            continue
        best = _best_mode(cells, "te delayed", lambda mode: f"te bf16 {mode}")
        measured = f"{best[0]:.2f}x ({best[1]})" if best else "–"
        rows.append((f"TransformerLayer {size}: FP8 delayed over te bf16, best mode ≥ {need}x", measured,
                     _verdict(None if best is None else best[0] >= need)))
    return rows


def linear_rows(linear: Dict[str, dict]) -> List[Row]:
    rows = []
    for size, cells in linear.items():
        # te's best recipe and mode against torchao's best mode other than eager (the stronger peer)
        tried = [(r[0], f"{name} {r[1]}") for name in ("delayed", "current", "block")
                 if (r := _best_mode(cells, f"te {name}", lambda mode: "nn.Linear eager"))]
        best = max(tried) if tried else None
        base = _v(cells, "nn.Linear eager")
        aos = [_v(cells, f"torchao tensorwise {mode}") for mode in MODES[1:]]
        ao = min((v for v in aos if v), default=None)
        peer = base / ao if ao and base else None
        ok = None if best is None or peer is None else best[0] >= peer
        measured = (f"te {best[0]:.2f}x ({best[1]})" if best else "te –") + (
            f", torchao {peer:.2f}x" if peer else ", torchao –")
        rows.append((f"te.Linear {size} over bf16, best recipe and mode ≥ torchao compiled", measured,
                     _verdict(ok)))
        if size == LINEAR_EAGER[0]:
            eager = base / _v(cells, "te delayed eager") if base and _v(cells, "te delayed eager") else None
            rows.append((f"te.Linear {size} FP8 delayed eager ≥ {LINEAR_EAGER[1]}x", "–" if eager is None else
                         f"{eager:.2f}x", _verdict(None if eager is None else eager >= LINEAR_EAGER[1])))
    return rows


def big_rows(big: Dict[str, dict]) -> List[Row]:
    size, targets = BIG
    if size not in big:
        return []
    cells, rows = big[size], []
    torch_peak = (cells.get("torch bf16 eager") or {}).get("peak_mib")
    for name, need in targets.items():
        ms = _v(cells, f"te {name} eager")
        rows.append((f"TransformerLayer {size} FP8 {name} ≤ {need:g} ms", "–" if ms is None else f"{ms:.2f} ms",
                     _verdict(None if ms is None else ms <= need)))
        peak = (cells.get(f"te {name} eager") or {}).get("peak_mib")
        ok = None if not (peak and torch_peak) else peak <= torch_peak
        rows.append((f"TransformerLayer {size} FP8 {name}: peak memory ≤ plain-torch bf16",
                     f"{peak:.0f} against {torch_peak:.0f} MiB" if ok is not None else "–", _verdict(ok)))
    return rows


def tiny_rows(tiny: Dict[str, dict]) -> List[Row]:
    size, most = TINY
    if size not in tiny:
        return []
    rows, base = [], _v(tiny[size], "te bf16 eager", "us")
    for name in FP8:
        ours = _v(tiny[size], f"te {name} eager", "us")
        cost = ours / base if ours and base else None
        measured = "–" if cost is None else f"{ours:.0f} against {base:.0f} µs ({cost:.2f}x)"
        rows.append((f"{size}, FP8 {name} eager ≤ {most:g}x te bf16's time", measured,
                     _verdict(None if cost is None else cost <= most)))
    return rows


def compiled_rows(sweep: dict) -> List[Row]:
    """Compiled te never slower than eager te, same recipe, over every cell pair that both ran;
    the eager time measured beside the compiled cell (in alternating rounds) where the cell has
    one, else the eager cell's."""
    pairs, slower = 0, []
    for section, unit in (("layer", "ms"), ("linear", "ms"), ("tiny", "us")):
        for size, cells in sweep.get(section, {}).items():
            for name in ("bf16",) + FP8:
                for mode in ("compiled", "graphed"):
                    comp = _v(cells, f"te {name} {mode}", unit)
                    eager = _v(cells, f"te {name} {mode}", f"eager_{unit}") or _v(cells, f"te {name} eager", unit)
                    if eager and comp:
                        pairs += 1
                        if comp > eager:
                            slower.append(f"{name} {mode} at {size} ({eager / comp:.2f}x)")
    measured = f"{pairs - len(slower)} of {pairs} pairs" + (f"; slower: {', '.join(slower)}" if slower else "")
    return [("te compiled (and graphed) never slower than te eager, same recipe", measured if pairs else "–",
             _verdict(None if not pairs else not slower))]


def rows(sweep: dict) -> List[Row]:
    return (layer_rows(sweep.get("layer", {})) + linear_rows(sweep.get("linear", {})) + big_rows(sweep.get("big", {}))
            + tiny_rows(sweep.get("tiny", {})) + compiled_rows(sweep))


def render(sweep: dict) -> List[str]:
    found = rows(sweep)
    if not found:
        return []
    return (["**FP8 targets** (ratios: the baseline's time over te FP8's; above 1: FP8 faster):", "",
             "| Target | Measured | Verdict |", "| --- | --- | --- |"]
            + [f"| {t} | {m} | {v} |" for t, m, v in found] + [""])
