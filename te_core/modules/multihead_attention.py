"""te.MultiheadAttention: (norm +) QKV projection, rotary embedding, attention core, output projection."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ..compat.te_state_dict_names import (
    accept_l2_qk_norm_extra_state,
    expose_split_qkv_names,
    load_split_qkv_names,
    save_split_qkv_names,
)
from ._base import QuantizedContainer
from ._tp_container import TensorParallelContainer
from ._common import (
    check_attention_heads,
    check_bool,
    check_bools,
    check_eps,
    check_choice,
    check_input,
    check_name,
    check_normalization,
    check_positive,
    check_probability,
    check_warmup_sizes,
    reject_unsupported,
    sub_name,
)
from ..distributed import tensor_parallel
from .attention import QKV_FORMATS, DotProductAttention, check_hidden_dims
from .fusible_ops.l2_normalization import L2Normalization
from .inference import fixed_shapes
from .layernorm import LayerNorm, RMSNorm
from .layernorm_linear import LayerNormLinear
from .linear import Linear
from .rope import apply_rotary_pos_emb, rotate_at
from ._te_order import te_order

QK_NORM_TYPES = (None, "L2Normalization", "RMSNorm", "LayerNorm")


def _qk_norms(qk_norm_type, eps: float, head_dim: int, params_dtype, device, module: str, warmup_sizes: dict):
    """(q_norm, k_norm) over each head's features, as Transformer Engine builds them: one shared
    fusible operation ops.L2Normalization (given TE's seq_length / micro_batch_size), or an
    RMSNorm / LayerNorm of its own each; (None, None) without."""
    check_choice(qk_norm_type, QK_NORM_TYPES, name="qk_norm_type", module=module)
    if qk_norm_type is None:
        return None, None
    eps = check_eps(eps, name="qk_norm_eps", module=module)
    if qk_norm_type == "L2Normalization":
        norm = L2Normalization(eps=eps, **warmup_sizes)
        return norm, norm
    cls = RMSNorm if qk_norm_type == "RMSNorm" else LayerNorm
    return tuple(cls(head_dim, eps=eps, params_dtype=params_dtype, device=device) for _ in range(2))


# The keyword arguments Transformer Engine's MultiheadAttention.forward and TransformerLayer.forward
# take beyond their own and pass on to the attention kernel: any other name is refused with the
# caller's name, rather than by the DotProductAttention the kwargs would reach.
PASSED_ON = frozenset(("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q",
                       "max_seqlen_kv", "fast_zero_fill", "pad_between_seqs"))


def check_passed_on(kwargs: dict, where: str) -> None:
    for name in kwargs:
        if name not in PASSED_ON:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")


class MultiheadAttention(TensorParallelContainer, QuantizedContainer):
    """Self- or cross-attention block with Transformer Engine's constructor and submodule names
    (layernorm_qkv / qkv, layernorm_query / query_layer, key_value, core_attention, proj).

    The fused QKV weight is laid out [q heads | k groups | v groups] along its output dimension,
    Transformer Engine's layout with fuse_qkv_params=False; with fuse_qkv_params=True and
    qkv_weight_interleaved=True (TE's defaults for a fused weight) it is TE's interleaved
    layout, per kv group [its q heads | k | v] (cross-attention's key_value: per group [k | v]).

    Tensor parallelism (tp_size > 1 with set_parallel_mode=True, as in Transformer Engine): each
    rank holds num_attention_heads / tp_size heads and num_gqa_groups / tp_size kv groups. The
    input projections are column-parallel (a rank's rows are its heads' q, k and v, in the layout
    above over its own heads), attention runs on the local heads, and `proj` is row-parallel.
    With sequence_parallel the input arrives split along the sequence (qkv_format "sbhd") and
    the output leaves split the same way.
    """

    @te_order("hidden_size", "num_attention_heads", "kv_channels", "attention_dropout", "layernorm_epsilon",
              "init_method", "output_layer_init_method", "layer_number", "attn_mask_type", "window_size",
              "bottom_right_diagonal", "tp_group", "tp_size", "num_gqa_groups", "fuse_wgrad_accumulation",
              "get_rng_state_tracker", "sequence_parallel", "params_dtype", "return_bias", "return_layernorm_output",
              "input_layernorm", "attention_type", "set_parallel_mode", "fuse_qkv_params", "zero_centered_gamma",
              "qkv_weight_interleaved", "rotary_pos_interleaved", "ub_overlap_ag", "ub_overlap_rs",
              "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad", "bias", "normalization", "device", "qkv_format",
              "name", "qk_norm_type", "qk_norm_eps", "qk_norm_before_rope", "seq_length", "micro_batch_size",
              "softmax_type")
    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        kv_channels: Optional[int] = None,
        attention_dropout: float = 0.1,
        layernorm_epsilon: float = 1e-5,
        init_method=None,
        output_layer_init_method=None,
        layer_number: Optional[int] = None,
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        *,
        num_gqa_groups: Optional[int] = None,
        params_dtype: Optional[torch.dtype] = None,
        return_layernorm_output: bool = False,
        input_layernorm: bool = False,
        attention_type: str = "self",
        fuse_qkv_params: bool = False,
        zero_centered_gamma: bool = False,
        qkv_weight_interleaved: bool = True,
        rotary_pos_interleaved: bool = False,
        bias: bool = True,
        normalization: str = "LayerNorm",
        device: Union[None, str, torch.device] = None,
        qkv_format: str = "sbhd",
        name: Optional[str] = None,
        tp_group=None,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        get_rng_state_tracker=None,
        set_parallel_mode: bool = False,
        qk_norm_type: Optional[str] = None,
        qk_norm_eps: float = 1e-6,
        qk_norm_before_rope: bool = False,
        return_bias: bool = False,
        softmax_type: str = "vanilla",
        **kwargs,
    ):
        super().__init__()
        module = "MultiheadAttention"
        fuse_wgrad = kwargs.pop("fuse_wgrad_accumulation", False)  # passed on to every projection
        warmup_sizes = {arg: kwargs.pop(arg, None) for arg in ("seq_length", "micro_batch_size")}  # (for q_norm)
        check_warmup_sizes(module, **warmup_sizes)
        reject_unsupported(module, **kwargs)
        (self.return_bias, fuse_wgrad, return_layernorm_output, input_layernorm, fuse_qkv_params, zero_centered_gamma,
         qkv_weight_interleaved, rotary_pos_interleaved, bias, sequence_parallel, qk_norm_before_rope) = check_bools(
            module, return_bias=return_bias, fuse_wgrad_accumulation=fuse_wgrad,
            return_layernorm_output=return_layernorm_output, input_layernorm=input_layernorm,
            fuse_qkv_params=fuse_qkv_params, zero_centered_gamma=zero_centered_gamma,
            qkv_weight_interleaved=qkv_weight_interleaved, rotary_pos_interleaved=rotary_pos_interleaved, bias=bias,
            sequence_parallel=sequence_parallel, qk_norm_before_rope=qk_norm_before_rope)
        check_probability(attention_dropout, name="attention_dropout", module=module)
        if input_layernorm:  # (read only then, as in Transformer Engine)
            check_eps(layernorm_epsilon, name="layernorm_epsilon", module=module)
        hidden_size = check_positive(hidden_size, name="hidden_size", module=module)
        if kv_channels == 0 and type(kv_channels) is int:  # (TE reads a 0 as unset: hidden_size / heads)
            kv_channels = None
        _, self.num_gqa_groups, kv_channels = check_attention_heads(
            module, num_attention_heads, num_gqa_groups, hidden_size, kv_channels)
        check_normalization(normalization, module)
        tp = self.init_container_parallel(module, tp_group=tp_group, tp_size=tp_size,
                                          sequence_parallel=sequence_parallel,
                                          get_rng_state_tracker=get_rng_state_tracker,
                                          set_parallel_mode=set_parallel_mode)
        self.attention_type = check_choice(attention_type, ("self", "cross"), name="attention_type", module=module)
        self.qkv_format = check_choice(qkv_format, QKV_FORMATS, name="qkv_format", module=module)
        self._split_heads_across_ranks(num_attention_heads)
        self.hidden_size, self.num_attention_heads, self.kv_channels = hidden_size, num_attention_heads, kv_channels
        self.input_layernorm, self.return_layernorm_output = input_layernorm, return_layernorm_output
        # as Transformer Engine: 1 when not given, so a single layer can use a KV cache
        self.layer_number, self.name = 1 if layer_number is None else layer_number, check_name(name, module)
        self.fuse_qkv_params = fuse_qkv_params
        # as in Transformer Engine: separate q, k, v weights are never interleaved
        self.qkv_weight_interleaved = qkv_weight_interleaved and fuse_qkv_params
        self.rotary_pos_interleaved = rotary_pos_interleaved
        q_size, kv_size = num_attention_heads * kv_channels, self.num_gqa_groups * kv_channels
        common = dict(params_dtype=params_dtype, device=device, bias=bias, fuse_wgrad_accumulation=fuse_wgrad, **tp)
        column = dict(parallel_mode="column") if self.tp_size > 1 else {}
        row = dict(parallel_mode="row") if self.tp_size > 1 else {}
        # fmt: off
        norm_args = dict(eps=layernorm_epsilon, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                         return_layernorm_output=return_layernorm_output)
        q_out = q_size + 2 * kv_size if attention_type == "self" else q_size
        # submodules named as Transformer Engine names them (a cross-attention's query Linear gets no name there)
        proj_name = {("self", True): "layernorm_linear_qkv", ("self", False): "linear_qkv",
                     ("cross", True): "layernorm_linear_q"}.get((attention_type, bool(input_layernorm)))
        proj_name = sub_name(name, proj_name) if proj_name else None
        if input_layernorm:
            proj = LayerNormLinear(hidden_size, q_out, init_method=init_method, name=proj_name, **norm_args, **column,
                                   **common)
        else:
            proj = Linear(hidden_size, q_out, init_method=init_method, name=proj_name, **column, **common)
        setattr(self, _input_proj_name(attention_type, input_layernorm), proj)
        if attention_type == "cross":
            self.key_value = Linear(hidden_size, 2 * kv_size, init_method=init_method, name=sub_name(name, "linear_kv"),
                                    **column, **common)
        self.core_attention = DotProductAttention(  # on this rank's heads
            self.num_attention_heads_per_partition, kv_channels, num_gqa_groups=self.num_gqa_groups_per_partition,
            attention_dropout=attention_dropout,
            qkv_format=qkv_format, attn_mask_type=attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, layer_number=self.layer_number, attention_type=attention_type,
            softmax_type=softmax_type, name=sub_name(name, "core_attention"))
        # fmt: on
        self.proj = Linear(q_size, hidden_size, init_method=output_layer_init_method, return_bias=self.return_bias,
                           name=sub_name(name, "proj"), **row, **common)
        # QK normalization (Transformer Engine's qk_norm_*): on each head's q and k, after the rotary
        # embedding (before it with qk_norm_before_rope), in high precision
        if self.tp_size > 1 and qk_norm_type in ("RMSNorm", "LayerNorm"):
            raise NotImplementedError(
                f"{module}: qk_norm_type={qk_norm_type!r} with tp_size > 1 is not supported: the norms' weights are "
                "shared by heads split over the ranks, so their gradients would need a sum over the tensor-parallel "
                "group; use qk_norm_type='L2Normalization' (no weights) or tp_size=1")
        self.q_norm, self.k_norm = _qk_norms(qk_norm_type, qk_norm_eps, kv_channels, params_dtype, device, module,
                                             warmup_sizes)
        self.qk_norm_before_rope = qk_norm_before_rope
        if qk_norm_type == "L2Normalization":  # (state dicts of te-core's earlier q_norm, without extra state, load)
            self.register_load_state_dict_pre_hook(accept_l2_qk_norm_extra_state)
        # Transformer Engine names separate q, k, v weights (its default, fuse_qkv_params=False): its
        # checkpoints load, and the state dict of such a module names them as TE's does
        self.register_load_state_dict_pre_hook(load_split_qkv_names)
        if not fuse_qkv_params:
            self.register_state_dict_post_hook(save_split_qkv_names)
            expose_split_qkv_names(self)

    def _split_heads_across_ranks(self, num_attention_heads: int) -> None:
        """This rank's share of the heads and kv groups (all of them without tensor parallelism)."""
        module = "MultiheadAttention"
        if self.sequence_parallel and self.qkv_format != "sbhd":
            raise ValueError(f"{module}: sequence_parallel=True splits the first dimension, the sequence only with "
                             f"qkv_format='sbhd' (got {self.qkv_format!r}); use 'sbhd' inputs")
        self.num_attention_heads_per_partition = tensor_parallel.split_size(
            num_attention_heads, self.tp_size, what="num_attention_heads", module=module)
        self.num_gqa_groups_per_partition = tensor_parallel.split_size(
            self.num_gqa_groups, self.tp_size, what="num_gqa_groups", module=module)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Union[None, Tensor, Tuple[Tensor, Tensor]] = None,
        encoder_output: Optional[Tensor] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        is_first_microbatch: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        inference_params=None,
        rotary_pos_emb: Union[None, Tensor, Tuple[Tensor, Tensor]] = None,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[Tensor] = None,
        alibi_slopes: Optional[Tensor] = None,
        *,
        return_residual: bool = False,
        **kwargs,
    ):
        """`return_residual` (te-core): also return `hidden_states` itself (last), to be the
        block's residual; with input_layernorm its gradient is summed into the input's inside
        the norm's backward (see LayerNormLinear). Attention arguments (window_size,
        core_attention_bias_type, cu_seqlens_*, ...) pass on to core_attention."""
        name = "MultiheadAttention"
        check_passed_on(kwargs, f"{name}.forward")
        check_input(hidden_states, self.hidden_size, name="hidden_states", module=name)
        check_hidden_dims(hidden_states, self.qkv_format, "hidden_states", name)
        return_residual = check_bool(return_residual, name="return_residual", module=f"{name}.forward")
        proj_in = getattr(self, _input_proj_name(self.attention_type, self.input_layernorm))
        h, g, d = self.num_attention_heads_per_partition, self.num_gqa_groups_per_partition, self.kv_channels
        residual = hidden_states if return_residual else None
        # LayerNormLinear keeps no residual of a sequence shard: the shard itself is the residual
        fused_residual = return_residual and not self.sequence_parallel
        # q, k and v as views whose gradients the projection's backward reads in place
        contiguous = self.attention_type == "self" and not self.qkv_weight_interleaved
        split = dict(split_sizes=(h * d, g * d, g * d)) if contiguous else {}
        if self.input_layernorm:
            projected = proj_in(hidden_states, is_first_microbatch=is_first_microbatch, return_residual=fused_residual,
                                **split)
            if fused_residual:
                *projected, residual = projected
                projected = projected[0] if len(projected) == 1 else tuple(projected)
        else:
            projected = proj_in(hidden_states, is_first_microbatch=is_first_microbatch, **split)
        ln_out = None
        if self.input_layernorm and self.return_layernorm_output:
            projected, ln_out = projected
        q, k, v = self._split_heads(projected, encoder_output, is_first_microbatch)
        if self.q_norm is not None and self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary_pos_emb is not None:
            pair = rotary_pos_emb if isinstance(rotary_pos_emb, (tuple, list)) else (rotary_pos_emb, rotary_pos_emb)
            if len(pair) != 2 or not all(isinstance(f, Tensor) for f in pair):
                raise ValueError(f"{name}: rotary_pos_emb must be a tensor of angles (RotaryPositionEmbedding's "
                                 f"output) or a (query, key) pair of them, got a {type(rotary_pos_emb).__name__} "
                                 f"of {len(pair)} items")
            q_freqs, k_freqs = pair
            # packed sequences: each token by its position in its own sequence, as attention reads
            # them (with padding between the sequences, from their starts in the padded layout)
            packed = self.qkv_format == "thd"
            q_cu, k_cu = ((_or(kwargs.get("cu_seqlens_q_padded"), kwargs.get("cu_seqlens_q")),
                           _or(kwargs.get("cu_seqlens_kv_padded"), kwargs.get("cu_seqlens_kv")))
                          if packed else (None, None))
            fixed = inference_params is not None and fixed_shapes(q)  # a KV-cache step compiled or captured
            # packed rows past the step's tokens: padding, placed as in a fixed-shape step
            padded_packed = (packed and inference_params is not None and not fixed
                             and q.shape[0] > sum(inference_params.step_lens))
            starts = None
            if inference_params is not None and (fixed or not packed or padded_packed):
                # each token at its place after the cached ones: padded rows (padding tokens at their
                # row's last), or packed as fixed_shape_step lays the tokens out; one position each
                inference_params.check_rotary_reach(min(q_freqs.shape[0], k_freqs.shape[0]), on_device=fixed)
                positions = (inference_params.fixed_shape_positions(q.shape[0]) if packed
                             else _padded_step_positions(inference_params, q, self.qkv_format))
                q, k = (rotate_at(t.reshape(-1, *t.shape[-2:]), f, positions, self.rotary_pos_interleaved).view(t.shape)
                        for t, f in ((q, q_freqs), (k, k_freqs)))
            else:
                if inference_params is not None:  # packed: the new tokens follow what each sequence has cached
                    starts = inference_params.get_seqlens_pre_step()
                    q_cu = k_cu = inference_params.cu_seqlens_q
                # cp: this rank's positions
                cp = dict(cp_size=self.core_attention.cp_size, cp_rank=self.core_attention.cp_rank)
                q = apply_rotary_pos_emb(q, q_freqs, self.qkv_format, starts, interleaved=self.rotary_pos_interleaved,
                                         cu_seqlens=q_cu, **cp)
                k = apply_rotary_pos_emb(k, k_freqs, self.qkv_format, starts, interleaved=self.rotary_pos_interleaved,
                                         cu_seqlens=k_cu, **cp)
        if self.q_norm is not None and not self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        with self.tracker_fork(self.training and self.core_attention.attention_dropout > 0):
            context = self.core_attention(
                q, k, v, attention_mask=attention_mask, attn_mask_type=attn_mask_type, window_size=window_size,
                inference_params=inference_params, bottom_right_diagonal=bottom_right_diagonal,
                checkpoint_core_attention=checkpoint_core_attention, core_attention_bias_type=core_attention_bias_type,
                core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes, **kwargs,
            )
        out = self.proj(context, is_first_microbatch=is_first_microbatch)
        # return_bias: (output without the projection's bias, that bias), as Transformer Engine returns them
        out = out if self.return_bias else (out,)
        result = out + ((ln_out,) if ln_out is not None else ()) + ((residual,) if return_residual else ())
        return result[0] if len(result) == 1 else result

    def _split_heads(
        self, projected: Tensor, encoder_output: Optional[Tensor], is_first_microbatch
    ) -> Tuple[Tensor, Tensor, Tensor]:
        h, g, d = self.num_attention_heads_per_partition, self.num_gqa_groups_per_partition, self.kv_channels
        # (s, b) or (b, s), or the packed tokens (t,) of "thd"
        lead = (projected[0] if isinstance(projected, tuple) else projected).shape[:-1]
        if self.attention_type == "self":
            if self.qkv_weight_interleaved:  # per kv group: its h // g query heads, then k, then v
                q, k, v = projected.view(*lead, g, h // g + 2, d).split([h // g, 1, 1], dim=-2)
            else:
                q, k, v = projected if isinstance(projected, tuple) else projected.split([h * d, g * d, g * d], dim=-1)
            return q.reshape(*lead, h, d), k.reshape(*lead, g, d), v.reshape(*lead, g, d)
        if encoder_output is None:
            raise ValueError("MultiheadAttention: attention_type='cross' needs encoder_output")
        check_input(encoder_output, self.hidden_size, name="encoder_output", module="MultiheadAttention")
        check_hidden_dims(encoder_output, self.qkv_format, "encoder_output", "MultiheadAttention")
        batch = {"sbhd": 1, "bshd": 0}.get(self.qkv_format)  # (thd: packed, sequences given by cu_seqlens)
        if batch is not None and encoder_output.shape[batch] != lead[batch]:
            raise ValueError(f"MultiheadAttention: encoder_output holds {encoder_output.shape[batch]} sequences but "
                             f"hidden_states {lead[batch]} ({self.qkv_format}: dimension {batch} is the batch); give "
                             "each query sequence its encoder sequence")
        kv = self.key_value(encoder_output, is_first_microbatch=is_first_microbatch)
        kv_lead = kv.shape[:-1]
        if self.qkv_weight_interleaved:  # per kv group: k then v
            k, v = kv.view(*kv_lead, g, 2 * d).split([d, d], dim=-1)
        else:
            k, v = kv.split([g * d, g * d], dim=-1)
        return projected.reshape(*lead, h, d), k.reshape(*kv_lead, g, d), v.reshape(*kv_lead, g, d)


def _padded_step_positions(inference_params, t: Tensor, qkv_format: str) -> Tensor:
    """Each token's position in a KV-cache step's padded (bshd / sbhd) input t, flattened in t's
    order (InferenceParams.padded_positions)."""
    rows, seq = (t.shape[1], t.shape[0]) if qkv_format == "sbhd" else (t.shape[0], t.shape[1])
    positions = inference_params.padded_positions(rows, seq)
    return (positions.t() if qkv_format == "sbhd" else positions).reshape(-1)


def _input_proj_name(attention_type: str, input_layernorm: bool) -> str:
    if attention_type == "self":
        return "layernorm_qkv" if input_layernorm else "qkv"
    return "layernorm_query" if input_layernorm else "query_layer"


def _or(first, second):
    return second if first is None else first
