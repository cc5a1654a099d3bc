"""Discovery and selection of backends: the one place the selection rule is written down.

Rule: TE_BACKEND (or set_backend) names a backend, or "auto" (default): the available
accelerator backend (device type other than cpu), else "reference". Plugins come from the
entry-point group `te_core.backends` (optionally limited by TE_BACKEND_PLUGINS), each loaded
inside its own guard; the reference backend is built in. A backend is used only after torch
confirmed its device and its hooks answered well formed: one that fails is listed as broken,
auto moves on, and naming it is an error with the reason. Environment values are parsed in
settings.py.
"""
from __future__ import annotations

import os
import threading
import warnings
from importlib import metadata
from typing import Dict, List, Optional, Tuple

import pluggy

from . import hookspecs, settings, sources
from .plugin import Backend, BackendError, BrokenPlugin, PluginFailure, te_core_version, validate_hooks

REFERENCE = "reference"


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
        self._config_error: Optional[str] = None  # a TE_BACKEND_PLUGINS value that names no plugin
        self._verified: set = set()  # names of backends whose device and hooks passed verify()
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

        self._load(pm, "reference", reference_plugin, "te-core (built in)", te_core_version(), found)
        entry_points = _entry_points()
        try:
            allowed = settings.plugin_allowlist([ep.name for ep in entry_points], REFERENCE)
        except BackendError as exc:  # raised when selecting; `te-core info` still runs and shows it
            self._config_error, allowed = str(exc), set()
        for ep in entry_points:
            if allowed is not None and ep.name not in allowed:
                continue
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

    # -- verification ----------------------------------------------------------------------
    def verify(self, backend: Backend) -> Optional[str]:
        """None when torch can use an available backend's device and its ops and capabilities
        load well formed; else the reason, and the backend moves to the broken list."""
        with self._lock:
            if backend.name in self._verified:
                return None
            try:
                backend.check_device()
                backend.ops, backend.capabilities
            except PluginFailure as exc:
                if self._backends is not None and self._backends.get(backend.name) is backend:
                    del self._backends[backend.name]
                    self._broken.append(BrokenPlugin(backend.name, backend.distribution, str(exc)))
                return str(exc)
            self._verified.add(backend.name)
            return None

    # -- selection -------------------------------------------------------------------------
    def selection(self) -> Selection:
        selection = self._selection  # made once: read without the lock (torch.compile traces this read)
        if selection is not None:
            return selection
        with self._lock:
            if self._selection is None:
                self.select(None)
            return self._selection

    def select(self, name: Optional[str]) -> Backend:
        """Select `name`, or what TE_BACKEND says when None; re-reads the other settings too."""
        with self._lock:
            requested = name if name is not None else os.environ.get("TE_BACKEND", "auto").strip() or "auto"
            source = "set_backend()" if name is not None else ("TE_BACKEND" if "TE_BACKEND" in os.environ else "default")
            self._raise_config_error()
            if requested == "auto":
                backend, why = self._auto()
                why = f"auto ({source}): {why}"
            else:
                try:
                    backend, why = self.get(requested), f"{source}={requested}"
                except BackendError as exc:  # say which setting named it
                    where = f"set_backend({requested!r})" if name is not None else f"TE_BACKEND={requested!r}"
                    raise BackendError(f"{where}: {exc}") from None
            strict = settings.env_switch("TE_BACKEND_STRICT")
            overrides = self._overrides(os.environ.get("TE_BACKEND_OVERRIDES", ""))
            self._selection = Selection(backend, why, strict, overrides)
            self.generation += 1
            return backend

    def _raise_config_error(self) -> None:
        self.backends()
        if self._config_error:
            raise BackendError(self._config_error)

    def get(self, name: str) -> Backend:
        """A usable backend by name, its device checked and its ops and capabilities loaded, or a
        BackendError saying why not and what to do."""
        with self._lock:
            self._raise_config_error()
            backend = self._backends.get(name)
            if backend is None:
                raise BackendError(self._missing(name))
            if not backend.available:
                raise BackendError(f"backend {name!r} is installed but not available on this machine: {backend.reason}")
            if self.verify(backend) is not None:
                raise BackendError(self._missing(name))
            return backend

    def _missing(self, name: str) -> str:
        """Why `name` is not a usable backend: broken (with the error), or not installed (with
        the installed ones and, for a backend of te-core's source tree, its install command)."""
        claims = [b for b in self._broken if b.name == name]
        if claims:
            errors = "; ".join(f"{b.distribution}: {b.error}" for b in claims)
            return f"backend {name!r} is installed but broken: {errors}. 'te-core info' lists every backend's state"
        installed = ", ".join(sorted(self._backends)) or "none"
        in_tree = sources.install_hints()
        missing = {n: h for n, h in in_tree.items() if n not in self._backends}
        if name in missing:
            return (f"backend {name!r} is not installed; install it from te-core's repository: {missing[name]}. "
                    f"Installed backends: {installed}")
        message = (f"unknown backend {name!r}{settings.did_you_mean(name, self._backends)}. Installed backends: "
                   f"{installed}, or 'auto' (the available accelerator backend, else reference; 'te-core info' "
                   "shows which are available here)")
        if missing:
            others = "; ".join(f"{n} ({h})" for n, h in sorted(missing.items()))
            message += f". Not installed, from te-core's repository: {others}"
        elif not in_tree:
            message += f". {sources.GENERAL_HINT}"
        return message

    def _auto(self) -> Tuple[Backend, str]:
        backends = self.backends()
        accelerators = [b for n, b in sorted(backends.items()) if n != REFERENCE and b.device_type != "cpu"]
        skipped = []
        for backend in accelerators:
            if not backend.available:
                skipped.append(f"{backend.name}: {backend.reason}")
                continue
            error = self.verify(backend)
            if error is None:
                return backend, f"{backend.name} is available ({backend.reason})"
            skipped.append(f"{backend.name}: broken: {error}")
            warnings.warn(f"te_core: backend {backend.name!r} is broken and is skipped: {error}", RuntimeWarning, stacklevel=4)
        reasons = "; ".join(skipped) or "no accelerator backend installed"
        return self.get(REFERENCE), f"no accelerator backend available ({reasons}); using reference"

    def _overrides(self, spec: str) -> Dict[str, Backend]:
        from ..ops import CONTRACT

        overrides = {}
        for op, backend_name in settings.override_entries(spec, CONTRACT):
            try:
                backend = self.get(backend_name)
            except BackendError as exc:
                raise BackendError(f"TE_BACKEND_OVERRIDES entry '{op}={backend_name}': {exc}") from None
            if backend_name != REFERENCE and op not in backend.ops:
                raise BackendError(
                    f"TE_BACKEND_OVERRIDES pins {op!r} to backend {backend_name!r}, which does not implement it; "
                    f"it implements: {', '.join(sorted(backend.ops)) or 'no op'}")
            overrides[op] = backend
        return overrides

    def reset(self) -> None:
        """Forget discovery and selection (after installing a plugin, or in tests)."""
        with self._lock:
            self._backends, self._broken, self._selection = None, [], None
            self._config_error, self._verified = None, set()
            self.generation += 1


def _entry_points():
    """Every installed plugin's entry point, by name (TE_BACKEND_PLUGINS is applied by the registry)."""
    eps = metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
    return sorted(eps, key=lambda e: e.name)


def _distribution(ep) -> Tuple[Optional[str], Optional[str]]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


REGISTRY = Registry()
