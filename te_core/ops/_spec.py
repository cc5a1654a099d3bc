"""How a contract op is declared: a stub whose signature and docstring are the specification.

`@contract_op(family)` turns the stub into an `Op`: calling it dispatches to the selected
backend's implementation (see te_core.backend.dispatch). The stub body is never run. While
torch.compile traces, the call records the op's torch.library twin instead (te_core.ops._library).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Sequence

import torch

from ..backend.types import Capabilities

CapabilityCheck = Callable[..., Optional[str]]

CONTRACT: Dict[str, "Op"] = {}
"""Every contract op by name, in declaration order."""


class Op:
    """A contract op: its specification plus a dispatching `__call__`."""

    def __init__(self, stub: Callable[..., Any], family: str, capability_check: Optional[CapabilityCheck],
                 mutates: Sequence[str] = ()):
        self.name = stub.__name__
        self.family = family
        self.signature = inspect.signature(stub)
        self.__doc__ = stub.__doc__
        self.__wrapped__ = stub
        self.capability_check = capability_check
        self.mutates = tuple(mutates)  # arguments written in place besides amax_out / out
        self.n_outputs = None  # set by te_core.ops._library.register_all
        self.aliased_outputs: tuple = ()  # (argument, output position) returned as written; ditto
        self.untraceable: Optional[str] = None  # why register_all could not make its twin, if it could not
        self._cache = None  # (registry generation, Resolution, runner); filled by dispatch

    def check_capabilities(self, caps: Capabilities, args, kwargs) -> Optional[str]:
        """None if `caps` can run this call, else why not."""
        if self.capability_check is None:
            return None
        return self.capability_check(caps, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if _is_compiling():
            from ._library import traced_call

            return traced_call(self, args, kwargs)
        # Eager: the runner cached on the op (te_core.backend.dispatch.runner: the implementation
        # itself, or its checks around it), valid while the registry has not re-selected since.
        # Inlined here rather than a call into the dispatcher, since every op of every step
        # comes through.
        cached = self._cache
        if cached is None or cached[0] != _REGISTRY.generation:
            cached = _refresh(self)
        return cached[2](*args, **kwargs)

    def __repr__(self) -> str:
        return f"<te_core op {self.family}.{self.name}{self.signature}>"


_is_compiling = torch.compiler.is_compiling


class _NoRegistryYet:
    """Stands in for te_core.backend.registry.REGISTRY until the first op call binds it (ops are
    declared before the registry module exists): its generation matches no cache, so that call
    resolves."""

    generation = -1


_REGISTRY = _NoRegistryYet()


def _refresh(op: Op):
    """Resolve op and cache (registry generation, Resolution, runner) on it, binding the registry."""
    global _REGISTRY
    from ..backend import dispatch
    from ..backend.registry import REGISTRY

    _REGISTRY = REGISTRY
    return dispatch.refresh(op)


def contract_op(family: str, capability_check: Optional[CapabilityCheck] = None, *, mutates: Sequence[str] = ()):
    """Declare an op of `family`. `mutates`: arguments the op writes in place other than
    `amax_out` and `out` (which always are), declared as such to torch.library."""

    def declare(stub: Callable[..., Any]) -> Op:
        if stub.__name__ in CONTRACT:
            raise RuntimeError(f"contract op {stub.__name__!r} declared twice")
        op = Op(stub, family, capability_check, mutates)
        CONTRACT[op.name] = op
        return op

    return declare

