"""The te_triton kernels on MUSA: detection of a Moore Threads Triton backend, MUSA tuning configs,
and binding te_triton's launchers (run here through Triton's CPU interpreter)."""
from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from te_backend_musa import plugin, triton_kernels

pytest.importorskip("te_triton", reason="the shared Triton kernels (backends/triton) are not installed")

E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def interpreted_kernels():
    """Skips a test that runs te_triton's kernels where this triton's CPU interpreter cannot run
    them (triton 3.3.1's cannot); the kernels are then checked on a GPU only."""
    import triton
    from te_triton import cast

    try:
        cast.quantize_fp8(torch.ones(4, 128), torch.ones(1), E4M3)
    except Exception as exc:  # the interpreter's own error, whatever its type
        pytest.skip(f"triton {triton.__version__}'s CPU interpreter cannot run te_triton's kernels "
                    f"({type(exc).__name__}: {str(exc)[:120]}); install a newer triton to run these on the CPU")


@pytest.fixture
def mt_triton(monkeypatch):
    """Pretend Moore Threads' triton backend (triton.backends.mtgpu) is importable."""
    name = "triton.backends.mtgpu"
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    monkeypatch.setitem(sys.modules, name, module)


def test_no_mt_backend_with_upstream_triton():
    backend, why = triton_kernels.mt_triton_backend()
    assert backend is None
    assert "triton.backends.mtgpu or triton.backends.mthreads" in why
    assert triton_kernels.triton_ops((3, 1)) == ({}, why)


def test_mt_backend_detected(mt_triton):
    assert triton_kernels.mt_triton_backend() == ("triton.backends.mtgpu", "")


@pytest.mark.parametrize("arch, warp, warps, tile_m", [((3, 1), 32, 8, 64), ((2, 2), 128, 2, 32), ((2, 1), 128, 2, 32)])
def test_tuning_configs_follow_warp_size_and_smem(arch, warp, warps, tile_m):
    configs = triton_kernels.tuning_configs(arch)
    assert triton_kernels.warp_size(arch) == warp
    assert configs["quantize"].num_warps == warps and configs["elementwise"].num_warps == warps
    assert configs["quantize"].num_warps * warp == 256  # same threads per program on every arch
    assert configs["cast_transpose"].block_m == tile_m
    for cfg in configs.values():
        for size in (cfg.block, cfg.block_m, cfg.block_n):
            assert size & (size - 1) == 0  # tl.arange needs powers of two


def test_ops_bound_with_musa_configs(mt_triton):
    ops, why = triton_kernels.triton_ops((2, 2))
    assert why == ""
    assert {"quantize_fp8", "cast_transpose_fp8"} <= set(ops)
    configs = triton_kernels.tuning_configs((2, 2))
    assert ops["quantize_fp8"].fn.keywords == {"cfg": configs["quantize"]}
    if "layernorm_fwd" in ops:
        assert ops["layernorm_fwd"].fn.keywords["rms"] is False


def test_launcher_with_changed_signature_is_skipped(mt_triton, monkeypatch):
    from te_triton import cast

    monkeypatch.setattr(cast, "quantize_fp8", lambda x, scale, fp8_dtype: None)
    ops, _ = triton_kernels.triton_ops((3, 1))
    assert "quantize_fp8" not in ops


@pytest.mark.parametrize("arch", [(3, 1), (2, 2)])
def test_bound_quantize_runs_and_matches_reference(mt_triton, interpreted_kernels, arch):
    reference = pytest.importorskip("te_core.reference.cast")
    ops, _ = triton_kernels.triton_ops(arch)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(37, 200, generator=g) * 3
    scale = torch.tensor([20.0])
    data, amax = ops["quantize_fp8"].fn(x, scale, E4M3)
    want, want_amax = reference.quantize_fp8(x, scale, E4M3)
    assert data.dtype == E4M3 and data.shape == x.shape
    torch.testing.assert_close(amax, want_amax)
    # triton 3.9's interpreter mis-rounds some fp32 -> fp8 casts (ties away from zero; a carry
    # into the next binade halves the value; see backends/triton/tests/fp8_compare.py), so on
    # the CPU: almost all equal, the rest within that binade slip. Bit-exactness is a GPU check.
    got, ref = data.float(), want.float()
    assert (got == ref).float().mean() > 0.9
    assert ((got - ref).abs() <= ref.abs() * 0.5 + 2.0**-9).all()
    data, data_t, amax = ops["cast_transpose_fp8"].fn(x, scale, E4M3)
    assert torch.equal(data_t.view(torch.uint8), data.T.contiguous().view(torch.uint8))


