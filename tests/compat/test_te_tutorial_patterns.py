"""The usage patterns of Transformer Engine's PyTorch tutorials, on te-core through the
`transformer_engine` stand-in (reference backend, CPU, tiny random models):

- a Hugging Face Llama whose decoder layers are swapped for a TransformerLayer subclass, its
  weights copied in through the TE state-dict names (q/k/v views included), FP8 training;
- Gemma layers (zero-centred RMSNorm, GeGLU, fused interleaved or split QKV) fed Hugging Face
  weights, a (batch, sequence) padding mask, and KV-cached generation with InferenceParams
  given page arguments while not paged;
- the quickstart's plain-torch layer rebuilt from te.Linear / te.LayerNorm, fused modules and
  TransformerLayer sharing its parameters; the FP8 primer's "FP8 output equals the FP32 output
  on FP8-representable inputs".
Needs transformers for the Hugging Face parts (`pip install 'te-core[hf]'`).
"""
from __future__ import annotations

import json
import math
from collections import OrderedDict

import pytest
import torch
from torch import nn

import te_core


FP32 = dict(rtol=1.3e-6, atol=1e-5)
E4M3 = dict(rtol=0.125, atol=0.0675)


def _sqnr(x, ref) -> float:
    """Signal-to-quantization-noise ratio of x against ref, in dB."""
    return (20 * torch.log10(ref.norm() / (x.detach() - ref.detach()).norm())).item()


def _hf():
    return pytest.importorskip("transformers", minversion="4.44", reason="needs pip install 'te-core[hf]'")


def _load_shards(folder):
    """Every tensor of a sharded safetensors checkpoint written by save_pretrained."""
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(folder / shard)))
    return tensors


def _randomize_norms(model, mean):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(mean, 0.1)


# ---------------------------------------------------------------- Llama (te_llama tutorial)

def _llama_layer_class(te):
    class LlamaLayer(te.TransformerLayer):
        """Takes a LlamaDecoderLayer's place: built from the config, called as HF calls it."""

        def __init__(self, config, *args, **kwargs):
            super().__init__(config.hidden_size, config.intermediate_size, config.num_attention_heads,
                             bias=False, layernorm_epsilon=config.rms_norm_eps, hidden_dropout=0,
                             attention_dropout=0, fuse_qkv_params=False, normalization="RMSNorm",
                             activation="swiglu", attn_input_format="bshd",
                             num_gqa_groups=config.num_key_value_heads)
            head_dim = config.hidden_size // config.num_attention_heads
            self.rope = te.attention.RotaryPositionEmbedding(head_dim)(max_seq_len=config.max_position_embeddings)

        def forward(self, hidden_states, *args, attention_mask=None, **kwargs):
            hidden_states = hidden_states[0] if isinstance(hidden_states, tuple) else hidden_states
            return super().forward(hidden_states, attention_mask=attention_mask, rotary_pos_emb=self.rope)

    return LlamaLayer


_LLAMA_NAMES = {  # HF name -> (TE name, rows of the TE tensor it fills: "gate" / "up" halves of fc1)
    "input_layernorm.weight": ("self_attention.layernorm_qkv.layer_norm_weight", None),
    "self_attn.q_proj.weight": ("self_attention.layernorm_qkv.query_weight", None),
    "self_attn.k_proj.weight": ("self_attention.layernorm_qkv.key_weight", None),
    "self_attn.v_proj.weight": ("self_attention.layernorm_qkv.value_weight", None),
    "self_attn.o_proj.weight": ("self_attention.proj.weight", None),
    "post_attention_layernorm.weight": ("layernorm_mlp.layer_norm_weight", None),
    "mlp.gate_proj.weight": ("layernorm_mlp.fc1_weight", "gate"),
    "mlp.up_proj.weight": ("layernorm_mlp.fc1_weight", "up"),
    "mlp.down_proj.weight": ("layernorm_mlp.fc2_weight", None),
}


