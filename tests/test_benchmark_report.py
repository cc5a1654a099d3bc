"""benchmarks/: report.py's targets checked against a run's JSON, the sweep's cells and tables,
and the doc sections report.py rewrites."""
import copy
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
import _hf_table  # noqa: E402
import _host_table  # noqa: E402
import _sweep_table  # noqa: E402
import _sweep_targets  # noqa: E402
import bench_hf  # noqa: E402
import bench_sweep  # noqa: E402
import report  # noqa: E402

import te_core as te  # noqa: E402

MODULES = {
    "meta": {"gpu": "GPU", "torch": "t", "triton": "tr", "date": "d"},
    "linear": [
        {"shape": "M16384 K8192 N8192", "bf16_ms": 10.0, "torchao_tensorwise_ms": 6.0, "te_delayed_ms": 5.0,
         "te_delayed_graphed_ms": 5.5},
        {"shape": "M8192 K4096 N4096", "bf16_ms": 1.2, "torchao_tensorwise_ms": 1.1, "te_delayed_ms": 2.0,
         "te_delayed_graphed_ms": 0.8},
    ],
    "layer": [{"variant": "torch bf16 eager + SDPA", "ms": 35.0, "peak_mib": 2800.0},
              {"variant": "torchao tensorwise + compile", "ms": 24.0, "peak_mib": 3700.0},
              {"variant": "te bf16", "ms": 34.0, "peak_mib": 2810.0},
              {"variant": "te fp8 delayed", "ms": 21.0, "peak_mib": 2900.0}],
    "tiny": [{"nn.Linear bf16 us": 20.0, "te.Linear fp8 us": 300.0, "te.Linear fp8 graphed us": 50.0}],
}
KERNELS = {"checks": [{"ok": True}, {"ok": False}],
           "timings": [{"op": "quantize_fp8 into history slot", "GBps": 3950.0},
                       {"op": "layernorm_fwd fp8 out", "GBps": 3700.0}, {"op": "rmsnorm_fwd fp8 out", "GBps": 3240.0}]}


def _rows():
    text = report.table(MODULES, KERNELS)
    return {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}, text


def test_verdicts_follow_the_numbers():
    rows, text = _rows()
    assert "1/2 OK" in text
    assert rows["te.Linear M16384 K8192 N8192 (over bf16)"].endswith("| met |")
    assert "met with graphs only" in rows["te.Linear M8192 K4096 N4096 (over bf16)"]
    assert "**missed** by 1.00 ms" in rows["TransformerLayer FP8 delayed"]  # 21 ms against 20, though 1.67x over torch
    assert "**missed**" in rows["Peak memory, FP8 layer step"]  # 2900 MiB against at most 2810
    assert rows["Tiny te.Linear FP8 forward (graphed)"].endswith("| met |")  # 2.5x
    assert rows["Quantize + amax (into a history slot, as modules call it)"].endswith("| met |")
    assert "**missed** by 10%" in rows["LayerNorm / RMSNorm forward, FP8 out"]  # the worse of the two decides
    assert "not measured" in rows["gelu / swiglu backward"]


def test_the_header_names_both_dates_when_modules_and_kernels_ran_apart():
    assert "from one run on GPU (torch t, triton tr, d)" in report.table(MODULES, {**KERNELS, "meta": {"date": "d"}})
    text = report.table(MODULES, {**KERNELS, "meta": {"date": "2026-12-03T00:53:18+00:00"}})
    assert "from two runs on GPU (torch t, triton tr, modules d; kernels 2026-12-03)" in text


def test_graphed_kernel_timings_are_shown_but_eager_decides():
    kernels = {"checks": [], "timings": [
        {"op": "layernorm_fwd fp8 out", "GBps": 2400.0, "graphed_GBps": 3900.0},
        {"op": "rmsnorm_fwd fp8 out", "GBps": 3700.0, "graphed_GBps": 3950.0},
        {"op": "layernorm_bwd", "GBps": 3000.0, "graphed_GBps": 3100.0},
        {"op": "rmsnorm_bwd", "GBps": 3300.0, "graphed_GBps": 3400.0}]}
    rows = {r[0]: r for r in report.kernel_rows(kernels)}
    fwd = rows["LayerNorm / RMSNorm forward, FP8 out"]
    assert fwd[2] == "2400 GB/s / 3700 GB/s; graphed 3900 / 3950"
    assert fwd[3].startswith("**missed** by 33%") and "the shortfall is launch and host time" in fwd[3]
    bwd = rows["LayerNorm / RMSNorm backward"]  # the replays miss too: no host-bound excuse
    assert bwd[3] == "**missed** by 6%"


def _doc(tmp_path):
    doc = tmp_path / "perf.md"
    doc.write_text(f"intro\n{report.BEGIN}\nold table\n{report.END}\nmiddle\n"
                   f"{report.SWEEP_BEGIN}\nold sweep\n{report.SWEEP_END}\nafter\n"
                   f"{report.HF_BEGIN}\nold hf\n{report.HF_END}\n"
                   f"{report.HOST_BEGIN}\nold host\n{report.HOST_END}\n"
                   f"{report.DIST_BEGIN}\nold distributed\n{report.DIST_END}\nend\n")
    return doc


