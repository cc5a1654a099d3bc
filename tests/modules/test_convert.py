"""te.convert_model on a Llama-style model (Hugging Face module names, built here; the real
transformers Llama is used when transformers is installed) and on nn.Sequential norm+linear."""

import copy

import pytest
import torch
from torch import nn

import te_core as te
import te_core.modules as tm
from te_core import recipe
from te_core.convert import convert_model


class LlamaRMSNorm(nn.Module):  # Hugging Face's layout: weight + variance_epsilon
    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.variance_epsilon)).to(x.dtype)


class ToyLlamaLayer(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(h)
        self.self_attn = nn.ModuleDict(
            {n: nn.Linear(h, h, bias=False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        )
        self.post_attention_layernorm = nn.RMSNorm(h, eps=1e-5)
        self.mlp = nn.ModuleDict(
            dict(
                gate_proj=nn.Linear(h, 2 * h, bias=False),
                up_proj=nn.Linear(h, 2 * h, bias=False),
                down_proj=nn.Linear(2 * h, h, bias=False),
            )
        )

    def forward(self, x):
        a = self.input_layernorm(x)
        q, k, v = (self.self_attn[n](a) for n in ("q_proj", "k_proj", "v_proj"))
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v
        x = x + self.self_attn["o_proj"](att)
        m = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](nn.functional.silu(self.mlp["gate_proj"](m)) * self.mlp["up_proj"](m))


class ToyLlama(nn.Module):
    def __init__(self, h=32, vocab=50):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList([ToyLlamaLayer(h), ToyLlamaLayer(h)])
        self.norm = LlamaRMSNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def test_converts_llama_style_model_keeping_weights():
    torch.manual_seed(0)
    model = ToyLlama()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    tokens = torch.randint(0, 50, (2, 9))
    before = model(tokens)
    converted = convert_model(copy.deepcopy(model), skip=("lm_head",))
    assert isinstance(converted.layers[0].self_attn["q_proj"], tm.Linear)
    assert isinstance(converted.layers[0].input_layernorm, tm.RMSNorm)
    assert isinstance(converted.layers[1].post_attention_layernorm, tm.RMSNorm)
    assert type(converted.lm_head) is nn.Linear
    assert converted.layers[0].input_layernorm.eps == 1e-6
    torch.testing.assert_close(converted(tokens), before, rtol=1.3e-6, atol=1e-5)


def test_filter_fn_and_fp8_alignment_warning():
    model = ToyLlama(h=32, vocab=50)
    with pytest.warns(UserWarning, match=r"left in high precision.*lm_head \(32->50\)"):
        convert_model(model, recipe.Float8CurrentScaling(), module_filter_fn=lambda m, name: "mlp" not in name)
    assert type(model.layers[0].mlp["gate_proj"]) is nn.Linear
    assert isinstance(model.layers[0].self_attn["o_proj"], tm.Linear)
    assert type(model.lm_head) is nn.Linear


def test_sequential_norm_linear_pairs_fuse():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.RMSNorm(32), nn.Linear(32, 8))
    with torch.no_grad():
        for p in seq.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    x = torch.randn(5, 16)
    before = seq(x)
    convert_model(seq)
    assert isinstance(seq[0], tm.LayerNormLinear) and isinstance(seq[1], nn.Identity)
    assert isinstance(seq[3], tm.LayerNormLinear) and seq[3].normalization == "RMSNorm"
    torch.testing.assert_close(seq(x), before, rtol=1.3e-6, atol=1e-5)


def test_fused_pairs_load_a_state_dict_saved_before_conversion():
    """A state dict of the unconverted model (the norm's and the Linear's own keys) loads into the
    converted one, strictly, to the same values; the converted model keeps Transformer Engine's
    names in its own state dict, which loads back as well, and it still pickles."""
    torch.manual_seed(0)

    def build():
        return nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.RMSNorm(32),
                             nn.Linear(32, 8, bias=False))

    original = build()
    with torch.no_grad():
        for p in original.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    x = torch.randn(5, 16)
    converted = convert_model(build())
    extra = {k: v for k, v in converted.state_dict().items() if k.endswith("_extra_state")}
    converted.load_state_dict({**original.state_dict(), **extra})
    torch.testing.assert_close(converted(x), original(x), rtol=1.3e-6, atol=1e-5)
    assert "0.layer_norm_weight" in converted.state_dict() and "1.weight" not in converted.state_dict()
    again = convert_model(build())
    again.load_state_dict(converted.state_dict())
    torch.testing.assert_close(again(x), original(x), rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(copy.deepcopy(converted)(x), original(x), rtol=1.3e-6, atol=1e-5)


def test_bad_model_argument():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        convert_model("llama")


def test_skip_as_one_string_is_one_name():
    # `in` on the string used to match substrings: "l" and "head" were skipped with skip="lm_head"
    model = nn.ModuleDict({"lm_head": nn.Linear(16, 16), "l": nn.Linear(16, 16), "head": nn.Linear(16, 16)})
    convert_model(model, skip="lm_head")
    assert type(model["lm_head"]) is nn.Linear
    assert isinstance(model["l"], tm.Linear) and isinstance(model["head"], tm.Linear)


def test_skip_names_that_match_nothing_are_named():
    """A misspelt skip name would convert the layer meant to stay: it is named in a warning,
    and the names that match (qualified, or a last component) convert as asked."""
    model = nn.ModuleDict({"lm_head": nn.Linear(16, 16), "block": nn.Sequential(nn.Linear(16, 16))})
    with pytest.warns(UserWarning, match=r"skip names no module of the model: 'lm_haed'"):
        convert_model(model, skip=["lm_haed", "block.0"])
    assert isinstance(model["lm_head"], tm.Linear) and type(model["block"][0]) is nn.Linear
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_model(nn.ModuleDict({"lm_head": nn.Linear(16, 16)}), skip="lm_head")


@pytest.mark.parametrize("kwargs, match", [
    (dict(skip=["lm_head", 3]), r"skip must be a module name or a sequence of names \(str\), got \['lm_head', 3\]"),
    (dict(skip=None), r"skip must be a module name or a sequence of names \(str\), got None"),
    (dict(module_filter_fn="lm_head"), r"module_filter_fn must be a callable or None, got 'lm_head'"),
    (dict(fuse_norm_linear="no"), r"fuse_norm_linear must be True or False, got 'no'"),
    (dict(recipe=recipe.DelayedScaling), r"recipe must be a recipe instance, got the class DelayedScaling; pass "
                                         r"DelayedScaling\(\) instead"),
    (dict(recipe=16), r"recipe must be a te_core.recipe recipe .*got int"),
])
def test_bad_arguments_name_the_problem(kwargs, match):
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16))
    with pytest.raises(TypeError, match=rf"convert_model: {match}"):
        convert_model(model, **kwargs)
    assert type(model[1]) is nn.Linear  # refused before anything was converted