def _copy_llama_weights(hf_tensors, te_model, ffn):
    """The tutorial's loading: write HF tensors into the TE model's state_dict() entries in
    place (they must be views of the parameters), then load the rest by name."""
    te_sd = te_model.state_dict()
    layers = sorted({k.split(".")[2] for k in hf_tensors if k.startswith("model.layers.")})
    for i in layers:
        for hf_name, (te_name, half) in _LLAMA_NAMES.items():
            rows = slice(None) if half is None else (slice(0, ffn) if half == "gate" else slice(ffn, None))
            te_sd[f"model.layers.{i}.{te_name}"].data[rows] = hf_tensors[f"model.layers.{i}.{hf_name}"]
    te_model.load_state_dict(hf_tensors, strict=False)


def test_llama_with_te_decoder_layers_matches_hf_and_trains_in_fp8(stand_in, tmp_path, monkeypatch):
    transformers = _hf()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf_model = transformers.LlamaForCausalLM(cfg).float()
    _randomize_norms(hf_model, 1.0)
    hf_model.save_pretrained(tmp_path, max_shard_size="50KB")  # sharded, as the tutorial's loader expects
    with monkeypatch.context() as patch:
        patch.setattr(modeling_llama, "LlamaDecoderLayer", _llama_layer_class(te))
        te_model = transformers.LlamaForCausalLM(cfg).float()
    assert isinstance(te_model.model.layers[0], te.TransformerLayer)
    _copy_llama_weights(_load_shards(tmp_path), te_model, cfg.intermediate_size)

    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    ref = hf_model(input_ids=ids, labels=ids)
    out = te_model(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, ref.logits, **FP32)
    ref.loss.backward()
    out.loss.backward()
    for hf_name, te_name in (("model.embed_tokens.weight", None), ("lm_head.weight", None),
                             ("model.layers.0.mlp.down_proj.weight", "model.layers.0.layernorm_mlp.fc2_weight"),
                             ("model.layers.1.input_layernorm.weight",
                              "model.layers.1.self_attention.layernorm_qkv.layer_norm_weight")):
        hf_grad = hf_model.get_parameter(hf_name).grad
        torch.testing.assert_close(te_model.get_parameter(te_name or hf_name).grad, hf_grad, **FP32)

    te_model.zero_grad()
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    for _ in range(2):
        with te.autocast(enabled=True, recipe=recipe):
            fp8 = te_model(input_ids=ids, labels=ids)
        fp8.loss.backward()
    torch.testing.assert_close(fp8.loss, ref.loss, **E4M3)
    assert not torch.equal(fp8.logits, out.logits)  # the GEMMs did run in FP8
    grads = [p.grad for p in te_model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


# ---------------------------------------------------------------- Gemma (te_gemma tutorial)

def _gemma_layers(te, cfg, fuse_qkv):
    return nn.ModuleList(te.TransformerLayer(
        cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, bias=False,
        layernorm_epsilon=cfg.rms_norm_eps, hidden_dropout=0, attention_dropout=0, fuse_qkv_params=fuse_qkv,
        normalization="RMSNorm", activation="geglu", attn_input_format="bshd",
        num_gqa_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, layer_number=i + 1,
        zero_centered_gamma=True) for i in range(cfg.num_hidden_layers))


def _copy_gemma_weights(hf_sd, layers, cfg, fuse_qkv):
    """The tutorial's mapping; with fused QKV, heads interleaved as [q1 k1 v1 q2 k2 v2 ...]."""
    d, ffn = cfg.head_dim, cfg.intermediate_size
    for i, layer in enumerate(layers):
        src = lambda name: hf_sd[f"model.layers.{i}.{name}"]  # noqa: E731
        te_sd = layer.state_dict()
        te_sd["self_attention.layernorm_qkv.layer_norm_weight"].data.copy_(src("input_layernorm.weight"))
        te_sd["self_attention.proj.weight"].data.copy_(src("self_attn.o_proj.weight"))
        te_sd["layernorm_mlp.layer_norm_weight"].data.copy_(src("post_attention_layernorm.weight"))
        te_sd["layernorm_mlp.fc2_weight"].data.copy_(src("mlp.down_proj.weight"))
        te_sd["layernorm_mlp.fc1_weight"].data[:ffn].copy_(src("mlp.gate_proj.weight"))
        te_sd["layernorm_mlp.fc1_weight"].data[ffn:].copy_(src("mlp.up_proj.weight"))
        for j, part in enumerate(("q", "k", "v")):
            weight = src(f"self_attn.{part}_proj.weight")
            if not fuse_qkv:
                te_sd[f"self_attention.layernorm_qkv.{dict(q='query', k='key', v='value')[part]}_weight"].data.copy_(weight)
                continue
            fused = te_sd["self_attention.layernorm_qkv.weight"]
            for head in range(cfg.num_attention_heads):
                fused.data[(3 * head + j) * d:(3 * head + j + 1) * d] = weight[head * d:(head + 1) * d]


@pytest.mark.parametrize("fuse_qkv", [False, True], ids=["split_qkv", "fused_interleaved_qkv"])
def test_gemma_layers_with_hf_weights_match_hf(stand_in, fuse_qkv):
    transformers = _hf()
    import transformer_engine.pytorch as te

    torch.manual_seed(1)
    cfg = transformers.GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                   max_position_embeddings=64, pad_token_id=0, initializer_range=0.3)
    hf_model = transformers.GemmaForCausalLM(cfg).float().eval()
    _randomize_norms(hf_model, 0.0)
    layers = _gemma_layers(te, cfg, fuse_qkv)
    _copy_gemma_weights(hf_model.state_dict(), layers, cfg, fuse_qkv)
    rope = te.attention.RotaryPositionEmbedding(cfg.head_dim)(max_seq_len=cfg.max_position_embeddings)

    ids = torch.randint(1, cfg.vocab_size, (2, 12))
    seen = {}  # the first layer's input: embeddings as this transformers version scales them
    def keep_input(module, args, kwargs):
        seen["h"] = args[0] if args else kwargs["hidden_states"]

    hook = hf_model.model.layers[0].register_forward_pre_hook(keep_input, with_kwargs=True)
    with torch.no_grad():
        ref = hf_model(input_ids=ids).logits
        hook.remove()
        h = seen["h"]
        for layer in layers:  # the tutorial's calibration forward: a (b, s) padding mask, True = pad
            h = layer(h, attention_mask=ids == 0, self_attn_mask_type="padding_causal", rotary_pos_emb=rope)
        logits = hf_model.lm_head(hf_model.model.norm(h))
    torch.testing.assert_close(logits, ref, **FP32)


