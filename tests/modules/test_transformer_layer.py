"""MultiheadAttention and TransformerLayer against a plain-PyTorch computation from the same
parameters (fp32, forward and every gradient), GroupedLinear against per-group F.linear."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import te_core.modules as tm

from ._compare import seeded
from .plain import plain_activation, plain_norm
from .test_attention import plain_attention, plain_rope


def plain_mha(p, prefix, x, cfg, freqs=None, mask=None):
    """x in (s, b, hidden) (sbhd) or (b, s, hidden) (bshd)."""
    h, g, d = cfg["heads"], cfg["groups"], cfg["hidden"] // cfg["heads"]
    ln = plain_norm(
        x,
        p[prefix + "layernorm_qkv.layer_norm_weight"],
        p.get(prefix + "layernorm_qkv.layer_norm_bias"),
        1e-5,
        cfg["normalization"],
    )
    qkv = F.linear(ln, p[prefix + "layernorm_qkv.weight"], p[prefix + "layernorm_qkv.bias"])
    q, k, v = qkv.split([h * d, g * d, g * d], dim=-1)
    q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (g, d)), v.unflatten(-1, (g, d))
    to_sbhd = (lambda t: t) if cfg["fmt"] == "sbhd" else (lambda t: t.transpose(0, 1))
    q, k, v = to_sbhd(q), to_sbhd(k), to_sbhd(v)
    if freqs is not None:
        q, k = plain_rope(q, freqs[: q.shape[0]]), plain_rope(k, freqs[: k.shape[0]])
    o = plain_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), cfg["mask_type"], mask, 1 / math.sqrt(d))
    o = to_sbhd(o.permute(2, 0, 1, 3)).flatten(-2)
    return F.linear(o, p[prefix + "proj.weight"], p[prefix + "proj.bias"])


def plain_layer(p, x, cfg, freqs=None, mask=None):
    hidden = x + plain_mha(p, "self_attention.", x, cfg, freqs, mask)
    ln = plain_norm(
        hidden, p["layernorm_mlp.layer_norm_weight"], p.get("layernorm_mlp.layer_norm_bias"), 1e-5, cfg["normalization"]
    )
    h = F.linear(ln, p["layernorm_mlp.fc1_weight"], p["layernorm_mlp.fc1_bias"])
    return hidden + F.linear(
        plain_activation(h, cfg["activation"]), p["layernorm_mlp.fc2_weight"], p["layernorm_mlp.fc2_bias"]
    )


CASES = [
    dict(
        hidden=32,
        heads=4,
        groups=4,
        normalization="LayerNorm",
        activation="gelu",
        fmt="sbhd",
        mask_type="causal",
        rope=False,
    ),
    dict(
        hidden=48,
        heads=6,
        groups=2,
        normalization="RMSNorm",
        activation="swiglu",
        fmt="bshd",
        mask_type="causal",
        rope=True,
    ),
    dict(
        hidden=24,
        heads=2,
        groups=1,
        normalization="LayerNorm",
        activation="relu",
        fmt="bshd",
        mask_type="padding",
        rope=False,
    ),
]


@pytest.mark.parametrize(
    "cfg", CASES, ids=lambda c: f"{c['normalization']}-{c['activation']}-{c['fmt']}-{c['mask_type']}"
)
def test_transformer_layer_matches_plain(cfg):
    torch.manual_seed(0)
    layer = tm.TransformerLayer(
        cfg["hidden"],
        2 * cfg["hidden"] + 8,
        cfg["heads"],
        num_gqa_groups=cfg["groups"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        self_attn_mask_type=cfg["mask_type"],
        normalization=cfg["normalization"],
        activation=cfg["activation"],
        attn_input_format=cfg["fmt"],
    )
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    s, b = 7, 3
    x = torch.randn((s, b, cfg["hidden"]) if cfg["fmt"] == "sbhd" else (b, s, cfg["hidden"]))
    freqs = tm.RotaryPositionEmbedding(cfg["hidden"] // cfg["heads"])(s) if cfg["rope"] else None
    mask = (
        (torch.arange(s)[None, :] >= torch.tensor([7, 5, 2])[:, None]).view(b, 1, 1, s)
        if cfg["mask_type"] == "padding"
        else None
    )
    x_te, x_ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y = layer(x_te, attention_mask=mask, rotary_pos_emb=freqs)
    params = {n: t.detach().clone().requires_grad_(True) for n, t in layer.named_parameters()}
    y_ref = plain_layer(params, x_ref, cfg, freqs, mask)
    torch.testing.assert_close(y, y_ref, rtol=1.3e-6, atol=1e-5)
    dy = torch.randn(y.shape, generator=seeded(1))
    y.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x_te.grad, x_ref.grad, rtol=1.3e-6, atol=1e-5)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, rtol=1.3e-6, atol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_parameter_names_follow_transformer_engine():
    layer = tm.TransformerLayer(32, 64, 4, normalization="LayerNorm")
    names = {n for n, _ in layer.named_parameters()}
    assert {
        "self_attention.layernorm_qkv.layer_norm_weight",
        "self_attention.layernorm_qkv.layer_norm_bias",
        "self_attention.layernorm_qkv.weight",
        "self_attention.layernorm_qkv.bias",
        "self_attention.proj.weight",
        "self_attention.proj.bias",
        "layernorm_mlp.layer_norm_weight",
        "layernorm_mlp.fc1_weight",
        "layernorm_mlp.fc1_bias",
        "layernorm_mlp.fc2_weight",
        "layernorm_mlp.fc2_bias",
    } == names - {"layernorm_mlp.layer_norm_bias"}


def test_decoder_layer_runs_cross_attention():
    torch.manual_seed(0)
    layer = tm.TransformerLayer(32, 64, 4, layer_type="decoder", hidden_dropout=0.0, attention_dropout=0.0)
    x, enc = torch.randn(5, 2, 32, requires_grad=True), torch.randn(9, 2, 32, requires_grad=True)
    y = layer(x, encoder_output=enc)
    y.sum().backward()
    assert y.shape == x.shape and enc.grad is not None and enc.grad.abs().sum() > 0
    assert hasattr(layer.inter_attention, "key_value")


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda: tm.TransformerLayer(30, 64, 4),
            r"TransformerLayer: hidden_size=30 is not divisible by num_attention_heads=4; pass kv_channels",
        ),
        (
            lambda: tm.TransformerLayer(32, 64, 4, num_gqa_groups=3),
            r"num_attention_heads=4 is not divisible by num_gqa_groups=3",
        ),
        (lambda: tm.TransformerLayer(32, 64, 4, activation="tanh"), r"TransformerLayer: unknown activation='tanh'"),
        (lambda: tm.TransformerLayer(32, 64, 4, normalization="Layernorm"), r"unknown normalization='Layernorm'"),
        (lambda: tm.TransformerLayer(32, 64, 4, layer_type="encdec"), r"unknown layer_type='encdec'"),
        (lambda: tm.TransformerLayer(32, 64, 4)(torch.randn(4, 32)), r"hidden_states must be 3-D"),
        (lambda: tm.TransformerLayer(32, 64, 4)(torch.randn(4, 2, 31)), r"hidden_states has shape \(4, 2, 31\)"),
        (
            lambda: tm.MultiheadAttention(32, 5),
            r"MultiheadAttention: hidden_size=32 is not divisible by num_attention_heads=5",
        ),
        (lambda: tm.TransformerLayer(32, 64, 4, layer_type="decoder")(torch.randn(4, 2, 32)), r"needs encoder_output"),
    ],
)
def test_bad_input_messages(build, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build()


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(bias="no"), TypeError, r"bias must be True or False, got 'no' \(str\)"),
    (dict(output_layernorm="yes"), TypeError, r"output_layernorm must be True or False, got 'yes'"),
    (dict(apply_residual_connection_post_layernorm=2), TypeError,
     r"apply_residual_connection_post_layernorm must be True or False, got 2"),
    (dict(parallel_attention_mlp=None), TypeError, r"parallel_attention_mlp must be True or False, got None"),
    (dict(ub_overlap_ag="no"), TypeError, r"ub_overlap_ag must be True or False, got 'no'"),
    (dict(bottom_right_diagonal="no"), TypeError, r"bottom_right_diagonal must be True, False or None, got 'no'"),
    (dict(hidden_dropout=1.5), ValueError, r"hidden_dropout must be in \[0, 1\], got 1.5"),
    (dict(hidden_dropout="0.1"), TypeError, r"hidden_dropout must be a number in \[0, 1\], got '0.1'"),
    (dict(attention_dropout=-0.1), ValueError, r"attention_dropout must be in \[0, 1\), got -0.1"),
    (dict(layernorm_epsilon=-1), ValueError, r"layernorm_epsilon must be finite and >= 0, got -1"),
    (dict(layernorm_epsilon=float("inf")), ValueError, r"layernorm_epsilon must be finite and >= 0, got inf"),
    (dict(layernorm_epsilon=None), TypeError, r"layernorm_epsilon must be a finite number >= 0, got None"),
    (dict(kv_channels=8.5), ValueError, r"kv_channels must be a positive integer, got 8.5"),
])
def test_transformer_layer_constructor_arguments_are_checked(kwargs, exc, match):
    # hidden_dropout=1.5 and kv_channels=8.5 used to fail later, or inside a submodule named otherwise
    with pytest.raises(exc, match=rf"TransformerLayer: {match}"):
        tm.TransformerLayer(32, 64, 4, **kwargs)


def test_transformer_layer_flags_take_0_1_and_numpy_bools():
    layer = tm.TransformerLayer(32, 64, 4, bias=0, output_layernorm=np.bool_(True), hidden_dropout=np.float64(0.0))
    assert layer.layernorm is not None and layer.layernorm_mlp.fc1_bias is None and layer.hidden_dropout == 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias="no"), r"bias must be True or False, got 'no'"),
    (dict(return_bias=[]), r"return_bias must be True or False, got \[\]"),
    (dict(fuse_wgrad_accumulation=2), r"fuse_wgrad_accumulation must be True or False, got 2"),
    (dict(sequence_parallel="no"), r"sequence_parallel must be True or False, got 'no'"),
])
def test_grouped_linear_flags_refuse_values_read_by_truthiness(kwargs, match):
    with pytest.raises(TypeError, match=rf"GroupedLinear: {match}"):
        tm.GroupedLinear(2, 16, 16, **kwargs)
    assert tm.GroupedLinear(2, 16, 16, bias=0).bias0 is None


@pytest.mark.parametrize("m_splits, exc, match", [
    ([7.0, 6.5], ValueError, r"m_splits must hold whole row counts, got 6.5"),  # (whole floats: TE's int64 cast)
    (["7", 7], TypeError, r"m_splits must be a list of 2 non-negative ints .* got \['7', 7\]"),
    ([True, 13], TypeError, r"m_splits must be a list of 2 non-negative ints"),
    (14, TypeError, r"m_splits must be a list of 2 non-negative ints .* got 14"),
    ("77", TypeError, r"m_splits must be a list of 2 non-negative ints"),
    # (a float tensor of whole counts is taken, as in TE)
    (torch.tensor([7.0, 6.5]), ValueError, r"m_splits must hold whole row counts, got 6.5"),
    ([15, -1], ValueError, r"m_splits must be 2 non-negative row counts \(num_gemms\), got \[15, -1\]"),
    ([7, 6], ValueError, r"m_splits sum to 13 but inp has 14 rows"),
])
def test_grouped_linear_m_splits_are_checked(m_splits, exc, match):
    # floats and bools used to pass through int(): [7.0, 7.0] ran, [True, 13] split 1 + 13 rows
    mod = tm.GroupedLinear(2, 16, 8)
    x = torch.randn(14, 16)
    with pytest.raises(exc, match=rf"GroupedLinear: {match}"):
        mod(x, m_splits)
    for valid in ([7, 7], (np.int64(7), 7), torch.tensor([7, 7])):  # ints of numpy and integer tensors still pass
        assert mod(x, valid).shape == (14, 8)


def test_grouped_linear_matches_per_group_linear():
    torch.manual_seed(0)
    mod = tm.GroupedLinear(3, 16, 24)
    with torch.no_grad():
        for i in range(3):
            getattr(mod, f"bias{i}").normal_()
    splits = [5, 0, 9]
    x = torch.randn(14, 16, requires_grad=True)
    y = mod(x, splits)
    ref = torch.cat(
        [F.linear(xi, getattr(mod, f"weight{i}"), getattr(mod, f"bias{i}")) for i, xi in enumerate(x.split(splits))]
    )
    torch.testing.assert_close(y, ref, rtol=1.3e-6, atol=1e-5)
    dy = torch.randn(y.shape)
    grads = torch.autograd.grad(y, [x, *mod.parameters()], dy)
    ref_grads = torch.autograd.grad(ref, [x, *mod.parameters()], dy, allow_unused=True)
    for a, e in zip(grads, ref_grads):
        torch.testing.assert_close(a, torch.zeros_like(a) if e is None else e, rtol=1.3e-6, atol=1e-5)
    with pytest.raises(ValueError, match=r"GroupedLinear: m_splits sum to 13 but inp has 14 rows"):
        mod(x, [5, 0, 8])
    with pytest.raises(ValueError, match=r"m_splits must be 3 non-negative row counts"):
        mod(x, [14])
    with pytest.raises(ValueError, match=r"GroupedLinear: inp is on meta but the weight is on \w+"):
        mod(torch.randn(14, 16, device="meta"), [5, 1, 8])


def test_grouped_linear_fp8_current_scaling():
    from te_core import recipe
    from te_core.quantization import autocast

    torch.manual_seed(0)
    mod = tm.GroupedLinear(2, 32, 32, bias=False)
    x = torch.randn(64, 32, requires_grad=True)
    with autocast(recipe=recipe.Float8CurrentScaling()):
        y = mod(x, [32, 32])
    y.sum().backward()
    ref = torch.cat([F.linear(xi, getattr(mod, f"weight{i}")) for i, xi in enumerate(x.detach().split([32, 32]))])
    scale = ref.abs().max()
    torch.testing.assert_close(y / scale, ref / scale, rtol=0.125, atol=0.0675)
    assert not torch.equal(y, ref)
    with pytest.raises(ValueError, match=r"GroupedLinear: FP8 GEMM.*multiple of 16"):
        with autocast(recipe=recipe.Float8BlockScaling()):  # (tensor-wise GEMMs pad such splits)
            mod(x, [24, 40])
    with autocast(recipe=recipe.Float8CurrentScaling()):
        y = mod(x.detach(), [24, 40])
    ref = torch.cat([F.linear(xi, getattr(mod, f"weight{i}")) for i, xi in enumerate(x.detach().split([24, 40]))])
    torch.testing.assert_close(y / scale, ref / scale, rtol=0.125, atol=0.0675)


@pytest.mark.parametrize("rec_name", ["delayed", "current", "block", "mxfp8"])
def test_transformer_layer_fp8_within_fp8_tolerances(rec_name):
    from te_core.quantization import autocast

    from .test_fp8_modules import E4M3, E5M2, RECIPES, assert_close_scaled

    cfg = dict(
        hidden=64, heads=4, groups=2, normalization="RMSNorm", activation="swiglu", fmt="sbhd", mask_type="causal"
    )
    torch.manual_seed(0)
    layer = tm.TransformerLayer(
        64,
        128,
        4,
        num_gqa_groups=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        activation="swiglu",
    )
    x = torch.randn(16, 2, 64)
    rec = RECIPES[rec_name]()
    for _ in range(2):  # delayed scaling: the second step uses scales from the first
        layer.zero_grad()
        x_te = x.clone().requires_grad_(True)
        with autocast(recipe=rec):
            y = layer(x_te)
        y.backward(torch.ones_like(y))
    params = {n: t.detach().clone().requires_grad_(True) for n, t in layer.named_parameters()}
    x_ref = x.clone().requires_grad_(True)
    y_ref = plain_layer(params, x_ref, cfg)
    y_ref.backward(torch.ones_like(y_ref))
    assert not torch.equal(y, y_ref)
    assert_close_scaled(y, y_ref, E4M3, "forward")
    assert_close_scaled(x_te.grad, x_ref.grad, E5M2, "dx")
    for name, p in layer.named_parameters():
        assert_close_scaled(p.grad, params[name].grad, E5M2, f"d{name}")


@pytest.mark.parametrize(
    "build, exc, match",
    [
        (
            lambda: tm.TransformerLayer(32, 64, 4, tp_size=2),
            ValueError,
            r"TransformerLayer: tp_size=2 needs set_parallel_mode=True",
        ),
        (
            lambda: tm.MultiheadAttention(32, 4, tp_size=2, set_parallel_mode=True, sequence_parallel=True,
                                          qkv_format="bshd"),
            ValueError,
            r"sequence_parallel=True splits the first dimension",
        ),
        (
            lambda: tm.TransformerLayer(32, 64, 4, hiden_dropout=0.1),
            TypeError,
            r"unexpected keyword argument 'hiden_dropout'",
        ),
        (lambda: tm.LayerNorm(8, tp_group=object()), NotImplementedError, r"LayerNorm: tp_group="),
    ],
)
def test_unsupported_and_unknown_arguments(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


@pytest.mark.parametrize("module", ["TransformerLayer", "MultiheadAttention"])
@pytest.mark.parametrize("name", ["bogus", "qkv_layer", "num_splits"])
def test_forward_refuses_unknown_keywords_by_its_own_name(module, name):
    """A keyword Transformer Engine's forward does not take is refused naming the module called
    (not the DotProductAttention the keywords would reach; qkv_layer and num_splits are
    DotProductAttention's own); the ones TE passes on still reach the attention."""
    torch.manual_seed(0)
    build = {"TransformerLayer": lambda: tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0),
             "MultiheadAttention": lambda: tm.MultiheadAttention(32, 4, attention_dropout=0.0)}[module]
    layer, x = build(), torch.randn(5, 2, 32)
    with pytest.raises(TypeError, match=rf"^{module}.forward got an unexpected keyword argument '{name}'$"):
        layer(x, **{name: 1})
    with pytest.raises(ValueError, match="max_seqlen_q"):  # passed on, checked by the attention
        layer(x, max_seqlen_q=-3)


