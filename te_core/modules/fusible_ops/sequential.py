"""ops.Sequential: Transformer Engine's container of fusible operations, which hands each
operation its extra inputs (a GroupedLinear's split sizes, a ScaledSwiGLU's probabilities) and
runs them in order."""
from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from ._op import FusibleOperation

_NAME = "ops.Sequential"


class Sequential(nn.Sequential):
    """torch.nn.Sequential (its container methods, and a dict of named modules) whose call
    seq(input, *extra_inputs) gives each fusible operation, in order, the next num_extra_inputs
    of the extra inputs: Sequential(GroupedLinear, SwiGLU, GroupedLinear)(x, split_sizes,
    split_sizes), or with a ScaledSwiGLU in the middle (x, split_sizes, probs, split_sizes).
    A plain nn.Module in it takes the running tensor only. te-core fuses nothing:
    each operation runs as it would alone."""

    def __init__(self, *args: nn.Module):
        if len(args) == 1 and isinstance(args[0], dict) and not isinstance(args[0], OrderedDict):
            args = (OrderedDict(args[0]),)  # (TE takes any dict; torch only an OrderedDict)
        super().__init__(*args)

    def __add__(self, other) -> "Sequential":
        joined = Sequential()
        joined.extend(self)
        joined.extend(other)
        return joined

    def forward(self, input: Tensor, *extra_inputs: Tensor, op_kwargs=None):  # noqa: A002 (TE's name)
        if op_kwargs:
            raise NotImplementedError(f"{_NAME}: op_kwargs (caller-provided output / grad_input buffers) are not "
                                      "supported by te-core; call without them")
        takes = [(key, m) for key, m in self._modules.items()
                 if isinstance(m, FusibleOperation) and m.num_extra_inputs]
        if len(extra_inputs) != sum(m.num_extra_inputs for _, m in takes):
            wanted = ", ".join(f"{m.num_extra_inputs} for the {type(m).__name__} at {key!r}" for key, m in takes)
            raise TypeError(f"{_NAME}: takes the input and {sum(m.num_extra_inputs for _, m in takes)} extra "
                            f"input(s) ({wanted or 'none'}), in the order of its operations; got {len(extra_inputs)}")
        x, rest = input, extra_inputs
        for module in self:
            if isinstance(module, FusibleOperation):
                count = module.num_extra_inputs
                x, rest = module(x, *rest[:count]), rest[count:]
            else:
                x = module(x)
        return x
