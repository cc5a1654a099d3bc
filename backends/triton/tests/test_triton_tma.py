"""The TMA-descriptor kernels (Config.tma_stages: norm_tma, dbias) under the Triton interpreter:
against the reference, the fallbacks to the pointer kernels, and tma_ready's conditions.
Where a test needs to know which kernel ran, the other one is replaced by one that fails."""
import pytest
import torch
from triton.runtime.errors import OutOfResources
from triton_fp8_compare import assert_fp8_matches
from te_core.reference import activation as ref_act
from te_core.reference import norm as ref
from te_triton import Config, dbias, norm, norm_tma
from te_triton._common import TensorDescriptor, tma_ready

pytestmark = pytest.mark.skipif(TensorDescriptor is None, reason="this triton has no host-side tensor descriptors "
                                                                 "(triton.tools.tensor_descriptor, 3.4 and later)")
TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}
E4M3 = torch.float8_e4m3fn


class _Fails:
    """Stands in for a jitted kernel: launching it raises `exc`."""

    def __init__(self, exc):
        self.exc = exc

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise self.exc
        return launch


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    return (x, (torch.randn(n, generator=g) * 0.5).to(dtype), torch.randn(n, generator=g).to(dtype),
            torch.randn(shape, generator=g).to(dtype))