def test_doc_sections_are_replaced_and_markers_are_required(tmp_path):
    folder = tmp_path / "h200"
    folder.mkdir()
    (folder / "modules.json").write_text(json.dumps(MODULES))
    (folder / "kernels.json").write_text(json.dumps(KERNELS))
    doc = _doc(tmp_path)
    report.main([str(folder), "--doc", str(doc)])
    text = doc.read_text()
    assert "old table" not in text and "old sweep" not in text
    assert "old hf" not in text and "No hf.json for h200 yet" in text
    assert "old host" not in text and "No host.json for h200 yet" in text
    assert "old distributed" not in text and "No distributed.json for h200 yet" in text
    assert text.startswith("intro\n") and "\nmiddle\n" in text and "\nafter\n" in text and text.endswith("end\n")
    assert "| TransformerLayer FP8 delayed |" in text
    assert "No sweep.json for h200 yet" in text  # a missing run is said, not hidden
    assert "| TransformerLayer FP8 delayed |" in (folder / "table.md").read_text()
    with pytest.raises(ValueError, match="add the two markers"):
        report.replace_section("no markers here", "x")


def test_the_committed_results_are_where_report_reads_them():
    """Every committed GPU folder's results are read: the project's reference GPU has them all;
    another GPU's folder may hold some benchmarks only (a sweep), and report reads those."""
    folder = os.path.join(BENCHMARKS, "results")
    assert "h200" in os.listdir(folder)
    for gpu in os.listdir(folder):
        path = os.path.join(folder, gpu)
        targets, sweep, kernels = report.tables(path)
        if gpu == "h200" or os.path.exists(os.path.join(path, "kernels.json")):
            assert "kernel correctness checks" in targets, gpu  # modules.json and kernels.json were read
            assert "| device copy (ceiling) |" in kernels, gpu
        if gpu == "h200" or os.path.exists(os.path.join(path, "sweep.json")):
            assert "| te.Linear(1024, 1024), 128 tokens | eager |" in sweep, gpu  # sweep.json was read


SWEEP = {
    "meta": {"gpu": "GPU", "torch": "t", "triton": "tr", "date": "d"},
    "settings": {"compile": {"fullgraph": False}, "backend": "cuda", "seconds": 1.0},
    "layer": {"h1024": {"torch bf16 eager": {"ms": 10.0}, "te bf16 eager": {"ms": 8.0},
                        "te delayed eager": {"ms": 4.0}, "te delayed compiled": {"error": "InductorError: boom | x"}}},
    "linear": {"M8 K8 N8": {"nn.Linear eager": {"ms": 2.0}, "nn.Linear compiled": {"ms": 1.0},
                            "te current eager": {"ms": 4.0}, "torchao tensorwise compiled": {"ms": 0.5}}},
    "tiny": {"tiny": {"te bf16 eager": {"us": 300.0}, "te block eager": {"us": 1200.0}}},
    "big": {"h4096": {"torch bf16 eager": {"ms": 30.0, "peak_mib": 2000.0},
                      "te delayed eager": {"ms": 20.0, "peak_mib": 2200.0}}},
}


def _table_rows(text):
    return [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]


def test_sweep_table_ratios_and_error_notes():
    text = _sweep_table.render(SWEEP)
    rows = _table_rows(text)
    assert "| h1024 | eager | 10.00 ms | 8.00 ms | 4.00 ms (2.00x) | – | – |" in rows  # FP8 over te bf16
    assert "| h1024 | compiled | – | – | error (1) | – | – |" in rows
    assert "1. h1024, te delayed compiled: `InductorError: boom / x`" in text  # no "|" breaking the table
    assert "| M8 K8 N8 | eager | 2.00 ms | – | 4.00 ms (0.50x) | – | – |" in rows  # over nn.Linear eager
    assert "| M8 K8 N8 | compiled | 1.00 ms (2.00x) | – | – | – | 0.50 ms (4.00x) |" in rows
    assert "| tiny | eager | – | 300 µs | – | – | 1200 µs (0.25x) |" in rows
    assert "| h4096 | te delayed | 20.00 ms (1.50x) | 2200 MiB (1.10x) |" in rows


def test_sweep_targets_follow_the_numbers():
    sweep = {
        "layer": {"h1024 ffn4096 nh8 s2048 b4": {"te bf16 eager": {"ms": 10.0}, "te delayed eager": {"ms": 12.0},
                                                 "te bf16 compiled": {"ms": 8.0}, "te delayed compiled": {"ms": 7.0}},
                  "h2048 ffn8192 nh16 s2048 b4": {"te bf16 eager": {"ms": 10.0}, "te delayed eager": {"ms": 8.0}}},
        "linear": {"M8192 K4096 N4096": {"nn.Linear eager": {"ms": 1.2}, "te delayed eager": {"ms": 1.0},
                                         "te block graphed": {"ms": 0.95},
                                         "torchao tensorwise compiled": {"ms": 0.9}},
                   "M4096 K4096 N4096": {"nn.Linear eager": {"ms": 1.2}, "te current graphed": {"ms": 0.8},
                                         "torchao tensorwise compiled": {"ms": 1.0},
                                         "torchao tensorwise graphed": {"ms": 0.9}}},
        "big": {"h4096 ffn16384 nh32 s2048 b8": {
            "torch bf16 eager": {"ms": 34.0, "peak_mib": 2800.0}, "te delayed eager": {"ms": 18.5, "peak_mib": 2700.0},
            "te current eager": {"error": "OutOfMemoryError"}, "te block eager": {"ms": 22.0, "peak_mib": 2900.0}}},
        "tiny": {"te.Linear(1024, 1024), 128 tokens": {"te bf16 eager": {"us": 300.0}, "te delayed eager": {"us": 500.0},
                                                       "te current eager": {"us": 700.0}}},
    }
    got = {target: (measured, verdict) for target, measured, verdict in _sweep_targets.rows(sweep)}
    assert got["TransformerLayer h1024 ffn4096 nh8 s2048 b4: FP8 delayed over te bf16, best mode ≥ 1.0x"] == (
        "1.14x (compiled)", "met")  # eager alone (0.83x) would miss
    assert got["TransformerLayer h2048 ffn8192 nh16 s2048 b4: FP8 delayed over te bf16, best mode ≥ 1.3x"][1] == "**missed**"
    linear = "over bf16, best recipe and mode ≥ torchao compiled"
    assert got[f"te.Linear M8192 K4096 N4096 {linear}"] == ("te 1.26x (block graphed), torchao 1.33x", "**missed**")
    # te's best recipe is compared with torchao's faster mode
    assert got[f"te.Linear M4096 K4096 N4096 {linear}"] == ("te 1.50x (current graphed), torchao 1.33x", "met")
    assert got["te.Linear M8192 K4096 N4096 FP8 delayed eager ≥ 1.2x"] == ("1.20x", "met")
    big = "TransformerLayer h4096 ffn16384 nh32 s2048 b8 FP8"
    assert got[f"{big} delayed ≤ 19 ms"][1] == "met" and got[f"{big} block ≤ 21 ms"][1] == "**missed**"
    assert got[f"{big} current ≤ 20 ms"][1] == "not measured"  # an error cell is no measurement
    assert got[f"{big} delayed: peak memory ≤ plain-torch bf16"][1] == "met"
    assert got[f"{big} block: peak memory ≤ plain-torch bf16"][1] == "**missed**"
    tiny = "te.Linear(1024, 1024), 128 tokens, FP8"
    assert got[f"{tiny} delayed eager ≤ 2x te bf16's time"] == ("500 against 300 µs (1.67x)", "met")
    assert got[f"{tiny} current eager ≤ 2x te bf16's time"][1] == "**missed**"
    assert got[f"{tiny} block eager ≤ 2x te bf16's time"][1] == "not measured"
    assert got["te compiled (and graphed) never slower than te eager, same recipe"] == ("2 of 2 pairs", "met")


