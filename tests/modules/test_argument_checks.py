"""Bad arguments to the modules' constructors and calls raise at once, naming the argument and
what it must be, instead of being used (a NaN softmax scale, a zero rotary base, an int where an
init method goes) or failing later inside torch with no context."""
import math
from collections import OrderedDict

import pytest
import torch

import te_core as te
import te_core.modules as tm
from te_core.modules.rope import apply_rotary_pos_emb

BAD_CONSTRUCTORS = [
    (lambda: tm.Linear(8, 8, init_method=0), TypeError, "Linear: init_method must be a callable or None, got 0"),
    (lambda: tm.LayerNormLinear(8, 8, init_method=3), TypeError, "LayerNormLinear: init_method must be a callable"),
    (lambda: tm.LayerNormMLP(8, 16, output_layer_init_method=5), TypeError,
     "LayerNormMLP: output_layer_init_method must be a callable"),
    (lambda: tm.GroupedLinear(2, 8, 8, init_method="normal"), TypeError, "GroupedLinear: init_method must be a callable"),
    (lambda: tm.DotProductAttention(2, 4, softmax_scale=math.nan), ValueError, "softmax_scale must be positive and finite"),
    (lambda: tm.DotProductAttention(2, 4, softmax_scale=0.0), ValueError, "softmax_scale must be positive and finite"),
    (lambda: tm.DotProductAttention(2, 4, softmax_scale=True), TypeError, "softmax_scale must be a positive finite number"),
    (lambda: tm.RotaryPositionEmbedding(8.0), ValueError, "dim must be a positive integer"),
    (lambda: tm.LayerNormMLP(8, 16, activation="clamped_swiglu", activation_params={"limit": "a"}), ValueError,
     "LayerNormMLP: clamped_swiglu's limit must be a finite number, got 'a'"),
    (lambda: tm.LayerNormMLP(8, 16, activation="clamped_swiglu", activation_params={"alpha": math.inf}), ValueError,
     "LayerNormMLP: clamped_swiglu's alpha must be a finite number, got inf"),
    (lambda: tm.RotaryPositionEmbedding(8, rotary_percent=2.0), ValueError, r"rotary_percent must be in \(0, 1\]"),
    (lambda: tm.RotaryPositionEmbedding(8, rotary_base=0), ValueError, "rotary_base must be positive and finite"),
    (lambda: tm.RotaryPositionEmbedding(8, rotary_base=math.nan), ValueError, "rotary_base must be positive"),
    (lambda: tm.RotaryPositionEmbedding(8, seq_len_interpolation_factor=0), ValueError,
     "seq_len_interpolation_factor must be positive"),
    (lambda: tm.RotaryPositionEmbedding(8, pretrained_max_position_embeddings=-1), ValueError,
     "pretrained_max_position_embeddings must be a positive integer"),
    (lambda: tm.RotaryPositionEmbedding(8, interleaved="yes"), TypeError, "interleaved must be True or False"),
    (lambda: te.InferenceParams(2, 16, 2, 8, torch.int32), TypeError, "dtype must be the caches' floating-point"),
    (lambda: te.InferenceParams(2, 16, 2, 8, "float32"), TypeError, "dtype must be the caches' floating-point"),
    (lambda: te.InferenceParams(2, 16, 2, 8, torch.float32, is_paged="no"), TypeError, "is_paged must be True or False"),
    (lambda: te.InferenceParams(2, 16, 2, 8, torch.float32, max_ctx_len=32), ValueError,
     "max_ctx_len=32 .* exceeds max_sequence_length=16"),
    (lambda: tm.TransformerLayer(16, 32, 2, enc_dec_attn_mask_type="bogus"), ValueError,
     "unknown enc_dec_attn_mask_type='bogus'; choose one of"),
]


