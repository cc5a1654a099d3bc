"""Every public module gives a strided input (a transpose, a slice with a storage offset, an
expanded or permuted view, q/k/v cut from one fused tensor) bit for bit the output and the
gradients (of the input and of every parameter) of its contiguous copy, in high precision and
in FP8 under te.autocast with each recipe: the result depends on the values, not on the
memory layout. The backends are deterministic, so any difference is a layout-dependent path."""

import copy

import pytest
import torch

import te_core.modules as tm
from te_core import recipe
from te_core.quantization import autocast

from ._compare import randomize_, seeded

RECIPES = {
    "hp": None,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
}
LAYOUTS = ("transposed", "offset", "expanded", "permuted")


def strided(shape, layout: str, seed: int) -> torch.Tensor:
    """A tensor of `shape` holding fresh random values, laid out in memory as `layout` says:
    never contiguous."""
    g, shape = seeded(seed), tuple(shape)
    if layout == "transposed":  # the last two dimensions swapped
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).transpose(-1, -2)
    elif layout == "offset":  # a slice of wider rows, starting past the storage's first element
        t = torch.randn(*shape[:-1], shape[-1] + 5, generator=g)[..., 3:3 + shape[-1]]
    elif layout == "expanded":  # the first dimension broadcast (stride 0): one value repeated
        t = torch.randn(1, *shape[1:], generator=g).expand(shape)
    elif layout == "permuted":  # channels-last-like: the last dimension strides furthest
        t = torch.randn(shape[-1], *shape[:-1], generator=g).permute(*range(1, len(shape)), 0)
    else:
        raise ValueError(layout)
    assert not t.is_contiguous() and tuple(t.shape) == shape
    return t


def dense_copy(t: torch.Tensor) -> torch.Tensor:
    out = t.detach().clone(memory_format=torch.contiguous_format)
    assert out.is_contiguous()
    return out


