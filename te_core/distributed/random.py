"""Named random-number-generator states, so that dropout and weight initialization inside
tensor-parallel regions are reproducible (Transformer Engine's CudaRNGStatesTracker).

A tracker keeps one generator state per name. `add(name, seed)` creates it; inside
`with tracker.fork(name):` the device's default generator runs from that state, and on exit
the state advanced by the region is kept under the name and the device's own state is put
back. The usual set-up gives every tensor-parallel rank its own "model-parallel-rng" seed
(dropout on split activations differs per rank) while the default generator, seeded alike on
all ranks, serves replicated regions.

The device is the selected backend's: its device module provides the generator state
(get_rng_state / set_rng_state / manual_seed); on the CPU it is torch's CPU generator.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator

import torch
from torch import Tensor

MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
# dynamo does not trace torch's generator-state calls: at a graph break (torch.compile without
# fullgraph=True) the fork runs eagerly and the region draws from the tracker's state; a whole
# graph cannot contain it
_TRACED_FORK = ("RNGStatesTracker.fork({name!r}) inside a graph traced by torch.compile: swapping the generator "
                "state cannot be traced, so dropout under a tensor-parallel RNG tracker (attention_dropout > 0 "
                "with get_rng_state_tracker, without sequence_parallel) cannot be compiled with "
                "fullgraph=True. Compile without fullgraph=True (the fork then runs eagerly, at a graph break, "
                "and the dropout draws from the tracker's state), or use attention_dropout=0 in compiled steps")
# The name -> state dict of the tracker that last added or set states, as Transformer Engine
# publishes it (the dict itself, so forks that advance a state show through it)
_ALL_STATES: list = [{}]


def get_all_rng_states() -> Dict[str, Tensor]:
    """The states of the tracker that last called add() or set_states() (TE's process-wide view,
    which graph capture code walks); {} before any."""
    return _ALL_STATES[0]


def graph_safe_rng_available() -> bool:
    """False: te-core's trackers hold generator states as state tensors, swapped in and out by
    fork(), never graph-safe generators registered with a captured graph; TE code asking this
    takes its state-tensor path."""
    return False


class _CpuGenerator:
    @staticmethod
    def get_state() -> Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_state(state: Tensor) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def seeded_state(seed: int) -> Tensor:
        return torch.Generator().manual_seed(seed).get_state()


class _DeviceGenerator:
    """The default generator of the current device of a backend's device module."""

    def __init__(self, device_module):
        self._module = device_module

    def get_state(self) -> Tensor:
        return self._module.get_rng_state()

    def set_state(self, state: Tensor) -> None:
        self._module.set_rng_state(state)

    def seeded_state(self, seed: int) -> Tensor:
        saved = self.get_state()
        try:
            self._module.manual_seed(seed)
            return self.get_state()
        finally:
            self.set_state(saved)


def _selected_generator():
    from .. import backend

    selected = backend.get_backend()
    if selected.device_type == "cpu":
        return _CpuGenerator()
    return _DeviceGenerator(selected.device_module)


class RNGStatesTracker:
    """Generator states by name for the selected backend's device (see the module docstring).
    Transformer Engine's `CudaRNGStatesTracker` is this class under its TE name."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_: Dict[str, Tensor] = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, Tensor]:
        """A copy of the name -> state mapping (the states themselves are shared)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, Tensor]) -> None:
        """Replace the mapping, e.g. with one saved by get_states() (activation recomputation)."""
        if not isinstance(states, dict):
            raise TypeError(f"RNGStatesTracker.set_states: expected a dict of name -> state, got "
                            f"{type(states).__name__}")
        self.states_ = dict(states)
        _ALL_STATES[0] = self.states_

    def add(self, name: str, seed: int) -> None:
        """A new state `name` seeded with `seed`; a name or seed used twice is an error (two
        regions drawing the same numbers is what the tracker exists to prevent)."""
        if seed in self.seeds_:
            raise ValueError(f"RNGStatesTracker.add: seed {seed} is already used by another state; give "
                             f"{name!r} its own seed")
        if name in self.states_:
            raise ValueError(f"RNGStatesTracker.add: a state named {name!r} already exists; call reset() "
                             "first to re-seed it")
        self.seeds_.add(seed)
        self.states_[name] = _selected_generator().seeded_state(seed)
        _ALL_STATES[0] = self.states_

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the region from state `name`, keep the advanced state, restore the device's own."""
        if torch.compiler.is_compiling():
            raise RuntimeError(_TRACED_FORK.format(name=name))
        if name not in self.states_:
            known = ", ".join(map(repr, self.states_)) or "none"
            raise KeyError(f"RNGStatesTracker.fork: no state named {name!r} (added: {known}); call "
                           f"add({name!r}, seed) first")
        generator = _selected_generator()
        outside = generator.get_state()
        generator.set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = generator.get_state()
            generator.set_state(outside)


@contextlib.contextmanager
def rng_states_kept() -> Iterator[None]:
    """The device's default generator state and every tracker state (get_all_rng_states) put
    back on exit: what make_graphed_callables does around its warm-up and capture, as Transformer
    Engine's does, so that they do not move the dropout masks of the steps after them."""
    generator = _selected_generator()
    device_state, tracked = generator.get_state(), dict(_ALL_STATES[0])
    try:
        yield
    finally:
        generator.set_state(device_state)
        live = _ALL_STATES[0]  # (the dict trackers hold: a fork replaces its entries, restored here)
        live.clear()
        live.update(tracked)


# Transformer Engine's name: code written for TE constructs the same tracker. It tracks the
# selected backend's device whatever that device is.
CudaRNGStatesTracker = RNGStatesTracker