def test_compiled_never_slower_reads_the_eager_time_measured_beside_the_compiled_cell():
    """A compiled cell timed in alternating rounds with its eager twin is judged against that
    eager time, not the eager cell measured in another pass of the sweep (the host drifts)."""
    row = {"te delayed eager": {"ms": 2.0},  # an earlier, faster host: alone it would say "slower"
           "te delayed compiled": {"ms": 2.2, "eager_ms": 2.5},
           "te current eager": {"ms": 3.0},  # alone it would say "faster"
           "te current compiled": {"ms": 2.9, "eager_ms": 2.6},
           "te block eager": {"ms": 2.0}, "te block compiled": {"ms": 2.2}}  # no twin: the eager cell
    got = _sweep_targets.compiled_rows({"linear": {"M8192 K4096 N4096": row}})
    (target, measured, verdict), = got
    assert verdict == "**missed**" and measured.startswith("1 of 3 pairs")
    assert "current compiled at M8192 K4096 N4096 (0.90x)" in measured
    assert "block compiled at M8192 K4096 N4096 (0.91x)" in measured and "delayed" not in measured


def test_a_compiled_te_cell_is_timed_beside_its_eager_twin():
    """On the CPU (dynamo without inductor): the compiled te cells carry the same module's eager
    time, measured in the same rounds; the peers' compiled cells and the eager cells do not."""
    sweep = bench_sweep.Sweep(bench_sweep.SMOKE, "cpu", {"backend": "eager"})
    cells = {c.name: c for c in sweep.linear() if c.name in ("te current compiled", "nn.Linear compiled",
                                                             "te current eager")}
    got = bench_sweep.run(list(cells.values()), budget_s=120, device="cpu")["linear"]
    (row,) = got.values()
    assert row["te current compiled"]["ms"] > 0 and row["te current compiled"]["eager_ms"] > 0
    assert "eager_ms" not in row["nn.Linear compiled"] and "eager_ms" not in row["te current eager"]


def test_sweep_cells_cover_every_section_mode_and_recipe():
    sweep = bench_sweep.Sweep(bench_sweep.SMOKE, "cpu", {"backend": "eager"})
    names = {s: {c.name for c in getattr(sweep, s)()} for s in bench_sweep.SECTIONS}
    te_names = {f"te {r} {m}" for r in ("bf16", "delayed", "current", "block") for m in ("eager", "compiled")}
    assert names["layer"] == te_names | {"torch bf16 eager", "torch bf16 compiled"}
    assert names["tiny"] == te_names | {"nn.Linear eager", "nn.Linear compiled"}
    assert names["linear"] == (te_names - {"te bf16 eager", "te bf16 compiled"}) | {
        "nn.Linear eager", "nn.Linear compiled", "torchao tensorwise compiled"}
    assert names["big"] == {"torch bf16 eager", "te bf16 eager", "te delayed eager", "te current eager", "te block eager"}
    eager_only = bench_sweep.Sweep(bench_sweep.SMOKE, "cpu", None)
    assert all(not c.name.endswith("compiled") for s in bench_sweep.SECTIONS for c in getattr(eager_only, s)())
    captured = bench_sweep.Sweep(bench_sweep.SMOKE, "cpu", {}, capture=True)
    got = {s: {c.name for c in getattr(captured, s)()} for s in bench_sweep.SECTIONS}
    assert got["linear"] == {n.replace("compiled", "captured") for n in names["linear"]}
    assert got["layer"] == {n.replace("compiled", "captured") for n in names["layer"]}
    assert got["big"] == names["big"]  # eager only: the batch-8 step is GPU-bound


def test_captured_cells_need_graph_capture_and_say_so():
    """A captured cell on a device without graph capture records why instead of a time; the
    eager cells of the run still measure."""
    sweep = bench_sweep.Sweep(bench_sweep.SMOKE, "cpu", {}, capture=True)
    cells = [c for c in sweep.linear() if c.name in ("te delayed captured", "nn.Linear captured", "te delayed eager")]
    (row,) = bench_sweep.run(cells, budget_s=120, device="cpu")["linear"].values()
    assert "no graph capture for device type 'cpu'" in row["te delayed captured"]["error"]
    assert "need graph capture, which torch has not for 'cpu'" in row["nn.Linear captured"]["error"]
    assert row["te delayed eager"]["ms"] > 0


