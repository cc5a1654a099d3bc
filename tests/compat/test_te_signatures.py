"""Nothing Transformer Engine accepts is silently ignored by te-core.

For every argument of TE 2.x's public modules and functions (te_signatures.py): either te-core
implements it, and a behavioural test names it (IMPLEMENTED: the test file whose test functions
use the argument), or passing a value other than TE's default raises NotImplementedError whose
message names the argument (or, where TE itself refuses the value, TE's exception: REJECTED_AS_BY_TE).
Owners "ops.X" are TE's fusible operations (transformer_engine.pytorch.ops), te_core.modules.fusible_ops.
"""
from __future__ import annotations

import ast
import pathlib
from functools import lru_cache

import pytest
import torch

import te_core as te
from te_core.modules import fusible_ops as te_ops

from .te_signatures import REQUIRED, SIGNATURES

TESTS = pathlib.Path(__file__).resolve().parents[1]
MODULES, ATTN, COMPAT = "modules/", "modules/test_attention.py", "compat/test_te_arguments.py"
DIST = "distributed/"
OPTIMIZERS = "optimizers/test_fused_optimizers.py"
COMPACT_STATES = "optimizers/test_fused_adam_compact_states.py"
OPS_MEGATRON, OPS_SUBSET = "compat/test_te_ops_megatron.py", "compat/test_te_ops_subset.py"
OPS_ARGUMENTS, FUSIBLE_OPS = "compat/test_te_ops_arguments.py", MODULES + "test_fusible_ops.py"
OPS_TP, OPS_BASIC = DIST + "test_te_ops_tp.py", "compat/test_te_ops_basic.py"
OPS_CACHED = MODULES + "test_fusible_cache_quantized_input.py"
CLAMPED_ARGS = ("limit", "alpha", "glu_linear_offset", "glu_interleave_size")
SITU_ARGS = ("beta1", "beta2", "glu_interleave_size")
TENSOR_PARALLEL = {"sequence_parallel": DIST + "test_errors.py", "tp_group": DIST + "test_errors.py",
                   "tp_size": DIST + "test_errors.py", "get_rng_state_tracker": DIST + "test_rng_tracker.py"}
ATTENTION_PARALLEL = {name: DIST + "test_attention_parallel.py" for name in (
    "sequence_parallel", "tp_group", "tp_size", "get_rng_state_tracker", "set_parallel_mode")}

