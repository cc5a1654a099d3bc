"""Transformer Engine 2.x's public signatures, as data: the argument names (and defaults) of the
constructors and forwards of its modules and of the functions te-core mirrors, read from
Transformer Engine's source (transformer_engine/pytorch, version 2.20.0.dev0).

test_te_signatures.py checks each argument against te-core: implemented (a behavioural test
names it) or rejected with NotImplementedError naming it. Update this table when a new
Transformer Engine release adds arguments.
"""

REQUIRED = object()  # an argument without a default

SIGNATURES = {
    ('Linear', '__init__'): {
        'in_features': REQUIRED, 'out_features': REQUIRED, 'sequence_parallel': False, 'fuse_wgrad_accumulation':
        False, 'tp_group': None, 'tp_size': 1, 'get_rng_state_tracker': None, 'rng_tracker_name': None,
        'init_method': None, 'bias': True, 'return_bias': False, 'params_dtype': None, 'parallel_mode': None,
        'parameters_split': None, 'device': 'cuda', 'ub_overlap_ag': False, 'ub_overlap_rs': False,
        'ub_overlap_rs_dgrad': False, 'ub_bulk_dgrad': False, 'ub_bulk_wgrad': False, 'ub_name': None,
        'delay_wgrad_compute': False, 'symmetric_ar_type': None, 'save_original_input': False, 'name': None,
    },
    ('Linear', 'forward'): {
        'inp': REQUIRED, 'is_first_microbatch': None, 'fp8_output': False, 'fp8_grad': False,
    },
    ('LayerNormLinear', '__init__'): {
        'in_features': REQUIRED, 'out_features': REQUIRED, 'eps': 1e-05, 'sequence_parallel': False,
        'fuse_wgrad_accumulation': False, 'tp_group': None, 'tp_size': 1, 'get_rng_state_tracker': None,
        'init_method': None, 'bias': True, 'normalization': 'LayerNorm', 'return_bias': False, 'params_dtype': None,
        'parallel_mode': None, 'return_layernorm_output': False, 'return_layernorm_output_gathered': False,
        'parameters_split': None, 'zero_centered_gamma': False, 'device': 'cuda', 'ub_overlap_ag': False,
        'ub_overlap_rs': False, 'ub_overlap_rs_dgrad': False, 'ub_bulk_wgrad': False, 'ub_bulk_dgrad': False,
        'ub_name': None, 'delay_wgrad_compute': False, 'symmetric_ar_type': None, 'name': None,
    },
    ('LayerNormLinear', 'forward'): {
        'inp': REQUIRED, 'is_first_microbatch': None, 'fp8_output': False, 'fp8_grad': False,
    },
    ('LayerNormMLP', '__init__'): {
        'hidden_size': REQUIRED, 'ffn_hidden_size': REQUIRED, 'eps': 1e-05, 'sequence_parallel': False,
        'return_bias': False, 'get_rng_state_tracker': None, 'tp_group': None, 'tp_size': 1, 'init_method': None,
        'bias': True, 'normalization': 'LayerNorm', 'activation': 'gelu', 'activation_params': None,
        'output_layer_init_method': None, 'fuse_wgrad_accumulation': False, 'params_dtype': None,
        'return_layernorm_output': False, 'return_layernorm_output_gathered': False, 'seq_length': None,
        'micro_batch_size': None, 'set_parallel_mode': False, 'zero_centered_gamma': False, 'device': 'cuda',
        'ub_overlap_ag': False, 'name': None, 'ub_overlap_rs': False, 'ub_overlap_rs_dgrad': False, 'ub_bulk_dgrad':
        False, 'ub_bulk_wgrad': False, 'delay_wgrad_compute': False, 'symmetric_ar_type': None, 'checkpoint': False,
    },
    ('LayerNormMLP', 'forward'): {
        'inp': REQUIRED, 'is_first_microbatch': None,
    },
    ('GroupedLinear', '__init__'): {
        'num_gemms': REQUIRED, 'in_features': REQUIRED, 'out_features': REQUIRED, 'sequence_parallel': False,
        'fuse_wgrad_accumulation': False, 'tp_group': None, 'tp_size': 1, 'get_rng_state_tracker': None,
        'rng_tracker_name': None, 'init_method': None, 'bias': True, 'return_bias': False, 'params_dtype': None,
        'parallel_mode': None, 'device': 'cuda', 'ub_overlap_rs': False, 'ub_overlap_ag': False, 'ub_name': None,
        'delay_wgrad_compute': False, 'save_original_input': False, 'single_grouped_weight': False,
        'single_grouped_bias': False, 'name': None, 'use_grouped_tensor': None,
    },
    ('GroupedLinear', 'forward'): {
        'inp': REQUIRED, 'm_splits': REQUIRED, 'is_first_microbatch': None, 'out': None, 'dgrad_out': None,
    },
    ('LayerNorm', '__init__'): {
        'normalized_shape': None, 'eps': 1e-05, 'sequence_parallel': None, 'params_dtype': None,
        'zero_centered_gamma': False, 'hidden_size': None,
    },
    ('RMSNorm', '__init__'): {
        'normalized_shape': None, 'eps': 1e-05, 'sequence_parallel': None, 'params_dtype': None,
        'zero_centered_gamma': False, 'hidden_size': None,
    },
    ('DotProductAttention', '__init__'): {
        'num_attention_heads': REQUIRED, 'kv_channels': REQUIRED, 'num_gqa_groups': None, 'attention_dropout': 0.0,
        'qkv_format': 'sbhd', 'attn_mask_type': 'causal', 'window_size': None, 'bottom_right_diagonal': None,
        'sequence_parallel': False, 'tp_size': 1, 'get_rng_state_tracker': None, 'tp_group': None, 'layer_number':
        None, 'attention_type': 'self', 'cp_group': None, 'cp_global_ranks': None, 'cp_stream': None,
        'cp_comm_type': 'p2p', 'softmax_scale': None, 'softmax_type': 'vanilla', 'return_max_logit': False, 'name':
        None,
    },
    ('DotProductAttention', 'forward'): {
        'query_layer': None, 'key_layer': None, 'value_layer': None, 'attention_mask': None, 'qkv_format': None,
        'cu_seqlens_q': None, 'cu_seqlens_kv': None, 'cu_seqlens_q_padded': None, 'cu_seqlens_kv_padded': None,
        'max_seqlen_q': None, 'max_seqlen_kv': None, 'attn_mask_type': None, 'window_size': None,
        'bottom_right_diagonal': None, 'checkpoint_core_attention': False, 'core_attention_bias_type': 'no_bias',
        'core_attention_bias': None, 'alibi_slopes': None, 'fast_zero_fill': True, 'inference_params': None,
        'pad_between_seqs': None, 'fp8_output': False, 'bf16_backward': False, 'num_splits': 1, 'score_mod': None,
        'score_mod_bprop': None, 'score_mod_tensors': None, 'score_mod_bprop_tensors': None, 'qkv_layer': None,
        'kv_layer': None, 'qkv_interleave_dim': -3,
    },
    ('MultiheadAttention', '__init__'): {
        'hidden_size': REQUIRED, 'num_attention_heads': REQUIRED, 'kv_channels': None, 'attention_dropout': 0.1,
        'layernorm_epsilon': 1e-05, 'init_method': None, 'output_layer_init_method': None, 'layer_number': None,
        'attn_mask_type': 'causal', 'window_size': None, 'bottom_right_diagonal': None, 'tp_group': None, 'tp_size':
        1, 'num_gqa_groups': None, 'fuse_wgrad_accumulation': False, 'get_rng_state_tracker': None,
        'sequence_parallel': False, 'params_dtype': None, 'return_bias': False, 'return_layernorm_output': False,
        'input_layernorm': False, 'attention_type': 'self', 'set_parallel_mode': False, 'fuse_qkv_params': False,
        'zero_centered_gamma': False, 'qkv_weight_interleaved': True, 'rotary_pos_interleaved': False,
        'ub_overlap_ag': False, 'ub_overlap_rs': False, 'ub_overlap_rs_dgrad': False, 'ub_bulk_dgrad': False,
        'ub_bulk_wgrad': False, 'bias': True, 'normalization': 'LayerNorm', 'device': 'cuda', 'qkv_format': 'sbhd',
        'name': None, 'qk_norm_type': None, 'qk_norm_eps': 1e-06, 'qk_norm_before_rope': False, 'seq_length': None,
        'micro_batch_size': None, 'softmax_type': 'vanilla',
    },
    ('MultiheadAttention', 'forward'): {
        'hidden_states': REQUIRED, 'attention_mask': None, 'encoder_output': None, 'attn_mask_type': None,
        'window_size': None, 'bottom_right_diagonal': None, 'is_first_microbatch': None,
        'checkpoint_core_attention': False, 'inference_params': None, 'rotary_pos_emb': None,
        'core_attention_bias_type': 'no_bias', 'core_attention_bias': None, 'alibi_slopes': None, 'cu_seqlens_q':
        None, 'cu_seqlens_kv': None, 'cu_seqlens_q_padded': None, 'cu_seqlens_kv_padded': None, 'max_seqlen_q':
        None, 'max_seqlen_kv': None, 'fast_zero_fill': True, 'pad_between_seqs': None,
    },
    ('TransformerLayer', '__init__'): {
        'hidden_size': REQUIRED, 'ffn_hidden_size': REQUIRED, 'num_attention_heads': REQUIRED, 'num_gqa_groups':
        None, 'layernorm_epsilon': 1e-05, 'hidden_dropout': 0.1, 'attention_dropout': 0.1, 'init_method': None,
        'output_layer_init_method': None, 'layer_number': None, 'kv_channels': None, 'self_attn_mask_type':
        'causal', 'window_size': None, 'bottom_right_diagonal': None, 'enc_dec_attn_mask_type': 'no_mask',
        'enc_dec_bottom_right_diagonal': None, 'enc_dec_window_size': None, 'tp_group': None, 'tp_size': 1,
        'params_dtype': None, 'get_rng_state_tracker': None, 'fuse_wgrad_accumulation': False, 'seq_length': None,
        'micro_batch_size': None, 'sequence_parallel': False, 'apply_residual_connection_post_layernorm': False,
        'output_layernorm': False, 'parallel_attention_mlp': False, 'layer_type': 'encoder', 'drop_path_rate': 0.0,
        'set_parallel_mode': False, 'fuse_qkv_params': False, 'rotary_pos_interleaved': False,
        'zero_centered_gamma': False, 'qkv_weight_interleaved': True, 'ub_tp_comm_overlap': False, 'ub_overlap_ag':
        True, 'ub_overlap_rs': True, 'ub_overlap_rs_dgrad': False, 'ub_bulk_dgrad': True, 'ub_bulk_wgrad': True,
        'bias': True, 'activation': 'gelu', 'activation_params': None, 'normalization': 'LayerNorm', 'device':
        'cuda', 'attn_input_format': 'sbhd', 'name': None, 'qk_norm_type': None, 'qk_norm_eps': 1e-06,
        'qk_norm_before_rope': False, 'softmax_type': 'vanilla',
    },
    ('TransformerLayer', 'forward'): {
        'hidden_states': REQUIRED, 'attention_mask': None, 'self_attn_mask_type': None, 'window_size': None,
        'bottom_right_diagonal': None, 'encoder_output': None, 'enc_dec_attn_mask': None, 'enc_dec_attn_mask_type':
        None, 'enc_dec_window_size': None, 'enc_dec_bottom_right_diagonal': None, 'is_first_microbatch': None,
        'checkpoint_core_attention': False, 'inference_params': None, 'rotary_pos_emb': None,
        'core_attention_bias_type': 'no_bias', 'core_attention_bias': None, 'alibi_slopes': None, 'cu_seqlens_q':
        None, 'cu_seqlens_kv': None, 'cu_seqlens_q_padded': None, 'cu_seqlens_kv_padded': None, 'max_seqlen_q':
        None, 'max_seqlen_kv': None, 'fast_zero_fill': True, 'pad_between_seqs': None,
    },
    ('RotaryPositionEmbedding', '__init__'): {
        'dim': REQUIRED, 'rotary_percent': 1.0, 'seq_len_interpolation_factor': None,
        'pretrained_max_position_embeddings': None, 'rotary_base': 10000.0, 'interleaved': False,
    },
    ('RotaryPositionEmbedding', 'forward'): {
        'max_seq_len': REQUIRED, 'offset': 0,
    },
    ('apply_rotary_pos_emb', 'call'): {
        't': REQUIRED, 'freqs': REQUIRED, 'tensor_format': 'sbhd', 'start_positions': None, 'interleaved': False,
        'fused': False, 'cu_seqlens': None, 'cp_size': 1, 'cp_rank': 0,
    },
    ('apply_fused_qkv_rotary_pos_emb', 'call'): {
        'qkv': REQUIRED, 'q_freqs': REQUIRED, 'k_freqs': REQUIRED, 'qkv_split_arg_list': REQUIRED,
        'tensor_format': 'sbhd', 'start_positions': None, 'interleaved': False, 'cu_seqlens': None, 'cp_size': 1,
        'cp_rank': 0,
    },
    ('checkpoint', 'call'): {
        'function': REQUIRED,
    },
    ('make_graphed_callables', 'call'): {
        'modules': REQUIRED, 'sample_args': REQUIRED, 'num_warmup_iters': 3, 'allow_unused_input': False,
        'sample_kwargs': None, 'fp8_enabled': None, 'fp8_calibrating': None, 'fp8_recipe': None, 'fp8_group': None,
        'fp8_weight_caching': None, 'enabled': None, 'calibrating': None, 'recipe': None, 'amax_reduction_group':
        None, 'cache_quantized_params': None, '_order': None, '_num_layers_per_chunk': None, 'pool': None,
        'retain_graph_in_backward': False, '_reuse_graph_input_output_buffers': False,
        'clone_param_grads_on_return': True, 'pre_warmup_hook': None, 'post_warmup_hook': None,
        'capture_time_hooks': None,
    },
    ('get_cpu_offload_context', 'call'): {
        'enabled': False, 'num_layers': 1, 'model_layers': 1, 'offload_activations': True, 'offload_weights': False,
        'double_buffering': False, 'manual_synchronization': False, 'retain_pinned_cpu_buffers': False,
        'offload_stream': None,
    },
    ('is_fp8_available', 'call'): {
        'return_reason': False,
    },
    ('is_bf16_available', 'call'): {
        'return_reason': False,
    },
    ('is_nvfp4_available', 'call'): {
        'return_reason': False,
    },
    ('get_default_recipe', 'call'): {},
    ('fp8_model_init', 'call'): {
        'enabled': True, 'recipe': None, 'preserve_high_precision_init_val': False,
    },
    ('quantized_model_init', 'call'): {
        'enabled': True, 'recipe': None, 'preserve_high_precision_init_val': False,
    },
    ('fp8_autocast', 'call'): {
        'enabled': True, 'calibrating': False, 'fp8_recipe': None, 'fp8_group': None, '_graph': False,
    },
    ('autocast', '__init__'): {
        'enabled': True, 'calibrating': False, 'recipe': None, 'amax_reduction_group': None, '_graph': False,
    },
    ('Fp8Padding', '__init__'): {'num_gemms': REQUIRED, 'align_size': None},
    ('Fp8Padding', 'forward'): {'inp': REQUIRED, 'm_splits': REQUIRED},
    ('Fp8Unpadding', '__init__'): {'num_gemms': REQUIRED, 'align_size': None},
    ('Fp8Unpadding', 'forward'): {'inp': REQUIRED, 'm_splits': REQUIRED},
    ('FusedAdam', '__init__'): {
        'params': REQUIRED, 'lr': 0.001, 'betas': (0.9, 0.999), 'eps': 1e-08, 'weight_decay': 0.0, 'amsgrad': False,
        'bias_correction': True, 'adam_w_mode': True, 'capturable': False, 'master_weights': False,
        'master_weight_dtype': 'torch.float32', 'exp_avg_dtype': 'torch.float32', 'exp_avg_sq_dtype': 'torch.float32',
        'use_decoupled_grad': False, 'store_param_remainders': False, 'set_grad_none': None,
    },
    ('FusedSGD', '__init__'): {
        'params': REQUIRED, 'lr': REQUIRED, 'momentum': 0.0, 'dampening': 0.0, 'weight_decay': 0.0, 'nesterov': False,
        'wd_after_momentum': False, 'materialize_master_grads': True, 'set_grad_none': None,
    },
    # transformer_engine.pytorch.ops (te_core.modules.fusible_ops), the operations te-core provides.
    # Their forwards are (input, *extra_inputs, **op_kwargs): only the arguments listed below have
    # names; an operation given op_kwargs it does not read raises TypeError in TE and te-core alike.
    ('ops.Sequential', 'forward'): {'input': REQUIRED, 'op_kwargs': None},
    ('ops.BasicLinear', '__init__'): {
        'in_features': REQUIRED, 'out_features': REQUIRED, 'device': None, 'dtype': None,
        'tensor_parallel_mode': None, 'tensor_parallel_group': None, 'sequence_parallel': False,
        'rng_state_tracker_function': None, 'accumulate_into_main_grad': False, 'userbuffers_options': None,
    },
    ('ops.GroupedLinear', '__init__'): {
        'num_groups': REQUIRED, 'in_features': REQUIRED, 'out_features': REQUIRED, 'bias': True, 'device': None,
        'dtype': None, 'rng_state_tracker_function': None, 'accumulate_into_main_grad': False,
        'single_grouped_weight': False, 'single_grouped_bias': False, 'delay_wgrad_compute': False,
        'scale_bias': False,
    },
    # the op_kwargs its fuser_forward reads (OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY)
    ('ops.GroupedLinear', 'forward'): {'input': REQUIRED, 'output': None, 'grad_input': None},
    ('ops.Bias', '__init__'): {
        'size': REQUIRED, 'device': None, 'dtype': None, 'tensor_parallel': False, 'tensor_parallel_group': None,
    },
    ('ops.LayerNorm', '__init__'): {
        'normalized_shape': REQUIRED, 'eps': 1e-05, 'device': None, 'dtype': None, 'zero_centered_gamma': False,
        'sm_margin': 0,
    },
    ('ops.RMSNorm', '__init__'): {
        'normalized_shape': REQUIRED, 'eps': 1e-05, 'device': None, 'dtype': None, 'zero_centered_gamma': False,
        'sm_margin': 0,
    },
    **{('ops.' + name, '__init__'): {'cache_quantized_input': False}
       for name in ('GELU', 'ReLU', 'SiLU', 'GEGLU', 'ReGLU')},
    ('ops.SwiGLU', '__init__'): {'cache_quantized_input': False, 'glu_interleave_size': None},
    ('ops.ScaledSwiGLU', '__init__'): {'glu_interleave_size': None, 'activation_recompute_in_mlp': False},
    ('ops.AllReduce', '__init__'): {'process_group': None, 'reduce_in_backward': True},
    ('ops.ReduceScatter', '__init__'): {'process_group': None},
    ('ops.AllGather', '__init__'): {'process_group': None},
    ('ops.MakeExtraOutput', '__init__'): {'in_place': False},
    ('ops.Linear', '__init__'): {
        'in_features': REQUIRED, 'out_features': REQUIRED, 'bias': True, 'device': None, 'dtype': None,
        'tensor_parallel_mode': None, 'tensor_parallel_group': None, 'sequence_parallel': False,
        'rng_state_tracker_function': None, 'accumulate_into_main_grad': False,
    },
    ('ops.AddExtraInput', '__init__'): {'in_place': False},
    ('ops.ConstantScale', '__init__'): {'scale': REQUIRED},
    ('ops.Reshape', '__init__'): {'shape': REQUIRED},
    ('ops.Dropout', '__init__'): {'p': REQUIRED},
    ('ops.Quantize', '__init__'): {'forward': True, 'backward': False},
    ('ops.L2Normalization', '__init__'): {'eps': 1e-06, 'seq_length': None, 'micro_batch_size': None},
    **{('ops.' + name, '__init__'): {'cache_quantized_input': False}
       for name in ('GLU', 'QGELU', 'QGEGLU', 'SReLU', 'SReGLU')},
    ('ops.ScaledSReLU', '__init__'): {'activation_recompute_in_mlp': False},
    ('ops.ClampedSwiGLU', '__init__'): {
        'limit': 7.0, 'alpha': 1.702, 'glu_linear_offset': 1.0, 'cache_quantized_input': False,
        'glu_interleave_size': None,
    },
    ('ops.SiTUGLU', '__init__'): {
        'beta1': 4.0, 'beta2': 25.0, 'cache_quantized_input': False, 'glu_interleave_size': None,
    },
    ('ops.ScaledSiTUGLU', '__init__'): {
        'glu_interleave_size': None, 'activation_recompute_in_mlp': False, 'beta1': 4.0, 'beta2': 25.0,
    },
    ('ops.ScaledClampedQGeGLU', '__init__'): {
        'glu_interleave_size': None, 'activation_recompute_in_mlp': False, 'limit': 7.0, 'alpha': 1.702,
        'glu_linear_offset': 1.0,
    },
}
