"""The eager dispatch shortcut: an op call runs the runner cached on the op (the implementation
itself where the backend has no checks), and every change of the registry re-resolves it."""
import warnings

import pytest
import torch

from te_core import backend, ops
from te_core.backend import BackendFallbackWarning, OpImpl, dispatch
from te_core.backend.registry import REGISTRY
from te_core.ops import _spec

from registry_fakes import FakeEntryPoint, make_plugin


class Counting:
    """A dbias implementation that counts its calls and marks its result (so a test sees which
    backend's function produced it): dy.sum(0) + offset."""

    def __init__(self, offset: float):
        self.offset, self.calls = offset, 0

    def __call__(self, dy):
        self.calls += 1
        return dy.sum(0) + self.offset


def _dbias_is(out, dy, offset):
    torch.testing.assert_close(out, dy.sum(0) + offset, rtol=1.3e-6, atol=1e-5)


def test_switching_between_checked_and_unchecked_backends_re_resolves(plugins, gen):
    """'plain' declares dbias without checks (its function is the cached runner), 'picky' with a
    supports() that declines odd widths: each selection must run its own backend's rule."""
    plain, picky = Counting(100.0), Counting(200.0)
    plugins([
        FakeEntryPoint("plain", make_plugin("plain", device_type="cpu", ops={"dbias": plain})),
        FakeEntryPoint("picky", make_plugin("picky", device_type="cpu", ops={
            "dbias": OpImpl(picky, lambda dy: (dy.shape[-1] % 2 == 0, "odd width"))})),
    ])
    even, odd = torch.randn(4, 6, generator=gen), torch.randn(4, 5, generator=gen)
    backend.set_backend("plain")
    _dbias_is(ops.dbias(odd), odd, 100.0)
    backend.set_backend("picky")
    _dbias_is(ops.dbias(even), even, 200.0)
    with pytest.warns(BackendFallbackWarning, match="odd width"):
        _dbias_is(ops.dbias(odd), odd, 0.0)  # declined: the reference ran
    backend.set_backend("plain")
    _dbias_is(ops.dbias(odd), odd, 100.0)
    backend.set_backend("reference")
    _dbias_is(ops.dbias(odd), odd, 0.0)
    assert (plain.calls, picky.calls) == (2, 1)


def test_cache_filled_before_the_first_op_call_follows_later_selections(plugins, monkeypatch, gen):
    """A resolution cached by another caller (backend.declares) before any op call of the process,
    when the op's own fast path has not bound the registry yet, is used, then dropped on reselection."""
    native = Counting(100.0)
    plugins([FakeEntryPoint("fake", make_plugin("fake", device_type="cpu", ops={"dbias": native}))])
    backend.set_backend("fake")
    monkeypatch.setattr(_spec, "_REGISTRY", _spec._NoRegistryYet())
    monkeypatch.setattr(ops.CONTRACT["dbias"], "_cache", None)
    assert backend.declares("dbias")  # fills the op's cache through the dispatcher
    dy = torch.randn(3, 8, generator=gen)
    _dbias_is(ops.dbias(dy), dy, 100.0)
    backend.set_backend("reference")
    _dbias_is(ops.dbias(dy), dy, 0.0)
    assert native.calls == 1


def test_registry_reset_re_resolves_to_the_newly_installed_plugin(plugins, gen):
    first, second = Counting(100.0), Counting(200.0)
    plugins([FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": first}))])  # auto selects it
    dy = torch.randn(2, 8, generator=gen)
    _dbias_is(ops.dbias(dy), dy, 100.0)
    generation = REGISTRY.generation
    plugins([FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": second}))])  # resets the registry
    assert REGISTRY.generation != generation
    _dbias_is(ops.dbias(dy), dy, 200.0)
    assert (first.calls, second.calls) == (1, 1)


def test_override_change_takes_effect_at_reselection(plugins, monkeypatch, gen):
    native = Counting(100.0)
    plugins([FakeEntryPoint("fake", make_plugin("fake", device_type="cpu", ops={"dbias": native}))])
    dy = torch.randn(2, 8, generator=gen)
    backend.set_backend("fake")
    _dbias_is(ops.dbias(dy), dy, 100.0)
    monkeypatch.setenv("TE_BACKEND_OVERRIDES", "dbias=reference")
    backend.set_backend("fake")
    _dbias_is(ops.dbias(dy), dy, 0.0)
    assert native.calls == 1


def test_call_and_call_eager_run_the_same_runner_with_arguments_and_keywords(plugins, gen):
    """dispatch.call (what the torch.library twin runs) passes positional and keyword arguments
    through the cached runner, checks included."""
    seen = []

    def supports(x, scale, fp8_dtype, *, amax_out=None):
        seen.append(amax_out is not None)
        return True, ""

    from te_core.reference.plugin import implementations

    plugins([FakeEntryPoint("fake", make_plugin("fake", device_type="cpu", ops={
        "quantize_fp8": OpImpl(implementations()["quantize_fp8"], supports)}))])
    backend.set_backend("fake")
    x, scale = torch.randn(8, 16, generator=gen), torch.tensor([4.0])
    op = ops.CONTRACT["quantize_fp8"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        direct = ops.quantize_fp8(x, scale, torch.float8_e4m3fn)
        via_call = dispatch.call(op, (x, scale, torch.float8_e4m3fn), {"amax_out": torch.zeros(1)})
        via_eager = dispatch.call_eager(op, (x, scale), {"fp8_dtype": torch.float8_e4m3fn})
    assert seen == [False, True, False]
    for data, amax in (via_call, via_eager):
        assert torch.equal(data.view(torch.uint8), direct[0].view(torch.uint8))
        assert torch.equal(amax, x.abs().amax().reshape(amax.shape))
