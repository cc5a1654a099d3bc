"""Constructor arguments in Transformer Engine's positional order.

Code written for Transformer Engine passes some constructor arguments by position, and TE's
order is not the one a reader of te-core's keyword arguments would guess: `te.Linear(16, 16,
False)` means `sequence_parallel=False` there, with `bias` tenth. A module's `__init__` wrapped
by `te_order(...)` takes its positional arguments in TE's order and hands everything on by name,
so a positional call means what it means in TE. Names te-core does not take explicitly (the
userbuffers flags, say) reach the module's `**kwargs` and its usual checks."""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Sequence

from ._common import UNSUPPORTED_DEFAULTS

_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


def te_order(*names: str) -> Callable:
    """Decorate a module's __init__: its positional arguments are, in order, `names` (Transformer
    Engine's order of the same constructor)."""
    def decorate(init: Callable) -> Callable:
        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            if len(args) > len(names):
                raise TypeError(f"{type(self).__name__}() takes at most {len(names)} positional arguments, in "
                                f"Transformer Engine's order ({', '.join(names)}); got {len(args)}: pass the rest "
                                "by name")
            for name, value in zip(names, args):
                if name in kwargs:
                    raise TypeError(f"{type(self).__name__}() got multiple values for argument {name!r}")
                kwargs[name] = value
            init(self, **kwargs)

        __init__.__signature__ = _signature(init, names)
        return __init__
    return decorate


def _signature(init: Callable, names: Sequence[str]) -> inspect.Signature:
    """What inspect and editors show: self, TE's positional arguments (te-core's default where it
    takes the argument, else the one value it accepts), then te-core's other arguments by name."""
    own = inspect.signature(init).parameters
    params = [own["self"]]
    for name in names:
        if name in own:
            params.append(own[name].replace(kind=_POSITIONAL))
        else:
            default = UNSUPPORTED_DEFAULTS[name][0] if name in UNSUPPORTED_DEFAULTS else None
            params.append(inspect.Parameter(name, _POSITIONAL, default=default))
    for name, param in own.items():
        if name != "self" and name not in names:
            params.append(param if param.kind is inspect.Parameter.VAR_KEYWORD
                          else param.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    return inspect.Signature(params)
