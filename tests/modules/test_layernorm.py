import re

import numpy as np
import pytest
import torch

import te_core.modules as tm
from te_core import backend
from ._compare import randomize_, run_pair


def plain_rmsnorm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


class PlainRMSNorm(torch.nn.Module):
    def __init__(self, n, eps, zero_centered):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x):
        return plain_rmsnorm(x, self.weight + 1 if self.zero_centered else self.weight, self.eps)


class PlainLayerNorm(torch.nn.Module):
    def __init__(self, n, eps, zero_centered):
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.ones(n)), torch.nn.Parameter(torch.zeros(n))
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x):
        w = self.weight + 1 if self.zero_centered else self.weight
        return torch.nn.functional.layer_norm(x.float(), x.shape[-1:], w, self.bias, self.eps).to(x.dtype)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("shape", [(4, 16), (3, 5, 37)])
def test_norm_matches_plain_pytorch(kind, zero_centered, shape):
    torch.manual_seed(0)
    n = shape[-1]
    te_mod = getattr(tm, kind)(n, eps=1e-5, zero_centered_gamma=zero_centered)
    ref = (PlainLayerNorm if kind == "LayerNorm" else PlainRMSNorm)(n, 1e-5, zero_centered)
    randomize_(te_mod, seed=1)
    ref.load_state_dict(te_mod.state_dict())
    names = {"weight": "weight", "bias": "bias"} if kind == "LayerNorm" else {"weight": "weight"}
    run_pair(te_mod, ref, torch.randn(shape) * 3 + 0.5, names)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_of_a_transposed_input_equals_that_of_its_contiguous_copy(kind):
    """A strided input (here a transpose) gives bit for bit the output and gradients of its
    contiguous copy: the result does not depend on the input's memory layout."""
    torch.manual_seed(0)
    strided = (torch.randn(200, 96) * 3 + 0.5).t().requires_grad_()
    assert not strided.is_contiguous()
    dense = strided.detach().contiguous().requires_grad_()
    mods = [getattr(tm, kind)(200) for _ in range(2)]
    randomize_(mods[0], seed=3)
    mods[1].load_state_dict(mods[0].state_dict())
    dy = torch.randn(96, 200)
    outs = []
    for mod, x in zip(mods, (strided, dense)):
        y = mod(x)
        y.backward(dy)
        outs.append([y, x.grad, *(p.grad for p in mod.parameters())])
    for got, want in zip(*outs):
        assert torch.equal(got, want)


def test_layernorm_multi_dim_normalized_shape_matches_torch():
    torch.manual_seed(0)
    te_mod, ref = tm.LayerNorm((5, 7)), torch.nn.LayerNorm((5, 7))
    randomize_(te_mod, seed=2)
    ref.load_state_dict(te_mod.state_dict())
    run_pair(te_mod, ref, torch.randn(3, 5, 7), {"weight": "weight", "bias": "bias"})


def test_bf16_params_and_input():
    torch.manual_seed(0)
    te_mod = tm.RMSNorm(64, params_dtype=torch.bfloat16)
    ref = PlainRMSNorm(64, 1e-5, False).to(torch.bfloat16)
    randomize_(te_mod, seed=3)
    ref.load_state_dict(te_mod.state_dict())
    y = run_pair(te_mod, ref, torch.randn(6, 64).to(torch.bfloat16), {"weight": "weight"})
    assert y.dtype == torch.bfloat16 and te_mod.weight.dtype == torch.bfloat16