def test_captured_cells_count_as_a_mode_in_targets_and_tables():
    cells = {"nn.Linear eager": {"ms": 1.2}, "te delayed eager": {"ms": 1.5}, "te delayed captured": {"ms": 0.6},
             "torchao tensorwise compiled": {"ms": 1.0}, "torchao tensorwise captured": {"ms": 0.8}}
    got = {t: (m, v) for t, m, v in _sweep_targets.linear_rows({"M4096 K4096 N4096": cells})}
    # te's best mode is the capture; the peer's is its capture too (0.8 ms, not its compiled 1.0 ms)
    assert got["te.Linear M4096 K4096 N4096 over bf16, best recipe and mode ≥ torchao compiled"] == (
        "te 2.00x (delayed captured), torchao 1.50x", "met")
    rows = _table_rows(_sweep_table.render({"linear": {"M4096 K4096 N4096": cells}}))
    assert "| M4096 K4096 N4096 | captured | – | 0.60 ms (2.00x) | – | – | 0.80 ms (1.50x) |" in rows
    # captured cells are not compiled ones: the compiled-never-slower target does not count them
    assert _sweep_targets.compiled_rows({"linear": {"M4096 K4096 N4096": cells}})[0][1] == "–"
    settings = {"capture": True, "compile": None, "merged_with": {"compile": {"fullgraph": False}}}
    text = _sweep_table.header({"settings": settings})
    assert "captured with te.make_graphed_callables" in text and "compiled with torch.compile(fullgraph=False)" in text
    # the legend names every mode the tables show, whichever merged run measured it
    assert _sweep_table.legend({"linear": {"M4096 K4096 N4096": cells}}).startswith("compiled: torch.compile")
    assert "captured: te.make_graphed_callables" in _sweep_table.legend({"linear": {"M4096 K4096 N4096": cells}})
    assert _sweep_table.legend({"tiny": {"t": {"te bf16 eager": {"us": 1.0}}}}) == ""


def test_a_failing_cell_and_a_spent_budget_are_recorded_not_raised():
    def boom():
        raise RuntimeError("compiled FP8 failed")

    cells = [bench_sweep.Cell("tiny", "t", "te delayed compiled", boom),
             bench_sweep.Cell("tiny", "t", "nn.Linear eager", lambda: {"us": 1.0})]
    got = bench_sweep.run(cells, budget_s=60, device="cpu")["tiny"]["t"]
    assert got == {"te delayed compiled": {"error": "RuntimeError: compiled FP8 failed"}, "nn.Linear eager": {"us": 1.0}}
    late = bench_sweep.run(cells[1:], budget_s=-1, device="cpu")["tiny"]["t"]["nn.Linear eager"]
    assert late["error"].startswith("skipped: the sweep's time budget")


def test_a_compiled_cell_records_its_graphs_and_graph_breaks():
    def with_a_break(x):
        y = x * 2
        print("a graph break")  # dynamo cannot trace print: the frame splits in two graphs
        return y + 1

    def measure():
        compiled = torch.compile(with_a_break, backend="eager")
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
        return {"us": 1.0}

    def whole():
        torch.compile(lambda x: x * 2 + 1, backend="eager", fullgraph=True)(torch.ones(3))
        return {"us": 1.0}

    cells = [bench_sweep.Cell("tiny", "t", "a compiled", measure), bench_sweep.Cell("tiny", "t", "b compiled", whole),
             bench_sweep.Cell("tiny", "t", "c eager", lambda: {"us": 2.0})]
    got = bench_sweep.run(cells, budget_s=60, device="cpu")["tiny"]["t"]
    assert got["a compiled"]["graph_breaks"] == 1 and got["a compiled"]["graphs"] == 2
    assert "print" in got["a compiled"]["first_graph_break"]
    assert got["b compiled"] == {"us": 1.0, "graphs": 1, "graph_breaks": 0}  # the counters start afresh per cell
    assert got["c eager"] == {"us": 2.0}


def test_smoke_sweep_writes_json_and_report_renders_it(tmp_path):
    """The whole pipeline on the CPU: bench_sweep.py --smoke (reference backend, tiny sizes,
    eager cells) writes RESULTS/cpu/sweep.json, report.py renders it into the doc."""
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "bench_sweep.py"), "--smoke", "--no-compile",
                           "--results", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "cpu" / "sweep.json").read_text())
    assert data["meta"]["gpu"] == "cpu" and data["settings"]["backend"] == "reference"
    for section, unit in (("layer", "ms"), ("linear", "ms"), ("tiny", "us"), ("big", "ms")):
        (cells,) = data[section].values()
        assert cells and all(c.get(unit, 0) > 0 for c in cells.values()), (section, cells)
    doc = _doc(tmp_path)
    report.main([str(tmp_path / "cpu"), "--doc", str(doc)])
    rows = _table_rows(doc.read_text())
    assert any(r.startswith("| h64 ffn256 nh2 s16 b2 | eager |") and r.count(" ms") == 5 for r in rows), rows
    assert any(r.startswith("| M64 K64 N32 | eager |") for r in rows), rows
    assert "No modules.json or kernels.json for cpu yet" in doc.read_text()


