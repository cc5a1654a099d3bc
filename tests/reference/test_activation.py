"""Reference activations against float64 torch, derivatives against float64 autograd."""
import pytest
import torch
import torch.nn.functional as F

from te_core.reference import activation

TOLS = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

PLAIN = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "srelu": lambda x: F.relu(x) ** 2,
}
GATED = {"glu": "sigmoid", "swiglu": "silu", "geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu", "sreglu": "srelu"}


def act64(x, kind):
    if kind in GATED:
        a, b = x.chunk(2, dim=-1)
        return dict(PLAIN, sigmoid=torch.sigmoid)[GATED[kind]](a) * b
    return PLAIN[kind](x)


@pytest.mark.parametrize("kind", list(PLAIN) + list(GATED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward(kind, dtype):
    x = (torch.randn(3, 5, 74) * 3).to(dtype)
    out_cols = 37 if kind in GATED else 74
    dy = torch.randn(3, 5, out_cols).to(dtype)
    y, amax = activation.activation_fwd(x, kind)
    x64 = x.double().requires_grad_()
    y64 = act64(x64, kind)
    assert y.dtype == dtype and y.shape == (3, 5, out_cols) and amax is None
    torch.testing.assert_close(y.double(), y64.to(dtype).double(), **TOLS[dtype])
    y64.backward(dy.double())
    dx = activation.activation_bwd(dy, x, kind)
    assert dx.dtype == dtype and dx.shape == x.shape
    torch.testing.assert_close(dx.double(), x64.grad.to(dtype).double(), **TOLS[dtype])


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_fp8_output(kind):
    x = torch.randn(6, 64) * 30
    y_hp, _ = activation.activation_fwd(x, kind)
    y8, amax = activation.activation_fwd(x, kind, fp8_scale=torch.tensor([2.5]), fp8_dtype=E4M3)
    assert torch.equal(y8.view(torch.uint8), torch.clamp(y_hp * 2.5, -448, 448).to(E4M3).view(torch.uint8))
    assert amax.item() == y_hp.abs().max().item()


def test_dbias():
    dy = torch.randn(3, 5, 37, dtype=torch.bfloat16)
    db = activation.dbias(dy)
    assert db.dtype == torch.bfloat16 and db.shape == (37,)
    torch.testing.assert_close(db.double(), dy.double().sum((0, 1)).bfloat16().double(), rtol=1.6e-2, atol=1e-5)


def test_dbias_cast_transpose():
    dy = torch.randn(45, 70) * 10
    scale = torch.tensor([4.0])
    data, data_t, db, amax = activation.dbias_cast_transpose(dy, scale, E4M3)
    want = torch.clamp(dy * 4.0, -448, 448).to(E4M3)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(data_t.view(torch.uint8), want.t().contiguous().view(torch.uint8))
    torch.testing.assert_close(db.double(), dy.double().sum(0), rtol=1.3e-6, atol=1e-5)
    assert amax.item() == dy.abs().max().item()


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_activation_bwd_dbias_cast_transpose(kind):
    x = torch.randn(33, 80, dtype=torch.bfloat16)
    dy = torch.randn(33, 40 if kind == "swiglu" else 80, dtype=torch.bfloat16)
    scale = torch.tensor([16.0])
    data, data_t, db, amax = activation.activation_bwd_dbias_cast_transpose(dy, x, kind, scale, E4M3)
    x64 = x.double().requires_grad_()
    act64(x64, kind).backward(dy.double())
    dx = x64.grad
    assert data.shape == x.shape and data_t.shape == (80, 33) and db.dtype == torch.bfloat16
    torch.testing.assert_close(data.double() / 16.0, dx, rtol=0.125, atol=0.0675)
    assert torch.equal(data_t.view(torch.uint8), data.t().contiguous().view(torch.uint8))
    # dbias sums dx as activation_bwd returns it (in x's dtype), accumulating in float32
    torch.testing.assert_close(db.double(), dx.bfloat16().double().sum(0).bfloat16().double(), rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(amax.double(), dx.abs().max(), rtol=1.6e-2, atol=1e-5)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"kind='tanh' is not supported; allowed values: 'gelu', 'relu'"):
        activation.activation_fwd(torch.randn(4, 6), "tanh")
    with pytest.raises(ValueError, match=r"gated activation 'swiglu'.*must be even, got 7"):
        activation.activation_fwd(torch.randn(4, 7), "swiglu")
    with pytest.raises(ValueError, match=r"dy has shape \(4, 6\); activation 'geglu' of x \(4, 6\) needs \(4, 3\)"):
        activation.activation_bwd(torch.randn(4, 6), torch.randn(4, 6), "geglu")
    with pytest.raises(ValueError, match=r"dy must be 2-D"):
        activation.dbias_cast_transpose(torch.randn(2, 3, 4), torch.ones(1), E4M3)
    with pytest.raises(TypeError, match=r"x has dtype torch.int64"):
        activation.activation_fwd(torch.ones(3, dtype=torch.long), "relu")


def test_dbias_cast_transpose_parts_names_bad_parts():
    scale = torch.ones(1)
    with pytest.raises(TypeError, match=r"parts must be a non-empty list or tuple of 2-D tensors, got Tensor"):
        activation.dbias_cast_transpose_parts(torch.randn(4, 8), scale, E4M3)
    with pytest.raises(ValueError, match=r"parts\[1\] has 5 rows but parts\[0\] has 4"):
        activation.dbias_cast_transpose_parts([torch.randn(4, 8), torch.randn(5, 8)], scale, E4M3)
    with pytest.raises(ValueError, match=r"parts\[1\] is torch.float16 on cpu but parts\[0\] is torch.float32"):
        activation.dbias_cast_transpose_parts([torch.randn(4, 8), torch.randn(4, 8).half()], scale, E4M3)
    with pytest.raises(ValueError, match=r"parts\[0\] must be 2-D"):
        activation.dbias_cast_transpose_parts([torch.randn(2, 4, 8)], scale, E4M3)


def test_dbias_cast_transpose_current_names_bad_inputs():
    with pytest.raises(TypeError, match=r"parts must be a non-empty list or tuple of 2-D tensors, got Tensor"):
        activation.dbias_cast_transpose_current(torch.randn(4, 8), E4M3)
    with pytest.raises(ValueError, match=r"parts\[1\] has 5 rows but parts\[0\] has 4"):
        activation.dbias_cast_transpose_current([torch.randn(4, 8), torch.randn(5, 8)], E4M3)
    with pytest.raises((TypeError, ValueError), match=r"fp8_dtype"):
        activation.dbias_cast_transpose_current([torch.randn(4, 8)], torch.bfloat16)


def test_dbias_cast_transpose_current_equals_its_composition():
    """The parts' join cast by its own amax (quantize_fp8_current) and its column sums, on fresh
    random parts of very different magnitudes."""
    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(24, w, generator=g) * 10.0 ** i for i, w in enumerate((16, 8, 40))]
    got = activation.dbias_cast_transpose_current(parts, E5M2, force_pow2_scales=True, amax_epsilon=1e-3)
    whole = torch.cat(parts, dim=1).double()
    amax = whole.abs().max()
    scale = 2.0 ** torch.floor(torch.log2(torch.finfo(E5M2).max / amax))
    assert got[5].item() == amax.item() and got[3].item() == scale.item() and got[4].item() == 1 / scale.item()
    torch.testing.assert_close(got[0].double() / scale, whole, rtol=0.25, atol=0.125 / scale.item())
    assert torch.equal(got[1], got[0].t().contiguous())
    # float32 sums of 24 rows, in any order: within the recursive-summation bound 23 u sum|x|
    bound = 23 * 2.0 ** -24 * whole.abs().sum(0)
    assert ((got[2].double() - whole.sum(0)).abs() <= bound).all()


def clamped_swiglu64(x, limit, alpha):
    """GPT-OSS's clamped SwiGLU on TE's [gate | linear] halves, by torch autograd in float64."""
    a, b = x.chunk(2, dim=-1)
    a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
    return a * torch.sigmoid(alpha * a) * (b + 1)


@pytest.mark.parametrize("limit,alpha", [(7.0, 1.702), (2.5, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_forward_and_backward(limit, alpha, dtype):
    # std 4 puts many entries beyond both clamps, so the zero-gradient regions are exercised
    x = (torch.randn(4, 3, 90) * 4).to(dtype)
    dy = torch.randn(4, 3, 45).to(dtype)
    kw = dict(limit=limit, alpha=alpha)
    y, _ = activation.activation_fwd(x, "clamped_swiglu", **kw)
    x64 = x.double().requires_grad_()
    y64 = clamped_swiglu64(x64, limit, alpha)
    assert (x.double().abs() > limit).any()
    torch.testing.assert_close(y.double(), y64.to(dtype).double(), **TOLS[dtype])
    y64.backward(dy.double())
    dx = activation.activation_bwd(dy, x, "clamped_swiglu", **kw)
    torch.testing.assert_close(dx.double(), x64.grad.to(dtype).double(), **TOLS[dtype])
    data, _, db, _ = activation.activation_bwd_dbias_cast_transpose(
        dy.reshape(12, 45), x.reshape(12, 90), "clamped_swiglu", torch.tensor([1.0]), E4M3, **kw)
    # the fused epilogue's dbias is the column sum of the dx just checked
    torch.testing.assert_close(db.double(), dx.double().reshape(12, 90).sum(0).to(dtype).double(), **TOLS[dtype])


def test_clamped_swiglu_parameters_are_checked():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="limit > 0"):
        activation.activation_fwd(x, "clamped_swiglu", limit=0.0)
    with pytest.raises(ValueError, match="clamped_swiglu' only"):
        activation.activation_fwd(x, "swiglu", limit=3.0)
    with pytest.raises(ValueError, match="clamped_swiglu' only"):
        activation.activation_bwd(torch.randn(4, 8), x, "gelu", alpha=2.0)
