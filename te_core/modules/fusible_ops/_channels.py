"""Transformer Engine's named extra-tensor channels: an operation's extra output slot bound to a name
(set_extra_output_channel) feeds the extra input slots of later operations bound to the same name
(set_extra_input_channel), instead of leaving the Sequential and coming back as a caller's extra input.
A bound output still goes to the caller unless output_to_caller=False. As in Transformer Engine, a
channel connects the fusible operations of one run between plain torch modules (one of TE's operation
fusers), each name has one producer, which comes before its consumers, and the bindings are frozen
once a Sequential (or a FusedOperation's call) has run with them. A basic operation called on its
own takes and returns all of its slots, bound or not (TE's transient fuser would route them).

Autograd does the rest: a consumer's gradient reaches the producer's extra output, summed with the
caller's where the output is public too."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from torch import nn


class ChannelBindings:
    """The binding of an operation's extra input and output slots to channel names (a mixin of the
    fusible operations). The slots left unbound are the caller's, as without channels."""

    _extra_tensor_channels_locked = False  # (TE's name) set by the first Sequential run that routes them

    def set_extra_input_channel(self, index: int, channel: Optional[str]):
        """Take extra input `index` from the earlier extra output bound to `channel` (None: from the
        caller again). Bind before the operation's first run in a Sequential."""
        index = self._check_slot(index, self.num_extra_inputs, "input")
        _check_channel(self, channel, "input")
        self._check_unlocked()
        self.__dict__.setdefault("_input_channels", {})[index] = channel
        return self

    def set_extra_output_channel(self, index: int, channel: Optional[str], *, output_to_caller: bool = True):
        """Hand extra output `index` to the later extra inputs bound to `channel`; it still goes to
        the caller unless output_to_caller=False (channel None: to the caller only, as unbound)."""
        index = self._check_slot(index, self.num_extra_outputs, "output")
        _check_channel(self, channel, "output")
        if not isinstance(output_to_caller, bool):
            raise TypeError(f"{self._name}: output_to_caller must be a bool, got {type(output_to_caller).__name__}")
        self._check_unlocked()
        self.__dict__.setdefault("_output_channels", {})[index] = (channel, output_to_caller or channel is None)
        return self

    def _check_slot(self, index, count: int, kind: str) -> int:
        if getattr(self, "is_fused_op", False):
            raise TypeError(f"{self._name}: a fused operation has no extra {kind} slots of its own; bind the channel "
                            f"on the basic operation that owns the slot (basic_ops[i].set_extra_{kind}_channel)")
        try:
            position = operator.index(index)
        except TypeError:
            raise TypeError(f"{self._name}: the extra {kind} index must be an int, got "
                            f"{type(index).__name__}") from None
        if not 0 <= position < count:
            raise IndexError(f"{self._name}: extra {kind} index {position} is out of range for its {count} extra "
                             f"{kind}(s) (num_extra_{kind}s); {f'pass 0 to {count - 1}' if count else 'it has none'}")
        return position

    def _check_unlocked(self) -> None:
        if self._extra_tensor_channels_locked:
            raise RuntimeError(f"{self._name}: a Sequential has already captured its channel routing (bindings are "
                               "frozen at the first run, as in Transformer Engine); build new operations, bind their "
                               "channels, and put them in a new Sequential")

    def _input_channel_names(self) -> List[Optional[str]]:
        bound = self.__dict__.get("_input_channels", {})
        return [bound.get(i) for i in range(self.num_extra_inputs)]

    def _output_channel_bindings(self) -> List[Tuple[Optional[str], bool]]:
        bound = self.__dict__.get("_output_channels", {})
        return [bound.get(i, (None, True)) for i in range(self.num_extra_outputs)]


def _check_channel(op, channel, kind: str) -> None:
    if channel is not None and (not isinstance(channel, str) or not channel):
        raise ValueError(f"{op._name}: an extra {kind} channel must be a non-empty string (or None to unbind), got "
                         f"{channel!r}")


@dataclass
class Step:
    """One fusible operation's extra slots in a run: each input's channel (None: the caller's next
    extra input) and each output's (channel or None, whether it goes to the caller)."""

    inputs: List[Optional[str]]
    outputs: List[Tuple[Optional[str], bool]]


