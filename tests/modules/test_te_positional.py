"""Constructor arguments passed by position land where Transformer Engine's signatures put them
(e.g. te.Linear's third is sequence_parallel and its tenth bias, as in TE): code written for TE
that passes them positionally builds the same module, and the signature shown reads TE's order."""
import inspect

import pytest
import torch

import te_core as te


def test_linear_positional_third_argument_is_sequence_parallel_not_bias():
    layer = te.Linear(16, 8, False)  # TE: sequence_parallel=False; the bias stays (its default)
    assert layer.bias is not None and layer.bias.shape == (8,)
    fused = te.Linear(16, 8, False, True)  # TE's fourth: fuse_wgrad_accumulation
    assert fused.fuse_wgrad_accumulation and fused.bias is not None
    no_bias = te.Linear(16, 8, False, False, None, 1, None, None, None, False)  # TE's tenth: bias
    assert no_bias.bias is None
    assert list(inspect.signature(te.Linear).parameters)[:4] == [
        "in_features", "out_features", "sequence_parallel", "fuse_wgrad_accumulation"]


def test_grouped_linear_positional_order_is_transformer_engines():
    layer = te.GroupedLinear(2, 16, 8, False, True)  # sequence_parallel, fuse_wgrad_accumulation
    assert layer.fuse_wgrad_accumulation and layer.bias0 is not None
    init = torch.nn.init.ones_
    ones = te.GroupedLinear(2, 16, 8, False, False, None, 1, None, None, init, False)  # init_method, bias
    assert ones.bias0 is None and torch.equal(ones.weight1, torch.ones_like(ones.weight1))


def test_norm_modules_positional_order_is_transformer_engines():
    ln = te.LayerNormLinear(16, 8, 1e-3, False, False, None, 1, None, None, True, "RMSNorm")
    assert ln.normalization == "RMSNorm" and ln.eps == 1e-3
    mlp = te.LayerNormMLP(16, 32, 1e-5, False, False, None, None, 1, None, True, "LayerNorm", "clamped_swiglu",
                          {"limit": 5.0})  # activation, then activation_params
    assert mlp.activation == "clamped_swiglu" and mlp.fc1_weight.shape == (64, 16)
    norm = te.RMSNorm(16, 1e-4, None, None, True)  # zero_centered_gamma
    assert norm.zero_centered_gamma and torch.equal(norm.weight, torch.zeros(16))


def test_attention_modules_positional_order_is_transformer_engines():
    dpa = te.DotProductAttention(2, 8, None, 0.0, "bshd", "no_mask")
    assert dpa.qkv_format == "bshd" and dpa.attn_mask_type == "no_mask"
    mha = te.MultiheadAttention(16, 2, None, 0.0, 1e-5, None, None, None, "padding")
    assert mha.core_attention.attn_mask_type == "padding"
    layer = te.TransformerLayer(16, 32, 2, None, 1e-5, 0.0, 0.0, None, None, None, None, "no_mask")
    assert layer.self_attn_mask_type == "no_mask"


def test_positional_mistakes_are_named():
    with pytest.raises(TypeError, match="multiple values for argument 'in_features'"):
        te.Linear(16, 8, in_features=4)
    with pytest.raises(TypeError, match=r"at most 25 positional arguments, in Transformer Engine's order"):
        te.Linear(16, 8, *([None] * 24))


def test_sizes_may_be_numpy_or_0d_torch_integers_as_in_transformer_engine():
    """TE hands sizes to torch.empty, which takes any integer: a config read through numpy works."""
    np = pytest.importorskip("numpy")
    layer = te.Linear(np.int64(16), np.int32(8))
    assert layer.weight.shape == (8, 16) and type(layer.in_features) is int
    assert te.LayerNormMLP(np.int64(16), torch.tensor(32)).fc1_weight.shape == (32, 16)
    assert te.RMSNorm(np.int64(12)).normalized_shape == (12,)
    for bad in (True, 0, 2.0, "8"):
        with pytest.raises(ValueError, match="in_features must be a positive integer"):
            te.Linear(bad, 8)


def test_forward_takes_transformer_engines_positional_fp8_flags():
    """TE's forward(inp, is_first_microbatch, fp8_output, fp8_grad): their defaults pass
    positionally; True (FP8 tensors between modules) is refused by name."""
    x = torch.randn(4, 16).to(torch.get_default_device())
    for module in (te.Linear(16, 8), te.LayerNormLinear(16, 8)):
        torch.testing.assert_close(module(x, None, False, False), module(x), rtol=0, atol=0)
        with pytest.raises(NotImplementedError, match="fp8_grad=True is not supported"):
            module(x, None, False, True)
