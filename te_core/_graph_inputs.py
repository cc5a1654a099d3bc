"""Keyword inputs of a captured forward (make_graphed_callables' sample_kwargs).

torch's graph capture takes positional tensors only. A sample call's keyword arguments are
flattened (torch's pytree: tuples, lists and dicts of them work) into their tensors, which the
graphs take as extra positional inputs after the call's own, and everything else (None, bools,
numbers, strings), which the graphs bake in. A replay must pass the same keywords with the same
structure and the same baked-in values; its tensors are copied into the graphs' input buffers,
as positional inputs are.

That copy would broadcast a smaller tensor or convert another dtype without a word, and an input
that did not require grad at capture gets no gradient from the backward graph; so every replay's
tensors are checked against the sample's (InputSignature).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch.utils import _pytree as pytree

_TENSOR = object()  # where a tensor leaf goes in `constants`


class KeywordInputs:
    """The keyword arguments of one module's sample call: their names, their structure, and the
    non-tensor values the graphs bake in."""

    def __init__(self, sample: Dict[str, Any], name: str):
        if not isinstance(sample, dict) or not all(isinstance(k, str) for k in sample):
            raise TypeError(f"make_graphed_callables: sample_kwargs of {name} must be a dict of keyword arguments, "
                            f"got {type(sample).__name__}")
        if "is_first_microbatch" in sample:
            raise ValueError(f"make_graphed_callables: is_first_microbatch is not a sample keyword argument of {name}; "
                             "capture with cache_quantized_params=True and pass it to each call")
        self.name, self.keys = name, tuple(sample)
        leaves, self.spec = pytree.tree_flatten([sample[k] for k in self.keys])
        self.constants = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.tensors = tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    def rebuild(self, tensors) -> Dict[str, Any]:
        """The keyword arguments with `tensors` (in flattened order) in the tensors' places."""
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        return dict(zip(self.keys, pytree.tree_unflatten(leaves, self.spec)))

    def tensors_of(self, kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, ...]:
        """A replay's keyword tensors, in the graphs' order, or a clear error where the call does
        not match the capture."""
        missing, extra = [k for k in self.keys if k not in kwargs], sorted(set(kwargs) - set(self.keys))
        if missing or extra:
            said = "; ".join(part for part in (f"missing {', '.join(missing)}" if missing else "",
                                               f"unexpected {', '.join(extra)}" if extra else "") if part)
            captured = ", ".join(self.keys) or "none"
            raise TypeError(f"graphed {self.name} was captured with keyword arguments ({captured}) and each call "
                            f"must pass exactly those: {said}")
        leaves, spec = pytree.tree_flatten([kwargs[k] for k in self.keys])
        if spec != self.spec:
            raise TypeError(f"graphed {self.name}: the keyword arguments' structure differs from the sample's "
                            f"(a None, tuple or list where the capture had something else); capture again with "
                            f"this structure")
        tensors = []
        for position, (leaf, const) in enumerate(zip(leaves, self.constants)):
            if const is _TENSOR:
                if not isinstance(leaf, torch.Tensor):
                    raise TypeError(f"graphed {self.name}: keyword input {position} (flattened) was a tensor at "
                                    f"capture, got {type(leaf).__name__}")
                tensors.append(leaf)
            elif isinstance(leaf, torch.Tensor) or not _same(leaf, const):
                raise ValueError(f"graphed {self.name}: the graphs baked in the keyword value {const!r} (flattened "
                                 f"position {position}), but this call passes {_short(leaf)}; a replay cannot "
                                 "change it: pass it as at capture, or capture again")
        return tuple(tensors)


class InputSignature:
    """Shape, dtype, device and requires_grad of each tensor a module was captured with
    (positional inputs, then keyword tensors in flattened order): what a replay's must match."""

    def __init__(self, tensors, name: str):
        self.name = name
        self.expected = tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors)

    def check(self, tensors) -> None:
        """Nothing where `tensors` match, else an error naming the input and the fix."""
        expected = self.expected
        if len(tensors) != len(expected):
            raise TypeError(f"graphed {self.name} was captured with {len(expected)} tensor inputs (positional, then "
                            f"keyword tensors), but this call passes {len(tensors)}")
        grad = torch.is_grad_enabled()
        for position, (t, (shape, dtype, device, needs_grad)) in enumerate(zip(tensors, expected)):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != device \
                    or (grad and t.requires_grad and not needs_grad):
                raise self._mismatch(position, t)

    def _mismatch(self, position: int, t) -> Exception:
        shape, dtype, device, needs_grad = self.expected[position]
        where = f"graphed {self.name}: input {position}"
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{where} was a tensor at capture, got {type(t).__name__}")
        if t.shape != shape or t.dtype != dtype or t.device != device:
            return ValueError(f"{where} is a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}, but the graphs "
                              f"were captured for {dtype} of shape {tuple(shape)} on {device}; a replay copies its "
                              "inputs into the captured buffers (which would broadcast or convert it): pass the "
                              "sample's shape and dtype, or capture again for these")
        return ValueError(f"{where} requires grad, but the sample it was captured with did not, so the backward graph "
                          "computes no gradient for it; capture with a sample that requires grad")


def _same(a, b) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == does not give a bool: only itself matches
        return a is b


def _short(value) -> str:
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)


def keyword_inputs(sample_kwargs, n_modules: int, names) -> List[KeywordInputs]:
    """One KeywordInputs per module from make_graphed_callables' sample_kwargs (None: none; a
    dict for one module; a tuple or list of dicts, one per module)."""
    if sample_kwargs is None:
        per_module = [{}] * n_modules
    elif isinstance(sample_kwargs, dict):
        if n_modules != 1:
            raise ValueError(f"make_graphed_callables: sample_kwargs is one dict but {n_modules} modules were given; "
                             "give a tuple with one dict per module")
        per_module = [sample_kwargs]
    elif isinstance(sample_kwargs, (tuple, list)):
        if len(sample_kwargs) != n_modules:
            raise ValueError(f"make_graphed_callables: {n_modules} modules but {len(sample_kwargs)} sample_kwargs")
        per_module = list(sample_kwargs)
    else:
        raise TypeError(f"make_graphed_callables: sample_kwargs must be a dict, or a tuple of dicts (one per module), "
                        f"got {type(sample_kwargs).__name__}")
    return [KeywordInputs(kwargs, name) for kwargs, name in zip(per_module, names)]
