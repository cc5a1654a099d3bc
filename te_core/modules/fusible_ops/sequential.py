"""ops.Sequential: Transformer Engine's container of fusible operations, which hands each
operation its extra inputs (a GroupedLinear's split sizes, a ScaledSwiGLU's probabilities), runs
them in order, and returns the extra outputs they make (a MakeExtraOutput's) after its output.

Its container methods are TE's, which differ from torch.nn.Sequential's in how they name modules
(so in a state dict's keys): a module added at the end takes the key one past the largest integer
key ("0" where there is none), and no edit renumbers the others. `del seq[i]` and `seq.pop(i)`
leave the gap; `seq.insert(i, m)` keeps the keys where they are and moves the modules from
position i on one key along, the last onto a new key; a slice and `seq + other` are new
Sequentials keyed from "0"."""
from __future__ import annotations

import operator
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

from torch import Tensor, nn

from ._channels import gather_inputs, plan_channels, scatter_outputs
from ._op import FusibleOperation

_NAME = "ops.Sequential"


class Sequential(nn.Module):
    """A container (keys "0", "1", ..., or a dict's keys) whose call seq(input, *extra_inputs)
    gives each fusible operation, in order, the next num_extra_inputs of the extra inputs:
    Sequential(GroupedLinear, SwiGLU, GroupedLinear)(x, split_sizes, split_sizes), or with a
    ScaledSwiGLU in the middle (x, split_sizes, probs, split_sizes). A plain nn.Module in it takes
    the running tensor only. te-core fuses nothing: each operation runs as it would alone.

    The call returns the output alone, or, where operations make extra outputs (num_extra_outputs),
    (output, *extra_outputs) in the order of the operations, as Transformer Engine's does:
    Sequential(MakeExtraOutput(), RMSNorm(h))(x) is (the normalized x, x). Extra slots bound to a
    named channel pass their tensors from one operation to later ones instead (see _channels), so
    Sequential(MakeExtraOutput() bound to "residual", Bias(h), AddExtraInput() bound to "residual")(x)
    is (x + b + x, x), or x + b + x alone where the MakeExtraOutput's binding has output_to_caller=False."""

    def __init__(self, *args: nn.Module):
        super().__init__()
        if len(args) == 1 and isinstance(args[0], dict):
            for key, module in args[0].items():
                self.add_module(key, _checked(module, f"the module at key {key!r}"))
        else:
            self.extend(args)

    def _keys(self, idx: Union[int, slice]) -> List[str]:
        """The keys of the modules at `idx`, a position or a slice of positions."""
        keys = list(self._modules)
        if isinstance(idx, slice):
            return keys[idx]
        position = _position(idx)
        if not -len(keys) <= position < len(keys):
            raise IndexError(f"{_NAME}: index {position} is out of range for its {len(keys)} module(s)")
        return [keys[position]]

    def _next_key(self) -> str:
        """TE's key for a module added at the end: one past the largest key int() reads, at least 0."""
        numbers = []
        for key in self._modules:
            try:
                numbers.append(int(key))
            except ValueError:
                pass
        return str(max([0] + [n + 1 for n in numbers]))

    def __getitem__(self, idx: Union[int, slice]) -> nn.Module:
        keys = self._keys(idx)
        if isinstance(idx, slice):
            return Sequential().extend(self._modules[key] for key in keys)
        return self._modules[keys[0]]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        if isinstance(idx, slice):
            raise TypeError(f"{_NAME}: assign one module at an int index, not a slice; delete the slice and insert "
                            "the modules one by one")
        self._modules[self._keys(idx)[0]] = _checked(module, "seq[idx] = module")

    def __delitem__(self, idx: Union[int, slice]) -> None:
        for key in self._keys(idx):
            del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def append(self, module: nn.Module) -> "Sequential":
        """Add `module` at the end, under the key one past the largest integer key."""
        self.add_module(self._next_key(), _checked(module, "append"))
        return self

    def extend(self, modules: Iterable[nn.Module]) -> "Sequential":
        for module in modules:
            self.append(module)
        return self

    def insert(self, idx: int, module: nn.Module) -> "Sequential":
        """Put `module` at position `idx` under that position's key; the modules from there on
        move one key along, the last one onto a new key (one past the largest integer key)."""
        _checked(module, "insert")
        keys = self._keys(slice(_position(idx), None)) + [self._next_key()]
        for i in range(len(keys) - 1, 0, -1):
            self._modules[keys[i]] = self._modules[keys[i - 1]]
        self._modules[keys[0]] = module
        return self

    def pop(self, idx: Union[int, slice]) -> nn.Module:
        """The module at `idx` (a new Sequential for a slice), removed; the other keys stay."""
        out = self[idx]
        del self[idx]
        return out

    def __iadd__(self, modules: Iterable[nn.Module]) -> "Sequential":
        return self.extend(modules)

    def __add__(self, modules: Iterable[nn.Module]) -> "Sequential":
        return Sequential().extend(self).extend(modules)

    def forward(self, input: Tensor, *extra_inputs: Tensor, op_kwargs=None):  # noqa: A002 (TE's name)
        if op_kwargs:
            raise NotImplementedError(f"{_NAME}: op_kwargs (caller-provided output / grad_input buffers) are not "
                                      "supported by te-core; call without them")
        return run_in_order(_NAME, self._modules, input, extra_inputs, plan_cache=self.__dict__.setdefault("_plan", []))


