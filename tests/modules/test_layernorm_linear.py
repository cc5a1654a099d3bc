import pytest
import torch

import te_core.modules as tm

from ._compare import randomize_, run_pair
from .plain import PlainNormLinear, PlainNormMLP


def params_of(mod):
    return {n: n for n, _ in mod.named_parameters()}


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("shape, n_out, bias", [((4, 32), 48, True), ((3, 5, 24), 13, False)])
def test_layernorm_linear_matches_plain(normalization, shape, n_out, bias):
    torch.manual_seed(0)
    te_mod = tm.LayerNormLinear(shape[-1], n_out, normalization=normalization, bias=bias)
    ref = PlainNormLinear(shape[-1], n_out, normalization, bias=bias)
    randomize_(te_mod, seed=4)
    ref.load_state_dict(te_mod.state_dict(), strict=False)
    run_pair(te_mod, ref, torch.randn(shape), params_of(ref))


def test_layernorm_linear_returns_layernorm_output_with_its_gradient():
    torch.manual_seed(0)
    te_mod = tm.LayerNormLinear(16, 8, return_layernorm_output=True)
    ref = PlainNormLinear(16, 8, "LayerNorm")
    randomize_(te_mod, seed=5)
    ref.load_state_dict(te_mod.state_dict(), strict=False)

    def both(m, x):
        if isinstance(m, tm.LayerNormLinear):
            y, ln = m(x)
        else:
            y = m(x)
            ln = torch.nn.functional.layer_norm(x, (16,), m.layer_norm_weight, m.layer_norm_bias)
        return torch.cat([y, ln], dim=-1)

    run_pair(te_mod, ref, torch.randn(6, 16), params_of(ref), forward=both)


@pytest.mark.parametrize("activation", ["gelu", "relu", "silu", "qgelu", "srelu", "swiglu", "geglu", "reglu"])
def test_layernorm_mlp_matches_plain(activation):
    torch.manual_seed(0)
    normalization = "RMSNorm" if activation in ("silu", "swiglu") else "LayerNorm"
    te_mod = tm.LayerNormMLP(24, 40, activation=activation, normalization=normalization)
    ref = PlainNormMLP(24, 40, activation, normalization)
    randomize_(te_mod, seed=6, std=0.15)
    ref.load_state_dict(te_mod.state_dict(), strict=False)
    assert [n for n, _ in te_mod.named_parameters()] == [n for n, _ in ref.named_parameters()]
    run_pair(te_mod, ref, torch.randn(3, 7, 24), params_of(ref))


@pytest.mark.parametrize("activation, params", [
    ("glu", None), ("qgeglu", None), ("sreglu", None), ("clamped_swiglu", None),
    # a small limit makes both clamps active on part of fc1's output (zero gradient there)
    ("clamped_swiglu", {"limit": 0.3, "alpha": 1.2}), ("clamped_swiglu", {"limit": 0.5}),
    ("clamped_swiglu", {"glu_linear_offset": 0.25}), ("clamped_swiglu", {"limit": 0.4, "glu_linear_offset": -0.5}),
])
def test_layernorm_mlp_new_activations_match_float64(activation, params):
    torch.manual_seed(0)
    te_mod = tm.LayerNormMLP(24, 40, activation=activation, activation_params=params)
    ref = PlainNormMLP(24, 40, activation, "LayerNorm", activation_params=params)
    randomize_(te_mod, seed=6, std=0.15)
    ref.load_state_dict(te_mod.state_dict(), strict=False)
    ref.double()
    x = torch.randn(3, 7, 24)
    x_te, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    y_te, y64 = te_mod(x_te), ref(x64)
    dy = torch.randn(y64.shape)
    y_te.backward(dy)
    y64.backward(dy.double())
    tol = dict(rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(y_te, y64.float(), **tol)
    torch.testing.assert_close(x_te.grad, x64.grad.float(), **tol)
    ref_params = dict(ref.named_parameters())
    for name, p in te_mod.named_parameters():
        want = ref_params[name].grad.float()
        # float32 GEMM rounding grows with the size of what is summed: the absolute tolerance is
        # taken relative to the gradient's largest entry (the squared activations reach ~5 here)
        atol = tol["atol"] * max(1.0, want.abs().max().item())
        torch.testing.assert_close(p.grad, want, rtol=tol["rtol"], atol=atol, msg=lambda m: f"d{name}: {m}")


def test_transformer_layer_passes_activation_params_to_its_mlp():
    torch.manual_seed(0)
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, activation="clamped_swiglu")
    layer = tm.TransformerLayer(16, 32, 2, activation_params={"limit": 0.2, "alpha": 1.5}, **kw)
    mlp = tm.LayerNormMLP(16, 32, activation="clamped_swiglu", activation_params={"limit": 0.2, "alpha": 1.5})
    mlp.load_state_dict(layer.layernorm_mlp.state_dict())
    x = torch.randn(5, 16)
    torch.testing.assert_close(layer.layernorm_mlp(x), mlp(x), rtol=0, atol=0)
    default = tm.LayerNormMLP(16, 32, activation="clamped_swiglu")
    default.load_state_dict(mlp.state_dict())
    assert not torch.allclose(default(x), mlp(x))


