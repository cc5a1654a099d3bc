"""benchmarks/report.py: targets checked against a run's JSON, and the doc section it rewrites."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import report  # noqa: E402

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


def test_doc_section_is_replaced_and_markers_are_required(tmp_path):
    doc = tmp_path / "perf.md"
    doc.write_text(f"intro\n{report.BEGIN}\nold table\n{report.END}\nafter\n")
    (tmp_path / "m.json").write_text(json.dumps(MODULES))
    (tmp_path / "k.json").write_text(json.dumps(KERNELS))
    report.main([str(tmp_path / "m.json"), str(tmp_path / "k.json"), "--doc", str(doc)])
    text = doc.read_text()
    assert "old table" not in text and text.startswith("intro\n") and text.endswith("after\n")
    assert "| TransformerLayer FP8 delayed |" in text
    with pytest.raises(ValueError, match="add the two markers"):
        report.replace_section("no markers here", "x")