def plan_channels(owner: str, modules: Dict[str, nn.Module], cache: Optional[list] = None) -> List[Optional[Step]]:
    """Each module's Step (None for a plain module), the bindings checked and then frozen. `cache`:
    a list the caller keeps, [modules, steps] of its last plan, reused while it runs the same
    modules in the same order (frozen bindings give the same plan)."""
    members = tuple(modules.values())
    if cache and len(cache[0]) == len(members) and all(a is b for a, b in zip(cache[0], members)):
        return cache[1]
    steps = [_step(owner, key, m) if isinstance(m, ChannelBindings) else None for key, m in modules.items()]
    run: List[Tuple[str, nn.Module, Step]] = []
    for (key, module), step in zip(list(modules.items()) + [("", None)], steps + [None]):
        if step is not None:
            run.append((key, module, step))
            continue
        _check_run(owner, run)
        run = []
    for module in modules.values():
        for op in getattr(module, "basic_ops", [module]):
            if isinstance(op, ChannelBindings):
                op._extra_tensor_channels_locked = True
    if cache is not None:
        cache[:] = [members, steps]
    return steps


def _step(owner: str, key: str, module) -> Step:
    if not getattr(module, "is_fused_op", False):
        return Step(module._input_channel_names(), module._output_channel_bindings())
    if any(isinstance(op, ChannelBindings) and _binds_any(op) for op in module.basic_ops):
        raise ValueError(f"{owner}: the {type(module).__name__} at {key!r} is a fused operation whose basic operations "
                         "bind extra-tensor channels; te-core routes channels between the operations of a Sequential, "
                         "so put those basic operations in the Sequential themselves")
    return Step([None] * module.num_extra_inputs, [(None, True)] * module.num_extra_outputs)


def _binds_any(op: ChannelBindings) -> bool:
    return any(op._input_channel_names()) or any(channel for channel, _ in op._output_channel_bindings())


def _check_run(owner: str, run: List[Tuple[str, nn.Module, Step]]) -> None:
    """One run of fusible operations (TE's operation fuser): one producer per name, before its consumers."""
    producers: Dict[str, int] = {}
    for position, (key, module, step) in enumerate(run):
        for channel, _ in step.outputs:
            if channel is None:
                continue
            if channel in producers:
                first_key, first = run[producers[channel]][:2]
                raise ValueError(f"{owner}: extra tensor channel {channel!r} has multiple producers (the "
                                 f"{type(first).__name__} at {first_key!r} and the {type(module).__name__} at "
                                 f"{key!r}); bind each channel name to one extra output")
            producers[channel] = position
    for position, (key, module, step) in enumerate(run):
        for channel in step.inputs:
            where = f"{owner}: extra tensor channel {channel!r} consumed by the {type(module).__name__} at {key!r}"
            if channel is not None and channel not in producers:
                raise ValueError(f"{where} has no producer among the fusible operations around it (a plain torch "
                                 "module ends a run of them); bind an earlier extra output to it")
            if channel is not None and producers[channel] >= position:
                raise ValueError(f"{where} has no earlier producer (channels run forward only); move the producer "
                                 "before it")


def gather_inputs(owner: str, key: str, step: Step, caller_inputs: List, channels: Dict[str, object]) -> list:
    """The extra inputs of `step`'s operation at `key`: from its channels, else the caller's next
    (taken off the front of `caller_inputs`)."""
    inputs = []
    for channel in step.inputs:
        if channel is not None and channels[channel] is None:
            raise RuntimeError(f"{owner}: the operation at {key!r} consumes extra tensor channel {channel!r}, whose "
                               "producer returned None for it; return the tensor there")
        inputs.append(caller_inputs.pop(0) if channel is None else channels[channel])
    return inputs


def scatter_outputs(owner: str, key: str, module, step: Step, extras: tuple, channels: Dict[str, object],
                    made: list) -> None:
    """`extras`, the operation's extra outputs, into their channels and (public ones) onto `made`."""
    for i, ((channel, to_caller), tensor) in enumerate(zip(step.outputs, extras)):
        if tensor is None and to_caller:
            raise RuntimeError(f"{owner}: the {type(module).__name__} at {key!r} returned None for extra output {i}, "
                               "which goes to the caller; return the tensor (or set_extra_output_channel(..., "
                               "output_to_caller=False))")
        if channel is not None:
            channels[channel] = tensor
        if to_caller:
            made.append(tensor)