def test_merge_replaces_only_the_cells_measured_again():
    earlier = {"tiny": {"t": {"a eager": {"us": 1.0}, "a compiled": {"error": "x"}}},
               "layer": {"h1": {"b eager": {"ms": 2.0}}}}
    now = {"tiny": {"t": {"a compiled": {"us": 3.0}}}, "linear": {"m": {"c eager": {"ms": 4.0}}}}
    out = bench_sweep.merged(earlier, now)
    assert out == {"tiny": {"t": {"a eager": {"us": 1.0}, "a compiled": {"us": 3.0}}},
                   "layer": {"h1": {"b eager": {"ms": 2.0}}}, "linear": {"m": {"c eager": {"ms": 4.0}}}}
    assert earlier["tiny"]["t"]["a compiled"] == {"error": "x"}  # the input is not modified


def test_cells_pattern_picks_cells_by_size_and_name():
    cells = [bench_sweep.Cell("linear", size, name, lambda: {}) for size in ("M4096 K4096 N4096", "M8192 K4096 N4096")
             for name in ("te current eager", "te current compiled", "te block compiled")]
    chosen = bench_sweep.selected(cells, "M8192.*(current|block) compiled")
    assert [(c.size, c.name) for c in chosen] == [("M8192 K4096 N4096", "te current compiled"),
                                                  ("M8192 K4096 N4096", "te block compiled")]
    assert bench_sweep.selected(cells, None) == cells
    with pytest.raises(ValueError, match="matches none of the 6 cells"):
        bench_sweep.selected(cells, "M16384")
    with pytest.raises(ValueError, match="matches none of the 0 cells"):
        bench_sweep.selected([], "M8192")


def test_merge_records_the_earlier_runs_settings_one_level_deep():
    earlier = {"backend": "cuda", "seconds": 12.5, "merged_with": {"backend": "cuda", "merged_with": {}}}
    assert bench_sweep.merged_settings(earlier) == {"backend": "cuda", "seconds": 12.5}
    assert bench_sweep.merged_settings(None) == {}


def test_merge_keeps_a_measurement_the_budget_skipped_this_time():
    earlier = {"layer": {"h1": {"b compiled": {"ms": 2.0}, "c compiled": {"ms": 3.0}}}}
    now = {"layer": {"h1": {"b compiled": {"error": bench_sweep.SKIPPED}, "c compiled": None,
                            "d compiled": {"error": bench_sweep.SKIPPED}, "e compiled": {"error": "boom"}}}}
    out = bench_sweep.merged(earlier, now)["layer"]["h1"]
    assert out["b compiled"] == {"ms": 2.0} and out["c compiled"] == {"ms": 3.0}  # skipped / not reached: kept
    assert out["d compiled"] == {"error": bench_sweep.SKIPPED}  # nothing earlier to keep
    assert out["e compiled"] == {"error": "boom"}  # a failure is a result


HF = {
    "meta": {"gpu": "GPU", "torch": "t", "date": "d"},
    "settings": {"transformers": "5.0", "backend": "cuda", "attention": "sdpa", "seconds": 1.0,
                 "sizes": {"layers": 4, "vocab": 32000, "warmup": 3, "steps": 8}},
    "hf": {"h1024": {"torch bf16 eager": {"tokens_per_s": 400e3}, "te bf16 eager": {"tokens_per_s": 380e3},
                     "te delayed eager": {"tokens_per_s": 500e3}, "te current eager": {"tokens_per_s": 360e3},
                     "torch bf16 compiled": {"tokens_per_s": 450e3},
                     "te delayed compiled": {"tokens_per_s": 600e3, "error": "loss is not finite: [nan]"},
                     "te current compiled": {"error": "InductorError: boom | x"}},
           "h2048": {"torch bf16 eager": {"tokens_per_s": 200e3}, "te delayed eager": {"tokens_per_s": 250e3}}},
}


def test_hf_table_ratios_verdicts_and_error_notes():
    text = _hf_table.render(HF)
    rows = _table_rows(text)
    assert rows[0] == "| Model | Mode | torch bf16 | te bf16 | te delayed | te current | FP8 ≥ torch bf16 |"
    assert ("| h1024 | eager | 400.0k | 380.0k (0.95x) | 500.0k (1.25x) | 360.0k (0.90x) | **missed** (current 0.90x) |"
            in rows)  # tokens/s over plain-torch bf16: above 1 is faster
    # a non-finite loss is an error even with a speed beside it; neither counts as a measurement
    assert "| h1024 | compiled | 450.0k | – | error (1) | error (2) | not measured |" in rows
    assert "1. h1024, te delayed compiled: `loss is not finite: [nan]`" in text
    assert "2. h1024, te current compiled: `InductorError: boom / x`" in text  # no "|" breaking the table
    assert "| h2048 | eager | 200.0k | – | 250.0k (1.25x) | – | met |" in rows  # a cell never run is no miss
    assert "transformers 5.0" in text and "4 layers" in text
    assert "--merge" not in text  # one run: nothing kept from another


def test_hf_table_says_when_cells_come_from_an_earlier_run(tmp_path):
    merged = {**HF, "settings": {**HF["settings"], "merged_with": "2026-01-02"}}
    assert "kept from the run of 2026-01-02 (--merge)" in _hf_table.header(merged)
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    (gpu / "hf.json").write_text(json.dumps(HF))
    rows, date = bench_hf.previous_rows({"gpu": "GPU"}, str(tmp_path))
    assert rows == {"hf": HF["hf"]} and date == "d"
    assert bench_hf.previous_rows({"gpu": "GPU"}, str(tmp_path / "none")) == ({}, None)