def test_layernorm_mlp_activation_params_are_checked():
    with pytest.raises(ValueError, match="takes none"):
        tm.LayerNormMLP(8, 16, activation="swiglu", activation_params={"limit": 1.0})
    with pytest.raises(ValueError, match="takes limit, alpha and glu_linear_offset, got \\['beta'\\]"):
        tm.LayerNormMLP(8, 16, activation="clamped_swiglu", activation_params={"beta": 1.0})
    with pytest.raises(ValueError, match="> 0"):
        tm.LayerNormMLP(8, 16, activation="clamped_swiglu", activation_params={"limit": -1.0})


def test_layernorm_mlp_bf16_within_te_tolerance():
    torch.manual_seed(0)
    te_mod = tm.LayerNormMLP(32, 64, activation="swiglu", params_dtype=torch.bfloat16)
    ref = PlainNormMLP(32, 64, "swiglu", "LayerNorm").to(torch.bfloat16)
    randomize_(te_mod, seed=7, std=0.2)
    ref.load_state_dict(te_mod.state_dict(), strict=False)
    run_pair(te_mod, ref, torch.randn(16, 32).to(torch.bfloat16), params_of(ref), tol=dict(rtol=1.6e-2, atol=1e-5))


def test_torch_autocast_bf16_compute_fp32_grads():
    torch.manual_seed(0)
    te_mod = tm.LayerNormMLP(32, 64)
    x = torch.randn(8, 32, requires_grad=True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = te_mod(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and te_mod.fc1_weight.grad.dtype == torch.float32
    ref = PlainNormMLP(32, 64, "gelu", "LayerNorm")
    ref.load_state_dict(te_mod.state_dict(), strict=False)
    torch.testing.assert_close(y.float(), ref(x.detach()), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: tm.LayerNormMLP(16, 32, activation="gelu2"), r"LayerNormMLP: unknown activation='gelu2'"),
        (
            lambda: tm.LayerNormMLP(16, 32, normalization="BatchNorm"),
            r"LayerNormMLP: unknown normalization='BatchNorm'",
        ),
        (lambda: tm.LayerNormLinear(16, 32, normalization="rms"), r"LayerNormLinear: unknown normalization='rms'"),
        (lambda: tm.LayerNormLinear(16, 0), r"out_features must be a positive integer"),
        (lambda: tm.LayerNormMLP(16, 32)(torch.randn(4, 15)), r"LayerNormMLP: inp has shape \(4, 15\)"),
        (lambda: tm.LayerNormLinear(16, 32)(torch.ones(4, 16, dtype=torch.int64)), r"inp has dtype torch.int64"),
        (lambda: tm.LayerNormLinear(16, 32)(torch.randn(4, 16, device="meta")),
         r"LayerNormLinear: inp is on meta but the weight is on \w+"),
        (lambda: tm.LayerNormMLP(16, 32)(torch.randn(4, 16, device="meta")),
         r"LayerNormMLP: inp is on meta but the weight is on \w+"),
    ],
)
def test_bad_input_messages(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


@pytest.mark.parametrize("cls", [tm.LayerNormLinear, tm.LayerNormMLP])
@pytest.mark.parametrize("arg", ["bias", "return_bias", "fuse_wgrad_accumulation", "sequence_parallel",
                                 "return_layernorm_output", "zero_centered_gamma", "delay_wgrad_compute"])
def test_flags_refuse_values_read_by_truthiness(cls, arg):
    with pytest.raises(TypeError, match=rf"{cls.__name__}: {arg} must be True or False, got 'no' \(str\)"):
        cls(16, 32, **{arg: "no"})


def test_flags_take_0_and_1_and_eps_must_be_a_finite_number_at_least_0():
    assert tm.LayerNormLinear(16, 32, bias=0).bias is None and tm.LayerNormMLP(16, 32, bias=0).fc1_bias is None
    assert tm.LayerNormMLP(16, 32, checkpoint=1).checkpoint is True
    with pytest.raises(TypeError, match=r"LayerNormMLP: checkpoint must be True or False, got 'yes'"):
        tm.LayerNormMLP(16, 32, checkpoint="yes")
    with pytest.raises(TypeError, match=r"LayerNormMLP: set_parallel_mode must be True or False, got None"):
        tm.LayerNormMLP(16, 32, set_parallel_mode=None)
    for cls in (tm.LayerNormLinear, tm.LayerNormMLP):
        with pytest.raises(ValueError, match=rf"{cls.__name__}: eps must be finite and >= 0, got inf"):
            cls(16, 32, eps=float("inf"))
        with pytest.raises(TypeError, match=rf"{cls.__name__}: eps must be a finite number >= 0, got '1e-5'"):
            cls(16, 32, eps="1e-5")
