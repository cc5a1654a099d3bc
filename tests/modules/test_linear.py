"""te_core Linear: high-precision numerics, each FP8 recipe end to end, options and bad input."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from te_core import backend
from te_core.modules.linear import Linear
from te_core.quantization import autocast
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

from ._compare import seeded

FP32 = dict(rtol=1.3e-6, atol=1e-5)
BF16 = dict(rtol=1.6e-2, atol=1e-5)
RECIPES = [DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()]

# FP8 GEMM outputs are compared by relative Frobenius error ||y - y64|| / ||y64|| (an SQNR bound),
# not elementwise: an output element is a sum of K products whose quantization errors partly cancel,
# and elements near zero have unbounded relative error although the GEMM is exact to the operands'
# precision. Each E4M3 operand carries a relative rounding error <= 2^-4 (3 mantissa bits), E5M2
# <= 2^-3, so the product's relative error is bounded by roughly their sum: we allow the E4M3
# tolerance 0.0675 for fprop (E4M3 x E4M3) and the E5M2 one, 0.125, for the gradient GEMMs (E5M2 dy).
FPROP_REL, GRAD_REL = 0.0675, 0.125


@pytest.fixture
def gen():
    return seeded(7)


def randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape,out_features,bias", [((16, 32), 48, True), ((3, 5, 17), 13, True), ((7, 9), 1, False)])
def test_high_precision_matches_torch(gen, shape, out_features, bias):
    layer = Linear(shape[-1], out_features, bias=bias)
    with torch.no_grad():
        if bias:
            layer.bias.copy_(randn(gen, out_features))
    x = randn(gen, *shape).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = layer.weight.detach().clone().requires_grad_()
    b_ref = layer.bias.detach().clone().requires_grad_() if bias else None
    y, y_ref = layer(x), F.linear(x_ref, w_ref, b_ref)
    torch.testing.assert_close(y, y_ref, **FP32)
    dy = randn(gen, *y.shape)
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, **FP32)
    torch.testing.assert_close(layer.weight.grad, w_ref.grad, **FP32)
    if bias:
        torch.testing.assert_close(layer.bias.grad, b_ref.grad, **FP32)


def test_high_precision_bf16(gen):
    layer = Linear(32, 16, params_dtype=torch.bfloat16)
    x = randn(gen, 4, 8, 32).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x.float(), layer.weight.float(), layer.bias.float()), **BF16)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_fp8_recipes_against_float64(gen, recipe):
    torch.manual_seed(0)
    layer = Linear(64, 96)
    with torch.no_grad():
        layer.bias.copy_(randn(gen, 96))
    x0 = randn(gen, 2, 16, 64, scale=2.0)
    with autocast(recipe=recipe):  # a first step gives delayed scaling its scales
        layer(x0).sum().backward()
    layer.zero_grad()
    x = randn(gen, 2, 16, 64, scale=2.0).requires_grad_()
    with autocast(recipe=recipe):
        y = layer(x)
    dy = randn(gen, 2, 16, 96, scale=0.5)
    y.backward(dy)
    x64, w64, b64, dy64 = x.detach().double(), layer.weight.detach().double(), layer.bias.detach().double(), dy.double()
    assert rel_err(y, x64 @ w64.T + b64) < FPROP_REL
    assert rel_err(x.grad, dy64 @ w64) < GRAD_REL
    assert rel_err(layer.weight.grad, dy64.reshape(-1, 96).T @ x64.reshape(-1, 64)) < GRAD_REL
    torch.testing.assert_close(layer.bias.grad, dy.sum((0, 1)), **FP32)  # dbias from the unquantized dy


@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["hp", "fp8"])
def test_fuse_wgrad_accumulation_into_main_grad(gen, recipe):
    layer = Linear(32, 16, fuse_wgrad_accumulation=True)
    start = randn(gen, 16, 32)
    layer.weight.main_grad = start.clone()
    x, dy = randn(gen, 16, 32), randn(gen, 16, 16)
    with autocast(enabled=recipe is not None, recipe=recipe):
        y = layer(x)
    y.backward(dy)
    assert layer.weight.grad is None
    want = start.double() + dy.double().T @ x.double()
    assert rel_err(layer.weight.main_grad - start, want - start.double()) < (GRAD_REL if recipe else 1e-6)
    del layer.weight.main_grad
    y = layer(x)
    with pytest.raises(RuntimeError, match=r"weight.main_grad is not set; assign a float32 buffer of shape \(16, 32\)"):
        y.backward(dy)


def test_return_bias(gen):
    layer = Linear(16, 8, return_bias=True)
    x = randn(gen, 4, 16)
    out, bias = layer(x)
    assert bias is layer.bias
    torch.testing.assert_close(out, x @ layer.weight.T, **FP32)


def test_init_method_and_defaults():
    layer = Linear(16, 8, init_method=torch.nn.init.ones_)
    assert torch.all(layer.weight == 1) and torch.all(layer.bias == 0)
    assert layer.weight.device == backend.get_backend().device and layer.weight.dtype == torch.float32


# tensor parallelism itself is tested in tests/distributed
@pytest.mark.parametrize("kwargs,name", [(dict(ub_overlap_ag=True), "ub_overlap_ag"),
                                         (dict(ub_overlap_rs=True), "ub_overlap_rs")])
def test_tensor_parallel_arguments_not_implemented(kwargs, name):
    with pytest.raises(NotImplementedError, match=f"Linear: {name}=.* is not supported"):
        Linear(16, 16, **kwargs)


def test_bad_constructor_arguments():
    with pytest.raises(TypeError, match="unexpected keyword argument.*bogus"):
        Linear(16, 16, bogus=1)
    with pytest.raises(ValueError, match="parallel_mode='diagonal'"):
        Linear(16, 16, parallel_mode="diagonal")
    with pytest.raises(ValueError, match="in_features must be a positive integer, got 0"):
        Linear(0, 16)
    with pytest.raises(TypeError, match="params_dtype=torch.int32 is not supported"):
        Linear(16, 16, params_dtype=torch.int32)


@pytest.mark.parametrize("arg", ["bias", "return_bias", "fuse_wgrad_accumulation", "sequence_parallel",
                                 "save_original_input"])
@pytest.mark.parametrize("value", ["no", None, 2, 1.0])
def test_flags_refuse_values_read_by_truthiness(arg, value):
    # bias="no" used to build a bias: a non-empty string is truthy
    with pytest.raises(TypeError, match=rf"Linear: {arg} must be True or False, got {re.escape(repr(value))}"):
        Linear(16, 16, **{arg: value})


@pytest.mark.parametrize("value, want", [(False, False), (True, True), (np.bool_(False), False),
                                         (np.bool_(True), True), (0, False), (1, True)])
def test_flags_take_bools_numpy_bools_and_0_or_1(value, want):
    layer = Linear(16, 16, bias=value, return_bias=value, fuse_wgrad_accumulation=value)
    assert (layer.bias is not None) is want and layer.use_bias is want
    assert layer.return_bias is want and layer.fuse_wgrad_accumulation is want  # stored as Python bools


@pytest.mark.parametrize("rec", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_tensorwise_fp8_takes_any_shape_as_if_padded_with_zeros(gen, rec):
    """Tensor-wise FP8 GEMMs of dims that are not multiples of 16 (M=30 tokens, K=40, N=24) run
    on zero-padded operands: the output and every gradient equal those of the layer padded by
    hand (zeros add nothing to the amaxes, so both cast to the same scales and bytes)."""
    m, k, n, pad_m, pad_k, pad_n = 30, 40, 24, 32, 48, 32
    odd = Linear(k, n)
    padded = Linear(pad_k, pad_n)
    with torch.no_grad():
        padded.weight.zero_()
        padded.weight[:n, :k] = odd.weight
        padded.bias.zero_()
        padded.bias[:n] = odd.bias
    x = randn(gen, m, k).requires_grad_()
    x_pad = torch.zeros(pad_m, pad_k)
    x_pad[:m, :k] = x.detach()
    x_pad.requires_grad_()
    dy = randn(gen, m, n)
    dy_pad = torch.zeros(pad_m, pad_n)
    dy_pad[:m, :n] = dy
    with autocast(recipe=rec):
        y = odd(x)
        y_pad = padded(x_pad)
    y.backward(dy)
    y_pad.backward(dy_pad)
    close = dict(rtol=1.3e-6, atol=1e-5)  # fp32: the same FP8 bytes, summed in another blocking
    torch.testing.assert_close(y, y_pad[:m, :n], **close)
    torch.testing.assert_close(x.grad, x_pad.grad[:m, :k], **close)
    torch.testing.assert_close(odd.weight.grad, padded.weight.grad[:n, :k], **close)
    torch.testing.assert_close(odd.bias.grad, padded.bias.grad[:n], **close)
    want = x.detach().double() @ odd.weight.detach().double().T + odd.bias.detach().double()
    assert ((y.detach().double() - want).norm() / want.norm()) < 0.0675  # and it is an FP8 result
    assert not torch.equal(y.double(), want)


def test_block_scaled_fp8_dims_not_multiples_name_the_shape(gen):
    """Block and MXFP8 scales cover blocks of aligned operands: no padding, a clear error."""
    block = Linear(32, 16)
    with autocast(recipe=Float8BlockScaling()):
        with pytest.raises(ValueError, match=r"multiple of 16; got M=10, N=16, K=32 \(M=10 not\)"):
            block(randn(gen, 10, 32))
    mx = Linear(48, 32)
    with autocast(recipe=MXFP8BlockScaling()):
        with pytest.raises(ValueError, match=r"multiple of 32; got M=32, N=32, K=48"):
            mx(randn(gen, 32, 48))
    assert block(randn(gen, 10, 32)).shape == (10, 16)  # fine in high precision


def test_bad_inputs_have_clear_errors(gen):
    layer = Linear(16, 16)
    with pytest.raises(TypeError, match="inp has dtype torch.int64; expected float32, bfloat16 or float16"):
        layer(torch.ones(4, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"inp has shape \(4, 15\); its last dimension must be in_features=16"):
        layer(randn(gen, 4, 15))
    with pytest.raises(ValueError, match=r"inp is on meta but the weight is on \w+"):
        layer(torch.empty(4, 16, device="meta"))
    with pytest.raises(TypeError, match="inp must be a torch.Tensor, got list"):
        layer([[1.0] * 16])


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=2), Float8CurrentScaling()],
                         ids=["delayed", "current"])
def test_nan_input_keeps_scale_and_stays_visible(gen, recipe):
    layer = Linear(32, 16)
    with autocast(recipe=recipe):
        layer(randn(gen, 16, 32))
    before = {k: v["scale"].clone() for k, v in layer.quantization_state()["forward"].items()}
    x = randn(gen, 16, 32)
    x[3, 5] = float("nan")
    with autocast(recipe=recipe):
        y = layer(x)
    assert torch.isnan(y[3]).all() and torch.isfinite(y[torch.arange(16) != 3]).all()
    for slot, scale in before.items():
        assert torch.equal(layer.quantization_state()["forward"][slot]["scale"], scale)


def test_torch_autocast_dtype_is_used(gen):
    layer = Linear(32, 16)
    x = randn(gen, 16, 32)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = layer(x)
        with autocast(recipe=Float8CurrentScaling()):
            y8 = layer(x)
    assert y.dtype == torch.bfloat16 and y8.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), F.linear(x, layer.weight, layer.bias), rtol=1.6e-2, atol=1e-2)


def test_inf_input_keeps_delayed_scale(gen):
    layer = Linear(32, 16)
    recipe = DelayedScaling(amax_history_len=1)
    with autocast(recipe=recipe):
        layer(randn(gen, 16, 32))
    before = layer.quantization_state()["forward"]["input"]["scale"].clone()
    x = randn(gen, 16, 32)
    x[0, 0] = float("inf")
    with autocast(recipe=recipe):
        y = layer(x)
    assert torch.equal(layer.quantization_state()["forward"]["input"]["scale"], before)
    assert torch.isfinite(y[1:]).all()  # inf saturates to the format's max in the cast (ops.cast contract)


def test_fp8_inference_without_grad_matches_the_training_forward(gen):
    """Under no_grad Linear skips its autograd Function: same output, amaxes still recorded."""
    import copy

    rcp = DelayedScaling(amax_history_len=4)
    trained = Linear(64, 48)
    with torch.no_grad():
        trained.bias.copy_(randn(gen, 48))
    with autocast(recipe=rcp):  # a first step gives the scales something to start from
        trained(randn(gen, 32, 64)).sum().backward()
    inferred = copy.deepcopy(trained)
    x = randn(gen, 2, 16, 64, scale=2.0)
    with autocast(recipe=rcp):
        y_train = trained(x.clone().requires_grad_())
    with torch.no_grad(), autocast(recipe=rcp):
        y_infer = inferred(x)
    assert y_infer.grad_fn is None and y_infer.shape == (2, 16, 48)
    torch.testing.assert_close(y_infer, y_train.detach(), rtol=0, atol=0)
    for slot, state in trained.quantization_state()["forward"].items():  # recorded and updated alike
        assert torch.equal(inferred.quantization_state()["forward"][slot]["amax_history"], state["amax_history"])
    y64 = F.linear(x.double(), trained.weight.detach().double(), trained.bias.detach().double())
    assert rel_err(y_infer, y64) < FPROP_REL


@pytest.mark.parametrize("k, n", [(40, 24), (48, 32)], ids=["k40-n24", "k48-n32"])
def test_padded_fp8_weight_gradients_accumulate_into_main_grad(gen, k, n):
    """fuse_wgrad_accumulation with 30 tokens, which the weight-gradient GEMM sums over: with
    K=40 and N=24 its result is padded too (computed aside, then added), with K=48 and N=32
    only the tokens are (added in place). main_grad gains what a plain layer's weight.grad
    holds, micro-batch after micro-batch."""
    fused, plain = Linear(k, n, fuse_wgrad_accumulation=True), Linear(k, n)
    with torch.no_grad():
        plain.weight.copy_(fused.weight)
        plain.bias.copy_(fused.bias)
    start = randn(gen, n, k)
    fused.weight.main_grad = start.clone()
    rec = Float8CurrentScaling()
    for _ in range(2):
        x, dy = randn(gen, 30, k), randn(gen, 30, n)
        with autocast(recipe=rec):
            fused(x).backward(dy)
            plain(x).backward(dy)
    assert fused.weight.grad is None
    torch.testing.assert_close(fused.weight.main_grad - start, plain.weight.grad, rtol=1.3e-6, atol=1e-5)