def run(module, inputs, rec, dy_layout, dense, forward):
    """(output, then the gradients of each input and of each parameter). The output's gradient
    is laid out as `dy_layout` says (None: contiguous), or is its contiguous copy where `dense`."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    context = autocast(recipe=RECIPES[rec]()) if RECIPES[rec] else autocast(enabled=False)
    with context:
        y = forward(module, *leaves)
    y = y[0] if isinstance(y, tuple) else y
    dy = strided(y.shape, dy_layout, seed=99) if dy_layout else torch.randn(y.shape, generator=seeded(99))
    y.backward(dense_copy(dy) if dense else dy)
    return [y, *(t.grad for t in leaves), *(p.grad for p in module.parameters() if p.requires_grad)]


def assert_layout_free(module, strided_inputs, rec="hp", *, dy_layout=None, forward=None, **kwargs):
    """The module (and an identical copy) on the strided inputs and on their contiguous copies
    (likewise the output's gradient): the same output and gradients, bit for bit."""
    forward = forward or (lambda m, *xs: m(*xs, **kwargs))
    module.zero_grad(set_to_none=True)
    twin = copy.deepcopy(module)
    got = run(module, strided_inputs, rec, dy_layout, False, forward)
    want = run(twin, [dense_copy(t) for t in strided_inputs], rec, dy_layout, True, forward)
    params = [f"d_{n}" for n, p in module.named_parameters() if p.requires_grad]
    names = ["output", *(f"d_input{i}" for i in range(len(strided_inputs))), *params]
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        assert a is not None and b is not None, name
        # (a parameter may see no input: GroupedLinear's weight of an empty split)
        assert a.abs().sum() > 0 or name in params, f"{name} is zero: the comparison could not fail"
        assert torch.equal(a, b), f"{name}: differs by up to {(a.double() - b.double()).abs().max().item():.3g}"


# ---------------------------------------------------------------- GEMM modules

GEMM_MODULES = {
    "Linear": lambda: tm.Linear(64, 96),
    "LayerNormLinear": lambda: tm.LayerNormLinear(64, 96, normalization="RMSNorm"),
    "LayerNormLinear-LayerNorm": lambda: tm.LayerNormLinear(64, 96),
    "LayerNormMLP": lambda: tm.LayerNormMLP(64, 128, activation="swiglu"),
    "LayerNormMLP-RMSNorm": lambda: tm.LayerNormMLP(64, 128, normalization="RMSNorm"),
}


@pytest.mark.parametrize("rec", list(RECIPES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(2, 32, 64), (64, 64)], ids=["3d", "2d"])
@pytest.mark.parametrize("name", list(GEMM_MODULES))
def test_gemm_module(name, shape, layout, rec):
    module = GEMM_MODULES[name]()
    randomize_(module, seed=5, std=0.2)
    x = strided(shape, layout, seed=len(name) + LAYOUTS.index(layout))
    assert_layout_free(module, [x], rec)


@pytest.mark.parametrize("rec", list(RECIPES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(GEMM_MODULES))
def test_gemm_module_strided_output_grad(name, layout, rec):
    """The output's gradient as it reaches the backward strided: `y.sum()` gives an expanded
    one, a transpose after the module a transposed one."""
    module = GEMM_MODULES[name]()
    randomize_(module, seed=6, std=0.2)
    x = torch.randn(2, 32, 64, generator=seeded(7))
    assert_layout_free(module, [x], rec, dy_layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(GEMM_MODULES))
def test_gemm_module_bf16(name, layout):
    module = GEMM_MODULES[name]()
    randomize_(module, seed=5, std=0.2)
    x = strided((2, 32, 64), layout, seed=3 + LAYOUTS.index(layout)).bfloat16()
    assert_layout_free(module.bfloat16(), [x])


@pytest.mark.parametrize("rec", ["hp", "current", "mxfp8"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["save_original_input", "split_sizes", "return_layernorm_output"])
def test_gemm_module_variants(variant, layout, rec):
    """The paths that keep the input as given (save_original_input: the backward casts it), or
    return views (split outputs, the norm's output)."""
    x = strided((2, 32, 64), layout, seed=4 + LAYOUTS.index(layout))
    if variant == "save_original_input":
        module, kwargs = tm.Linear(64, 96, save_original_input=True), {}
    elif variant == "split_sizes":
        module, kwargs = tm.LayerNormLinear(64, 96), dict(split_sizes=[32, 64])
    else:
        module, kwargs = tm.LayerNormLinear(64, 96, return_layernorm_output=True), {}
    randomize_(module, seed=8, std=0.2)
    assert_layout_free(module, [x], rec, **kwargs)


@pytest.mark.parametrize("rec", list(RECIPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_linear(layout, rec):
    module = tm.GroupedLinear(3, 64, 96)
    randomize_(module, seed=6, std=0.2)
    x = strided((128, 64), layout, seed=7 + LAYOUTS.index(layout))
    assert_layout_free(module, [x], rec, m_splits=[32, 0, 96])
    assert_layout_free(module, [torch.randn(128, 64, generator=seeded(8))], rec, dy_layout=layout,
                       m_splits=[64, 32, 32])


# ---------------------------------------------------------------- attention

S, B, H, D = 16, 2, 4, 16


def cu_seqlens():
    """Three packed sequences of S * B = 32 tokens, on the device under test."""
    return torch.tensor([0, 5, 16, 32], dtype=torch.int32)


def _token_dims(fmt):
    return {"sbhd": (S, B), "bshd": (B, S), "thd": (S * B,)}[fmt]


def qkv_views(fmt: str, layout: str, seed: int):
    """q, k, v of `fmt`: three tensors laid out as `layout`, or, for "fused_3hd" / "fused_h3d",
    slices of one (..., 3, h, d) / (..., h, 3, d) tensor as a fused QKV projection gives them."""
    tokens = _token_dims(fmt)
    if layout.startswith("fused"):
        g = seeded(seed)
        if layout == "fused_3hd":
            fused = torch.randn(*tokens, 3, H, D, generator=g)
            return [fused.select(-3, i) for i in range(3)]
        fused = torch.randn(*tokens, H, 3, D, generator=g)
        return [fused.select(-2, i) for i in range(3)]
    return [strided((*tokens, H, D), layout, seed + i) for i in range(3)]


QKV_LAYOUTS = LAYOUTS + ("fused_3hd", "fused_h3d")


@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
def test_dot_product_attention(fmt, layout):
    if fmt == "thd" and layout == "expanded":  # expanded over the tokens: every token alike
        layout = "offset"
    mask = "padding_causal" if fmt == "thd" else "causal"
    module = tm.DotProductAttention(H, D, qkv_format=fmt, attn_mask_type=mask, attention_dropout=0.0)
    packed = dict(cu_seqlens_q=cu_seqlens(), cu_seqlens_kv=cu_seqlens()) if fmt == "thd" else {}
    assert_layout_free(module, qkv_views(fmt, layout, seed=QKV_LAYOUTS.index(layout)), **packed)
    q, k, v = (torch.randn(*_token_dims(fmt), H, D, generator=seeded(20 + i)) for i in range(3))
    assert_layout_free(module, [q, k, v], dy_layout="transposed", **packed)


@pytest.mark.parametrize("interleave_dim", [-3, -2])
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_dot_product_attention_packed_qkv_layer(fmt, interleave_dim):
    """qkv_layer (one (..., 3, h, d) / (..., h, 3, d) tensor), itself a strided view."""
    module = tm.DotProductAttention(H, D, qkv_format=fmt, attention_dropout=0.0)
    shape = (*_token_dims(fmt), *((3, H, D) if interleave_dim == -3 else (H, 3, D)))
    qkv = strided(shape, "offset", seed=30)
    assert_layout_free(module, [qkv], forward=lambda m, t: m(qkv_layer=t, qkv_interleave_dim=interleave_dim))


@pytest.mark.parametrize("rec", list(RECIPES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", ["plain", "layernorm-rope-bshd"])
def test_multihead_attention(config, layout, rec):
    fmt = "bshd" if config.endswith("bshd") else "sbhd"
    module = tm.MultiheadAttention(64, H, attention_dropout=0.0, qkv_format=fmt,
                                   input_layernorm=config != "plain", qkv_weight_interleaved=config == "plain")
    randomize_(module, seed=9, std=0.2)
    hidden = strided((*_token_dims(fmt), 64), layout, seed=10 + LAYOUTS.index(layout))
    rope = tm.RotaryPositionEmbedding(D)(S) if "rope" in config else None
    assert_layout_free(module, [hidden], rec, rotary_pos_emb=rope)


@pytest.mark.parametrize("rec", list(RECIPES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", ["pre-norm", "rmsnorm-swiglu-parallel-bshd"])
def test_transformer_layer(config, layout, rec):
    fmt = "bshd" if config.endswith("bshd") else "sbhd"
    extra = dict(normalization="RMSNorm", activation="swiglu", parallel_attention_mlp=True) if "parallel" in config \
        else {}
    module = tm.TransformerLayer(64, 128, H, hidden_dropout=0.0, attention_dropout=0.0, attn_input_format=fmt,
                                 **extra)
    randomize_(module, seed=11, std=0.2)
    hidden = strided((*_token_dims(fmt), 64), layout, seed=12 + LAYOUTS.index(layout))
    assert_layout_free(module, [hidden], rec)
    assert_layout_free(module, [dense_copy(hidden)], rec, dy_layout=layout)


# ---------------------------------------------------------------- rotary embedding

@pytest.mark.parametrize("layout", QKV_LAYOUTS)
@pytest.mark.parametrize("fmt", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_pos_emb(fmt, layout, interleaved):
    if fmt == "thd" and layout == "expanded":
        layout = "offset"
    freqs = tm.RotaryPositionEmbedding(D, rotary_percent=0.5, interleaved=interleaved)(S * B)
    t = qkv_views(fmt, layout, seed=40 + QKV_LAYOUTS.index(layout))[1]
    kwargs = dict(tensor_format=fmt, interleaved=interleaved, cu_seqlens=cu_seqlens() if fmt == "thd" else None)
    rope = lambda m, x: tm.apply_rotary_pos_emb(x, freqs, **kwargs)  # noqa: E731
    assert_layout_free(torch.nn.Module(), [t], forward=rope)
    assert_layout_free(torch.nn.Module(), [dense_copy(t)], forward=rope, dy_layout="transposed")
    if fmt != "thd":  # from per-sequence start positions (a KV cache's next tokens)
        starts = torch.tensor([3, 0])
        rope = lambda m, x: tm.apply_rotary_pos_emb(x, freqs, start_positions=starts, **kwargs)  # noqa: E731
        assert_layout_free(torch.nn.Module(), [t], forward=rope)


def test_rotary_pos_emb_of_strided_freqs():
    """freqs themselves strided (rows of a wider table, from an offset) rotate as their copy."""
    table = tm.RotaryPositionEmbedding(D)(2 * S)
    wide = torch.cat([table, table], dim=-1)[S // 2:, ..., :D]
    assert not wide.is_contiguous()
    t = torch.randn(S, B, H, D, generator=seeded(50), requires_grad=True)
    y, y_dense = tm.apply_rotary_pos_emb(t, wide), tm.apply_rotary_pos_emb(t, wide.contiguous())
    assert torch.equal(y, y_dense) and not torch.equal(y, t)