def test_hf_cells_run_eager_first_and_cover_every_variant():
    bench = bench_hf.Bench(None, bench_hf.FULL, "cpu", smoke=False)
    variants = ["torch bf16", "te bf16", "te delayed"]
    cells = bench.cells([1024, 4096], bench_hf.MODES, variants)
    assert len(cells) == 2 * len(bench_hf.MODES) * len(variants)
    assert [c.name.split()[-1] for c in cells[:6]] == ["eager"] * 6  # both sizes' baselines before any compile
    assert {c.size for c in cells} == {"h1024 ffn3584 nh8 L4 s2048 b16", "h4096 ffn14336 nh32 L4 s2048 b4"}
    assert bench_hf.intermediate_size(2048) == 7168 and bench_hf.intermediate_size(1000) % 64 == 0


@pytest.mark.parametrize("mode", bench_hf.MODES[:3])
def test_hf_compiled_cells_compile_afresh(monkeypatch, mode):
    """Each compiled cell starts from an empty dynamo cache: one compiled loss function serving
    every cell would retrace later sizes as symbolic ones and, past the cache limit, run eagerly."""
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    bench = bench_hf.Bench(None, bench_hf.FULL, "cpu", smoke=True)
    bench.train_step(torch.nn.Linear(4, 4), None, mode, torch.zeros(1, 4, dtype=torch.long))
    assert len(resets) == (0 if mode == "eager" else 1)


class _StandInLayer(torch.nn.Module):
    """A decoder layer called as Hugging Face's are: hidden states, then keyword arguments."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = te.Linear(hidden, hidden, params_dtype=torch.float32)

    def forward(self, hidden_states, *, position_embeddings, attention_mask=None, use_cache=False):
        cos, sin = position_embeddings
        return hidden_states + self.proj(hidden_states) * cos + sin


class _StandInLM(torch.nn.Module):
    """model.model.layers, and a forward(input_ids, labels) whose result has .loss."""

    def __init__(self, vocab=32, hidden=16, layers=2):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed = torch.nn.Embedding(vocab, hidden)
        self.model.layers = torch.nn.ModuleList(_StandInLayer(hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        h = self.model.embed(input_ids)
        pos = torch.arange(input_ids.shape[1], dtype=torch.float32)[:, None]
        rotary = (torch.cos(pos * 0.1).expand_as(h[0]), torch.sin(pos * 0.1).expand_as(h[0]))
        for layer in self.model.layers:
            h = layer(h, position_embeddings=rotary, attention_mask=None, use_cache=False)
        logits = self.head(h)
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def test_hf_captured_layers_get_the_keywords_the_model_passes(monkeypatch):
    """bench_hf's captured mode records the keyword arguments a model passes its decoder layers
    and captures the layers with them: with the capture emulated (each replay runs the layer),
    training steps equal an eager twin's, and a call with other keywords is refused."""
    from te_core import graphs

    monkeypatch.setattr(graphs, "_graph_api", lambda device: lambda callables, sample_args, num_warmup_iters=3,
                        allow_unused_input=False: tuple(callables))
    rcp = te.recipe.Float8CurrentScaling()
    torch.manual_seed(0)
    model = _StandInLM()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 32, (2, 8))
    bench_hf.capture_layers(model, rcp, ids)
    for step in range(2):
        losses = []
        for m in (model, twin):
            loss = bench_hf.loss_of(m, ids, rcp)
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), step
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)
    with pytest.raises(TypeError, match="unexpected output_attentions"):
        with te.autocast(recipe=rcp):
            model.model.layers[0](torch.randn(2, 8, 16), position_embeddings=(torch.ones(8, 16), torch.ones(8, 16)),
                                  attention_mask=None, use_cache=False, output_attentions=False)


