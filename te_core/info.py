"""`te-core info`: what is installed, what is available here, and which ops run natively."""
from __future__ import annotations

import json
import platform
import sys
from typing import Any, Dict, List

import torch

from . import __version__
from .backend import dispatch
from .backend.plugin import Backend, BackendError
from .backend.registry import REGISTRY
from .ops import CONTRACT


def _capabilities(backend: Backend) -> Dict[str, Any]:
    caps = backend.capabilities
    return {
        "device": str(backend.device),
        "device_name": caps.device_name,
        "arch": caps.arch,
        "fp8_formats": dict(caps.fp8_formats),
        "scaling_modes": sorted(caps.scaling_modes),
        "distributed_backend": caps.distributed_backend,
        "notes": list(caps.notes),
    }


def _backend_entry(backend: Backend) -> Dict[str, Any]:
    entry: Dict[str, Any] = {
        "name": backend.name,
        "distribution": backend.distribution,
        "version": backend.version,
        "device_type": backend.device_type,
        "api_version": backend.info.api_version,
        "vendor_versions": dict(backend.info.vendor_versions),
        "available": backend.available,
        "reason": backend.reason,
        "ops": [],
        "capabilities": None,
    }
    if backend.available:  # verified by collect(): its device, ops and capabilities load
        entry["ops"] = sorted(backend.ops)
        entry["capabilities"] = _capabilities(backend)
    return entry


def collect() -> Dict[str, Any]:
    """Everything `te-core info` shows, as one JSON-serialisable dict."""
    for backend in list(REGISTRY.backends().values()):
        if backend.available:
            REGISTRY.verify(backend)  # one whose device or hooks fail moves to the broken list
    report: Dict[str, Any] = {
        "te_core": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "backends": [_backend_entry(b) for b in REGISTRY.backends().values()],
        "broken": [{"name": b.name, "distribution": b.distribution, "error": b.error} for b in REGISTRY.broken()],
    }
    try:
        selection = REGISTRY.selection()
    except BackendError as exc:
        report.update(selected=None, selected_reason=str(exc), ops=[])
        return report
    report["selected"] = selection.backend.name
    report["selected_reason"] = selection.why
    report["strict"] = selection.strict
    report["ops"] = [_op_row(name, selection) for name in CONTRACT]
    return report


def _op_row(name: str, selection) -> Dict[str, str]:
    backend = selection.overrides.get(name, selection.backend)
    reason = dispatch.fallback_reason(name)
    # under TE_BACKEND_STRICT=1 an op the backend cannot run raises instead of falling back
    fails = reason is not None and selection.strict
    return {
        "op": name,
        "family": CONTRACT[name].family,
        "backend": backend.name if reason is None else ("none" if fails else "reference"),
        "status": "native" if reason is None else ("error (TE_BACKEND_STRICT=1)" if fails else "fallback"),
        "reason": reason or ("pinned by TE_BACKEND_OVERRIDES" if name in selection.overrides else ""),
    }


def render(report: Dict[str, Any]) -> str:
    lines: List[str] = [f"te-core {report['te_core']}  torch {report['torch']}  python {report['python']}", "", "Backends:"]
    for b in report["backends"]:
        state = "available" if b["available"] else "NOT available"
        lines.append(f"  {b['name']:<10} {state}: {b['reason']}")
        lines.append(f"  {'':<10} from {b['distribution']} {b['version'] or ''}, device type {b['device_type']}, API {b['api_version']}")
        versions = ", ".join(f"{k} {v}" for k, v in b["vendor_versions"].items())
        if versions:
            lines.append(f"  {'':<10} libraries: {versions}")
        caps = b["capabilities"]
        if caps:
            formats = ", ".join(f"{k} (max {v:g})" for k, v in caps["fp8_formats"].items()) or "none"
            lines.append(f"  {'':<10} device {caps['device']} {caps['device_name']} {caps['arch']}".rstrip())
            lines.append(f"  {'':<10} FP8 formats: {formats}; scaling modes: {', '.join(caps['scaling_modes']) or 'none'}")
            for note in caps["notes"]:
                lines.append(f"  {'':<10} note: {note}")
            lines.append(f"  {'':<10} native ops: {len(b['ops'])}")
    lines.append("")
    lines.append("Broken plugins:" if report["broken"] else "Broken plugins: none")
    for b in report["broken"]:
        lines.append(f"  {b['name']} ({b['distribution']}): {b['error']}")
    lines.append("")
    strict = "; TE_BACKEND_STRICT=1: ops it cannot run raise instead of falling back" if report.get("strict") else ""
    lines.append(f"Selected: {report['selected']}  ({report['selected_reason']}{strict})")
    if report["ops"]:
        lines.append("")
        lines.append(f"  {'op':<38} {'family':<11} {'runs on':<10} note")
        for row in report["ops"]:
            lines.append(f"  {row['op']:<38} {row['family']:<11} {row['backend']:<10} {row['status']}{': ' + row['reason'] if row['reason'] else ''}")
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if as_json else render(report))
    if not report.get("selected") and not as_json:  # (also on stderr: what to fix)
        print(f"te-core: error: no backend selected: {report['selected_reason']}", file=sys.stderr)
    return 0 if report.get("selected") else 1
