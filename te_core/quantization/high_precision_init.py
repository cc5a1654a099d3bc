"""A primary FP8 weight's value from before quantization (quantized_model_init's
preserve_high_precision_init_val), kept on the CPU under Transformer Engine's contract.

Master weights made from an FP8 weight start from its rounded value; training code that wants
them to start from the initializer's value instead (Megatron-LM's distributed optimizer) reads
`weight.get_high_precision_init_val()` and then frees it with
`weight.clear_high_precision_init_val()`. Such code tests for the method with hasattr, so only a
weight that kept its value has the two methods (QuantizedTensor's properties, which raise
AttributeError on any other); after clearing, get returns None. The weight keeps only plain
data (the value, or None once cleared), so torch.save / torch.load and copy.deepcopy of the
model keep it too.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

_VALUE = "_high_precision_init_val"  # in the weight's __dict__ only where it kept one (None once cleared)


def keep(weight: torch.Tensor, value: Optional[torch.Tensor]) -> torch.Tensor:
    """`weight` keeping `value`, copied to the CPU (None: the methods without a value)."""
    weight.__dict__[_VALUE] = None if value is None else value.detach().to("cpu", copy=True)
    return weight


def _get(weight: torch.Tensor) -> Optional[torch.Tensor]:
    return weight.__dict__.get(_VALUE)


def _clear(weight: torch.Tensor) -> None:
    if _VALUE in weight.__dict__:
        weight.__dict__[_VALUE] = None


_METHODS = {"get_high_precision_init_val": _get, "clear_high_precision_init_val": _clear}


def method(weight: torch.Tensor, name: str) -> Callable:
    """weight.get_high_precision_init_val / weight.clear_high_precision_init_val, for a weight
    that kept its value; AttributeError for any other (so that hasattr answers False)."""
    if _VALUE not in weight.__dict__:
        raise AttributeError(f"{type(weight).__name__} has no attribute {name!r}: only FP8 primary weights made "
                             "under te.quantized_model_init(preserve_high_precision_init_val=True) have it")
    return functools.partial(_METHODS[name], weight)


def carry_over(source: torch.Tensor, twin: torch.Tensor) -> torch.Tensor:
    """`twin` (a copy of `source`) keeping a copy of what `source` kept, if anything."""
    if _VALUE in source.__dict__:
        keep(twin, _get(source))
    return twin
