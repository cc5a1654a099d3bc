"""Behaviour of Transformer Engine arguments that no other test exercises: each either changes
what it should, or (labels, kernel choices) provably changes nothing, as in Transformer Engine."""
from __future__ import annotations

import warnings

import pytest
import torch

import te_core as te
from te_core.recipe import DelayedScaling


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_name_is_kept_as_a_label():
    assert te.Linear(4, 4, name="fc").name == "fc"
    assert te.LayerNormLinear(4, 4, name="ln_fc").name == "ln_fc"
    assert te.LayerNormMLP(4, 8, name="mlp").name == "mlp"
    assert te.GroupedLinear(2, 4, 4, name="experts").name == "experts"
    assert te.DotProductAttention(2, 4, name="core").name == "core"
    assert te.MultiheadAttention(8, 2, name="attn").name == "attn"
    assert te.TransformerLayer(8, 16, 2, name="block").name == "block"
    with pytest.raises(TypeError, match="LayerNormMLP: name must be a string or None, got int"):
        te.LayerNormMLP(4, 8, name=3)


def test_ub_name_is_kept_as_a_label_and_changes_no_result():
    """ub_name names a module's userbuffers, read only with an ub_overlap_* flag (which te-core
    refuses); Megatron-LM passes one to every module with the flags off."""
    torch.manual_seed(0)
    plain = te.Linear(16, 16)
    named = te.Linear(16, 16, ub_name="qkv")
    named.load_state_dict(plain.state_dict())
    x = _x(16, 16)
    assert named.ub_name == "qkv" and plain.ub_name is None
    assert torch.equal(named(x), plain(x))
    assert te.LayerNormLinear(16, 16, ub_name="fc1").ub_name == "fc1"
    assert te.GroupedLinear(2, 16, 16, ub_name="fc2").ub_name == "fc2"
    with pytest.raises(TypeError, match="Linear: ub_name must be a string or None, got int"):
        te.Linear(16, 16, ub_name=1)
    with pytest.raises(NotImplementedError, match="ub_overlap_ag"):
        te.Linear(16, 16, ub_name="qkv", ub_overlap_ag=True)


def test_submodules_are_named_as_transformer_engine_names_them():
    layer = te.TransformerLayer(8, 16, 2, name="block", layer_type="decoder")
    names = {path: module.name for path, module in layer.named_modules() if getattr(module, "name", None)}
    assert names == {
        "": "block",
        "self_attention": "block.self_attention",
        "self_attention.layernorm_qkv": "block.self_attention.layernorm_linear_qkv",
        "self_attention.core_attention": "block.self_attention.core_attention",
        "self_attention.proj": "block.self_attention.proj",
        "inter_attention": "block.inter_attention",
        "inter_attention.layernorm_query": "block.inter_attention.layernorm_linear_q",
        "inter_attention.key_value": "block.inter_attention.linear_kv",
        "inter_attention.core_attention": "block.inter_attention.core_attention",
        "inter_attention.proj": "block.inter_attention.proj",
        "layernorm_mlp": "block.layernorm_mlp",
    }
    attention = te.MultiheadAttention(8, 2, name="attn")
    assert attention.qkv.name == "attn.linear_qkv"
    assert all(getattr(m, "name", None) is None for m in te.TransformerLayer(8, 16, 2).modules())


def test_a_norms_sequence_parallel_flags_its_parameters_and_changes_no_result():
    """Transformer Engine's legacy LayerNorm / RMSNorm(sequence_parallel=...): the flag set on the
    weight (and bias), for Megatron-LM's gradient all-reduce; the norm computes the same."""
    x = _x(6, 8, seed=5)
    for cls in (te.LayerNorm, te.RMSNorm):
        flagged, plain = cls(8, sequence_parallel=True), cls(8)
        params = [p for p in (flagged.weight, getattr(flagged, "bias", None)) if p is not None]
        assert params and all(p.sequence_parallel is True for p in params)
        assert not hasattr(plain.weight, "sequence_parallel")
        assert cls(8, sequence_parallel=False).weight.sequence_parallel is False
        torch.testing.assert_close(flagged(x), plain(x), rtol=0, atol=0)
        with pytest.raises(TypeError, match="sequence_parallel must be True, False or None"):
            cls(8, sequence_parallel="yes")


