"""`te-core info`: the report users read to see what runs where."""
import json
import subprocess
import sys

from te_core import info
from te_core.ops import CONTRACT

from registry_fakes import FakeEntryPoint, make_plugin


def test_report_lists_backends_broken_selection_and_coverage(plugins):
    plugins([
        FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": lambda dy: dy.sum(0)})),
        FakeEntryPoint("sleepy", make_plugin("sleepy", available=(False, "no sleepy device"))),
        FakeEntryPoint("bad", error=ImportError("missing libvendor")),
    ])
    report = info.collect()
    by_name = {b["name"]: b for b in report["backends"]}
    assert report["selected"] == "fake"
    assert by_name["fake"]["ops"] == ["dbias"] and by_name["fake"]["capabilities"]["arch"] == "fake_1"
    assert by_name["sleepy"]["available"] is False and by_name["sleepy"]["reason"] == "no sleepy device"
    assert report["broken"][0]["name"] == "bad" and "missing libvendor" in report["broken"][0]["error"]
    rows = {row["op"]: row for row in report["ops"]}
    assert set(rows) == set(CONTRACT)
    assert rows["dbias"]["status"] == "native" and rows["dbias"]["backend"] == "fake"
    assert rows["gemm"]["status"] == "fallback" and rows["gemm"]["reason"] == "not implemented by 'fake'"
    text = info.render(report)
    assert "sleepy     NOT available: no sleepy device" in text
    assert "Selected: fake" in text and "missing libvendor" in text


def test_strict_selection_marks_the_ops_that_would_raise(plugins, monkeypatch):
    """Under TE_BACKEND_STRICT=1 an op the backend lacks raises instead of falling back: the table
    says so, and the selection line names the mode."""
    plugins([FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": lambda dy: dy.sum(0)}))])
    monkeypatch.setenv("TE_BACKEND_STRICT", "1")
    report = info.collect()
    rows = {row["op"]: row for row in report["ops"]}
    assert rows["dbias"]["status"] == "native"
    assert rows["gemm"]["status"] == "error (TE_BACKEND_STRICT=1)" and rows["gemm"]["backend"] == "none"
    assert "TE_BACKEND_STRICT=1: ops it cannot run raise" in info.render(report)


def test_cli_json_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-m", "te_core", "info", "--json"], capture_output=True, text=True,
                         env={"TE_BACKEND": "reference", "PATH": ""}, check=True)
    report = json.loads(out.stdout)
    assert report["selected"] == "reference"
    assert {"selected", "backends", "broken"} <= set(report)
    ref = next(b for b in report["backends"] if b["name"] == "reference")
    assert ref["available"] is True and set(ref["ops"]) == set(CONTRACT)
    assert ref["capabilities"]["fp8_formats"] == {"E4M3": 448.0, "E5M2": 57344.0}


def test_cli_reports_selection_error(plugins):
    out = subprocess.run([sys.executable, "-m", "te_core", "info"], capture_output=True, text=True,
                         env={"TE_BACKEND": "nosuch", "PATH": ""})
    assert out.returncode == 1
    assert "unknown backend 'nosuch'" in out.stdout


def test_readme_sample_matches_what_info_prints():
    """README's sample output: the native-op counts and the table header are what `info` prints."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    sample = readme.split("```\nte-core ", 1)[1].split("```", 1)[0]
    counts = dict(re.findall(r"^  (\w+) .*?(?:\n {13}.*)*?\n {13}native ops: (\d+)$", sample, re.M))
    report = info.collect()
    actual = {b["name"]: str(len(b["ops"])) for b in report["backends"] if b["available"]}
    assert counts and counts["reference"] == str(len(CONTRACT)) == actual["reference"]
    for name, count in counts.items():
        if name in actual:
            assert actual[name] == count, f"README says {name} has {count} native ops; info prints {actual[name]}"
    rendered = info.render(report)
    header = next(line for line in sample.splitlines() if line.strip().startswith("op "))
    assert header in rendered.splitlines()
