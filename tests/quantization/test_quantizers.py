"""Quantizers and quantized tensors: current, block and MXFP8 scaling; tensor behaviour."""
from __future__ import annotations

import pytest
import torch

from te_core import ops
from te_core.quantization import (
    Float8BlockwiseTensor,
    Float8Tensor,
    MXFP8Tensor,
    QuantizedTensor,
    Role,
    gemm_slots,
)
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling, QParams

from .conftest import randn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def bits(t):
    return t.view(torch.uint8)


def quantizer(recipe, slot="input"):
    return recipe.make_state(gemm_slots(), torch.device("cpu")).quantizer(slot)


@pytest.mark.parametrize("shape", [(48, 80), (3, 16, 80)])
def test_current_scaling_gradient_with_its_bias_gradient(gen, shape):
    """The output-gradient cast with the bias gradient: x's shape kept, the cast the plain
    column-wise cast's bit for bit, the bias gradient the float64 sum over every leading
    dimension (within float32 summation's bound)."""
    dy = randn(gen, *shape, scale=5.0)
    q = quantizer(Float8CurrentScaling(), "grad_output")
    got, dbias = q.quantize_with_dbias(dy, columnwise=True)
    want = q.quantize(dy, columnwise=True)
    assert got.shape == dy.shape and got._data.shape == dy.shape
    assert torch.equal(bits(got._data), bits(want._data)) and torch.equal(bits(got._transpose), bits(want._transpose))
    assert torch.equal(got._scale_inv, want._scale_inv)
    exact = dy.double().reshape(-1, shape[-1]).sum(0)
    rows = dy.numel() // shape[-1]
    assert ((dbias.double() - exact).abs() <= rows * 2.0 ** -24 * dy.double().abs().reshape(-1, shape[-1]).sum(0)).all()


def test_current_scaling_scale_from_this_tensors_amax(gen):
    x = randn(gen, 48, 80, scale=7.0)
    q = quantizer(Float8CurrentScaling()).quantize(x, columnwise=True)
    assert isinstance(q, Float8Tensor)
    scale = torch.tensor([448.0]) / x.abs().max()
    torch.testing.assert_close(q._scale_inv, torch.reciprocal(scale), rtol=1.3e-6, atol=0)
    want, _ = ops.quantize_fp8(x, torch.reciprocal(q._scale_inv), E4M3)
    assert torch.equal(bits(q._data), bits(want))
    assert torch.equal(bits(q._transpose), bits(want.t().contiguous()))
    grad = quantizer(Float8CurrentScaling(), "grad_output").quantize(x)
    assert grad._data.dtype == E5M2  # HYBRID


def test_current_scaling_power_of_two_option(gen):
    recipe = Float8CurrentScaling(fp8_quant_fwd_inp=QParams(power_2_scale=True))
    x = randn(gen, 16, 32, scale=3.0)
    scale_inv = quantizer(recipe).quantize(x)._scale_inv
    assert torch.equal(torch.log2(scale_inv), torch.round(torch.log2(scale_inv)))
    assert 448.0 / 2 < 1 / scale_inv * x.abs().max() <= 448.0


@pytest.mark.parametrize("slot,block_2d", [("input", False), ("weight", True)])
def test_block_scaling_one_pow2_scale_per_block(gen, slot, block_2d):
    x = randn(gen, 200, 300)
    x[:128, :128] *= 50  # one block much larger than the rest
    q = quantizer(Float8BlockScaling(), slot).quantize(x, columnwise=True)
    assert isinstance(q, Float8BlockwiseTensor) and q._block_2d is block_2d
    expect_shape = (2, 3) if block_2d else (200, 3)
    assert tuple(q._scale_inv.shape) == expect_shape
    exponents = torch.log2(q._scale_inv)
    assert torch.equal(exponents, torch.round(exponents))  # power-of-2 scales (the recipe's default)
    assert q._scale_inv[0, 0] > q._scale_inv[-1, -1] * 8  # each block scaled by its own amax
    err = (q.dequantize() - x).abs() / x.abs().clamp_min(1e-3)
    assert err.median() < 0.0675
    col = q.columnwise()
    assert tuple(col.data.shape) == (300, 200)


def test_mxfp8_e8m0_scale_per_32_elements(gen):
    x = randn(gen, 64, 96, scale=5.0)
    q = quantizer(MXFP8BlockScaling()).quantize(x, columnwise=True)
    assert isinstance(q, MXFP8Tensor)
    assert q._scale_inv.dtype == torch.uint8 and tuple(q._scale_inv.shape) == (64, 3)
    amax = x.reshape(64, 3, 32).abs().amax(-1)
    exponent = q._scale_inv.float() - 127
    assert torch.all(amax / 2 ** exponent <= 448.0) and torch.all(amax / 2 ** (exponent - 1) > 448.0)
    torch.testing.assert_close(q.dequantize(), x, rtol=0.125, atol=0.0675 * 4)
    assert tuple(q.columnwise().scale_inv.shape) == (96, 2)


def test_mxfp8_shape_error_names_the_shape(gen):
    with pytest.raises(ValueError, match=r"multiples of 32.*\(16, 48\)"):
        quantizer(MXFP8BlockScaling()).quantize(randn(gen, 16, 48))


def test_float8_tensor_behaves_as_its_value(gen):
    x = randn(gen, 16, 32)
    q = quantizer(DelayedScaling()).quantize(x)
    value = q.dequantize()
    assert q.shape == x.shape and q.dtype == torch.float32
    assert torch.equal(q + 1, value + 1) and type(q + 1) is torch.Tensor
    assert torch.equal(torch.nn.functional.relu(q), value.relu())
    assert type(q.detach()) is Float8Tensor and q.detach()._data is q._data
    assert "Float8Tensor" in repr(q)
    torch.testing.assert_close(value, x, rtol=0.125, atol=0.0675)


