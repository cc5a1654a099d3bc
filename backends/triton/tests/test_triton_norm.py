"""te_triton.norm under the Triton interpreter against te_core.reference.norm."""
import pytest
import torch
from triton_fp8_compare import assert_fp8_matches
from te_core.reference import norm as ref
from te_triton import Config, norm

SMALL = Config(num_warps=4, max_programs=5)
TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def _inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype)
    w = (torch.randn(n, generator=g) * 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(13, 100), (2, 3, 64)])
@pytest.mark.parametrize("zc", [False, True])
def test_layernorm(dtype, shape, zc):
    x, w, b, dy = _inputs(shape, dtype, 1)
    y, mean, rstd, amax = norm.norm_fwd(x, w, b, 1e-5, rms=False, zero_centered_gamma=zc, cfg=SMALL)
    wy, wmean, wrstd, _ = ref.layernorm_fwd(x, w, b, 1e-5, zero_centered_gamma=zc)
    assert amax is None and y.dtype == dtype
    torch.testing.assert_close(y, wy, **TOL[dtype])
    torch.testing.assert_close(mean, wmean, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(rstd, wrstd, rtol=1.3e-6, atol=1e-5)
    dx, dw, db = norm.norm_bwd(dy, x, mean, rstd, w, rms=False, zero_centered_gamma=zc, cfg=SMALL)
    wdx, wdw, wdb = ref.layernorm_bwd(dy, x, wmean, wrstd, w, zero_centered_gamma=zc)
    torch.testing.assert_close(dx, wdx, **TOL[dtype])
    torch.testing.assert_close(dw, wdw, **{**TOL[dtype], "atol": 1e-4})
    torch.testing.assert_close(db, wdb, **{**TOL[dtype], "atol": 1e-4})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zc", [False, True])
def test_rmsnorm(dtype, zc):
    x, w, _, dy = _inputs((11, 70), dtype, 2)
    y, mean, rstd, _ = norm.norm_fwd(x, w, None, 1e-6, rms=True, zero_centered_gamma=zc, cfg=SMALL)
    wy, wrstd, _ = ref.rmsnorm_fwd(x, w, 1e-6, zero_centered_gamma=zc)
    assert mean is None
    torch.testing.assert_close(y, wy, **TOL[dtype])
    torch.testing.assert_close(rstd, wrstd, rtol=1.3e-6, atol=1e-5)
    dx, dw, db = norm.norm_bwd(dy, x, None, rstd, w, rms=True, zero_centered_gamma=zc, cfg=SMALL)
    wdx, wdw = ref.rmsnorm_bwd(dy, x, wrstd, w, zero_centered_gamma=zc)
    assert db is None
    torch.testing.assert_close(dx, wdx, **TOL[dtype])
    torch.testing.assert_close(dw, wdw, **{**TOL[dtype], "atol": 1e-4})


# (8, 64) / (12, 64) with 4 rows per step: full tiles, the kernel's unmasked path (EVEN)
# SMALL: one row per step; ROWS4: 4 rows per step over 9 rows (a padded step); WIDE: rows too
# wide for a per-element running amax (the per-row reduction path); RELOAD / RELOAD_WIDE: gamma
# and beta reloaded each step, amax kept per 8-element chunk (one chunk bigger than a tiny row)
ROWS4 = Config(num_warps=1, max_programs=2, rows=4)
WIDE = Config(num_warps=1, max_programs=2, rows=2)
RELOAD = Config(num_warps=1, max_programs=2, rows=4, hoist_params=False, amax_chunk=8)
RELOAD_WIDE = Config(num_warps=2, max_programs=3, rows=2, hoist_params=False, amax_chunk=8)
RELOAD_ONE = Config(num_warps=1, max_programs=2, rows=1, hoist_params=False, amax_chunk=8)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("cfg,shape", [(SMALL, (9, 48)), (ROWS4, (9, 48)), (WIDE, (5, 1500)), (RELOAD, (9, 48)),
                                       (RELOAD_WIDE, (7, 1500)), (ROWS4, (8, 64)), (RELOAD, (12, 64))])
def test_fp8_output(rms, fp8_dtype, cfg, shape):
    x, w, b, _ = _inputs(shape, torch.float32, 3)
    # column 0: every real row's output is below beta[0], a padding row's output would equal it
    x[:, 0], w[0], b[0] = -50.0, 1.0, 100.0
    scale = torch.tensor([20.0])
    y, mean, rstd, amax = norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms, fp8_scale=scale,
                                        fp8_dtype=fp8_dtype, cfg=cfg)
    if rms:
        wy, _, wamax = ref.rmsnorm_fwd(x, w, 1e-5, fp8_scale=scale, fp8_dtype=fp8_dtype)
    else:
        wy, _, _, wamax = ref.layernorm_fwd(x, w, b, 1e-5, fp8_scale=scale, fp8_dtype=fp8_dtype)
    torch.testing.assert_close(amax, wamax, rtol=1.3e-6, atol=1e-5)  # y differs in the last bits (reduction order)
    assert_fp8_matches(y, wy)
    if not rms:
        torch.testing.assert_close(mean, x.mean(dim=-1), rtol=1.3e-6, atol=1e-5)
    assert rstd.shape == shape[:-1]


