"""DelayedScaling(override_linear_precision=(False, False, True)), Transformer Engine's wgrad
override: each weight-gradient GEMM reads the layer input and the output gradient in high
precision, while the forward and dgrad GEMMs stay FP8.

Each module runs twice from the same parameters and inputs, under the plain recipe and under
the override: the output and the input gradient are the same FP8 results bit for bit, and each
weight gradient equals a float64 dy^T x of what that GEMM read (dy: the gradient the module's
backward received, or the one it computed inside; x: the high-precision input), which the
plain recipe's FP8 wgrad does not."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

import te_core.modules as tm
from te_core import backend
from te_core.quantization import autocast
from te_core.quantization.gemm import wgrad_operand
from te_core.recipe import DelayedScaling

from ._compare import TOL, randomize_, seeded
from .plain import gelu_tanh

WGRAD_HP = (False, False, True)
FP32 = TOL[torch.float32]


def _recipe(override=(False, False, False)):
    return DelayedScaling(amax_history_len=4, override_linear_precision=override)


def _run(module, x, dy, override, steps=2, compute_dtype=None, **forward):
    """`steps` training steps (the first calibrates the delayed scales); the last one's output,
    input gradient and parameter gradients, and the delayed-scaling scales it cast with. With
    `compute_dtype`, the forward runs under torch.autocast to it (the backward outside, as usual)."""
    for _ in range(steps):
        module.zero_grad()
        x_in = x.detach().clone().requires_grad_(True)
        torch_autocast = torch.autocast(x.device.type, dtype=compute_dtype, enabled=compute_dtype is not None)
        with torch_autocast, autocast(recipe=_recipe(override)):
            out = module(x_in, **forward)
            # forward scales update when the autocast exits, backward ones at the end of backward
            scales = {name: entry["scale"].clone() for entry_map in module.quantization_state().values()
                      for name, entry in entry_map.items()}
        (out[0] if isinstance(out, tuple) else out).backward(dy)
    grads = {name: p.grad for name, p in module.named_parameters()}
    return out, x_in.grad, grads, scales


def _pair(module, x, dy, **kwargs):
    """(plain run, override run) of two copies of `module`."""
    plain, override = module, copy.deepcopy(module)
    return _run(plain, x, dy, (False, False, False), **kwargs), _run(override, x, dy, WGRAD_HP, **kwargs)


def _same_fp8_path(plain, override):
    """The forward and dgrad GEMMs are the plain recipe's, bit for bit."""
    out_p, dx_p = plain[0], plain[1]
    out_o, dx_o = override[0], override[1]
    y_p = out_p[0] if isinstance(out_p, tuple) else out_p
    y_o = out_o[0] if isinstance(out_o, tuple) else out_o
    assert torch.equal(y_o, y_p), "the forward GEMM changed under the wgrad override"
    assert torch.equal(dx_o, dx_p), "the dgrad changed under the wgrad override"


def _assert_wgrad(got, expected64, tol, what):
    """Relative to the largest expected value: a GEMM's rounding error scales with the sum of the
    magnitudes of its terms, not with an element that happens to cancel to near zero."""
    scale = expected64.abs().max()
    torch.testing.assert_close(got.double() / scale, expected64 / scale, **tol, msg=lambda m: f"{what}: {m}")


def _check_wgrad(got, plain, expected64, tol, what):
    """The override's wgrad matches float64 dy^T x; the plain FP8 wgrad does not (so the check can fail)."""
    _assert_wgrad(got, expected64, tol, f"{what} under the override")
    with pytest.raises(AssertionError):
        _assert_wgrad(plain, expected64, tol, f"the plain FP8 {what}")


def _fp8(t, scale, dtype):
    """t as the FP8 GEMM reads it (float64): saturate(t * scale) in `dtype`, times 1/scale."""
    fmax = torch.finfo(dtype).max
    data = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return data.double() * (1.0 / scale).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(dtype):
    torch.manual_seed(0)
    module = tm.Linear(48, 32, params_dtype=dtype)
    randomize_(module, seed=1, std=0.3)
    x = torch.randn(4, 16, 48, generator=seeded(2)).to(dtype)
    dy = torch.randn(4, 16, 32, generator=seeded(3)).to(dtype)
    plain, override = _pair(module, x, dy)
    _same_fp8_path(plain, override)
    x64, dy64 = x.reshape(-1, 48).double(), dy.reshape(-1, 32).double()
    _check_wgrad(override[2]["weight"], plain[2]["weight"], dy64.t() @ x64, TOL[dtype], "dweight")