def test_bench_hf_arguments_and_a_missing_transformers_are_explained(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        bench_hf.parse_args(["--modes", "eager,fast"])
    assert "--modes: unknown fast; choose from eager, compiled, graphed, captured" in capsys.readouterr().err
    for mode in ("graphed", "captured"):
        with pytest.raises(SystemExit):
            bench_hf.parse_args(["--smoke", "--modes", mode])
        assert f"--modes {mode} needs CUDA graphs" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(SystemExit, match="pip install transformers"):
        bench_hf.main(["--smoke"])


def test_hf_smoke_writes_json_and_report_renders_it(tmp_path):
    """bench_hf.py --smoke: a tiny Llama trained on the CPU (reference backend) as plain torch and
    converted; the converted bf16 model starts from the same loss, FP8 within E4M3's tolerance."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "bench_hf.py"), "--smoke", "--modes", "eager",
                           "--results", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "cpu" / "hf.json").read_text())
    assert data["settings"]["backend"] == "reference"
    (cells,) = data["hf"].values()
    assert set(cells) == {"torch bf16 eager", "te bf16 eager", "te delayed eager", "te current eager"}
    assert all(c["tokens_per_s"] > 0 and "error" not in c for c in cells.values()), cells
    base = cells["torch bf16 eager"]["loss_first"]
    assert base == pytest.approx(cells["te bf16 eager"]["loss_first"], rel=1.6e-2, abs=1e-5)
    for fp8 in ("te delayed eager", "te current eager"):
        assert base == pytest.approx(cells[fp8]["loss_first"], rel=0.125, abs=0.0675)
    doc = _doc(tmp_path)
    report.main([str(tmp_path / "cpu"), "--doc", str(doc)])
    rows = _table_rows(doc.read_text())
    (row,) = [r for r in rows if r.startswith("| h64 ffn256 nh2 L2 s32 b2 | eager |")]
    cells = row.split(" | ")[2:6]  # torch bf16, then te bf16 / delayed / current with their ratios
    assert all(re.fullmatch(r"[0-9.]+k?( \([0-9.]+x\))?", c) for c in cells) and "(" not in cells[0], row


HOST = {"meta": {"gpu": "GPU", "torch": "t", "date": "d"}, "settings": {"steps": 10, "backend": "cuda"},
        "host": {"M128 K1024 N1024": {
            "nn.Linear": {"us": 250.0, "torch_ops": 12, "launches": 8.0, "python_calls": 40.0, "own_python_calls": 0.0,
                          "own_python_share": 0.0},
            "te bf16": {"us": 500.0, "us_calling_thread": 250.0, "torch_ops": 20, "launches": 11.0, "python_calls": 200.0, "own_python_calls": 80.0,
                        "own_python_share": 0.4},
            "te delayed": {"us": 900.0, "us_calling_thread": 600.0, "torch_ops": 40, "launches": 18.0, "python_calls": 900.0,
                           "own_python_calls": 330.0, "own_python_share": 0.5},
            "te current": {"us": 1100.0, "torch_ops": 45, "launches": 20.0, "python_calls": 1100.0,
                           "own_python_calls": 400.0, "own_python_share": 0.5},
            "te block": {"error": "RuntimeError: boom | x"}}}}


def test_host_table_targets_counts_and_error_notes():
    rows = _table_rows(_host_table.render(HOST))
    assert "| M128 K1024 N1024: te delayed step ≤ 2x te bf16's | 900 against 500 µs (1.80x) | met |" in rows
    assert "| M128 K1024 N1024: te current step ≤ 2x te bf16's | 1100 against 500 µs (2.20x) | **missed** (2.20x) |" \
        in rows
    assert "| M128 K1024 N1024 | te delayed | 900 µs (1.80x) | 600 µs (2.40x) | 40 | 18.0 | 900 (330) | 50% |" in rows
    # a cell without the calling-thread time (an older host.json, here te current) shows a dash
    assert "| M128 K1024 N1024 | te current | 1100 µs (2.20x) | – | 45 | 20.0 | 1100 (400) | 50% |" in rows
    assert any(r.startswith("| M128 K1024 N1024 | te block | error (1) |") for r in rows), rows
    assert "boom / x" in _host_table.render(HOST)


def test_host_table_shows_the_c_launch_off_column_where_measured():
    """The step with te_triton's C launch off appears as its own column, with its ratio over te
    bf16's in the same setting, only in runs that measured it (a GPU with the extension)."""
    assert "te_triton launches in Python" not in _host_table.render(HOST)
    data = json.loads(json.dumps(HOST))
    cells = data["host"]["M128 K1024 N1024"]
    cells["te bf16"]["us_python_launch"], cells["te delayed"]["us_python_launch"] = 510.0, 1020.0
    text = _host_table.render(data)
    assert "te_triton's C launch off" in text
    rows = _table_rows(text)
    assert "| M128 K1024 N1024 | te delayed | 900 µs (1.80x) | 600 µs (2.40x) | 1020 µs (2.00x) | 40 | 18.0 | " \
           "900 (330) | 50% |" in rows, rows
    assert "| M128 K1024 N1024 | te current | 1100 µs (2.20x) | – | – | 45 | 20.0 | 1100 (400) | 50% |" in rows


def test_host_smoke_writes_json_and_report_renders_it(tmp_path):
    """bench_host.py --smoke on the CPU (reference backend): every variant measured, FP8 steps
    doing more torch ops and Python calls than te bf16's, rendered by report.py."""
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "bench_host.py"), "--smoke", "--steps", "2",
                           "--results", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "cpu" / "host.json").read_text())
    (cells,) = data["host"].values()
    assert set(cells) == set(_host_table.VARIANTS) and all("error" not in c for c in cells.values()), cells
    assert all(c["us"] > 0 and c["us_calling_thread"] > 0 and c["launches"] is None for c in cells.values()), cells
    for fp8 in ("te delayed", "te current", "te block"):
        assert cells[fp8]["torch_ops"] > cells["te bf16"]["torch_ops"] > cells["nn.Linear"]["torch_ops"] > 0
        assert cells[fp8]["own_python_calls"] > cells["te bf16"]["own_python_calls"] > 0
    assert cells["nn.Linear"]["own_python_calls"] == 0
    # te-core alone (ops replayed) leaves out the backend's work, which the reference does in torch
    assert "us_ops_replayed" not in cells["nn.Linear"]
    for variant in _host_table.VARIANTS[1:]:
        assert 0 < cells[variant]["us_ops_replayed"] < cells[variant]["us_calling_thread"], cells[variant]
    doc = _doc(tmp_path)
    report.main([str(tmp_path / "cpu"), "--doc", str(doc)])
    rows = [r for r in _table_rows(doc.read_text()) if r.startswith("| M16 K128 N128 | te delayed | ")]
    assert len(rows) == 1 and rows[0].count("|") == 10, rows  # the ops-replayed column included


def test_interleaved_cells_take_turns_and_fail_alone():
    """The tiny row's eager cells: each round visits every cell once, in order; a cell whose
    step cannot be built, or raises while timed, records its own error and the others go on."""
    import _timing

    order = []

    def maker(name, fail_after=None):
        def make():
            calls = [0]

            def step():
                calls[0] += 1
                if fail_after is not None and calls[0] > fail_after:
                    raise RuntimeError(f"{name} broke")
                order.append(name)
            return step
        return make

    def unbuildable():
        raise ValueError("no such recipe")

    group = _timing.Interleaved(calls=10, device="cpu", rounds=5)  # 2 calls per round, 3 warm-up calls
    a, b = group.cell(maker("a")), group.cell(maker("b"))
    broken, late = group.cell(unbuildable), group.cell(maker("c", fail_after=3 + 2 * 2))
    assert not order  # nothing runs before the first cell is measured
    result = a()
    assert set(result) == {"us"} and result["us"] > 0 and b()["us"] > 0
    with pytest.raises(ValueError, match="no such recipe"):
        broken()
    with pytest.raises(RuntimeError, match="c broke"):
        late()
    timed = order[9:]  # after each cell's warm-up (a, b and c, three calls each)
    assert timed[:6] == ["a", "a", "b", "b", "c", "c"]  # round 1 visits every cell
    assert timed[6:] == ["a", "a", "b", "b", "c", "c"] + ["a", "a", "b", "b"] * 3  # c failed in round 3