@pytest.mark.parametrize("make, error, message", BAD_CONSTRUCTORS)
def test_bad_constructor_arguments_say_what_is_wrong(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_bad_call_arguments_say_what_is_wrong():
    rope = tm.RotaryPositionEmbedding(8)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="max_seq_len must be a non-negative int"):
            rope(bad)
    with pytest.raises(ValueError, match="offset must be a non-negative int"):
        rope(4, offset=math.nan)
    freqs = rope(4)
    t = torch.randn(4, 2, 2, 8)
    with pytest.raises(TypeError, match="apply_rotary_pos_emb: interleaved must be True or False"):
        apply_rotary_pos_emb(t, freqs, "sbhd", interleaved="yes")
    with pytest.raises(TypeError, match="apply_rotary_pos_emb: freqs must be a torch.Tensor, got list"):
        apply_rotary_pos_emb(t, [1.0], "sbhd")
    dpa = tm.DotProductAttention(2, 8, attn_mask_type="causal", layer_number=1)
    q = torch.randn(4, 1, 2, 8)
    with pytest.raises(TypeError, match="checkpoint_core_attention must be True or False"):
        dpa(q, q, q, checkpoint_core_attention="x")
    with pytest.raises(TypeError, match="bottom_right_diagonal"):
        dpa(q, q, q, bottom_right_diagonal="x")
    params = te.InferenceParams(2, 16, 2, 8, torch.float32)
    with pytest.raises(TypeError, match=r"pre_step: give an OrderedDict \{seq_id: new tokens\}.*got list"):
        params.pre_step([1, 2])
    with pytest.raises(RuntimeError, match=r"call pre_step\(\{seq_id: new tokens\}\) before the model"):
        dpa(q, q, q, inference_params=params)
    layer = tm.TransformerLayer(16, 32, 2, layer_type="decoder", hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(4, 1, 16)
    with pytest.raises(ValueError, match="unknown enc_dec_attn_mask_type='bogus'; choose one of"):
        layer(x, encoder_output=x, enc_dec_attn_mask_type="bogus")
    params.pre_step(OrderedDict(a=2))  # the checks leave a valid call alone
    assert rope(0).shape == (0, 1, 1, 8) and rope(3, offset=2).shape == (3, 1, 1, 8)


def test_more_bad_inputs_say_what_is_wrong():
    """split_sizes not a sequence, a float or bool normalized_shape, float cu_seqlens standing
    for padding masks, a rotary_pos_emb that is neither angles nor a pair of them."""
    with pytest.raises(TypeError, match="Linear: split_sizes must be a list or tuple of positive integers"):
        tm.Linear(8, 8)(torch.randn(4, 8), split_sizes=5)
    for bad in (16.0, True, None):
        with pytest.raises(ValueError, match="normalized_shape must be a positive int or a tuple of them"):
            tm.LayerNorm(bad)
    dpa = tm.DotProductAttention(2, 8, attn_mask_type="padding")
    q = torch.randn(4, 2, 2, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q must be 1-D offsets"):
        dpa(q, q, q, cu_seqlens_q=torch.tensor([0.0, 2.5, 4.0]), cu_seqlens_kv=torch.tensor([0, 2, 4]))
    mha = tm.MultiheadAttention(16, 2, attention_dropout=0.0)
    freqs = tm.RotaryPositionEmbedding(8)(4)
    for bad in ((freqs, freqs, freqs), [1.0]):
        with pytest.raises(ValueError, match="rotary_pos_emb must be a tensor of angles"):
            mha(torch.randn(4, 2, 16), rotary_pos_emb=bad)


@pytest.mark.parametrize("make", [lambda: tm.LayerNormLinear(16, 16), lambda: tm.LayerNormMLP(16, 32),
                                  lambda: tm.MultiheadAttention(16, 2, attention_dropout=0.0)],
                         ids=["LayerNormLinear", "LayerNormMLP", "MultiheadAttention"])
def test_return_residual_is_a_bool(make):
    with pytest.raises(TypeError, match=r"\.forward: return_residual must be True or False, got 'yes'"):
        make()(torch.randn(4, 2, 16), return_residual="yes")


def test_batch_mismatches_name_their_cause():
    """Padding given as cu_seqlens for another number of sequences than the batch, and a
    cross-attention encoder_output with another batch than the queries, say so."""
    dpa = tm.DotProductAttention(2, 8, attn_mask_type="padding")
    q = torch.randn(5, 2, 2, 8)  # sbhd: 2 sequences
    with pytest.raises(ValueError, match=r"cu_seqlens_q describes 3 sequences, but the sbhd tensors hold 2 "
                                         r"\(give b \+ 1 = 3 offsets\)"):
        dpa(q, q, q, cu_seqlens_q=torch.tensor([0, 2, 4, 5]), cu_seqlens_kv=torch.tensor([0, 2, 4, 5]))
    cross = tm.MultiheadAttention(16, 2, attention_type="cross", attention_dropout=0.0)
    with pytest.raises(ValueError, match="encoder_output holds 3 sequences but hidden_states 2"):
        cross(torch.randn(4, 2, 16), encoder_output=torch.randn(6, 3, 16))
    assert cross(torch.randn(4, 2, 16), encoder_output=torch.randn(6, 2, 16)).shape == (4, 2, 16)


@pytest.mark.parametrize("build, call", [
    (lambda: tm.Linear(16, 16), lambda m, x: m(x)),
    (lambda: tm.LayerNormLinear(16, 16), lambda m, x: m(x)),
    (lambda: tm.LayerNormMLP(16, 32), lambda m, x: m(x)),
    (lambda: tm.GroupedLinear(2, 16, 16), lambda m, x: m(x, [2, 2])),
])
def test_input_and_parameters_of_different_dtypes_outside_torch_autocast_are_refused(build, call):
    """As Transformer Engine's modules (and torch's layers): outside torch.autocast the input and
    the parameters share one dtype, where computing in the input's would round float32 parameters
    to bfloat16 silently; under torch.autocast the autocast dtype is the compute dtype."""
    torch.manual_seed(0)
    module = build()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"the input is torch.bfloat16 but the parameter '\w+' is torch.float32; "
                                        r"outside torch.autocast"):
        call(module, x)
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        assert call(module, x).dtype == torch.bfloat16
    assert call(module, x.float()).dtype == torch.float32