def test_seq_length_and_micro_batch_size_change_no_result():
    """Transformer Engine sizes its fusions' warm-up with them; the layer computes the same."""
    x = _x(6, 2, 8, seed=4)

    def run(**sizes):
        torch.manual_seed(0)
        layer = te.TransformerLayer(8, 16, 2, hidden_dropout=0.0, attention_dropout=0.0, **sizes)
        return layer(x)

    torch.testing.assert_close(run(seq_length=6, micro_batch_size=2), run(), rtol=0, atol=0)
    torch.manual_seed(0)
    plain = te.LayerNormMLP(8, 16)(x)
    torch.manual_seed(0)
    sized = te.LayerNormMLP(8, 16, seq_length=6, micro_batch_size=2)(x)
    torch.testing.assert_close(sized, plain, rtol=0, atol=0)
    torch.manual_seed(0)
    plain = te.MultiheadAttention(8, 2, attention_dropout=0.0)(x)
    torch.manual_seed(0)
    sized = te.MultiheadAttention(8, 2, attention_dropout=0.0, seq_length=6, micro_batch_size=2)(x)
    torch.testing.assert_close(sized, plain, rtol=0, atol=0)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="seq_length must be a positive int or None"):
            te.TransformerLayer(8, 16, 2, seq_length=bad)
    with pytest.raises(ValueError, match="MultiheadAttention: micro_batch_size must be a positive int"):
        te.MultiheadAttention(8, 2, micro_batch_size=0)


def test_layer_number_and_attention_type_leave_attention_unchanged():
    """Transformer Engine divides the logits by layer_number and multiplies them back in the
    softmax: the result is the same for every layer_number."""
    q, k, v = _x(4, 2, 2, 8, seed=1), _x(4, 2, 2, 8, seed=2), _x(4, 2, 2, 8, seed=3)
    base = te.DotProductAttention(2, 8)(q, k, v)
    torch.testing.assert_close(te.DotProductAttention(2, 8, layer_number=7, attention_type="cross")(q, k, v), base)
    with pytest.raises(ValueError, match="layer_number must be a positive integer"):
        te.DotProductAttention(2, 8, layer_number=0)
    assert te.MultiheadAttention(8, 2, layer_number=3).core_attention.layer_number == 3
    assert te.TransformerLayer(8, 16, 2, layer_number=4).self_attention.layer_number == 4


def test_fast_zero_fill_selects_no_different_values():
    torch.manual_seed(0)
    mha = te.MultiheadAttention(8, 2, attention_dropout=0.0)
    layer = te.TransformerLayer(8, 16, 2, hidden_dropout=0.0, attention_dropout=0.0)
    x = _x(4, 2, 8, seed=4)
    torch.testing.assert_close(mha(x, fast_zero_fill=False), mha(x, fast_zero_fill=True))
    torch.testing.assert_close(layer(x, fast_zero_fill=False), layer(x))
    q = _x(4, 2, 2, 4, seed=5)
    dpa = te.DotProductAttention(2, 4)
    torch.testing.assert_close(dpa(q, q, q, fast_zero_fill=False), dpa(q, q, q))


def test_num_splits_selects_no_different_values():
    """DotProductAttention's num_splits (TE's TransformerLayer.forward has none: refused there)."""
    torch.manual_seed(1)
    layer = te.TransformerLayer(8, 16, 2, hidden_dropout=0.0, attention_dropout=0.0)
    x = _x(4, 2, 8, seed=6)
    with pytest.raises(TypeError, match="TransformerLayer.forward got an unexpected keyword argument 'num_splits'"):
        layer(x, num_splits=4)
    q = _x(4, 2, 2, 4, seed=7)
    dpa = te.DotProductAttention(2, 4)
    torch.testing.assert_close(dpa(q, q, q, num_splits=2), dpa(q, q, q))
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="num_splits must be None or a positive int"):
            dpa(q, q, q, num_splits=bad)


