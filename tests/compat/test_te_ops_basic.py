"""Transformer Engine's fusible operations beyond its tutorials' and Megatron-LM's subset
(transformer_engine.pytorch.ops): ops.Linear (BasicLinear + Bias as a FusedOperation, TE's parameter
and state-dict names), AddExtraInput, ConstantScale, Identity, Reshape, Dropout, Quantize,
L2Normalization, the remaining activations and SwiGLU variants, BasicOperation / FusedOperation subclasses, and the
refused fusion registration. Forward and every gradient against float64 on random inputs, inside
ops.Sequential with extra inputs where an operation takes them."""
from __future__ import annotations

import math

import pytest
import torch

import te_core as te
from te_core.distributed import MODEL_PARALLEL_RNG_TRACKER_NAME, RNGStatesTracker
from te_core.modules import fusible_ops as ops
from te_core.recipe import DelayedScaling, Float8CurrentScaling, Format

FP32 = dict(rtol=1.3e-6, atol=1e-5)
BF16 = dict(rtol=1.6e-2, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)
TOLS = {torch.float32: FP32, torch.bfloat16: BF16}
IN, OUT = 24, 16


def _leaves(*tensors):
    """float64 copies of `tensors` that require grad."""
    return [t.detach().double().requires_grad_() for t in tensors]