def test_linear_under_torch_autocast_reads_the_input_in_the_compute_dtype():
    """float32 input and weight, bf16 compute: the wgrad reads x cast to bf16, as the dgrad's dy is."""
    torch.manual_seed(0)
    module = tm.Linear(32, 48)
    randomize_(module, seed=4, std=0.3)
    x = torch.randn(64, 32, generator=seeded(5))
    dy = torch.randn(64, 48, generator=seeded(6)).bfloat16()
    plain, override = _pair(module, x, dy, compute_dtype=torch.bfloat16)
    _same_fp8_path(plain, override)
    expected = dy.double().t() @ x.bfloat16().double()
    _check_wgrad(override[2]["weight"], plain[2]["weight"], expected, FP32, "dweight")


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear(normalization):
    torch.manual_seed(0)
    module = tm.LayerNormLinear(64, 48, normalization=normalization)
    randomize_(module, seed=7, std=0.3)
    x = torch.randn(32, 64, generator=seeded(8))
    dy = torch.randn(32, 48, generator=seeded(9))
    plain, override = _pair(module, x, dy)
    _same_fp8_path(plain, override)
    w, b = module.layer_norm_weight.double(), module.layer_norm_bias
    x64 = x.double()
    if normalization == "LayerNorm":
        ln = F.layer_norm(x64, (64,), w, b.double(), module.eps)
    else:
        ln = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + module.eps) * w
    _check_wgrad(override[2]["weight"], plain[2]["weight"], dy.double().t() @ ln, FP32, "dweight")


def test_layernorm_linear_split_output_and_returned_norm():
    """The gradients of split outputs reach the wgrad as one dy; the returned norm output is what it read."""
    torch.manual_seed(0)
    module = tm.LayerNormLinear(32, 48, return_layernorm_output=True)
    randomize_(module, seed=10, std=0.3)
    x = torch.randn(48, 32, generator=seeded(11))
    dy = torch.randn(48, 48, generator=seeded(12))
    with autocast(recipe=_recipe(WGRAD_HP)):
        (q, kv), ln_out = module(x, split_sizes=[16, 32])
    torch.autograd.backward((q, kv), dy.split([16, 32], dim=-1))
    _assert_wgrad(module.weight.grad, dy.double().t() @ ln_out.detach().double(), FP32, "dweight")


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp(activation):
    """fc2's wgrad reads act(h) in high precision, fc1's the norm output and d(act)/dh of the FP8
    dgrad's output, both emulated here in float64 from the scales the module cast with."""
    torch.manual_seed(0)
    module = tm.LayerNormMLP(32, 64, activation=activation, return_layernorm_output=True)
    randomize_(module, seed=13, std=0.3)
    x = torch.randn(48, 32, generator=seeded(14))
    dy = torch.randn(48, 32, generator=seeded(15))
    plain, override = _pair(module, x, dy)
    _same_fp8_path(plain, override)
    (_, ln_out), scales = override[0], override[3]
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    ln_fp8 = _fp8(ln_out.detach(), scales["fc1_input"], e4m3)
    h = ln_fp8 @ _fp8(module.fc1_weight.detach(), scales["fc1_weight"], e4m3).t() + module.fc1_bias.double()
    h = h.detach().requires_grad_(True)
    if activation == "gelu":
        act = gelu_tanh(h)
    else:
        a, b = h.chunk(2, dim=-1)
        act = F.silu(a) * b
    d_act = _fp8(dy, scales["fc2_grad_output"], e5m2) @ _fp8(module.fc2_weight.detach(), scales["fc2_weight"], e4m3)
    (dh,) = torch.autograd.grad(act, h, d_act)
    grads_o, grads_p = override[2], plain[2]
    # An accelerator runs fc1's forward FP8 GEMM in the tensor cores' own accumulator (the
    # recipe's fast accumulation, as Transformer Engine), which the float64 emulation of h does
    # not round like. The wgrads then match it to bf16's relative tolerance and, since they are
    # compared relative to their largest element, to 1e-4 of that element: FP8's rounding
    # (2^-4 relative for E4M3) leaves the plain recipe's wgrad far outside that.
    tol = FP32 if backend.get_backend().name == "reference" else dict(rtol=TOL[torch.bfloat16]["rtol"], atol=1e-4)
    _check_wgrad(grads_o["fc2_weight"], grads_p["fc2_weight"], dy.double().t() @ act.detach(), tol, "dfc2_weight")
    _check_wgrad(grads_o["fc1_weight"], grads_p["fc1_weight"], dh.t() @ ln_out.detach().double(), tol,
                 "dfc1_weight")


