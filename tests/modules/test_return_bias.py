"""return_bias=True on Linear, LayerNormLinear, LayerNormMLP and GroupedLinear, as Transformer
Engine returns it: the bias left out of the output and returned next to it in the module's
compute dtype (so that adding it keeps the output's dtype; the gradient still reaches the
float32 parameter), and None in its place for a module without a bias."""
import pytest
import torch

import te_core.modules as tm

BUILD = {
    "Linear": lambda **kw: tm.Linear(32, 16, **kw),
    "LayerNormLinear": lambda **kw: tm.LayerNormLinear(32, 16, **kw),
    "LayerNormMLP": lambda **kw: tm.LayerNormMLP(32, 64, **kw),
}


@pytest.mark.parametrize("name", list(BUILD))
def test_returned_bias_is_in_the_compute_dtype_and_trains_the_float32_parameter(name):
    torch.manual_seed(0)
    plain, split = BUILD[name](), BUILD[name](return_bias=True)
    split.load_state_dict(plain.state_dict())
    bias_name = "fc2_bias" if name == "LayerNormMLP" else "bias"
    with torch.no_grad():
        getattr(split, bias_name).normal_()
        getattr(plain, bias_name).zero_()  # the same GEMM with a zero bias: the output without it
    x = torch.randn(4, 8, 32, dtype=torch.bfloat16)  # float32 parameters, bf16 compute (torch.autocast's)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out, bias = split(x)
        plain_out = plain(x)
    assert out.dtype == bias.dtype == torch.bfloat16
    assert torch.equal(bias, getattr(split, bias_name).to(torch.bfloat16))
    torch.testing.assert_close(out, plain_out, rtol=1.6e-2, atol=1e-5)
    dy = torch.randn_like(out)
    (out + bias).backward(dy)
    grad = getattr(split, bias_name).grad
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, dy.float().sum(dim=(0, 1)), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("name", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("with_ln_out", [False, True])
def test_a_module_without_bias_returns_none_in_its_place(name, with_ln_out):
    torch.manual_seed(0)
    module = BUILD[name](bias=False, return_bias=True, return_layernorm_output=with_ln_out)
    x = torch.randn(3, 32)
    got = module(x)
    assert isinstance(got, tuple) and len(got) == 2 + with_ln_out and got[1] is None
    plain = BUILD[name](bias=False)
    plain.load_state_dict(module.state_dict())
    torch.testing.assert_close(got[0], plain(x), rtol=1.3e-6, atol=1e-5)
    if with_ln_out:
        assert got[2].shape == x.shape


def test_linear_without_bias_returns_none_in_its_place():
    out, bias = tm.Linear(32, 16, bias=False, return_bias=True)(torch.randn(3, 32))
    assert bias is None and out.shape == (3, 16)


def test_grouped_linear_returns_each_bias_in_the_compute_dtype():
    torch.manual_seed(0)
    module = tm.GroupedLinear(2, 32, 16, return_bias=True)
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out, biases = module(x, [2, 4])
    assert out.dtype == torch.bfloat16 and [b.dtype for b in biases] == [torch.bfloat16] * 2
    (out[:2] + biases[0]).sum().backward()
    assert module.bias0.grad.dtype == torch.float32
    torch.testing.assert_close(module.bias0.grad, torch.full((16,), 2.0), rtol=0, atol=0)
