"""On a GPU with TMA (compute capability 9.0+) only: the ops that take te_triton's descriptor
kernels for large tensors (norm forward with FP8 out, norm backward, dbias cast-transposes) pick
them, and their results match the reference (TE's tolerances) and the pointer kernels (the same
FP8 bytes for the casts, which round no reduction first). The pointer kernels are replaced by
failing stand-ins, so a test passes only if the descriptor kernel ran."""
import pytest
import torch

from te_core.reference.plugin import implementations

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="needs a CUDA GPU with TMA (compute capability 9.0 or later)")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_TOL = dict(rtol=0.125, atol=0.0675)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-5)


class _Fails:
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise AssertionError("the pointer kernel ran")
        return launch


@pytest.fixture(autouse=True)
def _small_tensors_take_descriptors(monkeypatch, request):
    """The tests' tensors (2^22-2^24 elements) are below the production size threshold: lower it,
    except for the test of the threshold itself."""
    if request.node.originalname != "test_configs_pick_descriptors_for_large_tensors_only":
        from te_backend_cuda import configs
        monkeypatch.setattr(configs, "TMA_MIN_NUMEL", 1 << 20)


def _tma_only(monkeypatch, fn):
    """fn() with te_triton's pointer kernels (norm, dbias) replaced by failing stand-ins."""
    from te_triton import dbias, norm
    with monkeypatch.context() as m:
        for mod, name in ((norm, "_norm_fwd_kernel"), (norm, "_norm_bwd_kernel"), (dbias, "_dbias_ct_kernel")):
            m.setattr(mod, name, _Fails())
        return fn()


def test_configs_pick_descriptors_for_large_tensors_only():
    from te_backend_cuda import configs, ops
    big = torch.empty(16384, 4096, device="cuda", dtype=torch.bfloat16)  # 2^26 elements: the threshold
    small = torch.empty(16383, 4096, device="cuda", dtype=torch.bfloat16)
    tuned = configs.for_tensor(big)
    assert ops.norm._norm_fwd_cfg(big, E4M3, rms=False) is tuned.norm_tma[False, False]
    assert ops.norm._norm_fwd_cfg(small, E4M3, rms=False) is tuned.norm
    assert ops.norm._norm_fwd_cfg(big, None, rms=False) is tuned.norm_high_precision  # bf16 out: pointer kernel
    assert ops.norm._norm_bwd_cfg(big, rms=True).tma_stages == tuned.norm_bwd_tma.tma_stages
    assert ops.activation._dbias_ct_cfg(small).tma_stages == 0


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("shape", [(4, 512, 4096), (999, 8192)])  # 999 rows: a last step past the end (2 rows a step)
def test_norm_forward_fp8(monkeypatch, rms, shape):
    from te_backend_cuda import ops
    ref = implementations()
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3 + 1
    w = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
    b = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([16.0], device="cuda")
    if rms:
        got = _tma_only(monkeypatch, lambda: ops.rmsnorm_fwd(x, w, 1e-5, fp8_scale=s, fp8_dtype=E4M3,
                                                             zero_centered_gamma=True))
        want = ref["rmsnorm_fwd"](x, w, 1e-5, fp8_scale=s, fp8_dtype=E4M3, zero_centered_gamma=True)
    else:
        got = _tma_only(monkeypatch, lambda: ops.layernorm_fwd(x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3))
        want = ref["layernorm_fwd"](x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3)
    torch.testing.assert_close(got[0].float(), want[0].float(), **FP8_TOL)
    for g, w_ in zip(got[1:], want[1:]):  # mean, rstd, amax
        torch.testing.assert_close(g, w_, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("with_add", [False, True])
@pytest.mark.parametrize("n", [4096, 8192])
def test_norm_backward(monkeypatch, rms, with_add, n):
    from te_backend_cuda import ops
    ref = implementations()
    torch.manual_seed(1)
    x = torch.randn(2048, n, device="cuda", dtype=torch.bfloat16) * 3 + 1
    dy = torch.randn_like(x)
    add = torch.randn_like(x)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    name = "rmsnorm" if rms else "layernorm"
    stats = ref[f"{name}_fwd"](x, w, 1e-5) if rms else ref[f"{name}_fwd"](x, w, w, 1e-5)
    stats = stats[1:2] if rms else stats[1:3]  # (rstd,) or (mean, rstd)
    args = (dy, x, *stats, w, *((add,) if with_add else ()))
    op = f"{name}_bwd_add" if with_add else f"{name}_bwd"
    got, want = _tma_only(monkeypatch, lambda: getattr(ops, op)(*args)), ref[op](*args)
    torch.testing.assert_close(got[0], want[0], **BF16_TOL)
    for g, w_ in zip(got[1:], want[1:]):  # parameter gradients: sums of 2048 rows
        torch.testing.assert_close(g.float(), w_.float(), rtol=1.6e-2, atol=1e-1)


def _same_cast(got, want):
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=1.6e-2, atol=0.5)  # bf16 sums of 2048+ rows
    assert got[3].item() == want[3].item()


