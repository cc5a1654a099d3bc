"""What te_core tells torch.compile about its own functions, without importing torch._dynamo
(importing it costs about a second, which `import te_core` must not pay)."""
from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


def run_while_tracing(fn: F) -> F:
    """torch.compiler.assume_constant_result, marked the way torch._dynamo reads it: dynamo
    calls `fn` at trace time (its arguments must be constants) instead of tracing it, and
    keeps its result as a constant. For functions with effects a graph cannot hold (locks,
    imports, creating state that a graph must find already there)."""
    fn._dynamo_marked_constant = True
    return fn
