"""Small fidelity points found by running Transformer Engine's own unit tests against te-core's
stand-in: ops.Quantize under DelayedScaling (scaling state of its own, advancing as a Linear's); a
recipe mismatch raises TE's RuntimeError; 0-d tensors in the block formats."""
from __future__ import annotations

import warnings

import pytest
import torch

import te_core as te
from te_core.modules import fusible_ops as ops
from te_core.recipe import DelayedScaling, Float8BlockScaling, Format, MXFP8BlockScaling

FP32 = dict(rtol=1.3e-6, atol=1e-5)
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _check(got, want, tols, what):
    torch.testing.assert_close(got.double(), want.double(), **tols, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- ops.Quantize under DelayedScaling

class _DelayedScale:
    """Transformer Engine's delayed scaling of one tensor, in float64: the step's amax goes into
    row 0 of the history; the update takes the history's max, sets scale = fp8_max / amax / 2^margin
    and rolls the history by one (row 0 zeroed)."""

    def __init__(self, length: int, fp8_max: float, margin: int):
        self.history = torch.zeros(length, dtype=torch.float64)
        self.scale, self.fp8_max, self.margin = 1.0, fp8_max, margin

    def cast(self, x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
        self.history[0] = x.abs().max().double()
        scale = torch.tensor(self.scale, dtype=torch.float32)
        q = (x.float() * scale).clamp(-self.fp8_max, self.fp8_max).to(fp8_dtype)
        return q.float() * scale.reciprocal()

    def update(self) -> None:
        self.scale = self.fp8_max / self.history.max().item() / 2 ** self.margin
        self.history = self.history.roll(-1)
        self.history[0] = 0


@pytest.mark.parametrize("backward", [True, False], ids=["fwd+bwd", "fwd-only"])
def test_quantize_delayed_scaling_advances_as_te(backward):
    """From a state made as Transformer Engine makes it (init_quantization_state: scale 1), each
    step casts the input (E4M3) and, with backward=True, the gradient (E5M2) with the scale of the
    step before; histories and scales after each step are float64's."""
    torch.manual_seed(11)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=3, margin=1)
    op = ops.Quantize(forward=True, backward=backward)
    te.init_quantization_state(op, recipe)
    fwd, bwd = _DelayedScale(3, E4M3_MAX, 1), _DelayedScale(3, E5M2_MAX, 1)
    for step in range(5):
        x = (torch.randn(16, 24) * (step + 1) * 0.7).requires_grad_()
        dy = torch.randn(16, 24) * 1e-3 * (5 - step)
        with te.autocast(recipe=recipe):
            y = op(x)
        _check(y, fwd.cast(x.detach(), torch.float8_e4m3fn), FP32, f"step {step}: y")
        fwd.update()
        y.backward(dy)
        if backward:
            _check(x.grad, bwd.cast(dy, torch.float8_e5m2), FP32, f"step {step}: dx")
            bwd.update()
        else:
            assert torch.equal(x.grad, dy)
        state = op.quantization_state()
        _check(state["forward"]["input"]["amax_history"], fwd.history, FP32, f"step {step}: input history")
        _check(state["forward"]["input"]["scale"], torch.tensor([fwd.scale]), FP32, f"step {step}: input scale")
        if backward:
            entry = state["backward"]["grad_output"]
            _check(entry["amax_history"], bwd.history, FP32, f"step {step}: grad history")
            _check(entry["scale"], torch.tensor([bwd.scale]), FP32, f"step {step}: grad scale")
        else:
            assert state["backward"] == {}
    assert not torch.equal(y, x)


def test_quantize_delayed_scaling_follows_a_linear_input():
    """Without init_quantization_state, as te.Linear's input slot: the first cast scales by the
    tensor's own amax (te-core's first_scale), later ones by the scale of the step before; histories
    and scales equal the Linear's, and the checkpointed state loads into a fresh operation."""
    torch.manual_seed(12)
    recipe = DelayedScaling(amax_history_len=4)
    op, linear = ops.Quantize(), te.Linear(32, 16, bias=False)
    scale = None
    for step in range(3):
        x = torch.randn(8, 32) * (3 - step)
        if scale is None:
            scale = E4M3_MAX / x.abs().max().float()
        with te.autocast(recipe=recipe):
            y = op(x)
            linear(x)
        _check(y, (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale.reciprocal(),
               FP32, f"step {step}: y")
        for key in ("scale", "amax_history"):
            _check(op.quantization_state()["forward"]["input"][key],
                   linear.quantization_state()["forward"]["input"][key], FP32, f"step {step}: {key}")
        scale = op.quantization_state()["forward"]["input"]["scale"][0].clone()
    loaded = ops.Quantize()
    loaded.load_state_dict(op.state_dict())
    for key in ("scale", "amax_history"):
        assert torch.equal(loaded.quantization_state()["forward"]["input"][key],
                           op.quantization_state()["forward"]["input"][key])


# ---------------------------------------------------------------- recipe mismatch: RuntimeError, as in TE

@pytest.mark.parametrize("built", [MXFP8BlockScaling, Float8BlockScaling], ids=["mxfp8", "block"])
def test_fp8_weight_under_another_recipe_raises_te_runtime_error(built):
    """TE's test_check_for_weight_tensor_and_recipe_correspondence: a weight made under a block
    recipe (quantized_model_init), run under DelayedScaling, raises a RuntimeError saying "Recipe
    mismatch for "; te-core's callers catch it as the ValueError it was, with its message."""
    from te_core.quantization.gemm import RecipeMismatchError

    with te.quantized_model_init(enabled=True, recipe=built()):
        linear = te.Linear(32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (the recipe-type change warning comes first)
        with te.autocast(enabled=True, recipe=DelayedScaling()), pytest.raises(RuntimeError) as excinfo:
            linear(torch.randn(32, 32))
    assert "Recipe mismatch for " in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError) and isinstance(excinfo.value, RecipeMismatchError)
    assert "kept only in FP8 (te.quantized_model_init) stays in the format of the recipe" in str(excinfo.value)


# ---------------------------------------------------------------- 0-d tensors in the block formats

def _block_cast_0d(x: torch.Tensor) -> torch.Tensor:
    """TE's 1x1 block cast of one value, in float64: a power-of-2 scale (force_pow_2_scales) from
    its own amax, E4M3 rounding, and back."""
    value = x.double()
    scale = 2.0 ** torch.floor(torch.log2(E4M3_MAX / value.abs()))
    return (value * scale).float().to(torch.float8_e4m3fn).double() / scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("columnwise", [True, False], ids=["both", "rowwise"])
@pytest.mark.parametrize("block_scaling_dim", [1, 2])
def test_block_quantizer_takes_a_0d_tensor(block_scaling_dim, columnwise, dtype):
    """TE's test_quantize_dequantize_dims with dims=[]: a 0-d tensor is one 1x1 block, cast by
    the quantizer itself and into make_empty([]) by update_quantized; both dequantize to float64's
    value, as a 0-d tensor of the input's dtype, from either copy."""
    from te_core.dtype import DType
    from te_core.quantization.te_quantizers import Float8BlockQuantizer

    torch.manual_seed(20 + block_scaling_dim)
    quantizer = Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=columnwise,
                                     block_scaling_dim=block_scaling_dim)
    rounded = False
    for _ in range(4):
        x = ((torch.rand(()) + 0.1) * torch.randn(()).sign() * 3).to(dtype)
        rounded |= bool(_block_cast_0d(x) != x.double())
        empty = quantizer.make_empty([], dtype=dtype, device="cpu")
        for cast in (quantizer(x), quantizer.update_quantized(x, empty)):
            got = cast.dequantize()
            assert got.shape == () and got.dtype == dtype and cast.shape == ()
            _check(got, _block_cast_0d(x), FP32, f"0-d {dtype}")
            if columnwise:
                _check(cast.columnwise_only().dequantize(), _block_cast_0d(x), FP32, "0-d column-wise")
    assert rounded  # (the cast changed some value: the comparison is not trivially met)


def test_mxfp8_quantizer_refuses_a_0d_tensor_as_te():
    """TE flattens a 0-d tensor to 1x1 and its MXFP8 quantizer refuses it, as any shape whose
    dimensions are not multiples of the 32-element block; te-core says the same."""
    from te_core.dtype import DType
    from te_core.quantization.te_quantizers import MXFP8Quantizer

    quantizer = MXFP8Quantizer(DType.kFloat8E4M3)
    with pytest.raises(ValueError, match=r"multiples of 32.*\(1, 1\)"):
        quantizer(torch.randn(()))
    with pytest.raises(ValueError, match=r"multiple of 32; got \(\)"):
        quantizer.make_empty([], device="cpu")