@pytest.mark.parametrize("rms", [False, True])
def test_amax_chunk_wider_than_the_tile(rms):
    """A row of 3 (a 4-wide tile) with amax_chunk=8: the chunk shrinks to the tile. (Only the
    amax and statistics are compared: at this width the interpreter's float32 -> FP8 cast
    mis-rounds whole columns, see triton_fp8_compare.)"""
    x, w, b, _ = _inputs((6, 3), torch.float32, 5)
    scale = torch.tensor([4.0])
    y, mean, rstd, amax = norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms, fp8_scale=scale,
                                        fp8_dtype=torch.float8_e4m3fn, cfg=RELOAD_ONE)
    if rms:
        _, wrstd, wamax = ref.rmsnorm_fwd(x, w, 1e-5, fp8_scale=scale, fp8_dtype=torch.float8_e4m3fn)
    else:
        _, wmean, wrstd, wamax = ref.layernorm_fwd(x, w, b, 1e-5, fp8_scale=scale, fp8_dtype=torch.float8_e4m3fn)
        torch.testing.assert_close(mean, wmean, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(amax, wamax, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(rstd, wrstd, rtol=1.3e-6, atol=1e-5)


def test_bad_inputs_name_the_problem():
    x, w, b, _ = _inputs((4, 8), torch.float32, 4)
    with pytest.raises(ValueError, match="weight has 7 elements"):
        norm.norm_fwd(x, w[:7], b, 1e-5, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match="needs fp8_scale"):
        norm.norm_fwd(x, w, b, 1e-5, rms=False, fp8_dtype=torch.float8_e4m3fn, cfg=SMALL)
    with pytest.raises(ValueError, match="must be contiguous"):
        norm.norm_fwd(torch.randn(8, 4).t(), w, b, 1e-5, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match="dy must be contiguous"):
        norm.norm_bwd(torch.randn(4, 9), x, None, torch.ones(4), w, rms=True, cfg=SMALL)


def test_forward_parameters_and_fp8_arguments_are_checked():
    """Unchecked, LayerNorm without a bias would read weight as beta; a short bias would be read
    past its end; a strided weight as if contiguous (wrong values); a scale without fp8_dtype
    would be ignored; a 16-bit amax_out would take the kernel's 4-byte atomic."""
    x, w, b, _ = _inputs((4, 8), torch.float32, 4)
    with pytest.raises(ValueError, match=r"LayerNorm needs a bias \(rms=False\)"):
        norm.norm_fwd(x, w, None, 1e-5, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match="bias has 4 elements but x's last dimension is 8"):
        norm.norm_fwd(x, w, b[:4], 1e-5, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match="bias must be contiguous"):
        norm.norm_fwd(x, w, torch.randn(8, 2)[:, 0], 1e-5, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        norm.norm_fwd(x, torch.randn(8, 2)[:, 0], b, 1e-5, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match="bias is on meta but x is on cpu"):
        norm.norm_fwd(x, w, b.to("meta"), 1e-5, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        norm.norm_fwd(x, w.to("meta"), None, 1e-5, rms=True, cfg=SMALL)
    with pytest.raises(ValueError, match="fp8_scale and fp8_dtype go together"):
        norm.norm_fwd(x, w, None, 1e-5, rms=True, fp8_scale=torch.ones(1), cfg=SMALL)
    with pytest.raises(ValueError, match="fp8_scale is on meta but x is on cpu"):
        norm.norm_fwd(x, w, None, 1e-5, rms=True, fp8_scale=torch.ones(1, device="meta"),
                      fp8_dtype=torch.float8_e4m3fn, cfg=SMALL)
    with pytest.raises(ValueError, match="amax_out must be a 1-element float32 tensor, got torch.float16"):
        norm.norm_fwd(x, w, None, 1e-5, rms=True, fp8_scale=torch.ones(1), fp8_dtype=torch.float8_e4m3fn,
                      cfg=SMALL, amax_out=torch.zeros(1, dtype=torch.float16))
    with pytest.raises(TypeError, match="x must be float32, bfloat16, float16 or float64, got torch.int64"):
        norm.norm_fwd(torch.randint(0, 5, (4, 8)), w, None, 1e-5, rms=True, cfg=SMALL)


def test_backward_statistics_and_gradients_are_checked():
    """Unchecked, LayerNorm's backward without mean would read rstd in its place; a short rstd
    past its end, a strided one out of order; an `add` of another shape given to norm_bwd would
    be read past its end; norm_bwd_add without `add` would fail with an AttributeError."""
    x, w, b, dy = _inputs((4, 8), torch.float32, 4)
    _, mean, rstd, _ = norm.norm_fwd(x, w, b, 1e-5, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match=r"mean must be the forward's contiguous mean of shape \(4,\), got None"):
        norm.norm_bwd(dy, x, None, rstd, w, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match=r"rstd must be the forward's contiguous rstd of shape \(4,\), got shape \(2"):
        norm.norm_bwd(dy, x, None, rstd[:2], w, rms=True, cfg=SMALL)
    with pytest.raises(ValueError, match=r"contiguous rstd of shape \(4,\), got shape \(4,\), strided"):
        norm.norm_bwd(dy, x, mean, torch.ones(4, 2)[:, 0], w, rms=False, cfg=SMALL)
    with pytest.raises(ValueError, match="rstd is on meta but x is on cpu"):
        norm.norm_bwd(dy, x, None, rstd.to("meta"), w, rms=True, cfg=SMALL)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        norm.norm_bwd(dy, x, None, rstd, torch.randn(8, 2)[:, 0], rms=True, cfg=SMALL)
    with pytest.raises(ValueError, match="dy is on meta but x is on cpu"):
        norm.norm_bwd(dy.to("meta"), x, None, rstd, w, rms=True, cfg=SMALL)
    with pytest.raises(ValueError, match=r"add must be contiguous torch.float32 with x's shape \(4, 8\)"):
        norm.norm_bwd(dy, x, None, rstd, w, rms=True, cfg=SMALL, add=torch.zeros(2, 8))
    with pytest.raises(ValueError, match="add is on meta but x is on cpu"):
        norm.norm_bwd_add(dy, x, None, rstd, w, torch.zeros(4, 8, device="meta"), rms=True, cfg=SMALL)
    with pytest.raises(TypeError, match="add must be a tensor of x's shape"):
        norm.norm_bwd_add(dy, x, None, rstd, w, None, rms=True, cfg=SMALL)


@pytest.mark.parametrize("case", ["randn", "offset", "outlier_first", "outlier_last"])
@pytest.mark.parametrize("cfg", [SMALL, RELOAD_WIDE])
def test_layernorm_statistics_hard_rows(case, cfg):
    """LayerNorm's statistics against float64 on rows built to lose precision (the bar any
    faster way of taking them must clear too): a mean 3000 standard deviations from zero, and
    one element at the sqrt(N-1) sigma bound, first or last in the row. rstd within
    1e-6 relatively; the mean within 2e-5 standard deviations (what y = (x - mean) * rstd sees)
    plus its float32 rounding."""
    n = 1500  # a padded row: the last 8-element chunks are partly or wholly outside it
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, n, generator=g, dtype=torch.float64) * 3 + 1
    if case == "offset":
        x = x + 1e4
    elif case != "randn":
        x[:, 0 if case == "outlier_first" else -1] = 1e6
    x = x.float()
    x64 = x.double()
    want_mean, std = x64.mean(dim=1), x64.std(dim=1, unbiased=False)
    want_rstd = 1 / torch.sqrt(std**2 + 1e-5)
    w, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    y, mean, rstd, _ = norm.norm_fwd(x, w, b, 1e-5, rms=False, cfg=cfg)
    rel = ((rstd.double() - want_rstd) / want_rstd).abs().max().item()
    assert rel < 1e-6, f"rstd {rel:.2e} off relatively"
    # beyond 2e-5 sigma, a float32 mean is allowed its own rounding (2 ulps)
    off = ((mean.double() - want_mean).abs() - 2 * want_mean.abs() * 2.0**-23) / std
    assert off.max().item() < 2e-5, f"mean {off.max().item():.2e} standard deviations off"
    if case != "offset":  # there a float32 mean's rounding alone moves y by ~5e-4
        want_y = (x64 - want_mean[:, None]) * want_rstd[:, None] * w.double() + b.double()
        torch.testing.assert_close(y.double(), want_y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rms", [False, True])
def test_backward_of_no_rows_gives_zero_parameter_grads(rms):
    x, w, b, dy = _inputs((0, 40), torch.float32, 9)
    _, mean, rstd, _ = norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms, cfg=SMALL)
    dx, dw, db = norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=SMALL)
    assert dx.shape == (0, 40) and torch.equal(dw, torch.zeros(40))
    assert rms or torch.equal(db, torch.zeros(40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [False, True])
def test_backward_with_add(dtype, rms):
    """norm_bwd_add: dx + add summed in float32 before the one rounding, as the reference."""
    x, w, b, dy = _inputs((9, 72), dtype, 5)
    add = (torch.randn(x.shape, generator=torch.Generator().manual_seed(6)) * 3).to(dtype)
    if rms:
        _, rstd, _ = ref.rmsnorm_fwd(x, w, 1e-5)
        dx, dw, db = norm.norm_bwd_add(dy, x, None, rstd, w, add, rms=True, cfg=SMALL)
        want = (*ref.rmsnorm_bwd_add(dy, x, rstd, w, add), None)
    else:
        _, mean, rstd, _ = ref.layernorm_fwd(x, w, b, 1e-5)
        dx, dw, db = norm.norm_bwd_add(dy, x, mean, rstd, w, add, rms=False, cfg=SMALL)
        want = ref.layernorm_bwd_add(dy, x, mean, rstd, w, add)
    torch.testing.assert_close(dx, want[0], **TOL[dtype])
    assert not torch.equal(dx, norm.norm_bwd(dy, x, mean if not rms else None, rstd, w, rms=rms, cfg=SMALL)[0])
    torch.testing.assert_close(dw, want[1], **{**TOL[dtype], "atol": 1e-4})
    if not rms:
        torch.testing.assert_close(db, want[2], **{**TOL[dtype], "atol": 1e-4})
    with pytest.raises(ValueError, match="add must be contiguous"):
        norm.norm_bwd_add(dy, x, None, rstd, w, add[:, :-1], rms=True, cfg=SMALL)