def test_userbuffer_flags_are_inert_without_ub_tp_comm_overlap():
    torch.manual_seed(1)
    a = te.TransformerLayer(8, 16, 2, hidden_dropout=0.0, attention_dropout=0.0)
    b = te.TransformerLayer(8, 16, 2, hidden_dropout=0.0, attention_dropout=0.0, ub_overlap_ag=False,
                            ub_overlap_rs=False, ub_overlap_rs_dgrad=True, ub_bulk_dgrad=False, ub_bulk_wgrad=False)
    b.load_state_dict(a.state_dict())
    x = _x(3, 2, 8, seed=6)
    torch.testing.assert_close(a(x), b(x))
    with pytest.raises(NotImplementedError, match="ub_tp_comm_overlap"):
        te.TransformerLayer(8, 16, 2, ub_tp_comm_overlap=True)


def test_norm_linear_eps_init_and_zero_centered_gamma():
    seen = []
    lnl = te.LayerNormLinear(8, 4, eps=0.5, zero_centered_gamma=True, init_method=lambda w: seen.append(w.shape)
                             or torch.nn.init.ones_(w))
    mlp = te.LayerNormMLP(8, 16, eps=0.5, zero_centered_gamma=True, init_method=torch.nn.init.ones_,
                          output_layer_init_method=torch.nn.init.zeros_)
    assert seen == [(4, 8)] and torch.all(lnl.weight == 1)
    assert torch.all(mlp.fc1_weight == 1) and torch.all(mlp.fc2_weight == 0)
    x = _x(3, 8, seed=7)
    # zero-centered gamma starts at 0 and means weight 1 + gamma; eps=0.5 enters the variance
    want_ln = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 0.5)
    assert torch.all(lnl.layer_norm_weight == 0)
    torch.testing.assert_close(lnl(x), want_ln @ lnl.weight.T + lnl.bias, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(mlp(x), mlp.fc2_bias.expand(3, 8), rtol=1.3e-6, atol=1e-5)


def test_grouped_linear_options():
    seen = []
    gl = te.GroupedLinear(2, 8, 4, bias=True, return_bias=True, params_dtype=torch.bfloat16, device="cpu",
                          init_method=lambda w: seen.append(tuple(w.shape)) or torch.nn.init.ones_(w))
    assert seen == [(4, 8), (4, 8)] and gl.weight0.dtype == torch.bfloat16 and gl.weight0.device.type == "cpu"
    with torch.no_grad():
        gl.bias0.fill_(3.0)
        gl.bias1.fill_(4.0)
    x = _x(5, 8, seed=8).bfloat16()
    out, bias = gl(x, [2, 3], is_first_microbatch=True)
    want = x.double().sum(-1, keepdim=True).expand(5, 4)  # the bias is returned, not added
    torch.testing.assert_close(out.double(), want, rtol=1.6e-2, atol=1e-5)
    assert bias is not None
    assert te.GroupedLinear(2, 8, 4, bias=False).bias0 is None
    # without tensor parallelism, parallel_mode="column" / "row" split nothing, in TE as here
    torch.testing.assert_close(te.GroupedLinear(2, 8, 4, parallel_mode="column", init_method=torch.nn.init.ones_)(
        x.float(), [2, 3]), te.GroupedLinear(2, 8, 4, init_method=torch.nn.init.ones_)(x.float(), [2, 3]))


def test_layernorm_normalized_shape_and_hidden_size_alias():
    x = _x(3, 8, seed=9)
    for cls in (te.LayerNorm, te.RMSNorm):
        a, b = cls(normalized_shape=8), cls(hidden_size=8)
        assert a.normalized_shape == b.normalized_shape == (8,)
        torch.testing.assert_close(a(x), b(x))


def test_rotary_options_follow_transformer_engine():
    dim, base = 8, 500.0
    inv = 1.0 / base ** (torch.arange(0, 4, 2, dtype=torch.float64) / 4)  # rotary_percent=0.5 -> 4 dims
    freqs = te.RotaryPositionEmbedding(dim, rotary_percent=0.5, rotary_base=base)(5, offset=2)
    want = torch.outer(torch.arange(2, 7, dtype=torch.float64), inv)
    torch.testing.assert_close(freqs.double().view(5, -1), torch.cat((want, want), -1))
    # interpolation needs both numbers: by the factor up to pretrained * factor positions,
    # by max_seq_len / pretrained beyond
    fixed = te.RotaryPositionEmbedding(dim, seq_len_interpolation_factor=2, pretrained_max_position_embeddings=4)
    torch.testing.assert_close(fixed(6)[0::2], te.RotaryPositionEmbedding(dim)(3))
    dynamic = fixed(16)
    torch.testing.assert_close(dynamic[4], te.RotaryPositionEmbedding(dim)(2)[1])  # 4 * 4 / 16 = 1
    only_factor = te.RotaryPositionEmbedding(dim, seq_len_interpolation_factor=2)
    torch.testing.assert_close(only_factor(6), te.RotaryPositionEmbedding(dim)(6))


def test_apply_rotary_fused_flag_selects_no_different_values():
    t, freqs = _x(5, 2, 2, 8, seed=10), te.RotaryPositionEmbedding(8)(5)
    torch.testing.assert_close(te.apply_rotary_pos_emb(t, freqs, fused=False), te.apply_rotary_pos_emb(t, freqs))
    with pytest.raises(ValueError, match="cu_seqlens is for tensor_format='thd'"):
        te.apply_rotary_pos_emb(t, freqs, cu_seqlens=torch.tensor([0, 5]))


def test_model_init_enabled_and_recipe():
    with te.quantized_model_init(enabled=False):
        assert te.Linear(16, 16).weight.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with te.fp8_model_init(enabled=True, recipe=DelayedScaling()):
            w = te.Linear(16, 16).weight
        with te.fp8_model_init(enabled=False):
            assert type(te.Linear(16, 16).weight) is torch.nn.Parameter
    assert isinstance(w, te.QuantizedTensor) or type(w.data) is not torch.Tensor


def test_graphed_callables_fp8_group_is_the_amax_reduction_group(monkeypatch):
    from te_core import graphs
    from te_core.quantization import get_autocast_context

    seen = []

    def recording_graph_api(callables, sample_args, num_warmup_iters, allow_unused_input):
        seen.append((get_autocast_context().amax_reduction_group, num_warmup_iters, allow_unused_input))
        return callables

    def recording_warm_up(device, callables, inputs, iterations, allow_unused, pre_hook, post_hook, **order):
        seen.append(("warm-up", get_autocast_context().amax_reduction_group, iterations, allow_unused))

    monkeypatch.setattr(graphs, "_graph_api", lambda device: recording_graph_api)
    monkeypatch.setattr(graphs, "warm_up", recording_warm_up)
    group = object()
    te.make_graphed_callables(te.Linear(16, 16), (_x(16, 16).requires_grad_(),), num_warmup_iters=1,
                              allow_unused_input=True, fp8_enabled=True, fp8_group=group)
    # te-core runs the warm-up itself (TE's order and hooks), so the device's capture gets none
    assert seen == [("warm-up", group, 1, True), (group, 0, True)]


@pytest.mark.parametrize("build", [lambda **kw: te.Linear(32, 16, **kw), lambda **kw: te.LayerNormLinear(32, 16, **kw),
                                   lambda **kw: te.LayerNormMLP(32, 64, **kw)])
def test_symmetric_ar_type_is_kept_and_computes_as_the_standard_all_reduce(build):
    """symmetric_ar_type (Transformer Engine's choice of symmetric-memory all-reduce kernel for a
    row-parallel forward): accepted with TE's values, kept, and the module computes as without it
    (te-core runs torch.distributed's all-reduce for every value); anything else is refused."""
    x = _x(8, 32)
    torch.manual_seed(0)
    plain = build()
    for kind in ("multimem_all_reduce", "two_shot", "one_shot"):
        torch.manual_seed(0)
        module = build(symmetric_ar_type=kind)
        assert module.symmetric_ar_type == kind
        torch.testing.assert_close(module(x), plain(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="symmetric_ar_type must be one of None, 'multimem_all_reduce'"):
        build(symmetric_ar_type="three_shot")


def test_bf16_backward_changes_nothing_as_attention_is_never_fp8():
    """DotProductAttention.forward(bf16_backward=...) (Transformer Engine's high-precision backward
    for FP8 attention): te-core's attention runs in the inputs' precision either way, so the
    outputs and gradients are the same bit for bit; a non-bool is refused."""
    attention = te.DotProductAttention(4, 8)
    results = []
    for flag in (False, True):
        q, k, v = (_x(6, 2, 4, 8, seed=s).requires_grad_() for s in range(3))
        out = attention(q, k, v, bf16_backward=flag)
        out.sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(TypeError, match="bf16_backward"):
        attention(*(_x(6, 2, 4, 8) for _ in range(3)), bf16_backward="yes")