def test_dbias_cast_transpose(monkeypatch):
    from te_triton import dbias

    from te_backend_cuda import configs, ops
    torch.manual_seed(2)
    g = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([64.0], device="cuda")
    got = _tma_only(monkeypatch, lambda: ops.dbias_cast_transpose(g, s, E5M2))
    _same_cast(got, dbias.dbias_cast_transpose(g, s, E5M2, configs.for_tensor(g).dbias_cast_transpose))


@pytest.mark.parametrize("first_contiguous", [True, False])
def test_dbias_cast_transpose_parts(monkeypatch, first_contiguous):
    """q, k, v gradients as column blocks, one launch each; a non-contiguous first part is
    concatenated by the launcher (the backend takes the call, it does not go to the reference)."""
    from te_triton import dbias

    from te_backend_cuda import configs, ops
    torch.manual_seed(3)
    parts = [torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    if not first_contiguous:
        parts[0] = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16).t()
    s = torch.tensor([64.0], device="cuda")
    assert ops.activation.dbias_ct_parts_ok(parts, s, E5M2) == (True, "")
    got = _tma_only(monkeypatch, lambda: ops.dbias_cast_transpose_parts(parts, s, E5M2))
    whole = torch.cat([p.contiguous() for p in parts], dim=1)
    _same_cast(got, dbias.dbias_cast_transpose(whole, s, E5M2, configs.for_tensor(whole).dbias_cast_transpose))


@pytest.mark.parametrize("n_parts", [1, 3])
def test_dbias_cast_transpose_current(monkeypatch, n_parts):
    """Current scaling's epilogue through the descriptor kernel, its scale made on the device
    from the amax pass: the FP8 bytes, scales and amax of the reference's quantize_fp8_current
    of the joined gradient, its dbias within bf16's tolerance."""
    from te_backend_cuda import ops
    torch.manual_seed(5)
    parts = [torch.randn(4096, 3072 // n_parts, device="cuda", dtype=torch.bfloat16) * (i + 1)
             for i in range(n_parts)]
    got = _tma_only(monkeypatch, lambda: ops.dbias_cast_transpose_current(parts, E5M2, force_pow2_scales=True))
    whole = torch.cat(parts, dim=1)
    ref = implementations()
    want = ref["quantize_fp8_current"](whole, E5M2, with_transpose=True, force_pow2_scales=True)
    _same_cast((got[0], got[1], got[2], got[5]), (want[0], want[1], ref["dbias"](whole), want[4]))
    assert torch.equal(got[3], want[2]) and torch.equal(got[4], want[3])


def test_activation_bwd_dbias_cast_transpose(monkeypatch):
    from te_triton import dbias

    from te_backend_cuda import configs, ops
    torch.manual_seed(4)
    dy = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn_like(dy)
    s = torch.tensor([64.0], device="cuda")
    got = _tma_only(monkeypatch, lambda: ops.activation_bwd_dbias_cast_transpose(dy, x, "gelu", s, E5M2))
    _same_cast(got, dbias.activation_bwd_dbias_cast_transpose(dy, x, "gelu", s, E5M2,
                                                          configs.for_tensor(x).dbias_cast_transpose))


def _captured(fn, monkeypatch):
    """fn captured as a CUDA graph (after a warm-up on a side stream), with the pointer kernels failing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _tma_only(monkeypatch, fn)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _tma_only(monkeypatch, fn)
    return graph, out


def test_descriptor_kernels_replay_in_cuda_graphs(monkeypatch):
    """The descriptors travel as kernel parameters, so a captured launch replays on whatever the
    captured tensors hold then: the replay equals an eager call on the new values, byte for byte."""
    from te_backend_cuda import ops
    torch.manual_seed(5)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    parts = [torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    s = torch.tensor([8.0], device="cuda")
    norm_graph, norm_out = _captured(lambda: ops.layernorm_fwd(x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3),
                                     monkeypatch)
    dbias_graph, dbias_out = _captured(lambda: ops.dbias_cast_transpose_parts(parts, s, E5M2), monkeypatch)
    x.copy_(torch.randn_like(x) * 2 - 1)
    for p in parts:
        p.copy_(torch.randn_like(p) * 3)
    norm_graph.replay()
    dbias_graph.replay()
    torch.cuda.synchronize()
    want = ops.layernorm_fwd(x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3)
    assert torch.equal(norm_out[0].view(torch.uint8), want[0].view(torch.uint8))
    for got, ref in zip(norm_out[1:], want[1:]):  # mean, rstd, amax
        assert torch.equal(got, ref)
    _same_cast(dbias_out, ops.dbias_cast_transpose_parts(parts, s, E5M2))