def run_in_order(owner: str, modules: Dict[str, nn.Module], input: Tensor, extra_inputs: tuple,  # noqa: A002
                 op_kwargs: Optional[List[dict]] = None, plan_cache: Optional[list] = None):
    """`modules` run in order on `input`, each fusible operation given its extra inputs, from its
    channels or else the next of `extra_inputs` (and its dict of `op_kwargs`, where given, as keyword
    arguments): the output alone, or (output, *the extra outputs that go to the caller, in order).
    `plan_cache`: the caller's list for plan_channels' cache."""
    steps = plan_channels(owner, modules, plan_cache)
    wanted = [(key, m, sum(c is None for c in step.inputs)) for (key, m), step in zip(modules.items(), steps)
              if step is not None]
    if len(extra_inputs) != sum(n for *_, n in wanted):
        listed = ", ".join(f"{n} for the {type(m).__name__} at {key!r}" for key, m, n in wanted if n)
        raise TypeError(f"{owner}: takes the input and {sum(n for *_, n in wanted)} extra input(s) ({listed or 'none'}"
                        f"), in the order of its operations; got {len(extra_inputs)}")
    x, rest, made, channels = input, list(extra_inputs), [], {}
    for i, ((key, module), step) in enumerate(zip(modules.items(), steps)):
        if step is None:
            x = module(x)
            continue
        inputs = gather_inputs(owner, key, step, rest, channels)
        x = module(x, *inputs, **(op_kwargs[i] if op_kwargs else {}))
        if module.num_extra_outputs:
            x, extras = _split_outputs(owner, key, module, x)
            scatter_outputs(owner, key, module, step, extras, channels, made)
    return (x, *made) if made else x


def _split_outputs(owner: str, key: str, op: FusibleOperation, outputs) -> Tuple[Tensor, tuple]:
    """(output, extra outputs) of an operation that returned (output, *extra outputs)."""
    count = op.num_extra_outputs
    if not (isinstance(outputs, tuple) and len(outputs) == 1 + count):
        got = f"a tuple of {len(outputs)}" if isinstance(outputs, tuple) else type(outputs).__name__
        raise TypeError(f"{owner}: the {type(op).__name__} at {key!r} declares num_extra_outputs={count}, so it must "
                        f"return a tuple (output, *{count} extra output(s)); it returned {got}")
    return outputs[0], outputs[1:]


def _position(idx) -> int:
    try:
        return operator.index(idx)
    except TypeError:
        raise TypeError(f"{_NAME}: index must be an int or a slice, got {type(idx).__name__}") from None


def _checked(module, where: str) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{_NAME}: {where} takes a torch.nn.Module, got {type(module).__name__}")
    return module