def _check(got, want, tols, what):
    torch.testing.assert_close(got.double(), want.double(), **tols, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------- ops.Linear

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_linear_matches_float64(dtype, bias):
    """Sequential(Linear) = x W^T + b: output, input, weight and bias gradients; `weight` and `bias`
    are the basic operations' Parameters, named as in TE."""
    torch.manual_seed(1)
    linear = ops.Linear(IN, OUT, bias=bias, dtype=dtype)
    with torch.no_grad():
        for p in linear.parameters():
            p.normal_()
    seq = ops.Sequential(linear)
    x = torch.randn(3, 5, IN, dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 5, OUT, dtype=dtype)
    y = seq(x)
    y.backward(dy)
    x64, w64, *b64 = _leaves(x, linear.weight, *([linear.bias] if bias else []))
    # (the bias is added to the GEMM's output rounded to dtype: te-core fuses no bias into the GEMM)
    want = (x64 @ w64.T).to(dtype).double() + (b64[0] if bias else 0)
    want.backward(dy.double())
    tols = TOLS[dtype]
    _check(y, want, tols, "y")
    _check(x.grad, x64.grad, tols, "dx")
    _check(linear.weight.grad, w64.grad, tols, "dw")
    if bias:
        _check(linear.bias.grad, b64[0].grad, tols, "db")
        assert linear.bias is linear.basic_ops[1].bias
    else:
        assert linear.bias is None and len(linear.basic_ops) == 1
    assert linear.weight is linear.basic_ops[0].weight and linear.is_fused_op
    assert [n for n, _ in seq.named_parameters()] == ["0.weight", "0.bias"][:1 + bias]


def test_linear_state_dict_is_te_and_loads_te_checkpoints():
    """The state dict holds the basic operations' keys only (TE's layout); a TE checkpoint of that
    layout loads strictly, weight and bias taking its values."""
    linear = ops.Linear(IN, OUT)
    assert list(ops.Sequential(linear).state_dict()) == [
        "0.basic_ops.0.weight", "0.basic_ops.0._extra_state", "0.basic_ops.1.bias", "0.basic_ops.1._extra_state"]
    w, b = torch.randn(OUT, IN), torch.randn(OUT)
    empty = torch.empty(0, dtype=torch.uint8)
    checkpoint = {"basic_ops.0.weight": w, "basic_ops.0._extra_state": empty, "basic_ops.1.bias": b,
                  "basic_ops.1._extra_state": empty}
    linear.load_state_dict(checkpoint, strict=True)
    assert torch.equal(linear.weight, w) and torch.equal(linear.bias, b)
    x = torch.randn(4, IN)
    _check(linear(x), x.double() @ w.double().T + b.double(), FP32, "y after loading")


def test_linear_assigned_and_meta_parameters_are_trained():
    """Built on meta and given Parameters (`op.weight = p`, as Megatron-LM does), the operation trains
    those; one left on meta is initialized at the first forward and registered again."""
    linear = ops.Linear(IN, OUT, device="meta")
    w, b = torch.nn.Parameter(torch.randn(OUT, IN)), torch.nn.Parameter(torch.randn(OUT))
    linear.weight, linear.bias = w, b
    assert linear.basic_ops[0].weight is w and linear.basic_ops[1].bias is b
    x = torch.randn(6, IN)
    linear(x).sum().backward()
    _check(w.grad, torch.ones(6, OUT).double().T @ x.double(), FP32, "dw")
    _check(b.grad, torch.full((OUT,), 6.0), FP32, "db")
    fresh = ops.Linear(IN, OUT, device="meta")
    fresh(x)
    assert not fresh.weight.is_meta and fresh.weight is fresh.basic_ops[0].weight
    with pytest.raises(ValueError, match="bias=False, so it has no bias"):
        ops.Linear(IN, OUT, bias=False).bias = torch.nn.Parameter(torch.randn(OUT))


def test_linear_to_empty_keeps_one_weight_and_bias():
    """Built on meta and moved with to_empty (which makes new tensors), `weight` and `bias` are still
    the basic operations' Parameters: initializing them through op.weight / op.bias reaches the GEMM."""
    linear = ops.Linear(IN, OUT, device="meta").to_empty(device="cpu")
    assert linear.weight is linear.basic_ops[0].weight and linear.bias is linear.basic_ops[1].bias
    assert len(list(linear.parameters())) == 2
    with torch.no_grad():
        linear.weight.normal_()
        linear.bias.normal_()
    x = torch.randn(6, IN)
    _check(linear(x), x.double() @ linear.weight.double().T + linear.bias.double(), FP32, "y")


def test_linear_fp8_under_autocast_matches_float64():
    """Under te.autocast the GEMMs run in FP8 (E4M3 forward, E5M2 backward): within E4M3's tolerance
    of float64, and equal to te.Linear(bias=False) given the same weight plus the bias."""
    torch.manual_seed(2)
    linear = ops.Linear(IN, OUT)
    reference = te.Linear(IN, OUT, bias=False, params_dtype=torch.float32)
    with torch.no_grad():
        linear.bias.normal_()
        reference.weight.copy_(linear.weight)
    x = torch.randn(8, IN, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    dy = torch.randn(8, OUT)
    recipe = DelayedScaling(fp8_format=Format.HYBRID)
    with te.autocast(recipe=recipe):
        y = ops.Sequential(linear)(x)
    y.backward(dy)
    with te.autocast(recipe=recipe):
        y_ref = reference(x_ref) + linear.bias.detach()
    y_ref.backward(dy)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)
    assert torch.equal(linear.weight.grad, reference.weight.grad)
    x64, w64, b64 = _leaves(x, linear.weight, linear.bias)
    want = x64 @ w64.T + b64
    want.backward(dy.double())
    _check(y, want, E4M3, "y")
    _check(linear.bias.grad, b64.grad, FP32, "db")
    assert not torch.equal(y.double(), want.detach())  # (FP8's rounding: not the float64 product)


def test_linear_rng_tracker_and_main_grad():
    """rng_state_tracker_function: the weight is drawn in the tracker's model-parallel region;
    accumulate_into_main_grad: the weight gradient is added into weight.main_grad."""
    tracker = RNGStatesTracker()
    tracker.add(MODEL_PARALLEL_RNG_TRACKER_NAME, 77)
    linear = ops.Linear(IN, OUT, rng_state_tracker_function=lambda: tracker, accumulate_into_main_grad=True)
    want = torch.nn.init.kaiming_uniform_(torch.empty(OUT, IN), a=math.sqrt(5),
                                          generator=torch.Generator().manual_seed(77))
    assert torch.equal(linear.weight, want)
    start = torch.randn(OUT, IN)
    linear.weight.main_grad, linear.weight.grad_added_to_main_grad = start.clone(), False
    x, dy = torch.randn(5, IN), torch.randn(5, OUT)
    linear(x).backward(dy)
    _check(linear.weight.main_grad - start, dy.double().T @ x.double(), FP32, "main_grad")


# ---------------------------------------------------------------- parameter-free basic operations

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scale_reshape_identity_add_extra_input_match_float64(dtype):
    """Sequential(ConstantScale, Reshape, Identity, AddExtraInput, Reshape)(x, residual): the
    output, and the gradients of x and of the residual (the extra input)."""
    seq = ops.Sequential(ops.ConstantScale(-1.75), ops.Reshape((3, -1)), ops.Identity(), ops.AddExtraInput(),
                         ops.Reshape([3, 4, 6]))
    x = torch.randn(3, 4, 6, dtype=dtype, requires_grad=True)
    residual = torch.randn(3, 24, dtype=dtype, requires_grad=True)
    dy = torch.randn(3, 4, 6, dtype=dtype)
    y = seq(x, residual)
    y.backward(dy)
    x64, r64 = _leaves(x, residual)
    # (each operation's output is rounded to dtype, as in TE: the scaled x before the addition)
    want = ((x64 * -1.75).to(dtype).double().reshape(3, 24) + r64).reshape(3, 4, 6)
    want.backward(dy.double())
    tols = TOLS[dtype]
    _check(y, want, tols, "y")
    _check(x.grad, x64.grad, tols, "dx")
    _check(residual.grad, r64.grad, tols, "d residual")


def test_add_extra_input_in_place_writes_the_extra_input():
    """in_place=True: the sum is written into the extra input, which is returned; both gradients
    are the output's."""
    x = torch.randn(4, 8, requires_grad=True)
    base = torch.randn(4, 8, requires_grad=True)
    extra = base * 1.0
    before = extra.detach().clone()
    y = ops.Sequential(ops.AddExtraInput(in_place=True), ops.ConstantScale(3.0))(x, extra)
    _check(extra, before + x.detach(), FP32, "extra input after")
    dy = torch.randn(4, 8)
    y.backward(dy)
    _check(x.grad, 3 * dy, FP32, "dx")
    _check(base.grad, 3 * dy, FP32, "d extra")


def test_add_extra_input_in_place_accepts_a_leaf_that_requires_grad():
    """As Transformer Engine: in_place=True writes the sum into a leaf extra input that requires grad
    (through a detached alias) instead of failing torch's in-place check; the leaf gets dy."""
    x = torch.randn(4, 8, requires_grad=True)
    extra = torch.randn(4, 8, requires_grad=True)
    expected = extra.detach().double() + x.detach().double()
    y = ops.AddExtraInput(in_place=True)(x, extra)
    _check(y, expected, FP32, "y")
    _check(extra.detach(), expected, FP32, "extra input after")
    dy = torch.randn(4, 8)
    y.backward(dy)
    _check(x.grad, dy, FP32, "dx")
    _check(extra.grad, dy, FP32, "d extra")


@pytest.mark.parametrize("op_cls", [ops.BasicLinear, ops.Linear], ids=["BasicLinear", "Linear"])
def test_linear_input_of_another_dtype_computes_in_the_weights(op_cls):
    """As Transformer Engine's linear operations (te.Linear refuses the mix): outside torch.autocast a
    bfloat16 input meets float32 weights in float32, the output float32, the input's gradient bfloat16."""
    torch.manual_seed(0)
    op = op_cls(IN, OUT, dtype=torch.float32)
    x = torch.randn(6, IN, dtype=torch.bfloat16, requires_grad=True)
    y = op(x)
    w64 = op.weight.detach().double()
    assert y.dtype == torch.float32
    _check(y, x.detach().double() @ w64.T + (op.bias.detach().double() if op_cls is ops.Linear else 0), FP32, "y")
    dy = torch.randn(6, OUT)
    y.backward(dy)
    assert x.grad.dtype == torch.bfloat16 and op.weight.grad.dtype == torch.float32
    _check(x.grad, dy.double() @ w64, BF16, "dx")
    _check(op.weight.grad, dy.double().T @ x.detach().double(), FP32, "dw")


def test_dropout_masks_and_scales_in_training_only():
    """Training: each entry 0 or x / (1 - p), about p of them 0, the gradient through the same mask;
    eval: the input itself."""
    torch.manual_seed(3)
    op = ops.Dropout(0.25)
    x = (torch.randn(64, 64) + 5.0).requires_grad_()  # (no zeros of its own)
    y = op(x)
    kept = y != 0
    _check(y[kept], x.detach()[kept] / 0.75, FP32, "kept entries")
    assert 0.2 < 1 - kept.float().mean().item() < 0.3
    dy = torch.randn(64, 64)
    y.backward(dy)
    _check(x.grad, dy * kept / 0.75, FP32, "dx")
    assert op.eval()(x) is x and ops.Dropout(0.0)(x) is x


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="ops.Reshape: shape must be an iterable of ints"):
        ops.Reshape((2, -1, -1))
    with pytest.raises(ValueError, match=r"ops.Reshape: an input of shape \(4, 6\) \(24 elements\) cannot take"):
        ops.Reshape((5, -1))(torch.randn(4, 6))
    with pytest.raises(TypeError, match="ops.ConstantScale: scale must be a real number"):
        ops.ConstantScale("2")
    with pytest.raises(ValueError, match=r"ops.Dropout: p must be in \[0, 1\]"):
        ops.Dropout(1.5)
    with pytest.raises(TypeError, match=r"ops.AddExtraInput: takes the input and 1 extra input"):
        ops.AddExtraInput()(torch.randn(2))
    with pytest.raises(ValueError, match="ops.L2Normalization: seq_length must be a positive int"):
        ops.L2Normalization(seq_length=0)