def test_grouped_linear():
    """Each expert's wgrad reads its rows in high precision; the expert without tokens gets zero."""
    torch.manual_seed(0)
    module = tm.GroupedLinear(3, 32, 48)
    randomize_(module, seed=16, std=0.3)
    splits = [16, 0, 32]
    x = torch.randn(48, 32, generator=seeded(17))
    dy = torch.randn(48, 48, generator=seeded(18))
    plain, override = _pair(module, x, dy, m_splits=splits)
    _same_fp8_path(plain, override)
    x64, dy64 = x.double().split(splits), dy.double().split(splits)
    for i in (0, 2):
        _check_wgrad(override[2][f"weight{i}"], plain[2][f"weight{i}"], dy64[i].t() @ x64[i], FP32, f"dweight{i}")
    assert torch.equal(override[2]["weight1"], torch.zeros_like(module.weight1))


def test_recipe_change_carries_the_state_and_switches_the_wgrad():
    """A module's delayed-scaling state carries over between the plain and the override recipe
    (same class): the wgrad follows the recipe of each step."""
    torch.manual_seed(0)
    module = tm.Linear(32, 32)
    randomize_(module, seed=19, std=0.3)
    x = torch.randn(32, 32, generator=seeded(20))
    dy = torch.randn(32, 32, generator=seeded(21))
    expected = dy.double().t() @ x.double()
    _run(module, x, dy, (False, False, False), steps=1)
    fp8_wgrad = module.weight.grad
    _run(module, x, dy, WGRAD_HP, steps=1)
    hp_wgrad = module.weight.grad
    _check_wgrad(hp_wgrad, fp8_wgrad, expected, FP32, "dweight")
    _run(module, x, dy, (False, False, False), steps=1)
    _check_wgrad(hp_wgrad, module.weight.grad, expected, FP32, "dweight")


def test_delayed_and_fused_wgrad_read_high_precision():
    """delay_wgrad_compute keeps the high-precision operands for backward_dw; fuse_wgrad_accumulation
    adds the high-precision product into main_grad."""
    torch.manual_seed(0)
    delayed = tm.LayerNormLinear(32, 48, delay_wgrad_compute=True, normalization="RMSNorm")
    randomize_(delayed, seed=22, std=0.3)
    fused = tm.LayerNormLinear(32, 48, fuse_wgrad_accumulation=True, normalization="RMSNorm")
    fused.load_state_dict(delayed.state_dict())
    start = torch.randn(48, 32, generator=seeded(23))
    fused.weight.main_grad = start.clone()
    x = torch.randn(32, 32, generator=seeded(24))
    dy = torch.randn(32, 48, generator=seeded(25))
    x64 = x.double()
    ln = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * delayed.layer_norm_weight.double()
    expected = dy.double().t() @ ln
    with autocast(recipe=_recipe(WGRAD_HP)):
        y_delayed, y_fused = delayed(x), fused(x)
    y_delayed.backward(dy)
    y_fused.backward(dy)
    assert delayed.weight.grad is None
    delayed.backward_dw()
    _assert_wgrad(delayed.weight.grad, expected, FP32, "backward_dw's dweight")
    _assert_wgrad(fused.weight.main_grad - start, expected, FP32, "main_grad's increment")
    assert fused.weight.grad is None


def test_a_wgrad_operand_that_exists_only_in_fp8_is_a_clear_error():
    """Where the wgrad's high-precision input does not exist whole (sequence parallelism's FP8 or
    post-norm all-gather), the override says so instead of reading the wrong tensor."""
    module = tm.Linear(32, 32)
    with autocast(recipe=_recipe(WGRAD_HP)):
        step = module.quantization_step()
        x = torch.randn(32, 32)
        x_q = step.operand("input", x, columnwise=True)
        assert not x_q.has_columnwise  # nothing will read a column-wise copy
        assert wgrad_operand(x_q, x) is x
        with pytest.raises(NotImplementedError, match=r"override_linear_precision=\(False, False, True\).*sequence "
                                                      r"parallelism.*\(False, False, False\)"):
            wgrad_operand(x_q, x[:16])
        with pytest.raises(NotImplementedError, match="sequence parallelism"):
            wgrad_operand(x_q, x_q)


@pytest.mark.parametrize("override", [(True, False, False), (False, True, False), (True, True, True),
                                      (False, True, True)])
def test_other_overrides_are_rejected(override):
    message = re.escape(f"override_linear_precision={override!r} is not supported: only the wgrad override is")
    with pytest.raises(NotImplementedError, match=message + r".*\(False, False, True\)"):
        DelayedScaling(override_linear_precision=override)