def test_hugging_face_llama_from_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    tokens = torch.randint(0, 64, (2, 8))
    before = model(tokens).logits
    convert_model(model, skip=("lm_head",))
    assert isinstance(model.model.layers[0].self_attn.q_proj, tm.Linear)
    assert isinstance(model.model.layers[0].input_layernorm, tm.RMSNorm)
    torch.testing.assert_close(model(tokens).logits, before, rtol=1e-4, atol=1e-4)


class _TiedLM(nn.Module):
    """An embedding and an LM head sharing one weight, as tied Hugging Face models have them."""

    def __init__(self, vocab=64, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(torch.relu(self.proj(self.norm(self.embed(tokens)))))


def test_converted_layers_hold_the_models_own_parameters():
    """The new modules hold the model's Parameter objects: weights the model ties stay tied (the
    head's gradient reaches the embedding; parameters do not multiply), and an optimizer made
    before the conversion trains the converted model."""
    torch.manual_seed(0)
    model = _TiedLM()
    original = copy.deepcopy(model)
    params = {name: p for name, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    convert_model(model)
    assert isinstance(model.head, tm.Linear) and isinstance(model.norm, tm.RMSNorm)
    assert model.head.weight is model.embed.weight
    assert {name: p for name, p in model.named_parameters()} == params  # the same objects, the same names
    original_opt = torch.optim.SGD(original.parameters(), lr=0.1)
    tokens = torch.randint(0, 64, (4, 8))
    for _ in range(3):
        for m, o in ((model, opt), (original, original_opt)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
            o.step()
    for (name, p), q in zip(model.named_parameters(), original.parameters()):
        torch.testing.assert_close(p, q, rtol=1.3e-6, atol=1e-5, msg=name)


def test_a_tie_fp8_primary_weights_break_is_named():
    with te.quantized_model_init(recipe=recipe.Float8CurrentScaling()):
        model = _TiedLM()
        with pytest.warns(UserWarning, match=r"head\.weight shared a parameter with another part of the model"):
            convert_model(model)
    assert model.head.weight is not model.embed.weight


def test_what_stays_as_it_is_is_said_once():
    class Projection(nn.Linear):  # a subclass: its forward may differ from nn.Linear's
        pass

    class Conv1D(nn.Module):  # Hugging Face GPT-2's: x @ weight + bias, weight (in, out)
        def __init__(self, nf, nx):
            super().__init__()
            self.weight, self.bias = nn.Parameter(torch.randn(nx, nf)), nn.Parameter(torch.zeros(nf))

    model = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 10), Projection(16, 16), Conv1D(16, 16),
                          nn.RMSNorm((4, 16)), nn.MultiheadAttention(16, 2))
    with pytest.warns(UserWarning) as caught:
        convert_model(model, recipe=recipe.DelayedScaling())
    messages = [str(w.message) for w in caught]
    assert sum("1 (64->10)" in m for m in messages) == 1 and all(m.count("1 (64->10)") <= 1 for m in messages)
    linear_like = [m for m in messages if "left as they are" in m]
    assert len(linear_like) == 1 and "2 (Projection), 3 (Conv1D)" in linear_like[0]
    assert "out_proj" not in linear_like[0]  # (torch's attention reads its own projection's weight)
    assert type(model[2]) is Projection and type(model[3]) is Conv1D
    assert type(model[4]) is nn.RMSNorm  # a norm over two dimensions stays, as nn.LayerNorm's would


def test_modules_with_hooks_or_parametrizations_are_left_as_they_are():
    """A te-core module in their place would drop a forward hook, a parametrization or an old-style
    weight_norm silently (the output, or what trains, would change): they stay, named in a warning,
    and the model computes what it computed before."""
    import torch.nn.utils.parametrize as parametrize

    class Softplus(nn.Module):
        def forward(self, w):
            return nn.functional.softplus(w)

    g = torch.Generator().manual_seed(4)
    hooked, plain = nn.Linear(32, 32), nn.Linear(32, 32)
    hooked.register_forward_hook(lambda mod, inp, out: out * 3)
    norm = nn.RMSNorm(32)  # (a parametrized one is still an nn.RMSNorm instance)
    parametrize.register_parametrization(norm, "weight", Softplus())
    normed = torch.nn.utils.weight_norm(nn.Linear(32, 16, bias=False))
    model = nn.Sequential(hooked, nn.ReLU(), norm, plain, nn.ReLU(), normed)
    x = torch.randn(8, 32, generator=g, device="cpu").to(torch.get_default_device())
    model.to(x.device)
    want = model(x)
    original = norm.parametrizations.weight.original
    with pytest.warns(UserWarning, match=r"0 \(Linear\), 2 \(ParametrizedRMSNorm\), 5 \(Linear\): modules with hooks"):
        convert_model(model)
    assert model[0] is hooked and model[2] is norm and model[5] is normed
    assert isinstance(model[3], tm.Linear)  # the plain Linear (its norm stays: no fusion with it)
    assert any(p is original for p in model.parameters())
    torch.testing.assert_close(model(x), want, rtol=1.3e-6, atol=1e-5)


@pytest.mark.reference_only
def test_norms_kept_in_another_dtype_stay_and_the_model_still_runs():
    """A bf16 model whose norms are kept in float32 (GPT-OSS-style `_keep_in_fp32_modules`, or by
    hand): torch's norms return the input's dtype, te-core's (as TE's) their parameters', which
    the next bf16 Linear would refuse. Those norms stay as they are, with a warning naming them;
    the Linears are converted, and the model computes what it computed. (On the CPU only: torch's
    CUDA layer_norm refuses a bf16 input with float32 parameters, so there the model itself does
    not run, before or after conversion.)"""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 16)).to(torch.bfloat16)
    model[1].float()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    want = model(x)
    converted = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"left as they are: 1 \(torch.float32\): norms kept in another dtype"):
        convert_model(converted)
    assert type(converted[1]) is nn.LayerNorm and isinstance(converted[0], tm.Linear) \
        and isinstance(converted[2], tm.Linear)
    torch.testing.assert_close(converted(x), want, rtol=1.6e-2, atol=1e-5)


def test_modules_with_a_forward_of_their_own_stay():
    """A module whose instance forward was replaced (Accelerate's CPU-offload and device_map
    hooks, which also set `_hf_hook` and keep the weights elsewhere) is left as it is, with the
    hooks warning: a te-core module in its place would drop the hook and read meta weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    inner = model[0].forward
    model[0].forward = lambda x: inner(x) * 2.0
    model[0]._hf_hook = object()
    with pytest.warns(UserWarning, match=r"left as they are, in high precision: 0 \(Linear\)"):
        convert_model(model)
    assert type(model[0]) is nn.Linear and isinstance(model[1], tm.Linear)