def test_headers_say_how_the_host_threads_were_placed():
    settings = {"backend": "cuda", "compile": None, "seconds": 1}
    assert "host threads placed by the OS" in _sweep_table.header({"settings": settings})
    pinned = {**settings, "pinned_cpu": 3}
    assert "host threads pinned to CPU 3 (`te.pin_host_threads`)" in _sweep_table.header({"settings": pinned})
    merged = _sweep_table.header({"settings": {**pinned, "merged_with": {"pinned_cpu": None}}})
    assert merged.endswith("(--merge), whose host threads placed by the OS; 1 s). fwd+bwd per call; the ratio in "
                           "brackets is the named baseline's time over the cell's (above 1: faster).")
    same = _sweep_table.header({"settings": {**pinned, "merged_with": {"pinned_cpu": 3}}})
    assert "whose" not in same
    assert "both threads pinned to CPU 7" in _host_table.render({"settings": {"pinned_cpu": 7}, "host": {}})
    assert "pinned" not in _host_table.render({"settings": {}, "host": {}})


def test_host_table_shows_the_pinned_column_only_when_measured():
    cell = {"us": 200.0, "us_calling_thread": 150.0, "torch_ops": 9, "launches": 4.0, "python_calls": 90,
            "own_python_calls": 30, "own_python_share": 0.5}
    row = {"te bf16": cell, "te delayed": {**cell, "us": 300.0}}
    plain = _host_table.render({"settings": {}, "host": {"M16 K16 N16": row}})
    assert "Threads pinned" not in plain and "| M16 K16 N16 | te delayed | 300 µs (1.50x) | 150 µs (1.00x) | 9 |" in plain
    row = {"te bf16": {**cell, "us_pinned": 100.0}, "te delayed": {**cell, "us": 300.0, "us_pinned": 160.0}}
    pinned = _host_table.render({"settings": {"pinned_cpu": 3}, "host": {"M16 K16 N16": row}})
    assert "| Threads pinned to one CPU |" in pinned
    assert "| M16 K16 N16 | te delayed | 300 µs (1.50x) | 150 µs (1.00x) | 160 µs (1.60x) | 9 |" in pinned
    # the compiled steps: their own columns, each over te bf16's compiled step in the same setting
    row = {"te bf16": {**cell, "us_compiled": 400.0, "us_compiled_calling_thread": 200.0},
           "te delayed": {**cell, "us": 300.0, "us_compiled": 900.0, "us_compiled_calling_thread": 500.0}}
    compiled = _host_table.render({"settings": {}, "host": {"M16 K16 N16": row}})
    assert "| Compiled | Compiled, backward on the calling thread |" in compiled
    assert "| M16 K16 N16 | te delayed | 300 µs (1.50x) | 150 µs (1.00x) | 900 µs (2.25x) | 500 µs (2.50x) | 9 |" \
        in compiled


def test_pin_argument_is_off_by_default_and_never_pins_a_cpu_run():
    import _results

    args = bench_sweep.parse_args(["--smoke"])
    assert args.pin_host_threads is False and _results.pin_host(args, "cpu") is None
    args = bench_sweep.parse_args(["--smoke", "--pin-host-threads"])
    assert args.pin_host_threads is True
    assert _results.pin_host(args, "cpu") is None  # the reference backend's CPU run keeps its cores


def test_an_interleaved_cell_runs_its_warm_up_and_rounds_inside_its_setting():
    import contextlib

    import _timing

    log = []

    @contextlib.contextmanager
    def setting():
        log.append("enter")
        yield
        log.append("exit")

    def maker(name):
        return lambda: (lambda: log.append(name))

    group = _timing.Interleaved(calls=4, device="cpu", rounds=2)  # 2 calls per round, 3 warm-up calls
    plain, inside = group.cell(maker("plain")), group.cell(maker("inside"), around=setting)
    assert plain()["us"] > 0 and inside()["us"] > 0
    assert log == (["plain"] * 3 + ["enter"] + ["inside"] * 3 + ["exit"]
                   + (["plain"] * 2 + ["enter"] + ["inside"] * 2 + ["exit"]) * 2)


def test_bench_kernels_refuses_an_unknown_sweep_family():
    run = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "bench_kernels.py"), "--sweep", "mxfp8", "nope"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert "unknown families ['nope']; choose from quantize, cast_transpose" in run.stderr


def test_results_carry_the_host_speed_and_headers_name_it():
    """Every results file's meta measures how fast the host drives the device (host-bound cells
    scale with it); each generated header names it, and a file without it reads as before."""
    import _distributed_table
    import _hf_table
    import _results

    host = _results.meta("cpu")["host"]
    assert host["torch_op_us"] > 0 and host["python_call_ns"] > 0
    meta = {"gpu": "NVIDIA H200", "host": {"torch_op_us": 4.25, "python_call_ns": 38}}
    note = "; host: 4.25 µs per small torch op, 38 ns per Python call)"
    settings = {"backend": "cuda", "compile": None, "seconds": 1}
    assert note in _sweep_table.header({"meta": meta, "settings": settings})
    assert note in _hf_table.header({"meta": meta, "settings": settings})
    assert note in _host_table.render({"meta": meta, "settings": {}, "host": {}})
    assert note in _distributed_table.header({"meta": meta, "settings": {}})
    assert "host:" not in _sweep_table.header({"meta": {"gpu": "NVIDIA H200"}, "settings": settings})
