"""What Sequential asks of a fusible operation: how many extra tensor inputs it takes."""
from __future__ import annotations


class FusibleOperation:
    """A te-core fusible operation (a mixin of an nn.Module). Sequential hands it the input and the
    next `num_extra_inputs` of the extra inputs it was called with, in the order of the operations;
    a plain nn.Module in a Sequential takes the input only."""

    num_extra_inputs: int = 0


def check_extra_inputs(op: str, expected: int, extra_inputs: tuple, what: str) -> None:
    """`extra_inputs` are the `expected` ones `op` takes (described by `what`)."""
    if len(extra_inputs) != expected:
        raise TypeError(f"{op}: takes the input and {expected} extra input(s) ({what}), got {len(extra_inputs)} extra "
                        "input(s)")
