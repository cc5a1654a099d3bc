"""Contract ops as torch.library custom ops (`torch.ops.te_core.<name>`), for torch.compile.

While dynamo traces, a contract op call records the custom op in the graph; the op resolves
the backend when the graph runs (te_core.backend.dispatch, cached per op), so a compiled graph
is backend-independent and dynamo never traces the registry or a backend's Python. Eager calls
keep the direct dispatch: a custom op's dispatcher round trip costs host time on every call.
Where the selected backend gives an op a plain-torch twin (OpImpl.traced), the trace takes the
twin instead: the compiler then fuses it with its neighbours and launches the result itself,
which on a host-bound step is the difference between a compiled step slower than eager and
one faster. Such a graph belongs to the backend it was traced with. While torch.onnx.export
traces, every op records the reference's plain-torch operators: ONNX has no te_core operators.

Rules the schema encodes, derived from each op's stub:
- arguments named `amax_out` and `out`, and those an op declares with `mutates`, are written in
  place (declared mutable, so functionalization and CUDA-graph replays see the writes);
- an output never aliases an input: where the contract returns `amax_out` (the last output) or
  `out` (the only output) itself, the variant that takes them (`<op>_into`) leaves that output
  out of its schema and the caller gets the argument back here (no tensor made for it on every
  call); a None output (an optional copy not asked for) is a placeholder;
- placeholders are 1-element bool tensors (no contract op returns bool data; empty tensors
  would all share the null data pointer, which the alias check of custom ops rejects);
- the fake (meta) implementation is the reference implementation run on fake tensors, so
  shapes, dtypes and mutations follow the reference by construction.
An opaque op has no autograd formula: a call that autograd must differentiate (grad mode on and
an input requiring grad, as ops.attention outside an autograd Function) traces the selected
implementation instead.
"""
from __future__ import annotations

import collections.abc
import json
import typing
from typing import Any, Dict, Tuple

import torch

from .._tracing import run_while_tracing

NAMESPACE = "te_core"
ALIASED_OUTPUTS = {"amax_out": -1, "out": 0}  # argument -> the output position it is returned at
MUTATED_BY_NAME = tuple(ALIASED_OUTPUTS)

_LIB = None
_PLACEHOLDER = torch.bool


def _schema_type(hint, mutable_alias: str = "") -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _schema_type(inner, mutable_alias) + "?"
    if origin in (list, tuple, collections.abc.Sequence):
        return _schema_type(args[0], mutable_alias) + "[]"
    names = {torch.Tensor: "Tensor", torch.dtype: "ScalarType", bool: "bool", int: "int", float: "float", str: "str"}
    if hint not in names:
        raise TypeError(f"contract op argument type {hint!r} has no torch.library schema type")
    base = names[hint]
    return f"{base}({mutable_alias}!)" if mutable_alias and base == "Tensor" else base