def test_torch_autocast_computes_in_autocast_dtype():
    torch.manual_seed(0)
    te_mod = tm.LayerNorm(32)
    x = torch.randn(4, 32)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = te_mod(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(
        y.float(), torch.nn.functional.layer_norm(x.bfloat16().float(), (32,)), rtol=1.6e-2, atol=1e-2
    )


def test_parameters_default_to_float32_on_backend_device():
    mod = tm.LayerNorm(8)
    assert mod.weight.dtype == torch.float32 and mod.weight.device == backend.get_backend().device
    assert [n for n, _ in tm.RMSNorm(8).named_parameters()] == ["weight"]


@pytest.mark.parametrize(
    "build, call, match",
    [
        (
            lambda: tm.LayerNorm(8),
            lambda m: m(torch.randn(4, 9)),
            r"inp has shape \(4, 9\).*trailing dimensions must be \(8,\)",
        ),
        (lambda: tm.RMSNorm(8), lambda m: m(torch.randint(0, 3, (4, 8))), r"inp has dtype torch.int64"),
        (lambda: tm.RMSNorm(8), lambda m: m(torch.randn(4, 8, device="meta")), r"inp is on meta but the weight is on \w+"),
        (lambda: tm.LayerNorm(0), None, r"normalized_shape must be a positive int"),
        (lambda: tm.LayerNorm(8, eps=-1.0), None, r"eps must be finite and >= 0"),
        (lambda: tm.LayerNorm(8, params_dtype=torch.int32), None, r"params_dtype=torch.int32 is not supported"),
    ],
)
def test_bad_input_messages(build, call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        mod = build()
        call(mod)


@pytest.mark.parametrize("cls", [tm.LayerNorm, tm.RMSNorm])
def test_flags_and_eps_refuse_what_they_cannot_mean(cls):
    name = cls.__name__
    with pytest.raises(TypeError, match=rf"{name}: zero_centered_gamma must be True or False, got 'no'"):
        cls(8, zero_centered_gamma="no")  # (truthy: it used to start gamma at 0)
    with pytest.raises(TypeError, match=rf"{name}: sequence_parallel must be True, False or None, got 2"):
        cls(8, sequence_parallel=2)
    for eps in (float("inf"), float("nan"), -1e-5):
        with pytest.raises(ValueError, match=rf"{name}: eps must be finite and >= 0, got {re.escape(repr(eps))}"):
            cls(8, eps=eps)
    for eps in ("1e-5", True, None):
        with pytest.raises(TypeError, match=rf"{name}: eps must be a finite number >= 0, got {re.escape(repr(eps))}"):
            cls(8, eps=eps)
    norm = cls(8, eps=np.float32(1e-6), zero_centered_gamma=np.bool_(True), sequence_parallel=0)
    assert type(norm.eps) is float and norm.zero_centered_gamma is True and norm.sequence_parallel is False


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("params_dtype,input_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_norm_computes_in_the_parameters_dtype_outside_torch_autocast(kind, params_dtype, input_dtype):
    """As Transformer Engine's te.LayerNorm / te.RMSNorm: the input is cast to the parameters'
    dtype, which the output keeps (fp32 parameters normalize a bf16 input in fp32)."""
    g = torch.Generator().manual_seed(5)
    norm = getattr(tm, kind)(48, dtype=params_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g, device="cpu") + 0.5)
    x = (torch.randn(6, 48, generator=g, device="cpu") * 3 + 1).to(input_dtype)
    y = norm(x.to(norm.weight.device))
    assert y.dtype == params_dtype
    x64, w64 = x.to(params_dtype).double(), norm.weight.detach().double().cpu()
    if kind == "LayerNorm":
        want = torch.nn.functional.layer_norm(x64, (48,), w64, torch.zeros(48, dtype=torch.float64, device="cpu"), 1e-5)
    else:
        want = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * w64
    tol = dict(rtol=1.3e-6, atol=1e-5) if params_dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(y.double().cpu(), want, **tol)


@pytest.mark.parametrize("cls", [tm.LayerNorm, tm.RMSNorm])
def test_transformer_engines_dtype_and_sm_margin_arguments(cls):
    assert cls(16, dtype=torch.bfloat16).weight.dtype == torch.bfloat16
    assert cls(16, sm_margin=0).weight.shape == (16,) and cls(16, sm_margin={"forward": 2, "backward": 0}).eps == 1e-5
    with pytest.raises(ValueError, match="give dtype or its older name params_dtype, not both"):
        cls(16, dtype=torch.bfloat16, params_dtype=torch.float32)
    with pytest.raises(TypeError, match="sm_margin must be an int >= 0"):
        cls(16, sm_margin=-1)


@pytest.mark.parametrize("cls", [tm.LayerNorm, tm.RMSNorm])
def test_eps_zero_is_taken_as_transformer_engine_takes_it(cls):
    """eps=0.0 (Transformer Engine and torch take it): the norm of float64 math without epsilon."""
    torch.manual_seed(0)
    norm = cls(8, eps=0.0)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 8)
    xd = x.double()
    if cls is tm.LayerNorm:
        want = (xd - xd.mean(-1, keepdim=True)) / xd.var(-1, unbiased=False, keepdim=True).sqrt()
    else:
        want = xd / xd.pow(2).mean(-1, keepdim=True).sqrt()
    want = want * norm.weight.double() + (norm.bias.double() if cls is tm.LayerNorm else 0)
    torch.testing.assert_close(norm(x).double(), want, rtol=1.3e-6, atol=1e-5)
