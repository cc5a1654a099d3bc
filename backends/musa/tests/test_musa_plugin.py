"""Availability, capabilities, op declaration and registry discovery, on a faked torch_musa."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from te_core.backend.types import MXFP8, ROWWISE, TENSORWISE, BackendInfo, Capabilities, OpImpl

from te_backend_musa import plugin
from te_backend_musa.capabilities import capabilities_for


# -- info and availability -------------------------------------------------------------------
def test_info_imports_nothing_vendor(no_torch_musa):
    info = plugin.te_backend_info()
    assert isinstance(info, BackendInfo)
    assert (info.name, info.device_type) == ("musa", "musa")
    assert set(info.vendor_versions) == {"torch", "torch_musa", "musa", "mudnn"}
    assert info.vendor_versions["torch_musa"] is None
    assert sys.modules.get("torch_musa") is None  # still the "not importable" marker


def test_unavailable_without_torch_musa(no_torch_musa):
    ok, reason = plugin.te_backend_available()
    assert not ok
    assert reason.startswith("torch_musa is not installed")
    assert "not PyPI" in reason and "torch_musa 2.7.x pairs with torch 2.7.1" in reason


def test_unavailable_when_import_breaks(monkeypatch):
    class Exploding:
        def find_spec(self, name, path=None, target=None):
            if name == "torch_musa":
                raise RuntimeError("libmusart.so.4: cannot open shared object file")
            return None

    monkeypatch.delitem(sys.modules, "torch_musa", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Exploding(), *sys.meta_path])
    ok, reason = plugin.te_backend_available()
    assert not ok
    assert "torch_musa failed to import: RuntimeError: libmusart.so.4" in reason


def test_unavailable_without_device(fake_musa):
    fake_musa(available=False)
    ok, reason = plugin.te_backend_available()
    assert not ok
    assert "torch.musa.is_available() is False" in reason and "mthreads-gmi" in reason


def test_unavailable_with_zero_devices(fake_musa):
    fake_musa(count=0)
    ok, reason = plugin.te_backend_available()
    assert not ok
    assert "0 MUSA devices" in reason


def test_available_reason_names_device(fake_musa):
    fake_musa(arch=(3, 1), count=2)
    ok, reason = plugin.te_backend_available()
    assert ok
    assert reason.startswith("2 MUSA device(s), current: MTT S5000 (mp_31), torch_musa ")


def test_device_module_is_torch_musa(fake_musa):
    fake_musa()
    assert plugin.te_backend_device_module() is torch.musa


# -- capabilities ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", [(2, 1), (2, 2)])
def test_no_fp8_before_arch_31(fake_musa, arch):
    fake_musa(arch=arch)
    caps = plugin.te_backend_capabilities(torch.device("cpu"))
    assert isinstance(caps, Capabilities)
    assert caps.fp8_formats == {} and caps.scaling_modes == frozenset()
    assert caps.arch == f"mp_{arch[0]}{arch[1]}"
    assert "FP8 format E4M3 not supported" in caps.check_fp8(torch.float8_e4m3fn)
    assert any("need MUSA arch >= 3.1" in n for n in caps.notes)


def test_fp8_on_arch_31(fake_musa):
    fake_musa(arch=(3, 1))
    caps = plugin.te_backend_capabilities(torch.device("cpu"))
    assert caps.fp8_formats == {"E4M3": 448.0, "E5M2": 57344.0}
    assert caps.scaling_modes == frozenset({TENSORWISE, ROWWISE})
    assert caps.check_fp8(torch.float8_e5m2) is None
    assert caps.check_scaling(ROWWISE) is None
    assert "not supported" in caps.check_scaling("block_1x128_128x128")
    assert "not supported" in caps.check_scaling(MXFP8)
    assert (caps.arch, caps.device_name, caps.distributed_backend) == ("mp_31", "MTT S5000", "mccl")
    notes = " ".join(caps.notes)
    assert "only per-tensor or per-row" in notes and "RunLt" in notes
    assert "no E8M0 dtype" in notes
    assert "bf16 collectives need arch >= 2.2" in notes


def test_fp8_needs_torch_dtypes():
    caps = capabilities_for((3, 1), "MTT S5000", dtypes_present=False)
    assert caps.fp8_formats == {}
    assert any("lacks torch.float8_e4m3fn" in n for n in caps.notes)


@pytest.mark.parametrize("arch, dist", [((2, 1), "gloo"), ((2, 2), "mccl"), ((3, 1), "mccl")])
def test_distributed_backend_by_arch(arch, dist):
    caps = capabilities_for(arch, "x", dtypes_present=True)
    assert caps.distributed_backend == dist
    if dist == "gloo":
        assert any("MCCL does not support mp_21" in n for n in caps.notes)


def test_capabilities_note_missing_features(fake_musa):
    fake_musa()
    notes = " ".join(plugin.te_backend_capabilities(torch.device("cpu")).notes)
    # Upstream CPU torch lacks torch_musa's ops, so they are named as missing.
    assert "aten::_fused_rmsnorm_forward" in notes and "F.swish_glu" in notes and "F.rope" in notes
    assert "Triton kernels off: no Moore Threads Triton backend" in notes


# -- ops ---------------------------------------------------------------------------------------
def test_ops_declared_by_feature(fake_musa, monkeypatch):
    fake_musa()
    ops = plugin.te_backend_ops()
    assert {"gemm_fp8", "gemm", "attention", "multi_tensor_adam"} <= set(ops)
    assert not {"rmsnorm_fwd", "activation_fwd", "rope_fwd"} & set(ops)
    monkeypatch.setattr(F, "swish_glu", lambda x: x, raising=False)
    monkeypatch.setattr(F, "rope", lambda **kw: kw["input"], raising=False)
    ops = plugin.te_backend_ops()
    assert {"activation_fwd", "activation_bwd", "rope_fwd", "rope_bwd"} <= set(ops)
    assert all(isinstance(impl, OpImpl) and impl.supports is not None for impl in ops.values())


def test_ops_are_contract_ops(fake_musa, monkeypatch):
    from te_core.ops import CONTRACT

    fake_musa()
    monkeypatch.setattr(F, "swish_glu", lambda x: x, raising=False)
    monkeypatch.setattr(F, "rope", lambda **kw: kw["input"], raising=False)
    assert set(plugin.te_backend_ops()) <= set(CONTRACT)


def test_first_supported_prefers_mudnn_then_triton():
    from te_backend_musa.ops import first_supported, merge

    mudnn = OpImpl(lambda x, kind: "mudnn", lambda x, kind: (kind == "swiglu", "only swiglu"))
    triton = OpImpl(lambda x, kind: "triton", lambda x, kind: (kind != "bad", "bad kind"))
    both = first_supported(mudnn, triton)
    assert both.fn(None, "swiglu") == "mudnn" and both.fn(None, "gelu") == "triton"
    assert both.supports(None, "gelu") == (True, "")
    assert both.supports(None, "bad") == (False, "only swiglu; Triton: bad kind")
    merged = merge({"activation_fwd": mudnn}, {"activation_fwd": triton, "quantize_fp8": triton})
    assert merged["quantize_fp8"] is triton and merged["activation_fwd"].fn(None, "gelu") == "triton"


# -- registry ----------------------------------------------------------------------------------
def test_registry_reports_musa_unavailable(no_torch_musa):
    backend_api = pytest.importorskip("te_core.backend")
    backend_api.reset()
    try:
        musa = {b.name: b for b in backend_api.list_backends()}.get("musa")
        assert musa is not None, f"musa not discovered; broken: {backend_api.broken_plugins()}"
        assert musa.distribution == "te-backend-musa"
        assert not musa.available
        assert musa.reason.startswith("torch_musa is not installed")
        assert musa.ops == {}
        with pytest.raises(backend_api.BackendError, match="not available on this machine: torch_musa is not installed"):
            backend_api.get_backend("musa")
    finally:
        backend_api.reset()