def _default(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def _returns(hint, dropped: int = 0) -> Tuple[str, int]:
    """(schema returns, number of outputs; -1 for a single unparenthesized Tensor), with
    `dropped` outputs left out (those a writing variant hands back as its arguments)."""
    if hint is type(None) or hint is None:
        return "()", 0
    n = len(typing.get_args(hint)) if typing.get_origin(hint) is tuple else 1
    if dropped:  # (a single output left is returned bare, as the custom op's `-> Tensor`)
        kept = n - dropped
        return ("Tensor" if kept == 1 else "(" + ", ".join(["Tensor"] * kept) + ")"), n
    if typing.get_origin(hint) is tuple:
        return "(" + ", ".join(["Tensor"] * n) + ")", n
    return "Tensor", -1


def schema(op, writes: bool) -> str:
    """The torch.library schema of `op` (name excluded), per the rules in the module docstring.
    writes=False leaves out the optional outputs written in place (amax_out, out): a call
    without them records this pure variant, since inductor cannot lower an optional mutable
    argument left at None."""
    hints = typing.get_type_hints(op.__wrapped__)
    mutated = set(MUTATED_BY_NAME) | set(op.mutates)
    parts, keyword_only, aliases = [], False, iter("abcdefghijklmnop")
    for name, param in op.signature.parameters.items():
        if name in MUTATED_BY_NAME and not writes:
            continue
        if param.kind is param.KEYWORD_ONLY and not keyword_only:
            parts.append("*")
            keyword_only = True
        text = f"{_schema_type(hints[name], next(aliases) if name in mutated else '')} {name}"
        if param.default is not param.empty:
            text += f"={_default(param.default)}"
        parts.append(text)
    dropped = len(op.aliased_outputs) if writes else 0
    return f"({', '.join(parts)}) -> {_returns(hints['return'], dropped)[0]}"


def _first_device(args, kwargs) -> torch.device:
    return next((t.device for t in _tensors(args, kwargs)), torch.device("cpu"))


def _given_positions(op, kwargs) -> list:
    """(position, argument name) of each output the call hands back as a given argument (the
    writing variant's), positions counted from 0, in order."""
    count = 1 if op.n_outputs == -1 else op.n_outputs
    return sorted((position % count, name) for name, position in op.aliased_outputs if kwargs.get(name) is not None)


def _encode(op, result, args, kwargs):
    """The implementation's result as the custom op returns it (placeholders, no aliases; the
    writing variant without the outputs it hands back as its arguments)."""
    n = op.n_outputs
    if n == 0:
        return None
    outputs = [result] if n == -1 else list(result)
    given = _given_positions(op, kwargs)
    for position, _ in reversed(given):
        del outputs[position]
    # A custom op's outputs may alias neither its inputs nor each other; an implementation may
    # hand back a view (a transpose that is already contiguous), which is copied here.
    seen = {_storage(v) for v in _tensors(args, kwargs)}
    device = None
    for i, value in enumerate(outputs):
        if value is None:
            device = device or _first_device(args, kwargs)
            outputs[i] = torch.empty(1, dtype=_PLACEHOLDER, device=device)
            continue
        key = _storage(value)
        if key in seen:
            outputs[i] = value = value.clone()
            key = _storage(value)
        seen.add(key)
    if given:
        return None if not outputs else outputs[0] if len(outputs) == 1 else tuple(outputs)
    return outputs[0] if n == -1 else tuple(outputs)


def _storage(t: torch.Tensor) -> int:
    """The identity of t's storage (views made inside an op kernel have no `_base` to follow)."""
    return t.untyped_storage()._cdata


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _decode(op, outputs, kwargs):
    """The contract's result from the custom op's: placeholders back to None, the outputs the
    writing variant leaves out back as the arguments it wrote."""
    n = op.n_outputs
    if n == 0:
        return None
    given = _given_positions(op, kwargs)
    if given:
        values = [] if outputs is None else [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    else:
        values = [outputs] if n == -1 else list(outputs)
    values = [None if value.dtype is _PLACEHOLDER else value for value in values]
    for position, name in given:
        values.insert(position, kwargs[name])
    return values[0] if n == -1 else tuple(values)


def writing_variant(op) -> str:
    """The name of the variant of `op` that takes amax_out / out (the plain name takes neither)."""
    return op.name + "_into"


def _register(lib, op) -> None:
    from ..backend.dispatch import call
    from ..reference.plugin import implementations

    def run(*args, **kwargs):
        return _encode(op, call(op, args, kwargs), args, kwargs)

    def fake(*args, **kwargs):
        return _encode(op, implementations()[op.name](*args, **kwargs), args, kwargs)

    names = [(op.name, False)]
    if any(name in op.signature.parameters for name in MUTATED_BY_NAME):
        names.append((writing_variant(op), True))
    for name, writes in names:
        lib.define(name + schema(op, writes))
        lib.impl(name, run, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)


def register_all(contract: Dict[str, Any]) -> None:
    """Define every contract op in the te_core namespace (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library(NAMESPACE, "FRAGMENT")
    for op in contract.values():
        try:
            op.n_outputs = _returns(typing.get_type_hints(op.__wrapped__)["return"])[1]
            # a plain tuple: dynamo refuses to read the signature's mapping proxy in some traces
            op.aliased_outputs = tuple((n, p) for n, p in ALIASED_OUTPUTS.items() if n in op.signature.parameters)
            _register(lib, op)
        except (TypeError, RuntimeError) as err:  # import must not fail: the op then refuses tracing
            op.untraceable = f"{type(err).__name__}: {err}"
    _LIB = lib


def _needs_autograd(args, kwargs) -> bool:
    return any(t.requires_grad for t in _tensors(args, kwargs))


@run_while_tracing
def _exporting_onnx() -> bool:
    """Whether torch.onnx.export is tracing the model (read once per trace, as a constant)."""
    import torch.onnx

    return torch.onnx.is_in_onnx_export()


def traced_call(op, args, kwargs):
    """What a contract op call records while dynamo traces (see the module docstring)."""
    if op.untraceable:
        raise NotImplementedError(f"te_core op {op.name!r} has no torch.library twin, so torch.compile cannot "
                                  f"trace it ({op.untraceable}); run it outside the compiled region")
    from ..backend.dispatch import call, resolution

    if _exporting_onnx():  # ONNX has no te_core operators: record the reference's standard torch ones
        return resolution(op).reference(*args, **kwargs)
    if torch.is_grad_enabled() and _needs_autograd(args, kwargs):
        return call(op, args, kwargs)
    traced = resolution(op).traced
    if traced is not None:  # the backend's plain-torch twin, which the compiler can fuse
        result = traced(*args, **kwargs)
        if result is not NotImplemented:
            return result
    writes = False
    for name in MUTATED_BY_NAME:
        if name in kwargs:
            if kwargs[name] is None:
                kwargs = {k: v for k, v in kwargs.items() if k != name}
            else:
                writes = True
    outputs = getattr(torch.ops.te_core, writing_variant(op) if writes else op.name)(*args, **kwargs)
    return _decode(op, outputs, kwargs)
