"""RNGStatesTracker (Transformer Engine's CudaRNGStatesTracker): named generator states that a
region forks into, reproducibly, without disturbing the default generator."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.distributed import MODEL_PARALLEL_RNG_TRACKER_NAME, CudaRNGStatesTracker, RNGStatesTracker
from te_core.distributed.random import _DeviceGenerator
from te_core.modules import LayerNormLinear, LayerNormMLP, Linear


def _reference_draws(seed: int, *shapes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(shape, generator=gen) for shape in shapes]


def test_fork_draws_from_the_named_state_and_leaves_the_default_alone():
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, 1234)
    torch.manual_seed(5)
    expected_outside = _reference_draws(5, (3,))[0]
    with tracker.fork():
        first = torch.rand(4)
    with tracker.fork(MODEL_PARALLEL_RNG_TRACKER_NAME):  # the state advanced by the first region
        second = torch.rand(4)
    torch.testing.assert_close(torch.rand(3), expected_outside, rtol=0, atol=0)
    ref_first, ref_second = _reference_draws(1234, (4,), (4,))
    torch.testing.assert_close(first, ref_first, rtol=0, atol=0)
    torch.testing.assert_close(second, ref_second, rtol=0, atol=0)


def test_dropout_in_a_forked_region_replays_from_saved_states():
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    saved = tracker.get_states()
    x = torch.ones(64)
    with tracker.fork():
        y1 = torch.nn.functional.dropout(x, p=0.5)
    tracker.set_states(saved)  # as activation recomputation does
    with tracker.fork():
        y2 = torch.nn.functional.dropout(x, p=0.5)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    assert 0 < int((y1 == 0).sum()) < 64


def test_tracker_errors_name_the_problem():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ValueError, match="a state named 'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(KeyError, match=r"no state named 'model-parallel-rng' \(added: 'a'\)"):
        with tracker.fork():
            pass
    with pytest.raises(TypeError, match="expected a dict"):
        tracker.set_states([1])
    tracker.reset()
    tracker.add("a", 1)  # after reset the name and seed are free again
    assert set(tracker.get_states()) == {"a"}


def test_te_name_is_the_same_class():
    assert CudaRNGStatesTracker is RNGStatesTracker and te.distributed.RNGStatesTracker is RNGStatesTracker
    assert te.CudaRNGStatesTracker is RNGStatesTracker  # exported at the top, as Transformer Engine does


def test_weights_are_initialized_in_the_trackers_region():
    """get_rng_state_tracker: each GEMM weight is drawn inside fork(rng_tracker_name or the
    model-parallel state), so tensor-parallel ranks seeded differently draw different shards."""
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 99)
    tracker.add("other", 100)
    init = torch.nn.init.uniform_
    torch.manual_seed(0)
    linear = Linear(16, 8, init_method=init, get_rng_state_tracker=lambda: tracker, rng_tracker_name="other")
    mlp = LayerNormMLP(16, 32, init_method=init, output_layer_init_method=init, get_rng_state_tracker=lambda: tracker)
    ln_linear = LayerNormLinear(16, 8, init_method=init, get_rng_state_tracker=lambda: tracker)
    torch.testing.assert_close(torch.rand(2), _reference_draws(0, (2,))[0], rtol=0, atol=0)  # default untouched
    torch.testing.assert_close(linear.weight, _reference_draws(100, (8, 16))[0], rtol=0, atol=0)
    fc1, fc2 = _reference_draws(99, (32, 16), (16, 32))
    torch.testing.assert_close(mlp.fc1_weight, fc1, rtol=0, atol=0)
    torch.testing.assert_close(mlp.fc2_weight, fc2, rtol=0, atol=0)
    _, _, next_draw = _reference_draws(99, (32, 16), (16, 32), (8, 16))
    torch.testing.assert_close(ln_linear.weight, next_draw, rtol=0, atol=0)


class _FakeDeviceModule:
    """A device module's RNG services, backed by a CPU generator."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(3)

    def get_rng_state(self):
        return self.gen.get_state()

    def set_rng_state(self, state):
        self.gen.set_state(state)

    def manual_seed(self, seed):
        self.gen.manual_seed(seed)


def test_device_generator_uses_the_device_modules_rng_services():
    device = _FakeDeviceModule()
    before = device.get_rng_state()
    state = _DeviceGenerator(device).seeded_state(42)
    assert torch.equal(device.get_rng_state(), before)  # seeding a new state leaves the device's alone
    assert torch.equal(state, torch.Generator().manual_seed(42).get_state())