# 7 rows with 2 per step: a last step past the end; 48 wide: a 64-wide box with 16 padding columns
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("rows,shape", [(1, (7, 48)), (2, (7, 48)), (2, (2, 4, 64))])
@pytest.mark.parametrize("zc", [False, True])
def test_norm_forward_fp8(monkeypatch, rms, rows, shape, zc):
    monkeypatch.setattr(norm, "_norm_fwd_kernel", _Fails(AssertionError("the pointer kernel ran")))
    x, w, b, _ = _inputs(shape, torch.bfloat16, 1)
    x[..., 0], b[0] = -50.0, 100.0  # a padding row's output would be beta[0], above every real one
    scale = torch.tensor([20.0])
    cfg = Config(num_warps=2, max_programs=3, rows=rows, tma_stages=2)
    y, mean, rstd, amax = norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms, zero_centered_gamma=zc,
                                        fp8_scale=scale, fp8_dtype=E4M3, cfg=cfg)
    if rms:
        wy, wrstd, wamax = ref.rmsnorm_fwd(x, w, 1e-5, zero_centered_gamma=zc, fp8_scale=scale, fp8_dtype=E4M3)
        assert mean is None
    else:
        wy, wmean, wrstd, wamax = ref.layernorm_fwd(x, w, b, 1e-5, zero_centered_gamma=zc, fp8_scale=scale,
                                                    fp8_dtype=E4M3)
        torch.testing.assert_close(mean, wmean, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(rstd, wrstd, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(amax, wamax, rtol=1.3e-6, atol=1e-5)
    assert_fp8_matches(y, wy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("with_add", [False, True])
def test_norm_backward(monkeypatch, dtype, rms, with_add):
    monkeypatch.setattr(norm, "_norm_bwd_kernel", _Fails(AssertionError("the pointer kernel ran")))
    x, w, b, dy = _inputs((9, 40), dtype, 2)
    add = (torch.randn(x.shape, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    cfg = Config(num_warps=2, max_programs=4, tma_stages=2)
    if rms:
        _, rstd, _ = ref.rmsnorm_fwd(x, w, 1e-5, zero_centered_gamma=True)
        mean = None
        want = ref.rmsnorm_bwd_add(dy, x, rstd, w, add, zero_centered_gamma=True) if with_add else \
            ref.rmsnorm_bwd(dy, x, rstd, w, zero_centered_gamma=True)
    else:
        _, mean, rstd, _ = ref.layernorm_fwd(x, w, b, 1e-5, zero_centered_gamma=True)
        want = ref.layernorm_bwd_add(dy, x, mean, rstd, w, add, zero_centered_gamma=True) if with_add else \
            ref.layernorm_bwd(dy, x, mean, rstd, w, zero_centered_gamma=True)
    if with_add:
        got = norm.norm_bwd_add(dy, x, mean, rstd, w, add, rms=rms, zero_centered_gamma=True, cfg=cfg)
    else:
        got = norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, zero_centered_gamma=True, cfg=cfg)
    torch.testing.assert_close(got[0], want[0], **TOL[dtype])
    for g, wnt in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, wnt, **{**TOL[dtype], "atol": 1e-4})
    assert (got[2] is None) == rms


def test_norm_rows_descriptors_cannot_take_use_the_pointer_kernels(monkeypatch):
    """100 bf16 columns are 200 bytes, not a multiple of 16: no descriptor, and the result is
    still right because the pointer kernels run."""
    monkeypatch.setattr(norm_tma, "_fwd_kernel", _Fails(AssertionError("the descriptor kernel ran")))
    monkeypatch.setattr(norm_tma, "_bwd_kernel", _Fails(AssertionError("the descriptor kernel ran")))
    x, w, b, dy = _inputs((5, 100), torch.bfloat16, 4)
    cfg = Config(num_warps=2, max_programs=3, tma_stages=2)
    y, mean, rstd, amax = norm.norm_fwd(x, w, b, 1e-5, rms=False, fp8_scale=torch.tensor([8.0]), fp8_dtype=E4M3,
                                        cfg=cfg)
    wy, wmean, wrstd, wamax = ref.layernorm_fwd(x, w, b, 1e-5, fp8_scale=torch.tensor([8.0]), fp8_dtype=E4M3)
    assert_fp8_matches(y, wy)
    torch.testing.assert_close(amax, wamax, rtol=1.3e-6, atol=1e-5)
    dx = norm.norm_bwd(dy, x, mean, rstd, w, rms=False, cfg=cfg)[0]
    torch.testing.assert_close(dx, ref.layernorm_bwd(dy, x, wmean, wrstd, w)[0], **TOL[torch.bfloat16])


def test_norm_stages_beyond_shared_memory_fall_back(monkeypatch):
    """A config whose stages do not fit the GPU's shared memory (Triton raises OutOfResources
    before running anything) runs the pointer kernels instead of failing."""
    monkeypatch.setattr(norm_tma, "_fwd_kernel", _Fails(OutOfResources(300000, 232448, "shared memory")))
    monkeypatch.setattr(norm_tma, "_bwd_kernel", _Fails(OutOfResources(300000, 232448, "shared memory")))
    x, w, _, dy = _inputs((6, 64), torch.float32, 5)
    cfg = Config(num_warps=2, max_programs=3, tma_stages=8)
    y, _, rstd, amax = norm.norm_fwd(x, w, None, 1e-5, rms=True, fp8_scale=torch.tensor([8.0]), fp8_dtype=E4M3, cfg=cfg)
    wy, wrstd, wamax = ref.rmsnorm_fwd(x, w, 1e-5, fp8_scale=torch.tensor([8.0]), fp8_dtype=E4M3)
    assert_fp8_matches(y, wy)
    torch.testing.assert_close(amax, wamax, rtol=1.3e-6, atol=1e-5)
    dx, dw, _ = norm.norm_bwd(dy, x, None, rstd, w, rms=True, cfg=cfg)
    wdx, wdw = ref.rmsnorm_bwd(dy, x, wrstd, w)
    torch.testing.assert_close(dx, wdx, **TOL[torch.float32])
    torch.testing.assert_close(dw, wdw, rtol=1.3e-6, atol=1e-4)


DBIAS_TMA = Config(block_m=16, block_n=16, num_warps=2, max_programs=4, tma_stages=2)


def _dbias_checks(got, want_src, fp8_dtype=torch.float8_e5m2, scale=2.0, recomputed=False):
    """want_src: the gradient the kernel casts. recomputed: the kernel derived it itself (the
    activation backward, rounded to bf16), where an element may be one bf16 ulp off (fp32
    formula differences), which moves a column sum by that ulp however small the sum is."""
    data, data_t, db, amax = got
    wdata = (want_src.float() * scale).to(fp8_dtype)
    assert_fp8_matches(data, wdata)
    assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).t())
    atol = 2.0**-7 * want_src.float().abs().max().item() if recomputed else 1e-3
    torch.testing.assert_close(db.float(), want_src.double().sum(0).float(), rtol=1.6e-2, atol=atol)
    if recomputed:
        torch.testing.assert_close(amax, want_src.float().abs().max(), **TOL[torch.bfloat16])
    else:
        assert amax.item() == want_src.float().abs().max().item()


@pytest.mark.parametrize("shape", [(40, 48), (33, 40)])
def test_dbias_cast_transpose(monkeypatch, shape):
    """40 rows: a last row tile past the end; 40 columns: a last strip past the end."""
    monkeypatch.setattr(dbias, "_dbias_ct_kernel", _Fails(AssertionError("the pointer kernel ran")))
    g = torch.randn(shape, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    if shape[0] % 16:
        with pytest.raises(AssertionError, match="pointer kernel"):  # 33 FP8 bytes per row of data_t: no descriptor
            dbias.dbias_cast_transpose(g, torch.tensor([2.0]), torch.float8_e5m2, DBIAS_TMA)
        return
    _dbias_checks(dbias.dbias_cast_transpose(g, torch.tensor([2.0]), torch.float8_e5m2, DBIAS_TMA), g)


@pytest.mark.parametrize("kind", ["gelu", "silu", "relu"])
def test_activation_bwd_dbias_cast_transpose(monkeypatch, kind):
    monkeypatch.setattr(dbias, "_dbias_ct_kernel", _Fails(AssertionError("the pointer kernel ran")))
    gen = torch.Generator().manual_seed(7)
    dy, x = (torch.randn(48, 32, generator=gen).to(torch.bfloat16) for _ in range(2))
    got = dbias.activation_bwd_dbias_cast_transpose(dy, x, kind, torch.tensor([2.0]), torch.float8_e5m2, DBIAS_TMA)
    _dbias_checks(got, ref_act.activation_bwd(dy, x, kind), recomputed=True)


@pytest.mark.parametrize("widths", [(32, 16, 16), (16, 64)])
def test_dbias_cast_transpose_parts(monkeypatch, widths):
    """One launch per column block; (16, 64): the blocks get different row-group counts (4 and 1
    programs' worth with max_programs 4), so the partial sums start from zeros."""
    monkeypatch.setattr(dbias, "_dbias_ct_kernel", _Fails(AssertionError("the pointer kernel ran")))
    gen = torch.Generator().manual_seed(8)
    parts = [torch.randn(64, w, generator=gen).to(torch.bfloat16) for w in widths]
    amax_slot = torch.tensor([0.25])
    got = dbias.dbias_cast_transpose_parts(parts, torch.tensor([2.0]), torch.float8_e5m2, DBIAS_TMA,
                                           amax_out=amax_slot)
    _dbias_checks(got, torch.cat(parts, dim=1))
    assert got[3] is amax_slot


def test_dbias_tiles_narrower_than_16_bytes_use_the_pointer_kernel(monkeypatch):
    monkeypatch.setattr(dbias, "_dbias_ct_tma_kernel", _Fails(AssertionError("the descriptor kernel ran")))
    g = torch.randn(32, 32, generator=torch.Generator().manual_seed(9))
    cfg = Config(block_m=8, block_n=16, num_warps=2, max_programs=4, tma_stages=2)
    _dbias_checks(dbias.dbias_cast_transpose(g, torch.tensor([2.0]), torch.float8_e5m2, cfg), g)


def test_tma_ready_names_each_condition():
    base = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert tma_ready(base, base[:, :32].contiguous())
    assert not tma_ready(base[:, :32])  # rows 64 apart: not contiguous
    assert not tma_ready(base.view(-1)[1:4033].view(63, 64))  # base 2 bytes past a 16-byte boundary
    assert not tma_ready(torch.zeros(4, 12, dtype=torch.bfloat16))  # 24-byte rows
    assert not tma_ready(torch.zeros(2, 4, 64))  # 3-D
    assert not tma_ready(base.t())  # transposed: not contiguous
