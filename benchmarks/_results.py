"""Where the benchmarks write: RESULTS/<gpu>/<kind>.json, one file per kind and GPU, each run
replacing the last (git keeps the history). RESULTS is benchmarks/results unless a script's
--results says otherwise (gpu_run.sh points it under $OUT on a GPU machine)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
from typing import Optional

import torch

DEFAULT_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_name(device: str = "cuda") -> str:
    """The GPU's marketing name ("NVIDIA H200"), or "cpu"."""
    return torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu"


def gpu_slug(name: str) -> str:
    """The results folder of a device: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "geforce")]
    if not words:
        raise ValueError(f"cannot name a results folder after the device {name!r}")
    return "-".join(words)


def meta(device: str = "cuda") -> dict:
    """What a result needs to be read later: device, versions, UTC time."""
    info = {"gpu": device_name(device), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.device(device).type == "cuda":
        info["cuda"] = torch.version.cuda
    info["host"] = host_probe(device)
    return info


def host_probe(device: str = "cuda", calls: int = 2000) -> dict:
    """How fast this machine's CPU drives the device: microseconds per call of a small torch op
    (an add of two 8-element tensors into a third, `calls` of them, the device synchronized once
    after) and nanoseconds per call of an empty Python function; the median of three runs each.
    Host-bound results (tiny layers, eager steps of small models) scale with these, which differ
    between machines of the same kind, so results whose probes differ compare only as ratios
    measured within each run."""
    from _timing import wall_us

    a = torch.ones(8, device=torch.device(device))
    out = torch.empty_like(a)
    op_us = wall_us(lambda: torch.add(a, a, out=out), n=calls, warmup=calls // 10, device=device, repeats=3)
    call_us = wall_us(lambda: None, n=50 * calls, warmup=0, device=device, repeats=3)
    return {"torch_op_us": round(op_us, 2), "python_call_ns": round(call_us * 1e3)}


def host_note(meta: dict) -> str:
    """"; host: ..." for a results header where the results carry host_probe's figures, else ""."""
    host = meta.get("host") or {}
    if "torch_op_us" not in host:
        return ""
    return (f"; host: {host['torch_op_us']:g} µs per small torch op, {host.get('python_call_ns', '?')} ns per "
            "Python call")


def select_device(smoke: bool, script: str) -> str:
    """The device a benchmark runs on: "cpu" with the reference backend under --smoke, else
    "cuda" (exiting with how to run the script on a CPU-only machine)."""
    if smoke:
        import te_core

        te_core.set_backend("reference")
        return "cpu"
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} needs a GPU; on a CPU-only machine run it with --smoke")
    return "cuda"


def add_results_argument(parser) -> None:
    parser.add_argument("--results", default=DEFAULT_ROOT,
                        help="results root; the JSON goes to RESULTS/<gpu>/ (default: benchmarks/results)")


def write_json(kind: str, data: dict, root: Optional[str] = None) -> str:
    """Write `data` (with its "meta") to ROOT/<gpu slug>/<kind>.json; returns the path."""
    folder = os.path.join(root or DEFAULT_ROOT, gpu_slug(data["meta"]["gpu"]))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{kind}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    return path


def add_pin_argument(parser) -> None:
    parser.add_argument("--pin-host-threads", action="store_true",
                        help="run with the calling thread and autograd's backward thread on one CPU "
                        "(te.pin_host_threads), as docs/performance.md advises for host-bound steps")


def pin_host(args, device: str) -> Optional[int]:
    """Per --pin-host-threads: the CPU the run's host threads are pinned to (for the whole run), or None."""
    if not getattr(args, "pin_host_threads", False) or torch.device(device).type == "cpu":
        return None
    import te_core

    return te_core.pin_host_threads(device=device).cpu


def host_threads_note(settings: dict) -> str:
    """How the run placed its host threads, for a table's header."""
    cpu = settings.get("pinned_cpu")
    if cpu is None:
        return "host threads placed by the OS"
    return f"host threads pinned to CPU {cpu} (`te.pin_host_threads`)"
