"""The repository's structural rules (docs/architecture.md): te_core holds no vendor code
(scripts/check_layering.py passes on te_core/ and catches each kind of violation), and nothing in
the repository points at files outside it."""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKER = ROOT / "scripts" / "check_layering.py"


def _check(*paths):
    return subprocess.run([sys.executable, str(CHECKER), *map(str, paths)], capture_output=True, text=True)


def test_te_core_mentions_no_vendor():
    out = _check()
    assert out.returncode == 0, "vendor code in te_core:\n" + out.stdout + out.stderr


def test_checker_catches_each_violation(tmp_path):
    bad = tmp_path / "bad.py"
    lines = ['torch.cuda.synchronize()', 'import torch_musa', 'from te_backend_acme.ops import gemm',
             'import te_triton', 'x = torch.ones(1, device="cuda:1")', "y = x.to('musa')"]
    bad.write_text("\n".join(['"""clean docstring about devices"""', *lines]) + "\n")
    (tmp_path / "good.py").write_text('device = backend.get_backend().device  # cuda-agnostic\n')
    out = _check(tmp_path)
    assert out.returncode == 1
    flagged = [line.split(": ", 1)[1].rsplit("  [", 1)[0] for line in out.stdout.splitlines()]
    assert flagged == lines


def test_missing_path_is_an_error(tmp_path):
    out = _check(tmp_path / "nowhere")
    assert out.returncode == 2 and "no such file or directory" in out.stderr


# -- the repository is self-contained -------------------------------------------------------------
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml"}
SKIPPED_DIRS = {"__pycache__", "build", "dist"}
# The project's working notes outside the tree: a clone has none of them.
OUTSIDE = re.compile(r"\.\./shared\b|\b(DESIGN|MUSA|PERFORMANCE|STYLE)\.md\b|check-layering")


def _text_files():
    this = pathlib.Path(__file__).resolve()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d in SKIPPED_DIRS or d.endswith(".egg-info"))]
        for name in files:
            path = pathlib.Path(folder) / name
            if path.suffix in TEXT_SUFFIXES and path != this:
                yield path


def test_nothing_points_outside_the_repository():
    """Docs, tests and comments name only files a clone has."""
    offending = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _text_files()
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not offending, "references to files outside the repository:\n" + "\n".join(offending)


# -- every setting a user can make is documented ----------------------------------------------------
ENV_NAME = re.compile(r"[\"'](TE_[A-Z][A-Z0-9_]+)[\"']")
SOURCE_DIRS = ("te_core", "backends", "plugins")


def test_every_environment_variable_read_is_in_the_backends_doc():
    """A TE_* variable named in the product's code (te_core, the backends, the template) has a
    row in docs/backends.md's table of environment variables."""
    named = {}
    for top in SOURCE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            if "tests" in path.relative_to(ROOT).parts or "__pycache__" in path.parts:
                continue
            for name in ENV_NAME.findall(path.read_text(encoding="utf-8")):
                named.setdefault(name, str(path.relative_to(ROOT)))
    assert "TE_BACKEND" in named  # the scan finds what it should
    table = (ROOT / "docs" / "backends.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(TE_[A-Z0-9_]+)", table, re.M))
    missing = {name: where for name, where in named.items() if name not in rows}
    assert not missing, f"environment variables without a row in docs/backends.md: {missing}"
