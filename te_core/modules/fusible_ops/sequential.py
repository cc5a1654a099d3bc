"""ops.Sequential: Transformer Engine's container of fusible operations, which hands each
operation its extra inputs (a GroupedLinear's split sizes, a ScaledSwiGLU's probabilities), runs
them in order, and returns the extra outputs they make (a MakeExtraOutput's) after its output."""
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
    each operation runs as it would alone.

    The call returns the output alone, or, where operations make extra outputs (num_extra_outputs),
    (output, *extra_outputs) in the order of the operations, as Transformer Engine's does:
    Sequential(MakeExtraOutput(), RMSNorm(h))(x) is (the normalized x, x)."""

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
        x, rest, made = input, extra_inputs, []
        for key, module in self._modules.items():
            if isinstance(module, FusibleOperation):
                count = module.num_extra_inputs
                x, rest = module(x, *rest[:count]), rest[count:]
                if module.num_extra_outputs:
                    x = _take_extra_outputs(key, module, x, made)
            else:
                x = module(x)
        return (x, *made) if made else x


def _take_extra_outputs(key: str, op: FusibleOperation, outputs, made: list) -> Tensor:
    """The output of an operation that returned (output, *extra outputs); the extra ones appended
    to `made`."""
    count = op.num_extra_outputs
    if not (isinstance(outputs, tuple) and len(outputs) == 1 + count):
        got = f"a tuple of {len(outputs)}" if isinstance(outputs, tuple) else type(outputs).__name__
        raise TypeError(f"{_NAME}: the {type(op).__name__} at {key!r} declares num_extra_outputs={count}, so it must "
                        f"return a tuple (output, *{count} extra output(s)); it returned {got}")
    made.extend(outputs[1:])
    return outputs[0]
