"""The template backend through te-core's dispatcher: its ops run, its supports() declines
with a reason (and the reference runs), and TE_BACKEND_STRICT=1 turns the decline into an error.
The kit (`te-core certify template`) checks its numerics."""
from __future__ import annotations

import pytest
import torch

from te_core import backend, ops
from te_backend_template.ops import gemm_fp8_supports


def _fp8_operands(m, n, k):
    gen = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    a = (torch.randn(m, k, generator=gen) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=gen) * 8).to(torch.float8_e4m3fn)
    return a, b, torch.tensor([0.05]), torch.tensor([0.125])


@pytest.fixture
def selected(monkeypatch):
    """This backend, selected as TE_BACKEND would select it."""
    monkeypatch.delenv("TE_BACKEND_STRICT", raising=False)
    monkeypatch.delenv("TE_BACKEND_OVERRIDES", raising=False)
    yield backend.set_backend("template")
    monkeypatch.undo()
    backend.reset()


def test_backend_is_available_with_its_ops(selected):
    assert selected.name == "template" and selected.available and selected.device_type == "cpu"
    assert {"quantize_fp8", "gemm_fp8", "gemm", "layernorm_fwd"} <= set(selected.ops)
    assert selected.ops["gemm_fp8"].supports is gemm_fp8_supports


def test_supports_declines_unaligned_dims_with_reason():
    ok, reason = gemm_fp8_supports(*_fp8_operands(33, 48, 64))
    assert not ok and reason == "gemm_fp8 needs M, N, K multiples of 16, got M=33, N=48, K=64"
    assert gemm_fp8_supports(*_fp8_operands(32, 48, 64)) == (True, "")


def test_declined_call_falls_back_with_a_warning(selected):
    a, b, a_si, b_si = _fp8_operands(17, 32, 48)
    with pytest.warns(backend.BackendFallbackWarning, match="M=17, N=32, K=48"):
        y = ops.gemm_fp8(a, b, a_si, b_si, out_dtype=torch.float32)
    expected = (a.float() * a_si) @ (b.float() * b_si).T
    torch.testing.assert_close(y, expected, rtol=1.3e-6, atol=1e-5)


def test_strict_mode_refuses_the_fallback(selected, monkeypatch):
    monkeypatch.setenv("TE_BACKEND_STRICT", "1")
    backend.set_backend("template")
    with pytest.raises(backend.BackendError, match="M=19, N=32, K=48.*TE_BACKEND_STRICT=1"):
        ops.gemm_fp8(*_fp8_operands(19, 32, 48), out_dtype=torch.float32)
