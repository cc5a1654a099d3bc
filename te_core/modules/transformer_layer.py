"""te.TransformerLayer: pre-norm self-attention (+ cross-attention for decoders) and MLP, with
residual connections, in Transformer Engine's layout and submodule names
(self_attention, inter_attention, layernorm_mlp, layernorm)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from ..distributed import tensor_parallel
from ._attention_inputs import check_mask_type, mask_type_spelling
from ._base import QuantizedContainer
from ._tp_container import TensorParallelContainer
from ._common import (
    reject_unsupported,
    cast_if_needed,
    check_activation,
    check_choice,
    check_attention_heads,
    check_bools,
    check_eps,
    check_input,
    check_name,
    check_normalization,
    check_optional_bool,
    check_positive,
    check_probability,
    compute_dtype,
    check_warmup_sizes,
    sub_name,
)
from .attention import QKV_FORMATS, check_hidden_dims
from .layernorm import LayerNorm, RMSNorm
from .layernorm_mlp import LayerNormMLP
from .multihead_attention import MultiheadAttention, check_passed_on
from ._te_order import te_order


class TransformerLayer(TensorParallelContainer, QuantizedContainer):
    @te_order("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_gqa_groups", "layernorm_epsilon",
              "hidden_dropout", "attention_dropout", "init_method", "output_layer_init_method", "layer_number",
              "kv_channels", "self_attn_mask_type", "window_size", "bottom_right_diagonal", "enc_dec_attn_mask_type",
              "enc_dec_bottom_right_diagonal", "enc_dec_window_size", "tp_group", "tp_size", "params_dtype",
              "get_rng_state_tracker", "fuse_wgrad_accumulation", "seq_length", "micro_batch_size", "sequence_parallel",
              "apply_residual_connection_post_layernorm", "output_layernorm", "parallel_attention_mlp", "layer_type",
              "drop_path_rate", "set_parallel_mode", "fuse_qkv_params", "rotary_pos_interleaved", "zero_centered_gamma",
              "qkv_weight_interleaved", "ub_tp_comm_overlap", "ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad",
              "ub_bulk_dgrad", "ub_bulk_wgrad", "bias", "activation", "activation_params", "normalization", "device",
              "attn_input_format", "name", "qk_norm_type", "qk_norm_eps", "qk_norm_before_rope", "softmax_type")
    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_gqa_groups: Optional[int] = None,
        layernorm_epsilon: float = 1e-5,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        init_method=None,
        output_layer_init_method=None,
        layer_number: Optional[int] = None,
        kv_channels: Optional[int] = None,
        self_attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        enc_dec_attn_mask_type: str = "no_mask",
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
        *,
        params_dtype: Optional[torch.dtype] = None,
        apply_residual_connection_post_layernorm: bool = False,
        output_layernorm: bool = False,
        parallel_attention_mlp: bool = False,
        layer_type: str = "encoder",
        fuse_qkv_params: bool = False,
        rotary_pos_interleaved: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        ub_tp_comm_overlap: bool = False,
        ub_overlap_ag: bool = True,
        ub_overlap_rs: bool = True,
        ub_overlap_rs_dgrad: bool = False,
        ub_bulk_dgrad: bool = True,
        ub_bulk_wgrad: bool = True,
        bias: bool = True,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        device: Union[None, str, torch.device] = None,
        attn_input_format: str = "sbhd",
        name: Optional[str] = None,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        get_rng_state_tracker=None,
        set_parallel_mode: bool = False,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        softmax_type: str = "vanilla",
        drop_path_rate: float = 0.0,
        **kwargs,
    ):
        """The ub_overlap_* / ub_bulk_* flags only choose overlaps inside userbuffers
        communication, which ub_tp_comm_overlap=True would enable and te-core rejects; without
        it they select nothing, in Transformer Engine as here.

        Tensor parallelism (tp_size > 1, set_parallel_mode=True): the attention blocks split their
        heads and LayerNormMLP its FFN features over the ranks of tp_group (see
        MultiheadAttention); with sequence_parallel the layer's input and output are the rank's
        shard of the sequence. Hidden dropout runs on the default generator, as in Transformer
        Engine; attention dropout on the RNG tracker's fork when get_rng_state_tracker is given.

        drop_path_rate > 0 (stochastic depth, training only): each slice of the input's first
        dimension keeps the self-attention branch, and separately the MLP branch, with probability
        1 - drop_path_rate, scaled by its inverse, as Transformer Engine does: per sample with
        bshd inputs, per sequence position with sbhd ones. Cross-attention is never dropped.
        drop_path_rate=1.0 drops both branches always (Transformer Engine accepts it too, and
        divides by the zero keep probability, which gives NaN): the layer's output is its input,
        and the branches' parameters get zero gradients."""
        super().__init__()
        debug_name, name = name, "TransformerLayer"
        activation_params = kwargs.pop("activation_params", None)  # checked by LayerNormMLP
        fuse_wgrad = kwargs.pop("fuse_wgrad_accumulation", False)  # passed on to every weighted submodule
        self.seq_length, micro_batch_size = kwargs.pop("seq_length", None), kwargs.pop("micro_batch_size", None)
        check_warmup_sizes(name, self.seq_length, micro_batch_size)
        debug_name = check_name(debug_name, name)
        reject_unsupported(name, ub_tp_comm_overlap=ub_tp_comm_overlap, **kwargs)
        (apply_residual_connection_post_layernorm, output_layernorm, parallel_attention_mlp, fuse_qkv_params,
         rotary_pos_interleaved, zero_centered_gamma, qkv_weight_interleaved, bias, sequence_parallel,
         qk_norm_before_rope, fuse_wgrad, *_) = check_bools(
            name, apply_residual_connection_post_layernorm=apply_residual_connection_post_layernorm,
            output_layernorm=output_layernorm, parallel_attention_mlp=parallel_attention_mlp,
            fuse_qkv_params=fuse_qkv_params, rotary_pos_interleaved=rotary_pos_interleaved,
            zero_centered_gamma=zero_centered_gamma, qkv_weight_interleaved=qkv_weight_interleaved, bias=bias,
            sequence_parallel=sequence_parallel, qk_norm_before_rope=qk_norm_before_rope,
            fuse_wgrad_accumulation=fuse_wgrad, ub_overlap_ag=ub_overlap_ag, ub_overlap_rs=ub_overlap_rs,
            ub_overlap_rs_dgrad=ub_overlap_rs_dgrad, ub_bulk_dgrad=ub_bulk_dgrad, ub_bulk_wgrad=ub_bulk_wgrad)
        for arg, value in (("bottom_right_diagonal", bottom_right_diagonal),
                           ("enc_dec_bottom_right_diagonal", enc_dec_bottom_right_diagonal)):
            check_optional_bool(value, name=arg, module=name)
        layernorm_epsilon = check_eps(layernorm_epsilon, name="layernorm_epsilon", module=name)
        # (1 as torch's dropout takes it: every output zeroed in training)
        hidden_dropout = check_probability(hidden_dropout, name="hidden_dropout", module=name, closed=True)
        check_probability(attention_dropout, name="attention_dropout", module=name)
        hidden_size = check_positive(hidden_size, name="hidden_size", module=name)
        ffn_hidden_size = check_positive(ffn_hidden_size, name="ffn_hidden_size", module=name)
        if kv_channels == 0 and type(kv_channels) is int:  # (TE reads a 0 as unset: hidden_size / heads)
            kv_channels = None
        check_attention_heads(name, num_attention_heads, num_gqa_groups, hidden_size, kv_channels)
        check_activation(activation, name)
        tp = self.init_container_parallel(name, tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel,
                                          get_rng_state_tracker=get_rng_state_tracker,
                                          set_parallel_mode=set_parallel_mode)
        tp["set_parallel_mode"] = set_parallel_mode
        check_normalization(normalization, name)
        self.layer_type = check_choice(layer_type, ("encoder", "decoder"), name="layer_type", module=name)
        if parallel_attention_mlp:  # (Transformer Engine's rules: its parallel branch has none of these)
            for clash, present in (("layer_type='decoder'", layer_type == "decoder"),
                                   ("apply_residual_connection_post_layernorm=True",
                                    apply_residual_connection_post_layernorm),
                                   ("output_layernorm=True", output_layernorm)):
                if present:
                    raise ValueError(f"{name}: parallel_attention_mlp=True does not go with {clash}: the parallel "
                                     "attention and MLP branches read the layer's input, have no cross-attention and "
                                     "no normalized residual; drop one of the two")
        check_choice(attn_input_format, QKV_FORMATS, name="attn_input_format", module=name)
        self.hidden_size, self.name, self.layer_number = hidden_size, debug_name, layer_number
        self.hidden_dropout = hidden_dropout
        drop_path_rate = check_probability(drop_path_rate, name="drop_path_rate", module=name, closed=True)
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0 else None
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.parallel_attention_mlp = parallel_attention_mlp
        self.attn_input_format = attn_input_format
        # (an encoder has no inter-attention, but a bad value is still one: Transformer Engine checks it too)
        enc_dec_attn_mask_type = check_mask_type(enc_dec_attn_mask_type, name="enc_dec_attn_mask_type", module=name)
        self_attn_mask_type = mask_type_spelling(self_attn_mask_type)  # (checked by its attention)
        self.self_attn_mask_type, self.enc_dec_attn_mask_type = self_attn_mask_type, enc_dec_attn_mask_type
        # fmt: off
        common = dict(params_dtype=params_dtype, device=device, bias=bias, zero_centered_gamma=zero_centered_gamma,
                      normalization=normalization, fuse_wgrad_accumulation=fuse_wgrad, **tp)
        attention = dict(num_gqa_groups=num_gqa_groups, kv_channels=kv_channels, attention_dropout=attention_dropout,
                         init_method=init_method, output_layer_init_method=output_layer_init_method,
                         layer_number=layer_number, qkv_format=attn_input_format,
                         fuse_qkv_params=fuse_qkv_params, qkv_weight_interleaved=qkv_weight_interleaved,
                         rotary_pos_interleaved=rotary_pos_interleaved,
                         layernorm_epsilon=layernorm_epsilon, qk_norm_type=qk_norm_type, qk_norm_eps=qk_norm_eps,
                         qk_norm_before_rope=qk_norm_before_rope, softmax_type=softmax_type,
                         seq_length=self.seq_length, micro_batch_size=micro_batch_size, **common)
        # output_layernorm (BERT's post-norm): the norm moves from the self-attention's input to the
        # layer's output, so self-attention has no normalized input to be the residual either
        self.output_layernorm = output_layernorm
        self.self_attention = MultiheadAttention(hidden_size, num_attention_heads, attn_mask_type=self_attn_mask_type,
                                                 window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
                                                 attention_type="self", name=sub_name(debug_name, "self_attention"),
                                                 input_layernorm=not output_layernorm,
                                                 return_layernorm_output=(apply_residual_connection_post_layernorm
                                                                          and not output_layernorm),
                                                 **attention)
        if layer_type == "decoder":
            self.inter_attention = MultiheadAttention(hidden_size, num_attention_heads, attention_type="cross",
                                                      attn_mask_type=enc_dec_attn_mask_type,
                                                      window_size=enc_dec_window_size,
                                                      bottom_right_diagonal=enc_dec_bottom_right_diagonal,
                                                      name=sub_name(debug_name, "inter_attention"),
                                                      input_layernorm=True,
                                                      return_layernorm_output=apply_residual_connection_post_layernorm,
                                                      **attention)
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, eps=layernorm_epsilon, init_method=init_method,
                                          output_layer_init_method=output_layer_init_method, activation=activation,
                                          activation_params=activation_params,
                                          return_layernorm_output=apply_residual_connection_post_layernorm,
                                          name=sub_name(debug_name, "layernorm_mlp"), **common)
        # fmt: on
        if output_layernorm:
            norm_cls = LayerNorm if normalization == "LayerNorm" else RMSNorm
            self.layernorm = norm_cls(
                hidden_size, eps=layernorm_epsilon, params_dtype=params_dtype, zero_centered_gamma=zero_centered_gamma, device=device
            )
            # applied to the rank's sequence shard: its gradient is partial there (summed by the training loop)
            tensor_parallel.mark_sequence_parallel(self, list(self.layernorm.parameters()))
        else:
            self.layernorm = None

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Union[None, Tensor, Tuple[Tensor, Tensor]] = None,
        self_attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        encoder_output: Optional[Tensor] = None,
        enc_dec_attn_mask: Union[None, Tensor, Tuple[Tensor, Tensor]] = None,
        enc_dec_attn_mask_type: Optional[str] = None,
        enc_dec_window_size: Optional[Tuple[int, int]] = None,
        enc_dec_bottom_right_diagonal: Optional[bool] = None,
        is_first_microbatch: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        inference_params=None,
        rotary_pos_emb=None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[Tensor] = None,
        alibi_slopes: Optional[Tensor] = None,
        **kwargs,
    ) -> Tensor:
        """As Transformer Engine: the bias, rotary and sequence-length arguments (cu_seqlens_*,
        max_seqlen_*, fast_zero_fill, ...) go to both attention blocks."""
        name = "TransformerLayer"
        check_passed_on(kwargs, f"{name}.forward")
        check_input(hidden_states, self.hidden_size, name="hidden_states", module=name)
        check_hidden_dims(hidden_states, self.attn_input_format, "hidden_states", name)
        if self.layer_type == "decoder" and encoder_output is None:
            raise ValueError(f"{name}: layer_type='decoder' needs encoder_output")
        if self.sequence_parallel and self.seq_length is not None:
            # as Transformer Engine: the one case where seq_length is checked, since an unsplit
            # sequence would otherwise run as each rank's shard of a sequence tp_size times longer
            expected = self.seq_length // self.tp_size
            if hidden_states.shape[0] != expected:
                raise ValueError(f"{name}: with sequence_parallel=True each rank passes its shard of the sequence: "
                                 f"hidden_states.shape[0] must be seq_length // tp_size = {self.seq_length} // "
                                 f"{self.tp_size} = {expected}, got {hidden_states.shape[0]}; split the sequence "
                                 "dimension across the tensor-parallel ranks")
        if enc_dec_attn_mask_type is not None:
            enc_dec_attn_mask_type = check_mask_type(enc_dec_attn_mask_type, name="enc_dec_attn_mask_type",
                                                     module=name)
        # Under torch.autocast the residual stream runs in the autocast dtype, as in Transformer
        # Engine: the blocks compute in it anyway, and the residual adds and the output would
        # otherwise stay in the input's float32.
        hidden_states = cast_if_needed(hidden_states, compute_dtype(hidden_states))
        shared = dict(is_first_microbatch=is_first_microbatch, checkpoint_core_attention=checkpoint_core_attention,
                      inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
                      core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
                      alibi_slopes=alibi_slopes)
        # self-attention's keys are its queries: it takes the query-side lengths for both, as in TE
        pairs = (("cu_seqlens_q", "cu_seqlens_kv"), ("max_seqlen_q", "max_seqlen_kv"),
                 ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"))
        self_kwargs = {k: v for k, v in kwargs.items() if k not in {kv for _, kv in pairs}}
        for q_name, kv_name in pairs:
            if kwargs.get(q_name) is not None:
                self_kwargs[kv_name] = kwargs[q_name]
        # the residuals come back from the blocks that normalize them (return_residual), so that
        # their gradients are summed inside the norms' backward kernels, not by separate adds
        fuse = not self.apply_residual_connection_post_layernorm and not self.parallel_attention_mlp
        # (self-attention without an input norm: its residual is always its input)
        fuse_self = fuse or self.output_layernorm
        attn = self.self_attention(
            hidden_states, attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type or self.self_attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, return_residual=fuse_self,
            **shared, **self_kwargs,
        )
        attn, residual = attn if fuse_self else self._residual_source(attn, hidden_states)
        if self.parallel_attention_mlp:
            mlp, _ = self._residual_source(
                self.layernorm_mlp(hidden_states, is_first_microbatch=is_first_microbatch), hidden_states
            )
            # one dropout mask on the sum of both branches, as in Transformer Engine
            out = residual + self._drop_path(self._dropout(attn + mlp))
            return self.layernorm(out) if self.layernorm is not None else out
        hidden = residual + self._drop_path(self._dropout(attn))
        if self.layer_type == "decoder":
            cross = self.inter_attention(
                hidden, attention_mask=enc_dec_attn_mask, encoder_output=encoder_output,
                attn_mask_type=enc_dec_attn_mask_type or self.enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                bottom_right_diagonal=enc_dec_bottom_right_diagonal, return_residual=fuse, **shared, **kwargs,
            )
            cross, residual = cross if fuse else self._residual_source(cross, hidden)
            hidden = residual + self._dropout(cross)
        mlp = self.layernorm_mlp(hidden, is_first_microbatch=is_first_microbatch, return_residual=fuse)
        mlp, residual = mlp if fuse else self._residual_source(mlp, hidden)
        out = residual + self._drop_path(self._dropout(mlp))
        return self.layernorm(out) if self.layernorm is not None else out

    def _residual_source(self, output, block_input: Tensor):
        """(block output, residual): the residual is the block's normalized input when
        apply_residual_connection_post_layernorm, else its input."""
        if self.apply_residual_connection_post_layernorm:
            out, ln_out = output
            return out, ln_out
        return output, block_input

    def _dropout(self, x: Tensor) -> Tensor:
        return nn.functional.dropout(x, p=self.hidden_dropout, training=self.training)

    def _drop_path(self, x: Tensor) -> Tensor:
        return x if self.drop_path is None else self.drop_path(x)


class DropPath(nn.Module):
    """Stochastic depth on a residual branch (Transformer Engine's TransformerLayer.drop_path): in
    training, each slice of the first dimension is kept with probability 1 - drop_prob and scaled by
    1 / (1 - drop_prob), or zeroed. The draw is uniform in the input's dtype, floored after adding
    the keep probability, as Transformer Engine draws it; at drop_prob 1 every slice is dropped
    (the draw is still made, so the generator advances as Transformer Engine's does) and nothing
    is scaled by 1 / 0."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: Tensor) -> Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = (keep + torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device)).floor_()
        return x.div(keep) * mask if keep > 0 else x * mask

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}"
