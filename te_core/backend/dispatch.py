"""Per-call dispatch of a contract op: the selected backend's implementation or the reference.

Fallback happens only when the backend does not declare the op, its capabilities decline the
call (FP8 format, scaling mode), or its `supports` declines it. It warns once per
(op, backend, device, reason); TE_BACKEND_STRICT=1 makes it an error. An exception raised
by an implementation propagates: it is a bug, never a reason to retry elsewhere.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Optional

import torch

from .._tracing import run_while_tracing
from .plugin import BackendError
from .registry import REFERENCE, REGISTRY
from .types import Capabilities, Supports


class BackendFallbackWarning(UserWarning):
    """An op ran on the reference backend instead of the selected one."""


class Resolution(NamedTuple):
    backend: str
    fn: Optional[Callable[..., Any]]  # None: not declared by the backend
    supports: Optional[Supports]
    capabilities: Optional[Capabilities]  # None: no capability check needed (reference)
    reference: Callable[..., Any]
    strict: bool
    traced: Optional[Callable[..., Any]] = None  # the backend's plain-torch twin (OpImpl.traced)


_warned: set = set()
_is_compiling = torch.compiler.is_compiling


def resolve(op) -> Resolution:
    from ..reference.plugin import implementations

    selection = REGISTRY.selection()
    backend = selection.overrides.get(op.name, selection.backend)
    reference = implementations()[op.name]
    impl = backend.ops.get(op.name)
    if backend.name == REFERENCE:
        caps = None
    else:
        caps = backend.capabilities if op.capability_check is not None else None
    return Resolution(
        backend.name,
        impl.fn if impl is not None else None,
        impl.supports if impl is not None else None,
        caps,
        reference,
        selection.strict,
        impl.traced if impl is not None else None,
    )


def resolution(op) -> Resolution:
    """resolve(op), cached on the op until the registry changes (a plain attribute read on the
    hot path, which torch.compile traces through)."""
    if torch.compiler.is_compiling():  # resolve outside the trace, before the trace reads the cache
        _resolve_untraced(op.name)
    return _cached(op)[1]


def refresh(op):
    """Resolve op and cache (registry generation, Resolution, runner) on it."""
    res = resolve(op)
    op._cache = cached = (REGISTRY.generation, res, runner(op, res))
    return cached


@run_while_tracing
def _resolve_untraced(op_name: str) -> bool:
    """Fill the op's resolution cache; dynamo runs this at trace time instead of tracing it
    (the registry takes locks and imports modules, which a graph cannot hold)."""
    from ..ops import CONTRACT

    _cached(CONTRACT[op_name])
    return True


def runner(op, res: Resolution) -> Callable[..., Any]:
    """run(*args, **kwargs) for op resolved to res: the checks res needs and nothing else, bound
    once per resolution so that an eager call does no lookups. A backend without a capability
    check or supports() for the op gets its implementation itself: an eager call is then
    Op.__call__ plus the implementation, with no frame in between."""
    fn, supports, caps = res.fn, res.supports, res.capabilities
    if fn is None:
        missing = f"{op.name} is not implemented by backend {res.backend!r}"
        return lambda *args, **kwargs: _fallback(op, res, missing, args, kwargs)
    check = op.capability_check if caps is not None else None
    if check is None and supports is None:
        return fn

    def run(*args, **kwargs):
        if check is not None:
            reason = check(caps, *args, **kwargs)
            if reason:
                return _fallback(op, res, reason, args, kwargs)
        if supports is not None:
            ok, reason = supports(*args, **kwargs)
            if not ok:
                return _fallback(op, res, reason or "declined by supports()", args, kwargs)
        return fn(*args, **kwargs)

    return run


def call(op, args, kwargs):
    """Run op on the selected backend (or the reference, see the module docstring)."""
    if _is_compiling():  # dynamo traces the checks with the resolution read at trace time
        return runner(op, resolution(op))(*args, **kwargs)
    return call_eager(op, args, kwargs)


def call_eager(op, args, kwargs):
    """call() outside a torch.compile trace: the op's cached runner (what Op.__call__ runs inline)."""
    return _cached(op)[2](*args, **kwargs)


def _cached(op):
    """(registry generation, Resolution, runner) of op, resolved again after the registry re-selected."""
    cached = op._cache
    if cached is None or cached[0] != REGISTRY.generation:
        cached = refresh(op)
    return cached


def _fallback(op, res: Resolution, reason: str, args, kwargs):
    if res.strict:
        raise BackendError(
            f"op {op.name!r} cannot run on backend {res.backend!r} ({reason}) and TE_BACKEND_STRICT=1 "
            "forbids falling back to the reference backend; unset TE_BACKEND_STRICT to allow it"
        )
    _warn_fallback(op.name, res.backend, _device_of(args, kwargs), reason)
    return res.reference(*args, **kwargs)


@run_while_tracing
def _warn_fallback(op_name: str, backend: str, device: str, reason: str) -> None:
    """The fallback warning, once per (op, backend, device, reason); while torch.compile traces,
    said at trace time (dynamo cannot trace warnings.warn: a fullgraph compile would fail)."""
    key = (op_name, backend, device, reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"te_core: op {op_name!r} falls back from backend {backend!r} to reference on {device}: "
                      f"{reason}", BackendFallbackWarning, stacklevel=4)


def _device_of(args, kwargs) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return str(value.device)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return str(value[0].device)
    return "no tensor"


def fallback_reason(op_name: str) -> Optional[str]:
    """Why `op_name` would fall back on the selected backend regardless of the call (not
    declared), or None when the backend declares it (it may still decline single calls)."""
    selection = REGISTRY.selection()
    backend = selection.overrides.get(op_name, selection.backend)
    if backend.name == REFERENCE or op_name in backend.ops:
        return None
    return f"not implemented by {backend.name!r}"