def _attention_reference(q, k, v, lengths):
    """Causal attention of each sequence's first `lengths[i]` tokens, float64, (b, s, h, d)."""
    out = torch.zeros_like(q, dtype=torch.float64)
    for i, n in enumerate(lengths):
        qi, ki, vi = (t[i, :n].double().transpose(0, 1) for t in (q, k, v))
        scores = qi @ ki.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out[i, :n] = (scores.softmax(-1) @ vi).transpose(0, 1)
    return out


def test_padding_mask_given_as_batch_by_sequence(stand_in):
    import transformer_engine.pytorch as te

    b, s, h, d, lengths = 3, 10, 2, 8, [10, 7, 4]
    attn = te.DotProductAttention(h, d, attn_mask_type="padding_causal", qkv_format="bshd")
    q, k, v = (torch.randn(b, s, h, d) for _ in range(3))
    mask = torch.arange(s).expand(b, s) >= torch.tensor(lengths).unsqueeze(1)  # True = padding
    out_2d = attn(q, k, v, attention_mask=mask).view(b, s, h, d)
    out_4d = attn(q, k, v, attention_mask=mask.view(b, 1, 1, s)).view(b, s, h, d)
    assert torch.equal(out_2d, out_4d)
    ref = _attention_reference(q, k, v, lengths)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(out_2d[i, :n].double(), ref[i, :n], **FP32)
    with pytest.raises(ValueError, match=r"\(3, 1, 1, 10\) or \(3, 10\)"):
        attn(q, k, v, attention_mask=mask[:, :9])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous_cache", "paged_cache"])
