"""FusedAdam's master weights of FP8 parameters (te.quantized_model_init's QuantizedTensors), of
every recipe and nominal dtype, and the constructor's checks of master_weight_dtype, as
Transformer Engine's."""
import copy

import pytest
import torch

import te_core as te
from te_core.optimizers import FusedAdam
from te_core.optimizers.fused_adam import FusedAdamConfigError
from te_core.quantization import QuantizedTensor
from te_core.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "block": Float8BlockScaling,
           "mxfp8": MXFP8BlockScaling}
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
FP32 = dict(rtol=1.3e-6, atol=1e-5)


def fp8_weight(recipe, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    with te.quantized_model_init(recipe=RECIPES[recipe]()):
        weight = te.Linear(64, 64, bias=False, params_dtype=dtype).weight
    assert isinstance(weight, QuantizedTensor) and weight.dtype == dtype
    return weight


def grads(steps, seed=1, shape=(64, 64)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def adamw64(p, gs, lr, betas, eps, weight_decay):
    """torch.optim.AdamW's update in float64, from float32 value `p`."""
    p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    for t, g in enumerate(gs, 1):
        g = g.double()
        p = p * (1 - lr * weight_decay)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p = p - lr / (1 - betas[0]**t) * m / ((v / (1 - betas[1]**t)).sqrt() + eps)
    return p


def step(opt, weight, gs):
    for g in gs:
        weight.grad = g.to(weight.dtype)
        opt.step()


def assert_quantized_close(weight, want):
    """`weight` is `want` up to the final cast into FP8 (E4M3: a 3-bit mantissa, so at most half
    a step of 2**-3 relative; values far below their block's largest land on subnormal steps)."""
    got = weight.dequantize(dtype=torch.float32).double()
    torch.testing.assert_close(got, want, rtol=2**-4, atol=want.abs().max().item() * 2**-9)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("capturable", [False, True])
def test_float32_fp8_parameters_step_through_a_float32_master(recipe, capturable):
    """A float32-nominal FP8 weight keeps a float32 master weight, which steps as float64 Adam
    does, and the weight is that master quantized: rounding each step into FP8 instead would
    lose most of these updates (lr 1e-3 against FP8 steps of about 2**-4 relative)."""
    weight = fp8_weight(recipe)
    start = weight.dequantize(dtype=torch.float32)
    opt = FusedAdam([weight], master_weights=True, capturable=capturable, **HYPER)
    gs = grads(20)
    step(opt, weight, gs)
    master = opt.state[weight]["master_param"]
    assert type(master) is torch.Tensor and master.dtype == torch.float32
    want = adamw64(start, gs, **HYPER)
    torch.testing.assert_close(master.double(), want, **FP32)
    assert_quantized_close(weight, want)
    assert isinstance(weight, QuantizedTensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_parameters_move_as_adam_does(dtype):
    """Transformer Engine's report: a constant gradient moves every weight by lr per step."""
    weight = fp8_weight("current", dtype)
    start = weight.dequantize().double()
    opt = FusedAdam([weight], lr=1e-3, master_weights=True)
    step(opt, weight, [torch.ones(64, 64)] * 20)
    assert "master_param" in opt.state[weight]
    assert abs((weight.dequantize().double() - start).mean().item() + 0.02) < 1e-3


def test_fp8_parameters_without_master_weights_keep_none():
    weight = fp8_weight("delayed")
    opt = FusedAdam([weight], master_weights=False, master_weight_dtype=torch.bfloat16, **HYPER)
    step(opt, weight, grads(2))
    assert set(opt.state[weight]) == {"exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "delayed"])
def test_self_scaled_fp8_parameters_need_master_weights(recipe):
    """As in Transformer Engine: without master weights only a delayed-scaling FP8 weight is
    updated in place; any other quantized weight is refused before anything changes (its
    updates, far below one FP8 step at its own scale, were mostly lost without an error)."""
    weight = fp8_weight(recipe)
    before = weight.dequantize().clone()
    opt = FusedAdam([weight], master_weights=False, **HYPER)
    with pytest.raises(RuntimeError, match="without master_weights does not support.*Use master_weights=True"):
        step(opt, weight, grads(1))
    assert torch.equal(weight.dequantize(), before) and not opt.state[weight]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_master_weights_round_trip_through_state_dict(recipe):
    """A checkpoint holds the float32 master, and an optimizer loading it (over a copy of the
    weight) steps on exactly as the one that saved it."""
    weight = fp8_weight(recipe)
    opt = FusedAdam([weight], master_weights=True, **HYPER)
    gs = grads(6)
    step(opt, weight, gs[:3])
    saved = copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["master_param"].dtype == torch.float32
    twin = copy.deepcopy(weight)
    loaded = FusedAdam([twin], master_weights=True, **HYPER)
    loaded.load_state_dict(saved)
    assert loaded.state[twin]["master_param"].dtype == torch.float32
    torch.testing.assert_close(loaded.state[twin]["master_param"], opt.state[weight]["master_param"], rtol=0, atol=0)
    step(opt, weight, gs[3:])
    step(loaded, twin, gs[3:])
    torch.testing.assert_close(loaded.state[twin]["master_param"], opt.state[weight]["master_param"], rtol=0, atol=0)
    torch.testing.assert_close(twin.dequantize(), weight.dequantize(), rtol=0, atol=0)


def test_a_checkpoint_without_master_weights_resumes_with_them():
    """One saved without master weights (master_weights=False, or by a te-core whose float32 FP8
    parameters had none) gets the parameter's value as the master at the next step."""
    weight = fp8_weight("delayed")  # (the one quantized kind stepped without master weights)
    plain = FusedAdam([weight], **HYPER)
    step(plain, weight, grads(2))
    opt = FusedAdam([weight], master_weights=True, **HYPER)
    opt.load_state_dict(plain.state_dict())
    start = weight.dequantize(dtype=torch.float32)
    step(opt, weight, grads(1, seed=2))
    master = opt.state[weight]["master_param"]
    assert master.dtype == torch.float32 and not torch.equal(master, start)
    assert_quantized_close(weight, master.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_param_remainders_keep_float32_masters_where_no_bf16_bits(dtype):
    """Remainders complete a bf16 parameter's own bits: an FP8 one (its bits are no bf16) and an
    fp16 one keep a full float32 master, and a checkpoint reloads it in float32."""
    if dtype == torch.bfloat16:
        param = fp8_weight("current", dtype)
    else:
        param = torch.randn(64, 64, dtype=dtype, requires_grad=True)
    start = param.detach().float() if dtype == torch.float16 else param.dequantize(dtype=torch.float32)
    opt = FusedAdam([param], master_weights=True, store_param_remainders=True, **HYPER)
    gs = grads(5)
    step(opt, param, gs)
    assert opt.state[param]["master_param"].dtype == torch.float32
    torch.testing.assert_close(opt.state[param]["master_param"].double(), adamw64(start, gs, **HYPER), **FP32)
    loaded = FusedAdam([param], master_weights=True, store_param_remainders=True, **HYPER)
    loaded.load_state_dict(opt.state_dict())
    assert loaded.state[param]["master_param"].dtype == torch.float32
    torch.testing.assert_close(loaded.state[param]["master_param"], opt.state[param]["master_param"], rtol=0, atol=0)


def test_master_weight_dtype_is_ignored_without_master_weights():
    params = [torch.randn(4, 4, requires_grad=True)]
    for dtype in (torch.bfloat16, torch.uint8, torch.float64):
        opt = FusedAdam(params, master_weights=False, master_weight_dtype=dtype)
        assert opt.master_weight_dtype == dtype
        assert opt.name_to_dtype_map["master_param"] == torch.float32


def test_bad_state_dtypes_raise_an_error_transformer_engine_code_catches():
    """ValueError, and the RuntimeError Transformer Engine raises; FP8 (torch.uint8) is offered
    for the moments only."""
    params = [torch.randn(4, 4, requires_grad=True)]
    with pytest.raises(FusedAdamConfigError, match=r"master_weight_dtype must be one of torch.float32, "
                                                   r"torch.float16, as in Transformer Engine") as caught:
        FusedAdam(params, master_weights=True, master_weight_dtype=torch.uint8)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RuntimeError)
    assert "uint8: FP8" not in str(caught.value)
    with pytest.raises(RuntimeError, match=r"exp_avg_dtype must be one of .* \(torch.uint8: FP8\)"):
        FusedAdam(params, exp_avg_dtype=torch.float64)
    for kwargs in (dict(exp_avg_dtype=torch.bfloat16), dict(master_weights=True, master_weight_dtype=torch.float16),
                   dict(master_weights=True, store_param_remainders=True)):
        with pytest.raises(RuntimeError, match="capturable=True"):
            FusedAdam([torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)], capturable=True, **kwargs)