# (callable, method) -> {argument: test file (under tests/) whose test functions exercise it}
PACKED_AND_CACHED = {**{name: MODULES + "test_packed_layers.py"
                     for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded", "pad_between_seqs")},
                  "inference_params": MODULES + "test_inference_cache.py"}
IMPLEMENTED = {
    ("Linear", "__init__"): {
        "symmetric_ar_type": COMPAT, "ub_name": COMPAT,
        "init_method": MODULES + "test_linear.py", "bias": MODULES + "test_linear.py",
        "return_bias": MODULES + "test_linear.py", "params_dtype": MODULES + "test_linear.py",
        "parallel_mode": MODULES + "test_linear.py", "device": MODULES + "test_linear.py",
        "fuse_wgrad_accumulation": MODULES + "test_linear.py", "name": COMPAT,
        "parameters_split": MODULES + "test_parameters_split.py",
        **TENSOR_PARALLEL, "rng_tracker_name": DIST + "test_rng_tracker.py",
        "delay_wgrad_compute": MODULES + "test_delay_wgrad.py",
        "save_original_input": MODULES + "test_save_original_input.py",
    },
    ("Linear", "forward"): {"is_first_microbatch": MODULES + "test_fp8_modules.py"},
    ("LayerNormLinear", "__init__"): {
        "return_layernorm_output_gathered": DIST + "test_tensor_parallel.py",
        "symmetric_ar_type": COMPAT, "ub_name": COMPAT,
        "name": COMPAT,
        "eps": COMPAT, "init_method": COMPAT, "bias": MODULES + "test_layernorm_linear.py",
        "normalization": MODULES + "test_layernorm_linear.py", "return_bias": MODULES + "test_split_output.py",
        "params_dtype": MODULES + "test_layernorm_linear.py", "device": MODULES + "test_layernorm_linear.py",
        "return_layernorm_output": MODULES + "test_layernorm_linear.py", "zero_centered_gamma": COMPAT,
        **TENSOR_PARALLEL, "parallel_mode": DIST + "test_errors.py",
        "fuse_wgrad_accumulation": MODULES + "test_fuse_wgrad.py",
        "parameters_split": MODULES + "test_parameters_split.py",
        "delay_wgrad_compute": MODULES + "test_delay_wgrad.py",
    },
    ("LayerNormLinear", "forward"): {"is_first_microbatch": MODULES + "test_fp8_modules.py"},
    ("LayerNormMLP", "__init__"): {
        "return_layernorm_output_gathered": DIST + "test_tensor_parallel.py",
        "symmetric_ar_type": COMPAT,
        "name": COMPAT, "seq_length": COMPAT, "micro_batch_size": COMPAT,
        "eps": COMPAT, "init_method": COMPAT, "output_layer_init_method": COMPAT,
        "bias": MODULES + "test_layernorm_linear.py", "normalization": MODULES + "test_layernorm_linear.py",
        "activation": MODULES + "test_layernorm_linear.py", "return_bias": MODULES + "test_split_output.py",
        "params_dtype": MODULES + "test_layernorm_linear.py", "device": MODULES + "test_layernorm_linear.py",
        "return_layernorm_output": MODULES + "test_split_output.py", "zero_centered_gamma": COMPAT,
        **TENSOR_PARALLEL, "set_parallel_mode": DIST + "test_errors.py",
        "activation_params": MODULES + "test_layernorm_linear.py",
        "fuse_wgrad_accumulation": MODULES + "test_fuse_wgrad.py",
        "delay_wgrad_compute": MODULES + "test_delay_wgrad.py", "checkpoint": MODULES + "test_mlp_checkpoint.py",
    },
    ("LayerNormMLP", "forward"): {"is_first_microbatch": MODULES + "test_fp8_modules.py"},
    ("GroupedLinear", "__init__"): {
        "name": COMPAT, "ub_name": COMPAT,
        "bias": COMPAT, "init_method": COMPAT, "return_bias": COMPAT, "params_dtype": COMPAT, "device": COMPAT,
        "parallel_mode": COMPAT, "fuse_wgrad_accumulation": MODULES + "test_fuse_wgrad.py",
        "delay_wgrad_compute": MODULES + "test_delay_wgrad.py",
        "save_original_input": MODULES + "test_save_original_input.py",
        **{name: MODULES + "test_grouped_linear.py" for name in (
            "single_grouped_weight", "single_grouped_bias", "use_grouped_tensor")},
        **{name: DIST + "test_grouped_linear_tp.py" for name in (
            "sequence_parallel", "tp_size", "tp_group", "get_rng_state_tracker", "rng_tracker_name")},
    },
    ("GroupedLinear", "forward"): {"is_first_microbatch": COMPAT, "out": "compat/test_te_suite_more.py",
                                   "dgrad_out": "compat/test_te_suite_more.py"},
    ("LayerNorm", "__init__"): {
        "sequence_parallel": COMPAT,
        "eps": MODULES + "test_layernorm.py", "params_dtype": MODULES + "test_layernorm.py",
        "zero_centered_gamma": MODULES + "test_layernorm.py", "normalized_shape": COMPAT,
        "hidden_size": COMPAT,
    },
    ("RMSNorm", "__init__"): {
        "sequence_parallel": COMPAT,
        "eps": MODULES + "test_layernorm.py", "params_dtype": MODULES + "test_layernorm.py",
        "zero_centered_gamma": MODULES + "test_layernorm.py", "normalized_shape": COMPAT,
        "hidden_size": COMPAT,
    },
    ("DotProductAttention", "__init__"): {
        "num_gqa_groups": ATTN, "attention_dropout": ATTN, "qkv_format": ATTN, "attn_mask_type": ATTN,
        "window_size": ATTN, "bottom_right_diagonal": ATTN, "layer_number": COMPAT, "attention_type": COMPAT,
        "softmax_scale": ATTN, "name": COMPAT, "softmax_type": MODULES + "test_attention_sinks.py",
        "return_max_logit": MODULES + "test_max_logit.py",
        **{name: DIST + "test_dpa_tp.py" for name in ("tp_size", "tp_group", "sequence_parallel",
                                                       "get_rng_state_tracker")},
        **{name: DIST + "test_context_parallel.py" for name in ("cp_group", "cp_global_ranks", "cp_stream",
                                                                 "cp_comm_type")},
    },
    ("DotProductAttention", "forward"): {
        "bf16_backward": COMPAT,
        "query_layer": ATTN, "key_layer": ATTN, "value_layer": ATTN, "attention_mask": ATTN, "qkv_format": ATTN,
        "attn_mask_type": ATTN, "window_size": ATTN, "bottom_right_diagonal": ATTN,
        "checkpoint_core_attention": ATTN, "core_attention_bias_type": ATTN, "core_attention_bias": ATTN,
        "alibi_slopes": ATTN, "fast_zero_fill": COMPAT, "num_splits": COMPAT, **PACKED_AND_CACHED, "cu_seqlens_q": ATTN, "cu_seqlens_kv": ATTN,
        "max_seqlen_q": ATTN, "max_seqlen_kv": ATTN, "qkv_layer": MODULES + "test_packed_layers.py",
        "kv_layer": MODULES + "test_packed_layers.py", "qkv_interleave_dim": MODULES + "test_packed_layers.py",
    },
    ("MultiheadAttention", "__init__"): {
        "seq_length": COMPAT, "micro_batch_size": COMPAT,
        "softmax_type": MODULES + "test_attention_sinks.py", "qk_norm_type": ATTN, "qk_norm_eps": ATTN, "qk_norm_before_rope": ATTN,
        "kv_channels": ATTN, "attention_dropout": ATTN, "layernorm_epsilon": ATTN, "init_method": ATTN,
        "output_layer_init_method": ATTN, "layer_number": COMPAT, "attn_mask_type": ATTN, "window_size": ATTN,
        "bottom_right_diagonal": ATTN, "num_gqa_groups": ATTN, "params_dtype": ATTN,
        "return_layernorm_output": ATTN, "input_layernorm": ATTN, "attention_type": ATTN,
        "fuse_qkv_params": ATTN, "zero_centered_gamma": ATTN, "qkv_weight_interleaved": ATTN, "bias": ATTN,
        "normalization": ATTN, "device": ATTN, "qkv_format": ATTN, "name": COMPAT, "rotary_pos_interleaved": ATTN, "return_bias": ATTN,
        "fuse_wgrad_accumulation": MODULES + "test_fuse_wgrad.py", **ATTENTION_PARALLEL,
    },
    ("MultiheadAttention", "forward"): {
        "attention_mask": ATTN, "encoder_output": ATTN, "attn_mask_type": ATTN, "window_size": ATTN,
        "bottom_right_diagonal": ATTN, "is_first_microbatch": MODULES + "test_fp8_modules.py",
        "checkpoint_core_attention": ATTN, "rotary_pos_emb": ATTN, "core_attention_bias_type": ATTN,
        "core_attention_bias": ATTN, "alibi_slopes": ATTN, "fast_zero_fill": COMPAT, "num_splits": COMPAT, **PACKED_AND_CACHED, "cu_seqlens_q": ATTN,
        "cu_seqlens_kv": ATTN, "max_seqlen_q": ATTN, "max_seqlen_kv": ATTN,
    },
    ("TransformerLayer", "__init__"): {
        "seq_length": COMPAT, "micro_batch_size": COMPAT,
        "qk_norm_type": ATTN, "qk_norm_eps": ATTN, "qk_norm_before_rope": ATTN,
        "num_gqa_groups": MODULES + "test_transformer_layer.py", "layernorm_epsilon": ATTN,
        "hidden_dropout": MODULES + "test_transformer_layer.py", "attention_dropout": ATTN, "init_method": ATTN,
        "output_layer_init_method": ATTN, "layer_number": COMPAT, "kv_channels": ATTN,
        "self_attn_mask_type": ATTN, "window_size": ATTN, "bottom_right_diagonal": ATTN,
        "enc_dec_attn_mask_type": ATTN, "enc_dec_bottom_right_diagonal": ATTN, "enc_dec_window_size": ATTN,
        "params_dtype": ATTN, "ub_overlap_rs_dgrad": COMPAT,
        "apply_residual_connection_post_layernorm": MODULES + "test_transformer_layer.py",
        "output_layernorm": MODULES + "test_transformer_layer.py",
        "parallel_attention_mlp": MODULES + "test_transformer_layer.py",
        "layer_type": MODULES + "test_transformer_layer.py", "rotary_pos_interleaved": ATTN,
        "fuse_qkv_params": ATTN, "zero_centered_gamma": ATTN, "qkv_weight_interleaved": ATTN,
        "ub_overlap_ag": COMPAT, "ub_overlap_rs": COMPAT, "ub_bulk_dgrad": COMPAT, "ub_bulk_wgrad": COMPAT,
        "bias": ATTN, "activation": MODULES + "test_transformer_layer.py",
        "normalization": MODULES + "test_transformer_layer.py", "device": MODULES + "test_transformer_layer.py",
        "attn_input_format": MODULES + "test_transformer_layer.py", "name": COMPAT, "softmax_type": MODULES + "test_attention_sinks.py",
        "activation_params": MODULES + "test_layernorm_linear.py",
        "fuse_wgrad_accumulation": MODULES + "test_fuse_wgrad.py", **ATTENTION_PARALLEL,
        "drop_path_rate": MODULES + "test_transformer_layer.py",
    },
    ("TransformerLayer", "forward"): {
        "attention_mask": ATTN, "self_attn_mask_type": ATTN, "window_size": ATTN, "bottom_right_diagonal": ATTN,
        "encoder_output": MODULES + "test_transformer_layer.py", "enc_dec_attn_mask": ATTN,
        "enc_dec_attn_mask_type": ATTN, "enc_dec_window_size": ATTN, "enc_dec_bottom_right_diagonal": ATTN,
        "is_first_microbatch": MODULES + "test_fp8_modules.py", "checkpoint_core_attention": ATTN,
        "rotary_pos_emb": MODULES + "test_transformer_layer.py", "core_attention_bias_type": ATTN,
        "core_attention_bias": ATTN, "alibi_slopes": ATTN, "fast_zero_fill": COMPAT, "num_splits": COMPAT, **PACKED_AND_CACHED, "cu_seqlens_q": ATTN,
        "cu_seqlens_kv": ATTN, "max_seqlen_q": ATTN, "max_seqlen_kv": ATTN,
    },
    ("RotaryPositionEmbedding", "__init__"): {
        "rotary_percent": COMPAT, "seq_len_interpolation_factor": COMPAT, "rotary_base": COMPAT,
        "pretrained_max_position_embeddings": COMPAT,
        "interleaved": ATTN,
    },
    ("RotaryPositionEmbedding", "forward"): {"offset": COMPAT},
    ("apply_rotary_pos_emb", "call"): {"tensor_format": ATTN, "interleaved": ATTN, "fused": COMPAT,
                                        "start_positions": MODULES + "test_rope_offsets.py",
                                        "cu_seqlens": MODULES + "test_rope_packed.py",
                                        "cp_size": MODULES + "test_rope_packed.py",
                                        "cp_rank": MODULES + "test_rope_packed.py"},
    ("apply_fused_qkv_rotary_pos_emb", "call"): {name: MODULES + "test_rope_fused_qkv.py" for name in (
        "tensor_format", "start_positions", "interleaved", "cu_seqlens", "cp_size", "cp_rank")},
    ("make_graphed_callables", "call"): {
        "num_warmup_iters": MODULES + "test_graphs.py", "allow_unused_input": COMPAT,
        "fp8_enabled": MODULES + "test_graphs.py", "fp8_recipe": MODULES + "test_graphs.py", "fp8_group": COMPAT,
        "fp8_weight_caching": MODULES + "test_graphs.py", "enabled": MODULES + "test_graphs_model.py",
        "recipe": MODULES + "test_graphs_model.py", "amax_reduction_group": MODULES + "test_graphs.py",
        "cache_quantized_params": MODULES + "test_graphs_model.py", "sample_kwargs": MODULES + "test_graphs_model.py",
        "pool": MODULES + "test_graphs.py", "clone_param_grads_on_return": MODULES + "test_graphs.py",
        "pre_warmup_hook": MODULES + "test_graphs.py", "post_warmup_hook": MODULES + "test_graphs.py",
        "retain_graph_in_backward": MODULES + "test_graph_order.py", "capture_time_hooks": MODULES + "test_graph_order.py",
        "calibrating": MODULES + "test_graphs_model.py", "fp8_calibrating": MODULES + "test_graphs_model.py",
    },
    ("get_cpu_offload_context", "call"): {name: MODULES + "test_cpu_offload.py" for name in (
        "enabled", "num_layers", "model_layers", "offload_activations", "offload_weights", "double_buffering",
        "manual_synchronization", "retain_pinned_cpu_buffers", "offload_stream")},
    ("autocast", "__init__"): {
        "enabled": "quantization/test_autocast.py", "calibrating": "quantization/test_autocast.py",
        "recipe": "quantization/test_autocast.py", "amax_reduction_group": "quantization/test_amax_reduction.py",
    },
    ("fp8_autocast", "call"): {
        "enabled": "quantization/test_autocast.py", "calibrating": "quantization/test_autocast.py",
        "fp8_recipe": "quantization/test_autocast.py", "fp8_group": "quantization/test_autocast.py",
    },
    ("quantized_model_init", "call"): {"enabled": COMPAT, "recipe": "modules/test_fp8_modules.py",
                                       "preserve_high_precision_init_val": MODULES + "test_high_precision_init.py"},
    ("fp8_model_init", "call"): {"enabled": COMPAT, "recipe": COMPAT,
                                 "preserve_high_precision_init_val": MODULES + "test_high_precision_init.py"},
    ("is_fp8_available", "call"): {"return_reason": "compat/test_availability.py"},
    ("is_bf16_available", "call"): {"return_reason": "compat/test_availability.py"},
    ("is_nvfp4_available", "call"): {"return_reason": "compat/test_availability.py"},
    ("Fp8Padding", "__init__"): {"align_size": MODULES + "test_fp8_padding.py"},
    ("Fp8Unpadding", "__init__"): {"align_size": MODULES + "test_fp8_padding.py"},
    ("FusedAdam", "__init__"): {name: OPTIMIZERS for name in (
        "lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode", "capturable", "master_weights",
        "use_decoupled_grad", "set_grad_none", "exp_avg_dtype", "exp_avg_sq_dtype")} | {
        "master_weight_dtype": COMPACT_STATES, "store_param_remainders": COMPACT_STATES},
    ("FusedSGD", "__init__"): {name: OPTIMIZERS for name in (
        "momentum", "dampening", "weight_decay", "nesterov", "wd_after_momentum", "set_grad_none",
        "materialize_master_grads")},
    **{(owner, "__init__"): {"device": OPS_MEGATRON, "dtype": FUSIBLE_OPS, "eps": FUSIBLE_OPS,
                             "zero_centered_gamma": OPS_MEGATRON, "sm_margin": OPS_ARGUMENTS}
       for owner in ("ops.LayerNorm", "ops.RMSNorm")},
    ("ops.BasicLinear", "__init__"): {
        "device": OPS_MEGATRON, "dtype": FUSIBLE_OPS, "accumulate_into_main_grad": OPS_MEGATRON,
        "rng_state_tracker_function": OPS_ARGUMENTS,
        **{name: OPS_TP for name in ("tensor_parallel_mode", "tensor_parallel_group", "sequence_parallel")},
    },
    ("ops.GroupedLinear", "__init__"): {
        "bias": OPS_SUBSET, "device": OPS_SUBSET, "dtype": FUSIBLE_OPS, "accumulate_into_main_grad": OPS_SUBSET,
        "delay_wgrad_compute": OPS_SUBSET, "scale_bias": MODULES + "test_grouped_scale_bias.py",
        **{name: OPS_ARGUMENTS for name in (
            "rng_state_tracker_function", "single_grouped_weight", "single_grouped_bias")},
    },
    ("ops.Bias", "__init__"): {"device": OPS_MEGATRON, "dtype": FUSIBLE_OPS, "tensor_parallel": OPS_TP,
                               "tensor_parallel_group": OPS_TP},
    ("ops.SwiGLU", "__init__"): {"glu_interleave_size": OPS_SUBSET, "cache_quantized_input": OPS_CACHED},
    **{(f"ops.{name}", "__init__"): {"cache_quantized_input": OPS_CACHED}
       for name in ("GELU", "ReLU", "SiLU", "GEGLU", "ReGLU", "GLU", "QGELU", "QGEGLU", "SReLU", "SReGLU")},
    ("ops.ScaledSwiGLU", "__init__"): {"glu_interleave_size": OPS_SUBSET},
    ("ops.AllReduce", "__init__"): {"process_group": OPS_TP, "reduce_in_backward": OPS_TP},
    ("ops.ReduceScatter", "__init__"): {"process_group": OPS_TP},
    ("ops.AllGather", "__init__"): {"process_group": OPS_TP},
    ("ops.MakeExtraOutput", "__init__"): {"in_place": OPS_MEGATRON},
    ("ops.Linear", "__init__"): {
        **{name: OPS_BASIC for name in ("bias", "device", "dtype", "rng_state_tracker_function",
                                        "accumulate_into_main_grad")},
        **{name: OPS_TP for name in ("tensor_parallel_mode", "tensor_parallel_group", "sequence_parallel")},
    },
    ("ops.AddExtraInput", "__init__"): {"in_place": OPS_BASIC},
    ("ops.Quantize", "__init__"): {"forward": OPS_BASIC, "backward": OPS_BASIC},
    ("ops.L2Normalization", "__init__"): {name: OPS_BASIC for name in ("eps", "seq_length", "micro_batch_size")},
    ("ops.ClampedSwiGLU", "__init__"): {**{n: OPS_BASIC for n in CLAMPED_ARGS}, "cache_quantized_input": OPS_CACHED},
    ("ops.ScaledClampedQGeGLU", "__init__"): {n: OPS_BASIC for n in CLAMPED_ARGS},
    ("ops.SiTUGLU", "__init__"): {**{n: OPS_BASIC for n in SITU_ARGS}, "cache_quantized_input": OPS_CACHED},
    ("ops.ScaledSiTUGLU", "__init__"): {n: OPS_BASIC for n in SITU_ARGS},
}

# TE arguments whose values other than the default TE itself refuses: te-core refuses them with TE's
# exception class, its message naming the argument.
REJECTED_AS_BY_TE = {(owner, "__init__"): {"activation_recompute_in_mlp": ValueError}
                     for owner in ("ops.ScaledSwiGLU", "ops.ScaledClampedQGeGLU", "ops.ScaledSiTUGLU")}

# TE arguments that are not te-core's to implement nor to reject: checkpoint() passes **kwargs on
# to the function it runs, as TE's does.
NOT_CHECKED = {("checkpoint", "call")}

# a value other than TE's default that TE accepts, for arguments where the generic choice
# (default flipped / replaced) is not a valid TE value
PROBES = {
    "cp_comm_type": "a2a", "softmax_type": "off-by-one", "qk_norm_type": "RMSNorm", "parallel_mode": "column",
    "symmetric_ar_type": "multimem_all_reduce", "activation_params": {"limit": 7.0}, "num_splits": 2,
    "use_grouped_tensor": True, "master_weight_dtype": torch.float16, "exp_avg_dtype": torch.float16,
    "exp_avg_sq_dtype": torch.float16,
}


def _probe(arg: str, default):
    if arg in PROBES:
        return PROBES[arg]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    return object() if default is None else default + "_other"


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _module_call(build, inputs):
    """(construct(**kw), call(**kw)) for a module built by `build`."""
    return build, lambda **kw: build()(*inputs(), **kw)


CALLS = {
    "Linear": _module_call(lambda **kw: te.Linear(8, 8, **kw), lambda: (_x(4, 8),)),
    "LayerNormLinear": _module_call(lambda **kw: te.LayerNormLinear(8, 8, **kw), lambda: (_x(4, 8),)),
    "LayerNormMLP": _module_call(lambda **kw: te.LayerNormMLP(8, 16, **kw), lambda: (_x(4, 8),)),
    "GroupedLinear": _module_call(lambda **kw: te.GroupedLinear(2, 8, 8, **kw), lambda: (_x(4, 8), [2, 2])),
    "LayerNorm": _module_call(lambda **kw: te.LayerNorm(8, **kw), lambda: (_x(4, 8),)),
    "RMSNorm": _module_call(lambda **kw: te.RMSNorm(8, **kw), lambda: (_x(4, 8),)),
    "DotProductAttention": _module_call(
        lambda **kw: te.DotProductAttention(2, 4, **kw), lambda: (_x(3, 2, 2, 4), _x(3, 2, 2, 4), _x(3, 2, 2, 4))
    ),
    "MultiheadAttention": _module_call(lambda **kw: te.MultiheadAttention(8, 2, **kw), lambda: (_x(3, 2, 8),)),
    "TransformerLayer": _module_call(lambda **kw: te.TransformerLayer(8, 16, 2, **kw), lambda: (_x(3, 2, 8),)),
    "RotaryPositionEmbedding": _module_call(lambda **kw: te.RotaryPositionEmbedding(4, **kw), lambda: (3,)),
    "apply_rotary_pos_emb": (None, lambda **kw: te.apply_rotary_pos_emb(
        _x(3, 2, 2, 4), te.RotaryPositionEmbedding(4)(3), **kw)),
    "apply_fused_qkv_rotary_pos_emb": (None, lambda **kw: te.apply_fused_qkv_rotary_pos_emb(
        _x(3, 2, 1, 12), te.RotaryPositionEmbedding(4)(3), te.RotaryPositionEmbedding(4)(3), [4, 4, 4], **kw)),
    "make_graphed_callables": (None, lambda **kw: te.make_graphed_callables(
        te.Linear(8, 8), (_x(4, 8).requires_grad_(),), **kw)),
    "get_cpu_offload_context": (None, lambda **kw: te.get_cpu_offload_context(**kw)),
    "autocast": (lambda **kw: te.autocast(**kw).__enter__(), None),
    "fp8_autocast": (None, lambda **kw: te.fp8_autocast(**kw).__enter__()),
    "quantized_model_init": (None, lambda **kw: te.quantized_model_init(**kw).__enter__()),
    "fp8_model_init": (None, lambda **kw: te.fp8_model_init(**kw).__enter__()),
    "is_fp8_available": (None, lambda **kw: te.is_fp8_available(**kw)),
    "is_bf16_available": (None, lambda **kw: te.is_bf16_available(**kw)),
    "is_nvfp4_available": (None, lambda **kw: te.is_nvfp4_available(**kw)),
    "get_default_recipe": (None, lambda **kw: te.get_default_recipe(**kw)),
    "Fp8Padding": _module_call(lambda **kw: te.Fp8Padding(2, **kw), lambda: (_x(4, 8), [2, 2])),
    "Fp8Unpadding": _module_call(lambda **kw: te.Fp8Unpadding(2, **kw), lambda: (_x(32, 8), [2, 2])),
    "FusedAdam": (lambda **kw: te.optimizers.FusedAdam([torch.nn.Parameter(_x(4))], **kw), None),
    "FusedSGD": (lambda **kw: te.optimizers.FusedSGD([torch.nn.Parameter(_x(4))], lr=0.1, **kw), None),
    # transformer_engine.pytorch.ops: te_core.modules.fusible_ops (te.ops is the backends' op registry)
    "ops.Sequential": (None, lambda **kw: te_ops.Sequential(te_ops.GELU())(_x(4, 8), **kw)),
    "ops.BasicLinear": _module_call(lambda **kw: te_ops.BasicLinear(8, 8, **kw), lambda: (_x(4, 8),)),
    "ops.GroupedLinear": _module_call(lambda **kw: te_ops.GroupedLinear(2, 8, 8, **kw),
                                      lambda: (_x(4, 8), torch.tensor([2, 2]))),
    "ops.Bias": _module_call(lambda **kw: te_ops.Bias(8, **kw), lambda: (_x(4, 8),)),
    "ops.LayerNorm": _module_call(lambda **kw: te_ops.LayerNorm(8, **kw), lambda: (_x(4, 8),)),
    "ops.RMSNorm": _module_call(lambda **kw: te_ops.RMSNorm(8, **kw), lambda: (_x(4, 8),)),
    **{f"ops.{name}": _module_call(lambda name=name, **kw: getattr(te_ops, name)(**kw), lambda: (_x(4, 8),))
       for name in ("GELU", "ReLU", "SiLU", "GEGLU", "ReGLU", "SwiGLU", "MakeExtraOutput")},
    "ops.ScaledSwiGLU": _module_call(lambda **kw: te_ops.ScaledSwiGLU(**kw), lambda: (_x(4, 8), _x(4))),
    **{f"ops.{name}": (lambda name=name, **kw: getattr(te_ops, name)(**kw), None)
       for name in ("AllReduce", "ReduceScatter", "AllGather")},
    "ops.Linear": _module_call(lambda **kw: te_ops.Linear(8, 8, **kw), lambda: (_x(4, 8),)),
    "ops.AddExtraInput": _module_call(lambda **kw: te_ops.AddExtraInput(**kw), lambda: (_x(4, 8), _x(4, 8))),
    "ops.ConstantScale": _module_call(lambda **kw: te_ops.ConstantScale(2.0, **kw), lambda: (_x(4, 8),)),
    "ops.Reshape": _module_call(lambda **kw: te_ops.Reshape((8, 4), **kw), lambda: (_x(4, 8),)),
    "ops.Dropout": _module_call(lambda **kw: te_ops.Dropout(0.5, **kw), lambda: (_x(4, 8),)),
    **{f"ops.{name}": _module_call(lambda name=name, **kw: getattr(te_ops, name)(**kw), lambda: (_x(4, 8),))
       for name in ("Quantize", "L2Normalization", "GLU", "QGELU", "QGEGLU", "SReLU", "SReGLU")},
    "ops.ScaledSReLU": _module_call(lambda **kw: te_ops.ScaledSReLU(**kw), lambda: (_x(4, 8), _x(4))),
    **{f"ops.{name}": _module_call(lambda name=name, **kw: getattr(te_ops, name)(**kw), lambda: (_x(4, 8),))
       for name in ("ClampedSwiGLU", "SiTUGLU")},
    **{f"ops.{name}": _module_call(lambda name=name, **kw: getattr(te_ops, name)(**kw), lambda: (_x(4, 8), _x(4)))
       for name in ("ScaledClampedQGeGLU", "ScaledSiTUGLU")},
}


def _cases():
    for (owner, method), args in SIGNATURES.items():
        if (owner, method) in NOT_CHECKED:
            continue
        for arg, default in args.items():
            if default is REQUIRED or arg.startswith("_"):
                continue  # required arguments are used by every test; private ones are TE-internal
            yield pytest.param(owner, method, arg, default, id=f"{owner}.{method}.{arg}")


def _names_in(fn: ast.AST) -> set:
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return names


@lru_cache(maxsize=None)
def _names_used_in_tests(path: str) -> frozenset:
    """Every identifier, keyword-argument name and string constant inside test functions of `path`
    and inside the module's functions they name (the helpers that distributed tests run on each rank)."""
    tree = ast.parse((TESTS / path).read_text())
    helpers = {fn.name: fn for fn in tree.body if isinstance(fn, ast.FunctionDef)}
    todo = [fn for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test")]
    names, seen = set(), set()
    while todo:
        fn = todo.pop()
        seen.add(fn.name)
        found = _names_in(fn)
        names |= found
        todo += [helpers[name] for name in found if name in helpers and name not in seen]
    return frozenset(names)


@pytest.mark.parametrize("owner, method, arg, default", list(_cases()))
def test_argument_implemented_or_rejected(owner, method, arg, default):
    implemented = IMPLEMENTED.get((owner, method), {})
    if arg in implemented:
        assert arg in _names_used_in_tests(implemented[arg]), (
            f"{owner}.{method}({arg}) is listed as implemented but no test in tests/{implemented[arg]} uses it"
        )
        return
    construct, call = CALLS[owner]
    run = construct if method in ("__init__",) and construct is not None else call
    value = _probe(arg, default)
    with pytest.raises(REJECTED_AS_BY_TE.get((owner, method), {}).get(arg, NotImplementedError), match=arg):
        run(**{arg: value})


def test_every_owner_has_a_call():
    assert {owner for owner, _ in SIGNATURES} - {o for o, _ in NOT_CHECKED} <= set(CALLS)
