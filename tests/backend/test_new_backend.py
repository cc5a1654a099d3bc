"""`te-core new-backend` writes a renamed, installable copy of the template, and `te-core certify`
runs the conformance kit and prints the op coverage."""
import importlib
import os
import subprocess
import sys

import pytest

from te_core import cli, info
from te_core.backend import BackendError
from te_core.backend.sources import install_hints
from te_core.commands import certify, new_backend

from registry_fakes import FakeEntryPoint


@pytest.fixture
def acme(tmp_path, monkeypatch):
    """A backend generated as plugins/acme of a scratch tree, importable without installing it."""
    dest = tmp_path / "plugins" / "acme"
    assert cli.main(["new-backend", "acme", "--dest", str(dest)]) == 0
    monkeypatch.syspath_prepend(str(dest))
    yield dest
    for name in [m for m in sys.modules if m.startswith("te_backend_acme")]:
        del sys.modules[name]


def test_generated_tree_is_renamed_and_clean(acme):
    files = sorted(p.relative_to(acme).as_posix() for p in acme.rglob("*") if p.is_file())
    assert files == ["README.md", "pyproject.toml", "te_backend_acme/__init__.py", "te_backend_acme/ops.py",
                     "te_backend_acme/plugin.py", "tests/test_acme_backend.py"]
    for path in acme.rglob("*"):
        assert "__pycache__" not in path.parts and not path.name.endswith(".egg-info")
        if path.is_file():
            assert "template" not in path.read_text(), f"{path} still mentions the template"
        if path.suffix == ".py":
            compile(path.read_text(), str(path), "exec")
    pyproject = (acme / "pyproject.toml").read_text()
    assert 'name = "te-backend-acme"' in pyproject and 'include = ["te_backend_acme*"]' in pyproject
    assert install_hints(acme.parents[1]) == {"acme": f"pip install {acme}"}  # its te_core.backends entry point
    tests = (acme / "tests" / "test_acme_backend.py").read_text()
    assert "from te_backend_acme.ops import OPS" in tests
    assert "from te_backend_acme.plugin import DEVICE_TYPE, NAME" in tests and "set_backend(NAME)" in tests
    assert 'NAME = "acme"' in (acme / "te_backend_acme" / "plugin.py").read_text()


def test_generated_backend_loads_under_its_name(acme, plugins):
    plugin = importlib.import_module("te_backend_acme.plugin")
    assert plugin.__file__.startswith(str(acme))
    plugins([FakeEntryPoint("acme", plugin, dist="te-backend-acme")])
    report = info.collect()
    entry = next(b for b in report["backends"] if b["name"] == "acme")
    assert entry["available"] and entry["reason"] == "acme backend, always available (runs on the CPU)"
    assert entry["vendor_versions"]["te-backend-acme"] == "0.1.0"
    assert entry["capabilities"]["device_name"] == "acme (cpu)" and len(entry["ops"]) == 6


def test_generated_tests_follow_the_ops_a_vendor_keeps(acme):
    """A vendor drops ops it does not implement (docs/backends.md, section 3): the generated tests
    take the op table from OPS, and the gemm_fp8 decline tests skip once gemm_fp8 is gone."""
    ops_py = acme / "te_backend_acme" / "ops.py"
    kept = [line for line in ops_py.read_text().splitlines(keepends=True)
            if not line.lstrip().startswith(('"gemm_fp8":', '"layernorm_fwd":'))]
    ops_py.write_text("".join(kept))
    dist = acme / "te_backend_acme-0.1.0.dist-info"  # the entry point, as `pip install -e` would register it
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: te-backend-acme\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[te_core.backends]\nacme = te_backend_acme.plugin\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TE_BACKEND", "TE_BACKEND_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(acme), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests"],
                            cwd=acme, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "1 passed, 3 skipped" in out and "OPS declares no gemm_fp8 with a supports()" in out, out


@pytest.mark.parametrize("name, problem", [
    ("Acme", "lower-case letters"), ("1acme", "lower-case letters"), ("ac-me", "lower-case letters"),
    ("class", "Python keyword"), ("reference", "reserved"), ("auto", "reserved"), ("template", "already installed"),
])
def test_bad_names_are_refused(tmp_path, name, problem):
    with pytest.raises(BackendError, match=problem):
        new_backend.create(name, tmp_path / "x", installed=["reference", "template"])
    assert not (tmp_path / "x").exists()


def test_existing_destination_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(BackendError, match="already exists and is not an empty directory"):
        new_backend.create("acme", tmp_path)
    with pytest.raises(BackendError, match="already exists and is not an empty directory"):
        new_backend.create("acme", tmp_path / "keep.txt")


def test_missing_template_says_where_it_ships(tmp_path, monkeypatch):
    with pytest.raises(BackendError, match="plugins/template.*pass --template the plugins/template directory"):
        new_backend.create("acme", tmp_path / "x", template=tmp_path / "nowhere")
    monkeypatch.setattr(new_backend, "TEMPLATE", tmp_path / "nowhere")  # (no checkout: the default is missing)
    with pytest.raises(BackendError, match="plugins/template.*--template DIR"):
        new_backend.create("acme", tmp_path / "x", template=tmp_path / "nowhere")


def test_user_path_errors_are_clear_not_tracebacks(tmp_path, capsys):
    """A --dest that cannot be made, a demo --device without data: exit status 2 and one line saying
    what is wrong, no traceback."""
    from te_core import cli

    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli.main(["new-backend", "acme", "--dest", str(blocker / "sub")]) == 2
    assert "te-core: error: cannot write" in capsys.readouterr().err


def test_coverage_is_read_from_the_kit_report(tmp_path):
    report = tmp_path / "kit.xml"
    case = '<testcase classname="te_core.testing.test_conformance" name="test_op_matches_reference[{}]">{}</testcase>'
    report.write_text("<testsuites><testsuite>" + "".join([
        case.format("gemm[a]", ""), case.format("gemm[b]", '<skipped message="gemm needs K % 16"/>'),
        case.format("dbias[a]", '<skipped message="fallback to reference: not declared (dbias)"/>'),
        case.format("attention[a]", '<failure message="mismatch"/>'),
        case.format("attention[b]", ""),
        '<testcase name="test_kit_covers_op[gemm]"/>',
    ]) + "</testsuite></testsuites>")
    counts = certify.outcomes(report)
    assert counts == {"gemm": {"passed": 1, "declined": 1, "fallback": 0, "failed": 0},
                      "dbias": {"passed": 0, "declined": 0, "fallback": 1, "failed": 0},
                      "attention": {"passed": 1, "declined": 0, "fallback": 0, "failed": 1}}
    table = certify.table("acme", counts)
    assert "gemm" in table and "1/1/0" in table and "native (some cases declined)" in table
    assert "fallback (not declared)" in table and "FAILING" in table
    assert "ops: 2 native (1 failing), 1 fall back to the reference backend" in table


def test_certify_the_template_backend(capfd):
    assert cli.main(["certify", "template", "-k", "gemm"]) == 0
    out = capfd.readouterr().out
    assert "$ python -m pytest --pyargs te_core.testing --te-backend template" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert rows["gemm"][0] == "gemm" and rows["gemm"][2] == "native"
    assert rows["gemm_fp8"][2:] == ["native", "(some", "cases", "declined)"]  # supports() declines unaligned K
    assert rows["attention"][1:] == ["-", "not", "run"]
    assert "native (0 failing)" in out and "not run" in out
    assert "backend 'template': the kit passed with -k gemm, a partial run" in out
