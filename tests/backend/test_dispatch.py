"""Per-op dispatch: native calls, fallback with one warning, strict mode, overrides."""
import warnings

import pytest
import torch

from te_core import backend, ops
from te_core.backend import BackendError, BackendFallbackWarning, OpImpl
from te_core.backend.types import Capabilities
from te_core.reference.plugin import implementations

from registry_fakes import FakeEntryPoint, make_plugin

REF = implementations()


def _native_dbias(dy):
    _native_dbias.calls += 1
    return REF["dbias"](dy)


def test_native_op_runs_on_selected_backend(plugins, gen):
    _native_dbias.calls = 0
    plugins([FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": _native_dbias}))])
    dy = torch.randn(6, 5, generator=gen)
    torch.testing.assert_close(ops.dbias(dy), dy.sum(0), rtol=1.3e-6, atol=1e-5)
    assert _native_dbias.calls == 1


def test_undeclared_op_falls_back_with_one_warning(plugins, gen):
    plugins([FakeEntryPoint("fake", make_plugin("fake"))])
    dy = torch.randn(7, 3, generator=gen)
    with pytest.warns(BackendFallbackWarning, match="'dbias' falls back from backend 'fake' to reference on cpu"):
        out = ops.dbias(dy)
    torch.testing.assert_close(out, dy.sum(0), rtol=1.3e-6, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.dbias(dy)  # same op, backend, device and reason: no second warning


def test_supports_decline_falls_back_with_reason(plugins, gen):
    def supports(dy):
        return (dy.shape[-1] % 16 == 0), "last dim must be a multiple of 16"

    _native_dbias.calls = 0
    plugins([FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": OpImpl(_native_dbias, supports)}))])
    ops.dbias(torch.randn(4, 32, generator=gen))
    with pytest.warns(BackendFallbackWarning, match="multiple of 16"):
        ops.dbias(torch.randn(4, 17, generator=gen))
    assert _native_dbias.calls == 1


def test_a_fallback_inside_a_fullgraph_compile_warns_at_trace_time(plugins, gen):
    """dynamo cannot trace warnings.warn: the fallback warning is said while tracing, and the
    compiled function (one graph) computes the reference's result."""
    def supports(dy):
        return (dy.shape[-1] % 16 == 0), "a reason only this test gives"

    plugins([FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": OpImpl(_native_dbias, supports)}))])
    x = torch.randn(4, 17, generator=gen, requires_grad=True)  # (autograd: the op runs through dispatch)
    compiled = torch.compile(lambda t: ops.dbias(t) * 2.0, fullgraph=True, backend="eager")
    with pytest.warns(BackendFallbackWarning, match="a reason only this test gives"):
        out = compiled(x)
    torch.testing.assert_close(out, x.detach().sum(0) * 2.0, rtol=1.3e-6, atol=1e-5)


def test_capabilities_are_enforced_before_the_call(plugins, gen):
    called = []
    caps = Capabilities(fp8_formats={"E5M2": 57344.0}, scaling_modes=frozenset({"tensorwise"}), arch="x", device_name="X")
    plugins([FakeEntryPoint("fake", make_plugin("fake", caps=caps, ops={"quantize_fp8": lambda *a: called.append(a)}))])
    x = torch.randn(8, 8, generator=gen)
    with pytest.warns(BackendFallbackWarning, match="FP8 format E4M3 not supported on X x"):
        data, amax = ops.quantize_fp8(x, torch.tensor([2.0]), torch.float8_e4m3fn)
    assert not called
    assert torch.equal(amax, x.abs().amax())


def test_strict_mode_turns_fallback_into_error(plugins, monkeypatch, gen):
    monkeypatch.setenv("TE_BACKEND_STRICT", "1")
    plugins([FakeEntryPoint("fake", make_plugin("fake"))])
    with pytest.raises(BackendError, match="TE_BACKEND_STRICT=1 forbids falling back"):
        ops.dbias(torch.randn(3, 3, generator=gen))


def test_exception_in_implementation_propagates_without_retry(plugins, gen):
    def broken(dy):
        raise ZeroDivisionError("kernel bug")

    plugins([FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": broken}))])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no fallback warning either
        with pytest.raises(ZeroDivisionError, match="kernel bug"):
            ops.dbias(torch.randn(3, 3, generator=gen))


def test_overrides_pin_single_ops(plugins, monkeypatch, gen):
    _native_dbias.calls = 0
    plugins([
        FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": lambda dy: dy.sum(0) * 0 + 7})),
        FakeEntryPoint("other", make_plugin("other", device_type="cpu", ops={"dbias": _native_dbias})),
    ])
    monkeypatch.setenv("TE_BACKEND_OVERRIDES", "dbias=other")
    backend.set_backend("fake")
    ops.dbias(torch.randn(3, 3, generator=gen))
    assert _native_dbias.calls == 1
    monkeypatch.setenv("TE_BACKEND_OVERRIDES", "dbias=reference")
    backend.set_backend("fake")
    dy = torch.randn(3, 3, generator=gen)
    torch.testing.assert_close(ops.dbias(dy), dy.sum(0))


@pytest.mark.parametrize("spec, message", [
    ("dbias", "not of the form op=backend"),
    ("nonsense=reference", "unknown op 'nonsense'"),
    ("gemm=other", "does not implement it"),
    ("dbias=missing", "unknown backend 'missing'"),
])
def test_bad_overrides(plugins, monkeypatch, spec, message):
    plugins([FakeEntryPoint("other", make_plugin("other", device_type="cpu"))])
    monkeypatch.setenv("TE_BACKEND_OVERRIDES", spec)
    with pytest.raises(BackendError, match=message):
        backend.set_backend("reference")


def test_reselection_invalidates_cached_resolution(plugins, gen):
    _native_dbias.calls = 0
    plugins([FakeEntryPoint("fake", make_plugin("fake", ops={"dbias": _native_dbias}))])
    dy = torch.randn(3, 3, generator=gen)
    ops.dbias(dy)
    backend.set_backend("reference")
    ops.dbias(dy)
    backend.set_backend("fake")
    ops.dbias(dy)
    assert _native_dbias.calls == 2