# ---------------------------------------------------------------- Quantize

def _fake_cast(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """x cast to FP8 scaled by its own amax (current scaling), and back, in float32."""
    scale = torch.finfo(fp8_dtype).max / x.abs().max().float()
    return (x.float() * scale).to(fp8_dtype).float() * (1 / scale)


def test_quantize_casts_forward_and_backward_under_autocast():
    """Float8CurrentScaling, HYBRID: the input's values cast to E4M3, the gradient's to E5M2 (with
    backward=True); outside te.autocast the identity."""
    op = ops.Quantize(forward=True, backward=True)
    x = torch.randn(16, 32, requires_grad=True)
    dy = torch.randn(16, 32)
    with te.autocast(recipe=Float8CurrentScaling(fp8_format=Format.HYBRID)):
        y = ops.Sequential(op)(x)
    y.backward(dy)
    _check(y, _fake_cast(x.detach(), torch.float8_e4m3fn), FP32, "y")
    _check(x.grad, _fake_cast(dy, torch.float8_e5m2), FP32, "dx")
    assert not torch.equal(y, x)
    assert ops.Quantize()(x) is x


def test_quantize_before_linear_is_the_linear_alone():
    """The next linear operation casts the quantized values again with the recipe's current scale,
    which gives back the same FP8 values: Quantize then Linear = Linear."""
    torch.manual_seed(4)
    linear = ops.Linear(IN, OUT)
    x = torch.randn(8, IN)
    with te.autocast(recipe=Float8CurrentScaling()):
        y = ops.Sequential(ops.Quantize(), linear)(x)
        want = linear(x)
    _check(y, want, FP32, "y")


# ---------------------------------------------------------------- L2Normalization, activations

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_l2_normalization_matches_float64(dtype):
    op = ops.L2Normalization(eps=1e-3, seq_length=5, micro_batch_size=2)
    x = torch.randn(5, 2, 3, 16, dtype=dtype, requires_grad=True)
    dy = torch.randn(5, 2, 3, 16, dtype=dtype)
    y = ops.Sequential(op)(x)
    y.backward(dy)
    (x64,) = _leaves(x)
    want = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) + 1e-3)
    want.backward(dy.double())
    _check(y, want, TOLS[dtype], "y")
    _check(x.grad, x64.grad, TOLS[dtype], "dx")
    assert list(op.state_dict()) == ["_extra_state"]


