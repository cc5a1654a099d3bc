"""te_core holds no vendor code (DESIGN.md): the same rule as shared/tools/check-layering."""
import pathlib
import re

VENDOR = re.compile(r"torch\.cuda|torch\.musa|import torch_musa|[\"'](cuda|musa)(:[0-9]+)?[\"']")


def test_te_core_mentions_no_vendor():
    root = pathlib.Path(__file__).resolve().parents[1] / "te_core"
    offending = [
        f"{path.relative_to(root.parent)}:{number}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if VENDOR.search(line)
    ]
    assert not offending, "vendor code in te_core:\n" + "\n".join(offending)
