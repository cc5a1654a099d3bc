"""Registration, availability and capability logic of te-backend-cuda, with torch.cuda mocked."""
import importlib.metadata

import pytest
import torch
from te_backend_cuda import capabilities, plugin
from te_core.backend.types import BLOCK_1x128_1x128, BLOCK_1x128_128x128, MXFP8, ROWWISE, TENSORWISE
from te_core.ops import CONTRACT


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA build with one visible GPU of a settable compute capability."""
    state = {"cc": (9, 0)}
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: state["cc"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    capabilities.capabilities_for.cache_clear()
    yield state
    capabilities.capabilities_for.cache_clear()


def test_entry_point_is_published():
    eps = importlib.metadata.entry_points(group="te_core.backends")
    assert any(ep.name == "cuda" and ep.value == "te_backend_cuda.plugin" for ep in eps)


def test_info_names_backend_and_versions():
    info = plugin.te_backend_info()
    assert info.name == "cuda" and info.device_type == "cuda"
    assert set(info.vendor_versions) == {"torch", "cuda", "cudnn", "triton"}


def test_unavailable_on_cpu_only_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    ok, why = plugin.te_backend_available()
    assert not ok and "CPU-only build" in why


def test_unavailable_on_rocm(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    ok, why = plugin.te_backend_available()
    assert not ok and "ROCm build" in why


def test_unavailable_without_gpu(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = plugin.te_backend_available()
    assert not ok and "no NVIDIA GPU visible" in why


def test_available_with_gpu(fake_gpu):
    ok, why = plugin.te_backend_available()
    assert ok and "NVIDIA H200" in why


def test_no_fp8_before_sm89(fake_gpu):
    fake_gpu["cc"] = (8, 0)
    caps = plugin.te_backend_capabilities(torch.device("cuda", 0))
    assert caps.fp8_formats == {} and caps.scaling_modes == frozenset()
    assert "8.9" in caps.check_fp8(torch.float8_e4m3fn) or "not supported" in caps.check_fp8(torch.float8_e4m3fn)
    assert caps.distributed_backend == "nccl"


def test_hopper_modes_follow_the_probes(fake_gpu):
    works = {ROWWISE: True, BLOCK_1x128_128x128: True, BLOCK_1x128_1x128: False}
    caps = capabilities.capabilities_for(0, lambda mode, device: (works[mode], f"{mode} failed"))
    assert caps.fp8_formats == {"E4M3": 448.0, "E5M2": 57344.0}
    assert caps.scaling_modes == {TENSORWISE, ROWWISE, BLOCK_1x128_128x128}
    assert caps.arch == "sm_90" and any("block_1x128_1x128 failed" in n for n in caps.notes)


def test_mxfp8_only_from_sm100(fake_gpu):
    fake_gpu["cc"] = (10, 0)
    caps = capabilities.capabilities_for(0, lambda mode, device: (True, ""))
    assert MXFP8 in caps.scaling_modes
    fake_gpu["cc"] = (8, 9)
    capabilities.capabilities_for.cache_clear()
    assert MXFP8 not in capabilities.capabilities_for(0, lambda mode, device: (True, "")).scaling_modes


def test_probe_reports_why_a_mode_fails(monkeypatch):
    from te_backend_cuda import scaled_mm

    def refuse(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration\nmore")

    monkeypatch.setattr(scaled_mm, "gemm_fp8", refuse)
    ok, why = capabilities.probe_scaling_mode(ROWWISE, torch.device("cpu"))
    assert not ok and why == "torch._scaled_mm does not run rowwise here: Invalid scaling configuration"


def test_probe_rejects_wrong_numbers(monkeypatch):
    from te_backend_cuda import scaled_mm

    monkeypatch.setattr(scaled_mm, "gemm_fp8", lambda a, b, *args, **kwargs: torch.zeros(a.shape[0], b.shape[0]))
    ok, why = capabilities.probe_scaling_mode(BLOCK_1x128_1x128, torch.device("cpu"))
    assert not ok and "wrong results in block_1x128_1x128" in why


def test_ops_are_contract_ops():
    impls = plugin.te_backend_ops()
    assert set(impls) <= set(CONTRACT)
    assert {"gemm_fp8", "gemm", "attention", "quantize_fp8", "cast_transpose_fp8", "layernorm_fwd",
            "delayed_scaling_update"} <= set(impls)
    assert all(impl.supports is not None for impl in impls.values())


def test_ops_decline_cpu_tensors():
    impls = plugin.te_backend_ops()
    x = torch.randn(4, 4)
    ok, why = impls["quantize_fp8"].supports(x, torch.ones(1), torch.float8_e4m3fn)
    assert not ok and "not on a CUDA device" in why
    ok, why = impls["attention"].supports(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    assert not ok and "CUDA" in why


def test_registry_lists_cuda_with_reason():
    from te_core import backend

    backend.reset()
    try:
        found = {b.name: b for b in backend.list_backends()}
        assert "cuda" in found
        if not torch.cuda.is_available():
            assert not found["cuda"].available and found["cuda"].reason
    finally:
        backend.reset()


def test_cross_entropy_is_native():
    assert {"cross_entropy", "quantize_blockwise", "quantize_mxfp8", "dequantize_mxfp8"} <= set(plugin.te_backend_ops())


def test_supports_decline_what_the_kernels_do_not_take(monkeypatch):
    """Argument checks that run before the device check, on CPU tensors."""
    from te_backend_cuda.ops import activation, cast, norm, scaling

    x = torch.randn(4, 6)
    assert "1-element float32" in cast.cast_ok(x, torch.ones(2))[1]
    assert "1-element float32" in cast.cast_ok(x, torch.ones(1, dtype=torch.float64))[1]
    assert "go together" in norm.norm_fwd_ok(x, torch.ones(6), torch.ones(6), 1e-5, fp8_dtype=torch.float8_e4m3fn)[1]
    assert "weight does not match" in norm._rows_ok(x, torch.ones(5))[1]
    assert "has no kernel" in activation.act_fwd_ok(x, "tanh")[1]
    assert "even last dimension" in activation.act_fwd_ok(torch.randn(4, 5), "swiglu")[1]
    assert "output shape" in activation.act_bwd_ok(torch.randn(4, 6), x, "swiglu")[1]
    assert "do not match" in norm.layernorm_bwd_ok(torch.randn(4, 5), x, None, torch.ones(4), torch.ones(6))[1]
    assert "is not 2-D" in activation.act_bwd_dbias_ct_ok(torch.randn(2, 2, 2), torch.randn(2, 2, 2), "gelu",
                                                           torch.ones(1), torch.float8_e4m3fn)[1]
    assert "callable" in scaling.scaling_ok([], [], [], amax_compute_algo=lambda h: h[0])[1]
    assert "is 0-dim" in activation.dbias_ok(torch.tensor(1.0))[1]
    assert "not contiguous" in cast.dequantize_ok(torch.zeros(4, 6).to(torch.float8_e4m3fn).t(), torch.ones(1),
                                                  torch.float32)[1]
    data = torch.zeros(4, 256).to(torch.float8_e4m3fn)
    assert "is not (4, 2)" in cast.dequantize_blockwise_ok(data, torch.ones(1, 2), False, torch.float32)[1]
    assert "is not FP8" in cast.dequantize_ok(torch.zeros(4), torch.ones(1), torch.float32)[1]
    assert "1x32 blocks" in cast.mxfp8_ok(torch.randn(64, 48), torch.float8_e4m3fn)[1]
    assert "1x32 blocks" in cast.mxfp8_ok(torch.randn(48, 64), torch.float8_e4m3fn, with_transpose=True)[1]
    assert "not 2-D" in cast.mxfp8_ok(torch.randn(2, 32, 32), torch.float8_e4m3fn)[1]
    assert "not on a CUDA device" in cast.mxfp8_ok(torch.randn(48, 64), torch.float8_e4m3fn)[1]
    mx = torch.zeros(4, 64).to(torch.float8_e4m3fn)
    assert "shape (4, 2)" in cast.dequantize_mxfp8_ok(mx, torch.zeros(4, 4, dtype=torch.uint8), torch.float32)[1]
    assert "uint8" in cast.dequantize_mxfp8_ok(mx, torch.zeros(4, 2), torch.float32)[1]
    assert "1x32 blocks" in cast.dequantize_mxfp8_ok(mx[:, :48], torch.zeros(4, 1, dtype=torch.uint8),
                                                     torch.float32)[1]
    assert "not on a CUDA device" in cast.dequantize_mxfp8_ok(mx, torch.zeros(4, 2, dtype=torch.uint8),
                                                              torch.float32)[1]


def test_fp8_output_kernels_need_sm89(fake_gpu):
    """They leave saturation to the hardware convert (configs' hw_saturate), which sm_89 brings."""
    from te_backend_cuda import configs
    from te_backend_cuda.ops.checks import fp8_convert_ok

    fp8_convert_ok.cache_clear()
    try:
        fake_gpu["cc"] = (8, 0)
        ok, why = fp8_convert_ok(0)
        assert not ok and "compute capability >= 8.9" in why and "8.0" in why
        fp8_convert_ok.cache_clear()
        fake_gpu["cc"] = (9, 0)
        assert fp8_convert_ok(0) == (True, "")
    finally:
        fp8_convert_ok.cache_clear()
    tuned = configs.tuning((9, 0), 132)
    assert tuned.quantize.hw_saturate and tuned.norm.hw_saturate and tuned.activation_fwd.hw_saturate
    assert tuned.mxfp8.hw_saturate
    # block casts too (a block holding inf casts at scale 1: test_cuda_saturation checks those bytes)
    assert tuned.blockwise.hw_saturate and tuned.blockwise_1d_transpose.hw_saturate


@pytest.mark.parametrize("shape", [(37, 50), (3, 5, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dbias_is_a_float32_column_sum(shape, dtype):
    """cuda's dbias is torch's column reduction: float32 accumulation, dy's dtype out, every
    leading dimension summed."""
    from te_backend_cuda import ops

    g = torch.Generator().manual_seed(1)
    dy = (torch.randn(shape, generator=g) * 3).to(dtype)
    got = ops.dbias(dy)
    want = dy.double().reshape(-1, shape[-1]).sum(0)
    assert got.dtype == dtype and got.shape == (shape[-1],)
    tol = dict(rtol=1.3e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("n,rms,warps", [(4096, False, 8), (8192, False, 8), (8192, True, 32), (16384, False, 16),
                                         (65536, False, 32), (100, True, 8)])
def test_norm_backward_warps_keep_32_elements_per_thread(monkeypatch, n, rms, warps):
    from te_backend_cuda import configs
    from te_backend_cuda.ops import norm

    monkeypatch.setattr(configs, "for_tensor", lambda x: configs.tuning((9, 0), 132))
    cfg = norm._norm_bwd_cfg(torch.empty(2, n), rms=rms)
    assert cfg.num_warps == warps


def test_info_says_where_te_triton_launches_go(fake_gpu, monkeypatch):
    """te-core info shows, among the device's notes, whether repeated te_triton launches go
    through the C extension or stay in Python, and why (here: turned off by the variable)."""
    from te_triton import launch

    monkeypatch.setattr(launch, "_C_STATE", [None])
    monkeypatch.setattr(launch, "_C_REASON", "TE_TRITON_C_LAUNCH=0")
    caps = capabilities.capabilities_for(0, lambda mode, device: (True, ""))
    assert "te_triton kernel launches stay in Python: TE_TRITON_C_LAUNCH=0" in caps.notes