def test_layout_options_match_their_definitions():
    """output_layernorm, apply_residual_connection_post_layernorm, parallel_attention_mlp."""
    torch.manual_seed(0)
    x = torch.randn(5, 2, 32)
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0)
    base = tm.TransformerLayer(32, 64, 4, **kw)
    # output_layernorm (Transformer Engine's BERT layout): the norm leaves self-attention's input
    # for the layer's output; self-attention projects x itself, with TE's parameter names
    with_out_norm = tm.TransformerLayer(32, 64, 4, output_layernorm=True, **kw)
    assert "self_attention.qkv.query_weight" in with_out_norm.state_dict()
    assert not any("layernorm_qkv" in name for name in with_out_norm.state_dict())
    for post_norm_residual in (False, True):
        layer = tm.TransformerLayer(32, 64, 4, output_layernorm=True,
                                    apply_residual_connection_post_layernorm=post_norm_residual, **kw)
        layer.load_state_dict(with_out_norm.state_dict())
        hidden = x + layer.self_attention(x)  # (no normalized input: the residual is x either way)
        mlp = layer.layernorm_mlp(hidden)
        mlp = mlp[0] + mlp[1] if post_norm_residual else hidden + mlp
        torch.testing.assert_close(layer(x), layer.layernorm(mlp), rtol=1.3e-6, atol=1e-5)

    post = tm.TransformerLayer(32, 64, 4, apply_residual_connection_post_layernorm=True, **kw)
    post.load_state_dict(base.state_dict())
    attn, ln1 = post.self_attention(x)
    hidden = ln1 + attn
    mlp, ln2 = post.layernorm_mlp(hidden)
    torch.testing.assert_close(post(x), ln2 + mlp, rtol=1.3e-6, atol=1e-5)

    par = tm.TransformerLayer(32, 64, 4, parallel_attention_mlp=True, **kw)
    par.load_state_dict(base.state_dict())
    expected = x + base.self_attention(x) + base.layernorm_mlp(x)
    torch.testing.assert_close(par(x), expected, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("clash", [dict(layer_type="decoder"), dict(apply_residual_connection_post_layernorm=True),
                                   dict(output_layernorm=True)])
def test_parallel_attention_mlp_refuses_what_its_branches_lack(clash):
    # Transformer Engine refuses these too; a decoder's cross-attention was silently skipped
    (name, value), = clash.items()
    with pytest.raises(ValueError, match=f"parallel_attention_mlp=True does not go with {name}={value!r}"):
        tm.TransformerLayer(32, 64, 4, parallel_attention_mlp=True, **clash)


def test_container_quantization_state_collects_submodules():
    """TransformerLayer.quantization_state(): each GEMM's slots under its submodule path, live
    views of the delayed-scaling state (the scale a step used is the one shown)."""
    from te_core import autocast, recipe

    torch.manual_seed(7)
    layer = tm.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(16, 2, 64, requires_grad=True)
    with autocast(recipe=recipe.DelayedScaling(amax_history_len=4)):
        layer(x).sum().backward()
    state = layer.quantization_state()
    assert set(state["forward"]) == {
        "self_attention.layernorm_qkv.input", "self_attention.layernorm_qkv.weight",
        "self_attention.proj.input", "self_attention.proj.weight",
        "layernorm_mlp.fc1_input", "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_input", "layernorm_mlp.fc2_weight",
    }
    assert set(state["backward"]) == {"self_attention.layernorm_qkv.grad_output", "self_attention.proj.grad_output",
                                      "layernorm_mlp.fc1_grad_output", "layernorm_mlp.fc2_grad_output"}
    fc1 = layer.layernorm_mlp.quantization_state()["forward"]["fc1_weight"]
    merged = state["forward"]["layernorm_mlp.fc1_weight"]
    assert torch.equal(merged["scale"], fc1["scale"]) and torch.equal(merged["amax_history"], fc1["amax_history"])
    # after one step the scale came from the recorded amax: fp8_max / amax of the weight
    amax = layer.layernorm_mlp.fc1_weight.detach().abs().max()
    torch.testing.assert_close(merged["scale"].reshape(()), (448.0 / amax).float(), rtol=1.3e-6, atol=0)


def _pair(**kw):
    """A layer with `kw` and one without, sharing parameters; no dropout."""
    base = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
    layer = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, **kw)
    layer.load_state_dict(base.state_dict())
    return base, layer


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_drop_path_drops_whole_slices_of_each_residual_branch(fmt):
    """Stochastic depth as Transformer Engine draws it: one uniform per slice of the first
    dimension (sequence positions with sbhd, samples with bshd), first for the attention branch,
    then for the MLP branch; kept slices scaled by 1 / keep; nothing dropped in eval mode."""
    torch.manual_seed(0)
    base = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format=fmt)
    layer = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format=fmt,
                                drop_path_rate=0.4)
    layer.load_state_dict(base.state_dict())
    assert base.drop_path is None and layer.drop_path.drop_prob == 0.4
    x = torch.randn(8, 8, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    dy = torch.randn(8, 8, 32)
    torch.manual_seed(7)
    out = layer(x)
    torch.manual_seed(7)
    keep = 0.6
    masks = [(keep + torch.rand(8, 1, 1)).floor() for _ in range(2)]
    assert all(0 < m.sum() < 8 for m in masks) and not torch.equal(*masks)  # a real mix of kept and dropped
    hidden = x_ref + base.self_attention(x_ref).div(keep) * masks[0]
    expected = hidden + base.layernorm_mlp(hidden).div(keep) * masks[1]
    torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=1e-5)
    out.backward(dy)
    expected.backward(dy)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1.3e-6, atol=1e-5)
    for (name, p), q in zip(layer.named_parameters(), base.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1.3e-6, atol=1e-5, msg=name)
    layer.eval(), base.eval()
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)