def test_musa_ops_take_triton_for_what_mudnn_lacks(fake_musa, mt_triton):
    fake_musa(arch=(3, 1))
    ops = plugin.te_backend_ops()
    assert "quantize_fp8" in ops and "gemm_fp8" in ops
    x = torch.randn(4, 8)
    ok, why = ops["activation_fwd"].supports(x, "gelu")  # no F.swish_glu here: Triton decides
    assert ok, why


def _case_ids(cases):
    return [c.id for c in cases]


def _bound_cases():
    from te_core.testing.cases import CASES

    return [c for c in CASES if c.op in triton_kernels.LAUNCHERS]


@pytest.mark.parametrize("case", _bound_cases(), ids=_case_ids(_bound_cases()))
def test_bound_kernels_return_the_reference_layouts(mt_triton, interpreted_kernels, case):
    """Every te_triton kernel bound here returns outputs of the reference's shapes, dtypes and
    strides on each conformance case it takes. Under torch.compile the reference is the ops' fake
    implementation, and inductor asserts its strides on the kernel's outputs (the values are the
    conformance kit's to check on the GPU: the CPU interpreter rounds some FP8 casts differently)."""
    from te_core.reference.plugin import implementations
    from te_core.testing.runner import map_tensors

    impl = triton_kernels.triton_ops((3, 1))[0].get(case.op)
    if impl is None:
        pytest.skip(f"{case.op} is not bound (te_triton's launcher is missing or changed)")
    args, kwargs = case.inputs()
    ok, why = impl.supports(*args, **kwargs)
    if not ok:
        pytest.skip(f"declined by supports(): {why}")
    got, want = [], []
    map_tensors(impl.fn(*args, **kwargs), lambda t: got.append(t) or t)
    args, kwargs = case.inputs()
    map_tensors(implementations()[case.op](*args, **kwargs), lambda t: want.append(t) or t)
    assert [(tuple(t.shape), t.dtype) for t in got] == [(tuple(t.shape), t.dtype) for t in want]
    for i, (g, w) in enumerate(zip(got, want)):
        # as inductor's stride assertion: dimensions of size 1, and empty tensors, have no stride to keep
        kept = [d for d in range(g.dim()) if g.numel() and g.shape[d] > 1]
        assert [g.stride(d) for d in kept] == [w.stride(d) for d in kept], (i, g.stride(), w.stride())


def test_bound_kernels_decline_what_they_would_raise_on(mt_triton):
    """A kind without a kernel, clamped_swiglu's parameters, a strided input: declined, so the
    reference runs them, never the launcher's ValueError."""
    ops = triton_kernels.triton_ops((3, 1))[0]
    x = torch.randn(8, 32)
    for kind, params in (("qgeglu", {}), ("clamped_swiglu", {"limit": 7.0, "alpha": 1.702}), ("tanh", {})):
        ok, why = ops["activation_fwd"].supports(x, kind, **params)
        assert not ok and kind in why
        ok, why = ops["activation_bwd"].supports(torch.randn(8, 16), x, kind, **params)
        assert not ok and kind in why
    assert not ops["activation_fwd"].supports(x.t(), "gelu")[0]
    assert "contiguous" in ops["activation_bwd"].supports(torch.randn(32, 8).t(), x, "gelu")[1]
    assert not ops["activation_bwd_dbias_cast_transpose"].supports(x, x, "qgeglu", torch.ones(1), E4M3)[0]
    assert ops["activation_bwd_dbias_cast_transpose"].supports(x, x, "gelu", torch.ones(1), E4M3) == (True, "")
    assert "not contiguous" in ops["quantize_fp8"].supports(x.t(), torch.ones(1), E4M3)[1]
    assert "not contiguous" in ops["layernorm_bwd_add"].supports(
        x, x, torch.zeros(8), torch.ones(8), torch.ones(32), torch.randn(32, 8).t())[1]
