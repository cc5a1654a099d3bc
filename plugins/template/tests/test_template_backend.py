"""The template backend through te-core's dispatcher: its ops run, its supports() declines
with a reason (and the reference runs), and TE_BACKEND_STRICT=1 turns the decline into an error.
The kit (`te-core certify template`) checks its numerics.

The expected op table is the backend's own OPS, so dropping an op from ops.py breaks nothing
here. The gemm_fp8 tests check the example decline rule of ops.py (M, N, K multiples of 16):
they skip once gemm_fp8 or its supports() is gone; change them when you change the rule."""
from __future__ import annotations

import pytest
import torch

from te_core import backend, ops
from te_core.backend import OpImpl
from te_core.ops import CONTRACT
from te_backend_template.ops import OPS
from te_backend_template.plugin import DEVICE_TYPE, NAME


def _fp8_operands(m, n, k):
    gen = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    a = (torch.randn(m, k, generator=gen) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=gen) * 8).to(torch.float8_e4m3fn)
    return a, b, torch.tensor([0.05]), torch.tensor([0.125])


def _gemm_fp8_supports():
    """gemm_fp8's supports() as OPS declares it; skips the test where there is none to test."""
    impl = OPS.get("gemm_fp8")
    if impl is None or impl.supports is None:
        pytest.skip("OPS declares no gemm_fp8 with a supports(): no example decline to test")
    return impl.supports


@pytest.fixture
def selected(monkeypatch):
    """This backend, selected as TE_BACKEND would select it."""
    monkeypatch.delenv("TE_BACKEND_STRICT", raising=False)
    monkeypatch.delenv("TE_BACKEND_OVERRIDES", raising=False)
    yield backend.set_backend(NAME)
    monkeypatch.undo()
    backend.reset()


def test_backend_is_available_with_its_ops(selected):
    assert selected.name == NAME and selected.available and selected.device_type == DEVICE_TYPE
    assert OPS and set(selected.ops) == set(OPS)  # what te_backend_ops hands the registry, nothing lost
    for name, impl in OPS.items():
        assert name in CONTRACT, f"OPS[{name!r}]: not a contract op (see te_core.ops.CONTRACT)"
        assert isinstance(impl, OpImpl) and selected.ops[name] is impl


def test_supports_declines_unaligned_dims_with_reason():
    supports = _gemm_fp8_supports()
    ok, reason = supports(*_fp8_operands(33, 48, 64))
    assert not ok and reason == "gemm_fp8 needs M, N, K multiples of 16, got M=33, N=48, K=64"
    assert supports(*_fp8_operands(32, 48, 64)) == (True, "")


def test_declined_call_falls_back_with_a_warning(selected):
    _gemm_fp8_supports()
    a, b, a_si, b_si = _fp8_operands(17, 32, 48)
    with pytest.warns(backend.BackendFallbackWarning, match="M=17, N=32, K=48"):
        y = ops.gemm_fp8(a, b, a_si, b_si, out_dtype=torch.float32)
    expected = (a.float() * a_si) @ (b.float() * b_si).T
    torch.testing.assert_close(y, expected, rtol=1.3e-6, atol=1e-5)


def test_strict_mode_refuses_the_fallback(selected, monkeypatch):
    _gemm_fp8_supports()
    monkeypatch.setenv("TE_BACKEND_STRICT", "1")
    backend.set_backend(NAME)
    with pytest.raises(backend.BackendError, match="M=19, N=32, K=48.*TE_BACKEND_STRICT=1"):
        ops.gemm_fp8(*_fp8_operands(19, 32, 48), out_dtype=torch.float32)