def test_drop_path_leaves_cross_attention_alone():
    torch.manual_seed(0)
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, layer_type="decoder")
    base = tm.TransformerLayer(32, 64, 4, **kw)
    layer = tm.TransformerLayer(32, 64, 4, drop_path_rate=0.5, **kw)
    layer.load_state_dict(base.state_dict())
    x, enc = torch.randn(6, 2, 32), torch.randn(4, 2, 32)
    torch.manual_seed(3)
    out = layer(x, encoder_output=enc)
    torch.manual_seed(3)
    masks = [(0.5 + torch.rand(6, 1, 1)).floor() for _ in range(2)]
    hidden = x + base.self_attention(x).div(0.5) * masks[0]
    hidden = hidden + base.inter_attention(hidden, encoder_output=enc)
    expected = hidden + base.layernorm_mlp(hidden).div(0.5) * masks[1]
    torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("rate, exc, match", [
    (-0.1, ValueError, r"drop_path_rate must be in \[0, 1\]"),
    (1.5, ValueError, r"drop_path_rate must be in \[0, 1\]"),
    ("0.1", TypeError, r"drop_path_rate must be a number"),
    (True, TypeError, r"drop_path_rate must be a number"),
])
def test_drop_path_rate_outside_zero_to_one_is_refused(rate, exc, match):
    with pytest.raises(exc, match=match):
        tm.TransformerLayer(32, 64, 4, drop_path_rate=rate)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_drop_path_rate_one_drops_both_branches_without_nan(fmt):
    """drop_path_rate=1.0 (Transformer Engine's sanity tests pass it): in training both residual
    branches are dropped for every slice, so the output is the input and its gradient the output
    gradient, every parameter's gradient is zero (not NaN from a division by the zero keep
    probability, nor None); the generator advances as with a rate below 1; eval mode is the plain layer."""
    torch.manual_seed(0)
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, attn_input_format=fmt)
    base = tm.TransformerLayer(32, 64, 4, **kw)
    layer = tm.TransformerLayer(32, 64, 4, drop_path_rate=1.0, **kw)
    layer.load_state_dict(base.state_dict())
    x = torch.randn(6, 4, 32, requires_grad=True)
    dy = torch.randn(6, 4, 32)
    torch.manual_seed(5)
    out = layer(x)
    after = torch.rand(1)
    torch.manual_seed(5)
    torch.rand(6, 1, 1), torch.rand(6, 1, 1)  # one draw per branch, as at any rate
    assert torch.equal(after, torch.rand(1))
    torch.testing.assert_close(out, x, rtol=0, atol=0)
    out.backward(dy)
    torch.testing.assert_close(x.grad, dy, rtol=0, atol=0)
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name
    layer.eval(), base.eval()
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)