def test_kv_cache_generation_as_in_the_gemma_tutorial(stand_in, paged):
    """Prefill with 'padding_causal' and decode with 'padding', attention_mask=None, the full RoPE
    table given every step; InferenceParams gets page_size / total_num_pages either way."""
    import transformer_engine.pytorch as te

    torch.manual_seed(2)
    heads, d, hidden, s_max = 4, 8, 32, 16
    layer = te.TransformerLayer(hidden, 48, heads, bias=False, hidden_dropout=0, attention_dropout=0,
                                normalization="RMSNorm", activation="geglu", attn_input_format="bshd",
                                num_gqa_groups=2, kv_channels=d, layer_number=1, zero_centered_gamma=True).eval()
    rope = te.attention.RotaryPositionEmbedding(d)(max_seq_len=s_max)
    cache = te.InferenceParams(max_batch_size=2, max_sequence_length=s_max, num_heads_kv=2, head_dim_v=d,
                               head_dim_k=d, dtype=torch.float32, is_paged=paged, page_size=4,
                               total_num_pages=2 * s_max // 4)
    lengths, new_tokens = [5, 3], 3
    full = torch.randn(2, max(lengths) + new_tokens, hidden)  # each sequence's prompt, then its new tokens
    with torch.no_grad():
        prompt = torch.zeros(2, max(lengths), hidden)  # padding at the end, as the tutorial moves it
        for i, n in enumerate(lengths):
            prompt[i, :n] = full[i, :n]
        cache.pre_step(OrderedDict(enumerate(lengths)))
        first = layer(prompt, self_attn_mask_type="padding_causal", inference_params=cache, rotary_pos_emb=rope)
        steps = []
        for t in range(new_tokens):
            token = torch.stack([full[i, n + t] for i, n in enumerate(lengths)]).unsqueeze(1)
            cache.pre_step(OrderedDict((i, 1) for i in range(2)))
            steps.append(layer(token, self_attn_mask_type="padding", inference_params=cache, rotary_pos_emb=rope))
        for i, n in enumerate(lengths):  # each sequence alone, without a cache
            whole = torch.cat([full[i, :n], full[i, n:n + new_tokens]]).unsqueeze(0)
            ref = layer(whole, self_attn_mask_type="causal", rotary_pos_emb=rope)[0]
            torch.testing.assert_close(first[i, :n], ref[:n], **FP32)
            for t, out in enumerate(steps):
                torch.testing.assert_close(out[i, 0], ref[n + t], **FP32)


# ---------------------------------------------------------------- quickstart and FP8 primer

class _PlainLayer(nn.Module):
    """The quickstart's baseline: pre-LN attention (QKV heads interleaved) and a GELU MLP."""

    def __init__(self, hidden, ffn, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv_projection = nn.Linear(hidden, 3 * hidden)
        self.projection = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def attention(self, qkv):  # (s, b, 3h) -> (s, b, h), no mask
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, self.heads, -1).split(qkv.shape[-1] // (3 * self.heads), dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        probs = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1)
        return (probs @ v).permute(2, 0, 1, 3).reshape(s, b, -1)

    def forward(self, x):
        x = x + self.projection(self.attention(self.qkv_projection(self.ln1(x))))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class _UnfusedTELayer(_PlainLayer):
    def __init__(self, te, hidden, ffn, heads):
        super().__init__(hidden, ffn, heads)
        self.ln1, self.ln2 = te.LayerNorm(hidden), te.LayerNorm(hidden)
        self.qkv_projection, self.projection = te.Linear(hidden, 3 * hidden), te.Linear(hidden, hidden)
        self.fc1, self.fc2 = te.Linear(hidden, ffn), te.Linear(ffn, hidden)


class _FusedTELayer(_PlainLayer):
    def __init__(self, te, hidden, ffn, heads):
        super().__init__(hidden, ffn, heads)
        self.ln_qkv = te.LayerNormLinear(hidden, 3 * hidden, eps=1e-5)
        self.ln_mlp = te.LayerNormMLP(hidden, ffn, eps=1e-5)

    def forward(self, x):
        x = x + self.projection(self.attention(self.ln_qkv(x)))
        return x + self.ln_mlp(x)


def _share(plain, te_model, kind):
    """The quickstart's parameter sharing: te-side attributes set to the plain layer's Parameters."""
    pairs = {"unfused": {f"{m}.{p}": f"{m}.{p}" for m in ("ln1", "ln2", "qkv_projection", "projection", "fc1", "fc2")
                         for p in ("weight", "bias")},
             "fused": {"ln_qkv.layer_norm_weight": "ln1.weight", "ln_qkv.layer_norm_bias": "ln1.bias",
                       "ln_qkv.weight": "qkv_projection.weight", "ln_qkv.bias": "qkv_projection.bias",
                       "projection.weight": "projection.weight", "projection.bias": "projection.bias",
                       "ln_mlp.layer_norm_weight": "ln2.weight", "ln_mlp.layer_norm_bias": "ln2.bias",
                       "ln_mlp.fc1_weight": "fc1.weight", "ln_mlp.fc1_bias": "fc1.bias",
                       "ln_mlp.fc2_weight": "fc2.weight", "ln_mlp.fc2_bias": "fc2.bias"}}
    pairs["layer"] = {("self_attention." + k.replace("ln_qkv", "layernorm_qkv").replace("projection.", "proj.")
                       if k.startswith(("ln_qkv", "projection")) else k.replace("ln_mlp", "layernorm_mlp")): v
                      for k, v in pairs["fused"].items()}
    for te_name, plain_name in pairs[kind].items():
        owner, attr = te_name.rsplit(".", 1)
        setattr(te_model.get_submodule(owner), attr, plain.get_parameter(plain_name))


@pytest.mark.parametrize("kind", ["unfused", "fused", "layer"])
def test_quickstart_layers_sharing_plain_parameters(stand_in, kind):
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    torch.manual_seed(3)
    hidden, ffn, heads = 64, 128, 4
    plain = _PlainLayer(hidden, ffn, heads)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # LayerNorm weights off 1, biases off 0
    te_model = {"unfused": lambda: _UnfusedTELayer(te, hidden, ffn, heads),
                "fused": lambda: _FusedTELayer(te, hidden, ffn, heads),
                "layer": lambda: te.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
                                                     self_attn_mask_type="no_mask", fuse_qkv_params=True)}[kind]()
    _share(plain, te_model, kind)
    x = torch.randn(32, 2, hidden)
    ref = plain(x)
    ref_grads = torch.autograd.grad(ref.sum(), list(plain.parameters()))
    out = te_model(x) if kind != "layer" else te_model(x, attention_mask=None)
    torch.testing.assert_close(out, ref, **FP32)
    grads = torch.autograd.grad(out.sum(), list(plain.parameters()))  # the shared Parameters
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1.3e-6, atol=1e-4)  # sums over 64 tokens

    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    with te.autocast(enabled=True, recipe=recipe):
        fp8 = te_model(x) if kind != "layer" else te_model(x, attention_mask=None)
    fp8.backward(torch.randn_like(fp8))
    assert _sqnr(fp8, ref) > 24  # chained FP8 GEMMs: per-element E4M3 bounds do not compose
    assert not torch.equal(fp8, out)


def test_primer_fp8_output_equals_output_on_representable_inputs(stand_in):
    """With a state made by te_core.init_quantization_state, the first step casts at scale 1, as
    Transformer Engine's does, so the FP8 output is the high-precision output on the inputs
    rounded to E4M3 (te-core's default first step scales by each tensor's own amax instead)."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    def representable(t):
        quantizer = Float8Quantizer(scale=torch.ones(1), amax=torch.zeros(1, 1), fp8_dtype=te.DType.kFloat8E4M3)
        return quantizer(t).dequantize()

    torch.manual_seed(4)
    linear = te.Linear(128, 96, bias=True)
    x = torch.rand(64, 128)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
    te_core.init_quantization_state(linear, recipe)
    with te.autocast(enabled=True, recipe=recipe):
        fp8 = linear(x)
    assert not torch.equal(representable(x), x)
    linear.weight.data = representable(linear.weight.data)
    torch.testing.assert_close(fp8, linear(representable(x)), rtol=0, atol=0)


def test_primer_nvfp4_cell_says_it_is_unsupported(stand_in):
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import NVFP4BlockScaling

    with pytest.raises(NotImplementedError, match="NVFP4"):
        with te.autocast(recipe=NVFP4BlockScaling()):
            pass
