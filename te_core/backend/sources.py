"""Backends that te-core's source tree ships but that may not be installed, with the command
that installs each one: the hint a user gets after naming a backend that is not installed.

The vendor backends are not on a package index; they install from the repository
(`backends/<name>`, `plugins/<name>`), so the hint is read from the tree te-core runs from.
From an installed wheel there is no tree, and no hint beyond the general one.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, List, Optional

from .hookspecs import ENTRY_POINT_GROUP

REPOSITORY = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("backends", "plugins")
GENERAL_HINT = "Vendor backends install from a checkout of te-core's source repository: pip install ./backends/<name>"

_NAME = re.compile(r'^name\s*=\s*"([^"]+)"', re.M)
_DEPENDENCIES = re.compile(r"^dependencies\s*=\s*\[([^\]]*)\]", re.M)
_ENTRY_POINTS = re.compile(r'^\[project\.entry-points\."' + re.escape(ENTRY_POINT_GROUP) + r'"\]\s*$(.*?)(?=^\[|\Z)', re.M | re.S)
_ENTRY = re.compile(r'^\s*([A-Za-z0-9_.-]+)\s*=\s*"', re.M)


class _Project:
    def __init__(self, path: Path, text: str):
        self.path = path
        match = _NAME.search(text)
        self.distribution = match.group(1) if match else ""
        deps = _DEPENDENCIES.search(text)
        self.requires = re.findall(r'"([A-Za-z0-9_.-]+)', deps.group(1)) if deps else []
        section = _ENTRY_POINTS.search(text)
        self.backends = _ENTRY.findall(section.group(1)) if section else []


def _projects(root: Path) -> List[_Project]:
    projects = []
    for folder in SOURCE_DIRS:
        for pyproject in sorted((root / folder).glob("*/pyproject.toml")):
            try:
                projects.append(_Project(pyproject.parent, pyproject.read_text(encoding="utf-8")))
            except OSError:  # an unreadable file only costs the hint
                continue
    return projects


def _shown(path: Path) -> str:
    """`path` as a user types it: relative to the current directory when below it."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else f"./{rel}"


def install_hints(root: Optional[Path] = None) -> Dict[str, str]:
    """Backend (entry-point) name -> the pip command that installs it from the source tree,
    its in-tree dependencies first (e.g. shared kernels a backend needs)."""
    projects = _projects(REPOSITORY if root is None else root)
    by_dist = {p.distribution: p for p in projects}
    hints = {}
    for project in projects:
        needed = [by_dist[d].path for d in project.requires if d in by_dist and d != "te-core"]
        command = "pip install " + " ".join(_shown(p) for p in (*needed, project.path))
        for name in project.backends:
            hints.setdefault(name, command)
    return hints
