"""Discovery and selection of backends: the one place the selection rule is written down.

Rule: TE_BACKEND (or set_backend) names a backend, or "auto" (default): the available
accelerator backend (device type other than cpu), else "reference". Plugins come from the
entry-point group `te_core.backends` (optionally limited by TE_BACKEND_PLUGINS), each loaded
inside its own guard; the reference backend is built in.
"""
from __future__ import annotations

import os
import threading
from importlib import metadata
from typing import Dict, List, Optional, Tuple

import pluggy

from . import hookspecs
from .plugin import Backend, BackendError, BrokenPlugin, PluginFailure, validate_hooks

REFERENCE = "reference"
VENDOR_WHEELS = (("te-backend-cuda", "NVIDIA GPUs"), ("te-backend-musa", "Moore Threads GPUs"))


class Selection:
    """The selected backend, why, and the per-op settings read with it."""

    def __init__(self, backend: Backend, why: str, strict: bool, overrides: Dict[str, Backend]):
        self.backend = backend
        self.why = why
        self.strict = strict
        self.overrides = overrides


class Registry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._backends: Optional[Dict[str, Backend]] = None
        self._broken: List[BrokenPlugin] = []
        self._selection: Optional[Selection] = None
        self.generation = 0  # bumped on every (re)selection; dispatch caches key on it

    # -- discovery -------------------------------------------------------------------------
    def backends(self) -> Dict[str, Backend]:
        with self._lock:
            if self._backends is None:
                self._discover()
            return self._backends

    def broken(self) -> List[BrokenPlugin]:
        self.backends()
        return list(self._broken)

    def _discover(self) -> None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        found: Dict[str, List[Tuple[Backend, str]]] = {}
        from ..reference import plugin as reference_plugin

        self._load(pm, "reference", reference_plugin, "te-core (built in)", _te_core_version(), found)
        for ep in _entry_points():
            dist, version = _distribution(ep)
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must never break import te_core
                self._broken.append(BrokenPlugin(ep.name, dist, f"import failed: {type(exc).__name__}: {exc}"))
                continue
            self._load(pm, ep.name, plugin, dist, version, found)
        self._backends = {}
        for name, claims in found.items():
            if name == REFERENCE and len(claims) > 1:  # the built-in one is listed first and wins
                for _, dist in claims[1:]:
                    self._broken.append(BrokenPlugin(name, dist, "backend name 'reference' is reserved for te-core's built-in backend; rename the plugin's backend"))
                claims = claims[:1]
            if len(claims) == 1:
                self._backends[name] = claims[0][0]
                continue
            dists = " and ".join(repr(dist) for _, dist in claims)
            for backend, dist in claims:
                self._broken.append(BrokenPlugin(name, dist, f"backend name {name!r} is claimed by {dists}; uninstall one of them, or list the one to load in TE_BACKEND_PLUGINS"))

    def _load(self, pm, ep_name, plugin, dist, version, found) -> None:
        try:
            pm.register(plugin, name=f"{ep_name}@{dist}")
        except Exception as exc:  # pluggy validates hook signatures here
            self._broken.append(BrokenPlugin(ep_name, dist, f"invalid plugin: {type(exc).__name__}: {exc}"))
            return
        try:
            validate_hooks(pm, plugin)
            backend = Backend(pm, plugin, dist, version)
        except PluginFailure as exc:
            pm.unregister(plugin)
            self._broken.append(BrokenPlugin(ep_name, dist, str(exc)))
            return
        found.setdefault(backend.name, []).append((backend, dist))

    # -- selection -------------------------------------------------------------------------
    def selection(self) -> Selection:
        with self._lock:
            if self._selection is None:
                self.select(None)
            return self._selection

    def select(self, name: Optional[str]) -> Backend:
        """Select `name`, or what TE_BACKEND says when None; re-reads the other settings too."""
        with self._lock:
            requested = name if name is not None else os.environ.get("TE_BACKEND", "auto").strip() or "auto"
            source = "set_backend()" if name is not None else ("TE_BACKEND" if "TE_BACKEND" in os.environ else "default")
            if requested == "auto":
                backend, why = self._auto()
                why = f"auto ({source}): {why}"
            else:
                backend, why = self.get(requested), f"{source}={requested}"
            strict = os.environ.get("TE_BACKEND_STRICT", "0").strip() not in ("", "0", "false", "False")
            overrides = self._overrides(os.environ.get("TE_BACKEND_OVERRIDES", ""))
            self._selection = Selection(backend, why, strict, overrides)
            self.generation += 1
            return backend

    def get(self, name: str) -> Backend:
        """A usable backend by name, its ops and capabilities loaded, or a BackendError saying why not."""
        backends = self.backends()
        if name not in backends:
            claims = [b for b in self._broken if b.name == name]
            if claims:
                raise BackendError(f"backend {name!r} is installed but broken: " + "; ".join(f"{b.distribution}: {b.error}" for b in claims))
            installed = ", ".join(sorted(backends)) or "none"
            hints = "; ".join(f"pip install {wheel} ({what})" for wheel, what in VENDOR_WHEELS)
            raise BackendError(f"unknown backend {name!r}. Installed backends: {installed}. To add one: {hints}; 'te-core info' lists what is installed and available.")
        backend = backends[name]
        if not backend.available:
            raise BackendError(f"backend {name!r} is installed but not available on this machine: {backend.reason}")
        try:
            backend.ops, backend.capabilities
        except PluginFailure as exc:
            raise BackendError(f"backend {name!r} failed while loading: {exc}") from exc
        return backend

    def _auto(self) -> Tuple[Backend, str]:
        backends = self.backends()
        accelerators = [b for n, b in sorted(backends.items()) if n != REFERENCE and b.device_type != "cpu"]
        usable = [b for b in accelerators if b.available]
        for backend in usable:
            try:
                return self.get(backend.name), f"{backend.name} is available ({backend.reason})"
            except BackendError:
                continue
        skipped = "; ".join(f"{b.name}: {b.reason}" for b in accelerators) or "no accelerator backend installed"
        return self.get(REFERENCE), f"no accelerator backend available ({skipped}); using reference"

    def _overrides(self, spec: str) -> Dict[str, Backend]:
        from ..ops import CONTRACT

        overrides = {}
        for item in filter(None, (part.strip() for part in spec.split(";"))):
            op, sep, backend_name = (s.strip() for s in item.partition("="))
            if not sep or not op or not backend_name:
                raise BackendError(f"TE_BACKEND_OVERRIDES entry {item!r} is not of the form op=backend")
            if op not in CONTRACT:
                raise BackendError(f"TE_BACKEND_OVERRIDES names unknown op {op!r}; contract ops: {', '.join(CONTRACT)}")
            backend = self.get(backend_name)
            if backend_name != REFERENCE and op not in backend.ops:
                raise BackendError(f"TE_BACKEND_OVERRIDES pins {op!r} to backend {backend_name!r}, which does not implement it")
            overrides[op] = backend
        return overrides

    def reset(self) -> None:
        """Forget discovery and selection (after installing a plugin, or in tests)."""
        with self._lock:
            self._backends, self._broken, self._selection = None, [], None
            self.generation += 1


def _entry_points():
    allow = os.environ.get("TE_BACKEND_PLUGINS")
    allowed = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()}
    eps = metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
    return [ep for ep in sorted(eps, key=lambda e: e.name) if allowed is None or ep.name in allowed]


def _distribution(ep) -> Tuple[Optional[str], Optional[str]]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def _te_core_version() -> str:
    from .. import __version__

    return __version__


REGISTRY = Registry()