def test_column_wise_copy_is_the_exact_transpose(gen):
    q = quantizer(DelayedScaling()).quantize(randn(gen, 24, 40))
    assert not q.has_columnwise
    col = q.columnwise()
    assert torch.equal(bits(col.data), bits(q._data.t().contiguous()))


def test_in_place_update_requantizes(gen):
    x = randn(gen, 16, 16)
    q = quantizer(Float8CurrentScaling()).quantize(x, columnwise=True)
    delta = randn(gen, 16, 16, scale=0.1)
    before = q.dequantize()
    q.add_(delta)
    assert isinstance(q, QuantizedTensor) and q.has_columnwise
    torch.testing.assert_close(q.dequantize(), before + delta, rtol=0.125, atol=0.0675)
    q.copy_(x * 2)
    torch.testing.assert_close(q.dequantize(), x * 2, rtol=0.125, atol=0.0675)


def test_fused_cast_output_is_wrapped(gen):
    """A norm/activation kernel with FP8 output + amax, wrapped by the delayed quantizer."""
    q = quantizer(DelayedScaling())
    args = q.fused_cast_args()
    x = randn(gen, 16, 32)
    y, amax = ops.activation_fwd(x, "gelu", **args)
    wrapped = q.wrap_fused(y, amax, nominal_dtype=torch.float32, columnwise=True)
    hp, _ = ops.activation_fwd(x, "gelu")
    torch.testing.assert_close(wrapped.dequantize(), hp, rtol=0.125, atol=0.0675)
    assert q.scaling_group.amax_history[0, 0] == amax
    assert quantizer(Float8CurrentScaling()).fused_cast_args() is None


def test_roles_and_slots():
    slots = gemm_slots("fc1_")
    assert [s.name for s in slots] == ["fc1_input", "fc1_weight", "fc1_grad_output"]
    assert [s.role.direction for s in slots] == ["forward", "forward", "backward"]
    assert Role.GRAD_OUTPUT.value == "grad_output"
    with pytest.raises(KeyError, match="no quantizer slot 'bogus'"):
        DelayedScaling().make_state(slots, torch.device("cpu")).quantizer("bogus")


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8BlockScaling(), MXFP8BlockScaling()],
                         ids=lambda r: type(r).__name__)
def test_columnwise_only_keeps_value_and_drops_rowwise(gen, recipe):
    x = randn(gen, 64, 96)
    q = quantizer(recipe).quantize(x, columnwise=True)
    col = q.columnwise_only()
    assert col._data is None and col.shape == q.shape
    if isinstance(col, Float8Tensor):
        assert torch.equal(col.dequantize(), q.dequantize())  # one scale: both layouts hold the same values
    else:  # blocks run along the other dimension: another (equally accurate) quantization of x
        torch.testing.assert_close(col.dequantize(), x, rtol=0.125, atol=0.0675)
    assert torch.equal(bits(col.columnwise().data), bits(q.columnwise().data))
    if isinstance(col, Float8Tensor):
        assert torch.equal(bits(col.rowwise().data), bits(q.rowwise().data))  # exact: same scale
    else:
        with pytest.raises(RuntimeError, match="keeps only its column-wise copy"):
            col.rowwise()


def test_fp8_primary_weights_survive_deepcopy_clone_and_device_moves():
    """deepcopy / clone / module.to(device) keep an FP8 primary weight FP8 (same value, own
    storage, the copy's own scaling state); a dtype change is a dequantizing conversion."""
    import copy

    from te_core.modules.linear import Linear
    from te_core.quantization import quantized_model_init
    from te_core.recipe import DelayedScaling

    torch.manual_seed(3)
    with quantized_model_init(recipe=DelayedScaling(amax_history_len=4)):
        layer = Linear(32, 16)
    weight = layer.weight
    twin = copy.deepcopy(layer)
    assert type(twin.weight) is type(weight)
    assert torch.equal(twin.weight.dequantize(), weight.dequantize())
    assert twin.weight._data.data_ptr() != weight._data.data_ptr()
    assert twin.weight.quantizer is twin._recipe_state.quantizer("weight")  # not the original's state
    assert twin.weight.quantizer is not weight.quantizer

    cloned = weight.clone()
    assert type(cloned) is type(weight) and torch.equal(cloned.dequantize(), weight.dequantize())
    assert cloned._data.data_ptr() != weight._data.data_ptr()

    as_bf16 = weight.to(torch.bfloat16)
    assert type(as_bf16) is torch.Tensor and as_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(as_bf16, weight.dequantize().to(torch.bfloat16), rtol=0, atol=0)

    fp8_data, scale_inv, value = weight._data.clone(), weight._scale_inv.clone(), weight.dequantize()
    layer.to(torch.bfloat16)  # the FP8 data and scale stay; only the nominal dtype changes
    assert type(layer.weight) is type(weight) and layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight._data.view(torch.uint8), fp8_data.view(torch.uint8))
    assert torch.equal(layer.weight._scale_inv, scale_inv)  # (it was made again from the bf16 values' amax)
    layer.float()
    assert torch.equal(layer.weight.dequantize(), value)  # the round trip keeps every value

    layer.to("meta")
    assert type(layer.weight) is type(weight) and layer.weight.device.type == "meta"
    assert layer.weight._data.device.type == "meta"