def test_parallel_attention_mlp_drops_out_the_sum_of_both_branches():
    """One hidden-dropout mask on attention + MLP, as in Transformer Engine (not one per branch)."""
    torch.manual_seed(0)
    layer = tm.TransformerLayer(32, 64, 4, parallel_attention_mlp=True, hidden_dropout=0.5, attention_dropout=0.0)
    x = torch.randn(5, 2, 32)
    torch.manual_seed(11)
    out = layer(x)
    both = layer.self_attention(x) + layer.layernorm_mlp(x)
    torch.manual_seed(11)
    expected = x + F.dropout(both, p=0.5, training=True)
    torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=1e-5)
    dropped = out == x  # where the one mask dropped both branches together
    assert 0 < dropped.sum() < dropped.numel()


@pytest.mark.reference_only
def test_drop_path_compiles_whole_and_draws_as_eager():
    torch.manual_seed(0)
    layer = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0, drop_path_rate=0.3)
    x = torch.randn(6, 2, 32)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    got = compiled(x)
    torch.manual_seed(5)
    torch.testing.assert_close(got, layer(x), rtol=1.3e-6, atol=1e-5)


def test_torch_autocast_runs_the_residual_stream_in_its_dtype():
    """As in Transformer Engine: under torch.autocast the layer takes its input in the autocast
    dtype, so the output (residual adds included) is in that dtype and equals the layer run on
    the input cast beforehand; the float32 input still gets its gradient, in float32."""
    torch.manual_seed(0)
    layer = tm.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(16, 2, 64, generator=seeded(0)).requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        y = layer(x)
        y_cast = layer(x.detach().to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_cast, rtol=0, atol=0)
    y.float().square().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0
    # outside torch.autocast the input's dtype is kept
    assert layer(x.detach()).dtype == torch.float32


def test_transformer_engines_zero_kv_channels_and_full_hidden_dropout():
    """kv_channels=0 means hidden_size / heads (TE reads 0 as unset); hidden_dropout=1.0 is taken
    as torch's dropout takes it: in training both residual branches add nothing."""
    torch.manual_seed(0)
    zero = tm.TransformerLayer(32, 64, 4, kv_channels=0, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    unset = tm.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(5, 2, 32)
    assert zero.self_attention.kv_channels == 8
    torch.testing.assert_close(zero(x), unset(x), rtol=0, atol=0)
    dropped = tm.TransformerLayer(32, 64, 4, hidden_dropout=1.0, attention_dropout=0.0)
    torch.testing.assert_close(dropped.train()(x), x, rtol=0, atol=0)
