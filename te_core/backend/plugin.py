"""A typed facade over one backend plugin: its hooks called one at a time, inside guards."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import pluggy
import torch

from . import devices
from .hookspecs import REQUIRED_HOOKS
from .types import API_VERSION, BackendInfo, Capabilities, OpImpl


class BackendError(RuntimeError):
    """A backend cannot be selected or used; the message says why and what to do."""


class PluginFailure(Exception):
    """A plugin misbehaved (raised in a hook, returned the wrong type); it is recorded as broken."""


@dataclass(frozen=True)
class BrokenPlugin:
    name: str  # entry-point name (or backend name when known)
    distribution: Optional[str]
    error: str


def call_hook(pm: pluggy.PluginManager, plugin: Any, hook: str, **kwargs) -> Any:
    """Call `hook` of this one plugin only; None when it does not implement it."""
    for impl in getattr(pm.hook, hook).get_hookimpls():
        if impl.plugin is plugin:
            try:
                return impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception as exc:  # recorded as broken by the caller, never swallowed silently
                raise PluginFailure(f"{hook} raised {type(exc).__name__}: {exc}") from exc
    return None


def validate_hooks(pm: pluggy.PluginManager, plugin: Any) -> None:
    """Reject hooks without a specification (typos) and missing required hooks."""
    implemented = set()
    for caller in pm.get_hookcallers(plugin) or ():
        if caller.spec is None:
            raise PluginFailure(f"implements unknown hook {caller.name!r} (known: see te_core.backend.hookspecs)")
        implemented.add(caller.name)
    missing = [h for h in REQUIRED_HOOKS if h not in implemented]
    if missing:
        raise PluginFailure(f"does not implement required hook(s) {', '.join(missing)}")


def _api_major(version: str) -> str:
    return str(version).split(".")[0]


class Backend:
    """One loaded backend. Built by the registry; hooks beyond info/availability run lazily."""

    def __init__(self, pm: pluggy.PluginManager, plugin: Any, distribution: Optional[str], version: Optional[str]):
        self._pm = pm
        self._plugin = plugin
        self.distribution = distribution
        self.version = version
        self.info: BackendInfo = self._load_info()
        self.available, self.reason = self._load_availability()
        self._ops: Optional[Dict[str, OpImpl]] = None
        self._capabilities: Optional[Capabilities] = None
        self._device_module: Any = None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def device_type(self) -> str:
        return self.info.device_type

    def _hook(self, hook: str, **kwargs) -> Any:
        return call_hook(self._pm, self._plugin, hook, **kwargs)

    def _load_info(self) -> BackendInfo:
        info = self._hook("te_backend_info")
        if not isinstance(info, BackendInfo):
            raise PluginFailure(f"te_backend_info returned {type(info).__name__}, expected BackendInfo")
        if info.problems():
            raise PluginFailure(f"te_backend_info returned a malformed BackendInfo: {'; '.join(info.problems())}")
        if _api_major(info.api_version) != _api_major(API_VERSION):
            raise PluginFailure(
                f"backend {info.name!r} implements backend API {info.api_version}, but te-core "
                f"{te_core_version()} speaks API {API_VERSION}: install a {info.name} backend built "
                f"for te-core's API {_api_major(API_VERSION)}.x"
            )
        return info

    def _load_availability(self) -> Tuple[bool, str]:
        result = self._hook("te_backend_available")
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], str)):
            raise PluginFailure(f"te_backend_available returned {result!r}, expected (bool, reason)")
        return bool(result[0]), result[1]

    def _require_available(self, what: str) -> None:
        if not self.available:
            raise BackendError(f"backend {self.name!r} is installed but not available: {self.reason}; cannot get {what}")

    @property
    def ops(self) -> Mapping[str, OpImpl]:
        """Native implementations by op name (empty when unavailable)."""
        if self._ops is None:
            self._ops = self._load_ops() if self.available else {}
        return self._ops

    def _load_ops(self) -> Dict[str, OpImpl]:
        from ..ops import CONTRACT

        declared = self._hook("te_backend_ops") or {}
        if not isinstance(declared, Mapping):
            raise PluginFailure(f"te_backend_ops returned {type(declared).__name__}, expected a mapping")
        ops = {}
        for name, impl in declared.items():
            if name not in CONTRACT:
                raise PluginFailure(f"te_backend_ops declares {name!r}, which is not a contract op (see te_core.ops)")
            if callable(impl) and not isinstance(impl, OpImpl):
                impl = OpImpl(impl)
            if not isinstance(impl, OpImpl):
                raise PluginFailure(f"te_backend_ops[{name!r}] is {type(impl).__name__}, expected OpImpl or a callable")
            ops[name] = impl
        return ops

    @property
    def device_module(self) -> Any:
        if self._device_module is None:
            self._require_available("its device module")
            module = self._hook("te_backend_device_module")
            self._device_module = module if module is not None else _torch_device_module(self.device_type)
        return self._device_module

    @property
    def device(self) -> torch.device:
        """The device new modules and tensors go to: the current device of this backend's type."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, self.device_module.current_device())

    def check_device(self) -> None:
        """PluginFailure unless torch can use this backend's device: a plugin's claim to be
        available is trusted only after that (a device type torch lacks, or was not built with,
        would otherwise fail deep inside torch on the user's first module)."""
        claim = f"claims to be available ({self.reason}), but"
        try:
            device = self.device
        except PluginFailure:
            raise
        except Exception as exc:  # torch's own error for a device type it lacks is the reason
            raise PluginFailure(
                f"{claim} this torch build ({torch.__version__}) has no usable {self.device_type!r} device: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        reason = devices.backend_device_problem(device)
        if reason is not None:
            raise PluginFailure(f"{claim} torch {torch.__version__} cannot use {device}: {reason}")

    @property
    def capabilities(self) -> Capabilities:
        if self._capabilities is None:
            self._require_available("capabilities")
            caps = self._hook("te_backend_capabilities", device=self.device)
            if caps is None:
                caps = Capabilities()
            if not isinstance(caps, Capabilities):
                raise PluginFailure(f"te_backend_capabilities returned {type(caps).__name__}, expected Capabilities")
            if caps.problems():
                raise PluginFailure(f"te_backend_capabilities returned malformed Capabilities: {'; '.join(caps.problems())}")
            self._capabilities = caps
        return self._capabilities

    def __repr__(self) -> str:
        state = "available" if self.available else f"unavailable: {self.reason}"
        return f"<te_core backend {self.name!r} ({self.device_type}, {state})>"


def _torch_device_module(device_type: str) -> Any:
    """torch's module for `device_type`, for a plugin whose te_backend_device_module gave none;
    where torch has none, its error says which hook supplies one."""
    try:
        return torch.get_device_module(device_type)
    except (RuntimeError, AttributeError) as exc:
        raise RuntimeError(
            f"{str(exc).rstrip('.')}; te_backend_device_module returned None, so te-core asked torch for the "
            f"{device_type!r} device module: return your device's module (synchronize(), current_device(), Stream, "
            f"Event, manual_seed(), ...) from the te_backend_device_module hook") from exc


def te_core_version() -> str:
    """te-core's version (imported late: this module loads while te_core itself is importing)."""
    from .. import __version__

    return __version__