def _halves(x):
    a, b = x.chunk(2, -1)
    return a, b


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "GLU": lambda x: torch.sigmoid(_halves(x)[0]) * _halves(x)[1],
    "QGELU": _qgelu,
    "QGEGLU": lambda x: _qgelu(_halves(x)[0]) * _halves(x)[1],
    "SReLU": lambda x: torch.relu(x) ** 2,
    "SReGLU": lambda x: torch.relu(_halves(x)[0]) ** 2 * _halves(x)[1],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activations_match_float64(name, dtype):
    x = torch.randn(6, 5, 20, dtype=dtype, requires_grad=True)
    y = ops.Sequential(getattr(ops, name)())(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    (x64,) = _leaves(x)
    want = ACTIVATIONS[name](x64)
    want.backward(dy.double())
    _check(y, want, TOLS[dtype], "y")
    _check(x.grad, x64.grad, TOLS[dtype], "dx")
    with pytest.raises(TypeError, match=f"ops.{name}.*cache_quantized_input"):
        getattr(ops, name)(cache_quantized_input="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scaled_srelu_matches_float64(dtype):
    """ScaledSReLU scales each output row by probs, its extra input; x and probs get gradients."""
    x = torch.randn(7, 12, dtype=dtype, requires_grad=True)
    probs = torch.rand(7, requires_grad=True)
    dy = torch.randn(7, 12, dtype=dtype)
    y = ops.Sequential(ops.Identity(), ops.ScaledSReLU())(x, probs)
    y.backward(dy)
    x64, p64 = _leaves(x, probs)
    want = torch.relu(x64) ** 2 * p64.reshape(-1, 1)
    want.backward(dy.double())
    tols = TOLS[dtype]
    _check(y, want, tols, "y")
    _check(x.grad, x64.grad, tols, "dx")
    _check(probs.grad, p64.grad, tols, "dprobs")
    with pytest.raises(NotImplementedError, match="activation_recompute_in_mlp=True"):
        ops.ScaledSReLU(activation_recompute_in_mlp=True)


# ---------------------------------------------------------------- SwiGLU variants: clamped (GPT-OSS), SiTU (Kimi K3)

def _clamped_swiglu64(x, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
    """TE's formula: a' = min(a, limit), b' = clamp(b, -limit, limit); a clamp passes a gradient
    only where it is inactive, boundaries included (TE's `<=` and `>=`)."""
    a, b = _halves(x)
    a_c = torch.where(a <= limit, a, torch.full_like(a, limit))
    b_c = torch.where((b >= -limit) & (b <= limit), b, b.detach().clamp(-limit, limit))
    return a_c * torch.sigmoid(alpha * a_c) * (b_c + glu_linear_offset)


def _situglu64(x, beta1=4.0, beta2=25.0):
    a, b = _halves(x)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * (beta2 * torch.tanh(b / beta2))


def _deinterleave(x, block):
    """x's alternating blocks of `block` gate and `block` linear columns as [gates, linears]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // (2 * block), 2, block).transpose(-3, -2).reshape(x.shape)


def _glu_variants():
    """case: (operation, its keyword arguments, TE's formula of them in float64, whether probs scale each row)."""
    return {
        "ClampedSwiGLU-default": ("ClampedSwiGLU", {}, _clamped_swiglu64, False),
        "ClampedSwiGLU": ("ClampedSwiGLU", dict(limit=1.5, alpha=1.25, glu_linear_offset=0.5),
                          lambda x: _clamped_swiglu64(x, 1.5, 1.25, 0.5), False),
        "ScaledClampedQGeGLU": ("ScaledClampedQGeGLU", dict(limit=1.5, alpha=1.25, glu_linear_offset=-0.5),
                                lambda x: _clamped_swiglu64(x, 1.5, 1.25, -0.5), True),
        "SiTUGLU-default": ("SiTUGLU", {}, _situglu64, False),
        "SiTUGLU": ("SiTUGLU", dict(beta1=1.5, beta2=2.0), lambda x: _situglu64(x, 1.5, 2.0), False),
        "ScaledSiTUGLU": ("ScaledSiTUGLU", dict(beta1=1.5, beta2=2.0), lambda x: _situglu64(x, 1.5, 2.0), True),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("interleave", [None, 2], ids=["halves", "interleaved"])
@pytest.mark.parametrize("case", list(_glu_variants()))
def test_glu_variants_match_float64(case, interleave, dtype):
    """Output, input gradient and (Scaled*) probs gradient against TE's formula in float64; inputs
    of up to ~3 sigma, with the clamp boundaries +-1.5 themselves in both halves."""
    name, kwargs, formula, scaled = _glu_variants()[case]
    torch.manual_seed(7)
    x = (torch.randn(3, 5, 16) * 2).to(dtype)
    x[0, :, :4] = torch.tensor([1.5, -1.5, 1.5, -1.5])  # gate and linear columns in either layout
    x[1, :, 8:12] = torch.tensor([1.5, -1.5, 1.5, -1.5])
    x.requires_grad_()
    probs = torch.rand(3, 5, requires_grad=True)
    dy = torch.randn(3, 5, 8, dtype=dtype)
    op = getattr(ops, name)(**kwargs, glu_interleave_size=interleave)
    y = ops.Sequential(ops.Identity(), op)(x, *([probs] if scaled else []))
    y.backward(dy)
    x64, p64 = _leaves(x, probs)
    want = formula(_deinterleave(x64, interleave) if interleave else x64)
    if scaled:
        # TE casts probs to the input's dtype
        want = want * p64.to(dtype).double().unsqueeze(-1)
    want.backward(dy.double())
    tols = TOLS[dtype]
    assert y.dtype == dtype
    _check(y, want, tols, "y")
    _check(x.grad, x64.grad, tols, "dx")
    if scaled:
        _check(probs.grad, p64.grad, tols, "dprobs")


@pytest.mark.parametrize("name", ["ClampedSwiGLU", "SiTUGLU", "ScaledClampedQGeGLU", "ScaledSiTUGLU"])
def test_glu_variants_refuse_what_te_core_cannot_honour(name):
    if name.startswith("Scaled"):
        with pytest.raises(ValueError, match=f"ops.{name}: activation_recompute_in_mlp=True is not supported"):
            getattr(ops, name)(activation_recompute_in_mlp=True)
    else:
        with pytest.raises(TypeError, match=f"ops.{name}.*cache_quantized_input"):
            getattr(ops, name)(cache_quantized_input="yes")
    bad = dict(limit=0.0) if "Clamped" in name else dict(beta1=-1.0)
    with pytest.raises(ValueError, match=f"ops.{name}: {next(iter(bad))} must be a finite number > 0"):
        getattr(ops, name)(**bad)
    with pytest.raises(ValueError, match="positive multiple of 2 \\* glu_interleave_size = 8"):
        getattr(ops, name)(glu_interleave_size=4)(torch.randn(2, 12), *([torch.rand(2)] if "Scaled" in name else []))


# ---------------------------------------------------------------- base classes, fusion registration

class _Affine(ops.BasicOperation):
    """A basic operation written for Transformer Engine: op_forward / op_backward."""

    def __init__(self):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.randn(8))

    def op_forward(self, ctx, input_, prev_op_grad_output_quantizer=None, next_op_input_quantizer=None):
        ctx.save_for_backward(input_)
        return input_ * self.gain

    def op_backward(self, ctx, grad_output):
        (x,) = ctx.saved_tensors
        return grad_output * self.gain, ((grad_output * x).sum(0),)


def test_te_style_basic_and_fused_operations_run():
    """A BasicOperation defining op_forward / op_backward, and a FusedOperation of it with an
    AddExtraInput (its extra input passed through Sequential), against float64."""
    affine = _Affine()
    fused = ops.FusedOperation([affine, ops.AddExtraInput()])
    assert fused.num_extra_inputs == 1 and fused.is_fused_op and not affine.is_fused_op
    x = torch.randn(5, 8, requires_grad=True)
    extra = torch.randn(5, 8, requires_grad=True)
    dy = torch.randn(5, 8)
    y = ops.Sequential(fused, ops.ConstantScale(0.5))(x, extra)
    y.backward(dy)
    x64, g64, e64 = _leaves(x, affine.gain, extra)
    want = (x64 * g64 + e64) * 0.5
    want.backward(dy.double())
    _check(y, want, FP32, "y")
    for got, ref, what in ((x.grad, x64.grad, "dx"), (affine.gain.grad, g64.grad, "dgain"), (extra.grad, e64.grad,
                                                                                             "dextra")):
        _check(got, ref, FP32, what)
    assert list(fused.state_dict()) == ["basic_ops.0.gain", "basic_ops.0._extra_state", "basic_ops.1._extra_state"]
    with pytest.raises(ValueError, match="at least one basic operation"):
        ops.FusedOperation([])


@pytest.mark.parametrize("name", ["register_forward_fusion", "register_backward_fusion",
                                  "register_forward_backward_fusion"])
def test_fusion_registration_is_refused(name):
    with pytest.raises(NotImplementedError, match=f"ops.{name}: te-core fuses no operations"):
        getattr(ops, name)(lambda operations, **kwargs: operations)
