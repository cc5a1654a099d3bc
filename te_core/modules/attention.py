"""te.DotProductAttention: softmax(q k^T * scale + mask) v over heads, through ops.attention."""

from __future__ import annotations

import io
import math
import warnings
from functools import partial
from typing import Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .. import ops
from ..distributed import tensor_parallel
from ..distributed.collectives import all_reduce_max
from ..ops.attention import PADDING_MASK_TYPES
from ..ops.attention_masks import attention_logits
from ..ops.packed_sequences import padded_layout, to_padded
from ..quantization import extra_state as extra_state_bytes
from ._attention_parallel import AttentionParallelMixin
from ._attention_inputs import between_seqs, check_mask_type, check_qkv, sequence_layout, unpack_qkv
from ._packed import Packing, tail_padding
from ._reset import DeferredInit, resetting
from ._te_base import TransformerEngineBaseModule
from .inference import InferenceParams, fixed_shapes
from ._common import (
    HP_DTYPES,
    reject_unsupported,
    check_attention_heads,
    check_bool,
    check_bools,
    check_choice,
    check_name,
    check_optional_bool,
    check_positive,
    check_positive_finite,
    check_probability,
    compute_dtype,
    no_torch_autocast,
    resolve_device,
)
from ._te_order import te_order

PADDED_FORMATS = ("sbhd", "bshd")
QKV_FORMATS = PADDED_FORMATS + ("thd",)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# with a KV cache the new queries are their sequences' last tokens: causal types align bottom-right
CACHED_MASK_TYPE = {"no_mask": "padding", "padding": "padding",
                    **dict.fromkeys(("causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right"),
                                    "padding_causal_bottom_right")}


def check_hidden_dims(x: Tensor, fmt: str, name: str, module: str) -> None:
    """A block's hidden states: (s, b, hidden) or (b, s, hidden), or the (t, hidden) packed
    tokens of "thd" (their sequences given by cu_seqlens_q / cu_seqlens_kv)."""
    if fmt == "thd" and x.dim() != 2:
        raise ValueError(f"{module}: {name} must be 2-D (thd: packed tokens, hidden), got shape {tuple(x.shape)}")
    if fmt != "thd" and x.dim() != 3:
        raise ValueError(f"{module}: {name} must be 3-D ({fmt}), got shape {tuple(x.shape)}")


def _extra_state_may_be_missing(module, incompatible_keys) -> None:
    """A strict load of a state dict without a layer's `core_attention._extra_state` (checkpoints
    of older Transformer Engine releases, Megatron-LM's sharded ones) passes, as Transformer
    Engine's own post-hook lets it: the entry holds nothing te-core reads."""
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if "core_attention._extra_state" not in key]


class DotProductAttention(AttentionParallelMixin, DeferredInit, TransformerEngineBaseModule):
    """Attention core with Transformer Engine's constructor and forward signature.

    q is (s, b, h, d) for qkv_format "sbhd" or (b, s, h, d) for "bshd"; k and v have
    num_gqa_groups heads. Returns (s, b, h * dv) or (b, s, h * dv). Attention runs in the
    inputs' (or torch.autocast's) precision; it is not quantized to FP8.

    Masks follow Transformer Engine: bool, True = masked out. Padding types take one
    (b, 1, 1, s) mask for self-attention (queries and keys) or a (query mask, key mask) pair;
    "arbitrary" takes a mask broadcastable to (b, h, sq, sk). window_size (left, right) is a
    sliding window around each query's diagonal (-1 = unbounded), aligned per
    bottom_right_diagonal for the mask types that leave it open; core_attention_bias_type
    "pre_scale_bias" / "post_scale_bias" take core_attention_bias, "alibi" optional alibi_slopes.
    softmax_type "off-by-one" / "learnable" add an attention sink to every query's softmax (a
    logit of 0, or the learnable per-head parameter `softmax_offset`, initialized to 0).
    """

    @te_order("num_attention_heads", "kv_channels", "num_gqa_groups", "attention_dropout", "qkv_format",
              "attn_mask_type", "window_size", "bottom_right_diagonal", "sequence_parallel", "tp_size",
              "get_rng_state_tracker", "tp_group", "layer_number", "attention_type", "cp_group", "cp_global_ranks",
              "cp_stream", "cp_comm_type", "softmax_scale", "softmax_type", "return_max_logit", "name")
    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: Union[int, Tuple[int, int]],
        num_gqa_groups: Optional[int] = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        tp_group=None,
        layer_number: Optional[int] = None,
        attention_type: str = "self",
        *,
        softmax_scale: Optional[float] = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool = False,
        name: Optional[str] = None,
        **kwargs,
    ):
        super().__init__()
        module = "DotProductAttention"
        context_parallel = {name: kwargs.pop(name, default) for name, default in (
            ("cp_group", None), ("cp_global_ranks", None), ("cp_stream", None), ("cp_comm_type", "p2p"))}
        reject_unsupported(module, **kwargs)
        self.num_attention_heads, self.num_gqa_groups, _ = check_attention_heads(
            module, num_attention_heads, num_gqa_groups)
        self._init_tensor_parallel(tp_group, tp_size, sequence_parallel, get_rng_state_tracker)
        self.set_context_parallel_group(**context_parallel)
        k_ch, v_ch = _kv_channels(kv_channels, module)
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = k_ch, v_ch
        if layer_number is not None:
            check_positive(layer_number, name="layer_number", module=module)
        self.attention_dropout = check_probability(attention_dropout, name="attention_dropout", module=module)
        self.qkv_format = check_choice(qkv_format, QKV_FORMATS, name="qkv_format", module=module)
        self.attn_mask_type = check_mask_type(attn_mask_type, name="attn_mask_type", module=module)
        self.window_size = _check_window(window_size, module)
        self.bottom_right_diagonal = check_optional_bool(bottom_right_diagonal, name="bottom_right_diagonal",
                                                         module=module)
        self.softmax_scale = (1.0 / math.sqrt(k_ch) if softmax_scale is None
                              else check_positive_finite(softmax_scale, name="softmax_scale", module=module))
        # layer_number scales nothing here: Transformer Engine divides the logits by it and
        # multiplies them back inside the softmax (fp16 range), an identity in exact math
        self.layer_number, self.name = layer_number, check_name(name, "DotProductAttention")
        self.attention_type = check_choice(attention_type, ("self", "cross"), name="attention_type", module=module)
        self.softmax_type = check_choice(softmax_type, SOFTMAX_TYPES, name="softmax_type", module=module)
        self.return_max_logit = check_bool(return_max_logit, name="return_max_logit", module=module)
        # the sink logits, one per head, in float32 as the op takes them: a parameter when
        # learnable; for "off-by-one" zeros that follow the module's device (not saved, as in TE)
        heads, device = self.num_attention_heads_per_partition, resolve_device(None)
        if softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.zeros(heads, dtype=torch.float32, device=device))
            # one per head, so split with the heads over tensor-parallel ranks (read by Megatron-LM)
            tensor_parallel.model_parallel_attributes(self.softmax_offset, 0)
        elif softmax_type == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, dtype=torch.float32, device=device),
                                 persistent=False)
        else:
            self.softmax_offset = None
        self.register_load_state_dict_post_hook(_extra_state_may_be_missing)

    def _initialize(self) -> None:
        """reset_parameters' work (DeferredInit): the learnable softmax_offset
        (softmax_type="learnable") back to zeros; nothing else here is a parameter."""
        with resetting(self) as params:
            if "softmax_offset" in params:
                params["softmax_offset"].zero_()

    def forward(
        self,
        query_layer: Optional[Tensor] = None,
        key_layer: Optional[Tensor] = None,
        value_layer: Optional[Tensor] = None,
        attention_mask: Union[None, Tensor, Tuple[Tensor, Tensor]] = None,
        qkv_format: Optional[str] = None,
        cu_seqlens_q: Optional[Tensor] = None,
        cu_seqlens_kv: Optional[Tensor] = None,
        cu_seqlens_q_padded: Optional[Tensor] = None,
        cu_seqlens_kv_padded: Optional[Tensor] = None,
        max_seqlen_q: Optional[int] = None,
        max_seqlen_kv: Optional[int] = None,
        attn_mask_type: Optional[str] = None,
        window_size: Optional[Tuple[int, int]] = None,
        bottom_right_diagonal: Optional[bool] = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: Optional[Tensor] = None,
        alibi_slopes: Optional[Tensor] = None,
        fast_zero_fill: bool = True,
        inference_params=None,
        num_splits: Optional[int] = 1,
        **kwargs,
    ) -> Tensor:
        """fast_zero_fill only picks how Transformer Engine zeroes padded outputs, num_splits how
        its FlashAttention-3 kernel splits the keys; the values are the same either way."""
        module = "DotProductAttention"
        if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                       or num_splits < 1):
            raise ValueError(f"{module}: num_splits must be None or a positive int, got {num_splits!r}")
        pad_between_seqs = kwargs.pop("pad_between_seqs", None)
        qkv_layer, kv_layer = kwargs.pop("qkv_layer", None), kwargs.pop("kv_layer", None)
        interleave_dim = kwargs.pop("qkv_interleave_dim", -3)
        # bf16_backward picks a high-precision backward for Transformer Engine's FP8 attention;
        # te-core's attention is never FP8, so its backward always runs in the inputs' precision
        check_bool(kwargs.pop("bf16_backward", False), name="bf16_backward", module=module)
        reject_unsupported(f"{module}.forward", **kwargs)
        check_bools(f"{module}.forward", checkpoint_core_attention=checkpoint_core_attention,
                    fast_zero_fill=fast_zero_fill)
        bottom_right_diagonal = check_optional_bool(bottom_right_diagonal, name="bottom_right_diagonal",
                                                    module=f"{module}.forward")
        fmt = check_choice(qkv_format or self.qkv_format, QKV_FORMATS, name="qkv_format", module=module)
        query_layer, key_layer, value_layer = unpack_qkv(qkv_layer, kv_layer, query_layer, key_layer, value_layer,
                                                          fmt, interleave_dim)
        check_qkv(query_layer, key_layer, value_layer)
        if self.cp_size > 1:
            self._check_context_parallel_layout(
                fmt, bool(pad_between_seqs) or cu_seqlens_q_padded is not None or cu_seqlens_kv_padded is not None,
                query_layer, key_layer, (max_seqlen_q, max_seqlen_kv))
            max_seqlen_q = max_seqlen_kv = None  # (checked: the gathered tensors are the whole sequence's)
        restore = None  # packed outputs back in the caller's layout (padding between sequences, KV cache)
        if inference_params is not None and not isinstance(inference_params, InferenceParams):
            raise TypeError(f"{module}: inference_params must be a te_core.InferenceParams, "
                            f"got {type(inference_params).__name__}")
        if fmt == "thd" and not pad_between_seqs and inference_params is None and cu_seqlens_q_padded is None \
                and cu_seqlens_kv_padded is None:
            cu_seqlens_q_padded, cu_seqlens_kv_padded = tail_padding(cu_seqlens_q, cu_seqlens_kv, query_layer,
                                                                     key_layer)
        padded_between = pad_between_seqs or cu_seqlens_q_padded is not None or cu_seqlens_kv_padded is not None
        if inference_params is not None and padded_between:
            raise ValueError(f"{module}: with inference_params the KV cache lays out the sequences; pass no "
                             "cu_seqlens_*_padded / pad_between_seqs")
        if padded_between:
            total_q = query_layer.shape[0]
            rows_q, rows_kv = between_seqs(fmt, (cu_seqlens_q, cu_seqlens_kv),
                                            (cu_seqlens_q_padded, cu_seqlens_kv_padded),
                                            (total_q, key_layer.shape[0]))
            # the padding between sequences comes back as zeros, as Transformer Engine fills it
            restore = partial(_scatter_rows, rows=rows_q, total=total_q)
            query_layer = query_layer.index_select(0, rows_q.to(query_layer.device))
            key_layer, value_layer = (t.index_select(0, rows_kv.to(t.device)) for t in (key_layer, value_layer))
        mask_type = check_mask_type(attn_mask_type or self.attn_mask_type, name="attn_mask_type", module=module)
        attention_mask = _read_mask(attention_mask, mask_type)
        if self.cp_size > 1:
            key_layer, value_layer, mask_type, attention_mask = self._context_parallel(
                fmt, mask_type, query_layer, key_layer, value_layer, attention_mask, window_size,
                core_attention_bias_type, alibi_slopes, inference_params, padded_between, _check_window)
            window_size = (-1, -1)  # (a causal window is the mask of global positions _context_parallel made)
        if inference_params is not None and fixed_shapes(query_layer):  # compiled or captured: padded, fixed
            self._check_cached_call(mask_type, attention_mask, fmt, query_layer, key_layer, value_layer)
            if fmt == "thd":  # padded rows for the attention, packed again after it
                restore = partial(inference_params.fixed_shape_packed, tokens=query_layer.shape[0])
                query_layer, key_layer, value_layer = inference_params.fixed_shape_padded(query_layer, key_layer,
                                                                                         value_layer)
                fmt = "bshd"
            key_layer, value_layer, padding_q, padding_kv = inference_params.fixed_shape_step(
                self.layer_number, key_layer, value_layer, fmt)
            attention_mask, mask_type, packed = (padding_q, padding_kv), CACHED_MASK_TYPE[mask_type], None
        elif inference_params is not None:  # the output takes the new tokens' layout
            restore = partial(inference_params.unpacked, qkv_format=fmt, like_shape=query_layer.shape)
            query_layer, key_layer, value_layer, packed, mask_type = self._from_cache(
                inference_params, fmt, mask_type, attention_mask, query_layer, key_layer, value_layer)
            fmt, attention_mask = "thd", None
        else:
            packed, mask_type, attention_mask = sequence_layout(
                fmt, query_layer, key_layer, mask_type, attention_mask, (cu_seqlens_q, cu_seqlens_kv),
                (max_seqlen_q, max_seqlen_kv))
        q, k, v = (
            self._to_bhsd(t, arg, fmt, where)
            for t, arg, where in ((query_layer, "query_layer", packed and packed[0]),
                                  (key_layer, "key_layer", packed and packed[1]),
                                  (value_layer, "value_layer", packed and packed[1]))
        )
        self._check_heads(q, k, v)
        options = dict(attn_mask_type=mask_type, softmax_scale=self.softmax_scale,
                       dropout_p=self.attention_dropout if self.training else 0.0)
        if packed is None:  # packed sequences take their padding from cu_seqlens
            options.update(_mask_options(attention_mask, mask_type, q, k))
        options.update(_extensions(
            window_size=self.window_size if window_size is None else _check_window(window_size, module),
            bottom_right_diagonal=(self.bottom_right_diagonal if bottom_right_diagonal is None
                                   else bottom_right_diagonal),
            core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
            alibi_slopes=alibi_slopes,
            softmax_offset=None if self.softmax_offset is None else self.softmax_offset.float(),
        ))
        dtype = compute_dtype(query_layer)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        with no_torch_autocast(q.device.type), self._dropout_context(options["dropout_p"] > 0):
            out = _core_attention(q, k, v, options, checkpoint_core_attention, packed)
        result = _shaped(out, fmt, packed, restore)
        if self.return_max_logit:  # (out, max_logit), as Transformer Engine returns them
            logits = max_logit(q, k, options, packed)
            if self.cp_size > 1:  # this rank's queries: the whole sequence's max over the ranks', as TE reduces it
                logits = all_reduce_max(logits, self._cp_run_group)
            return result, logits
        return result

    def _check_cached_call(self, mask_type: str, attention_mask, fmt: str, q: Tensor, k: Tensor, v: Tensor) -> None:
        name = "DotProductAttention"
        if self.layer_number is None:
            raise ValueError(f"{name}: inference_params needs layer_number (each layer's key in the KV cache)")
        if self.attention_type != "self":
            raise NotImplementedError(f"{name}: inference_params with cross-attention is not supported by te-core yet")
        if attention_mask is not None or mask_type == "arbitrary":
            raise ValueError(f"{name}: with inference_params the KV cache gives the padding: no attention_mask, and "
                             f"attn_mask_type one of {', '.join(CACHED_MASK_TYPE)} (got {mask_type!r})")
        if not all(isinstance(t, Tensor) and t.dim() == (3 if fmt == "thd" else 4) for t in (q, k, v)):
            raise ValueError(f"{name}: query_layer, key_layer and value_layer must be "
                             f"{3 if fmt == 'thd' else 4}-D ({fmt})")

    def _from_cache(self, params, fmt: str, mask_type: str, attention_mask, q: Tensor, k: Tensor, v: Tensor):
        """Generation with a KV cache (te.InferenceParams): (the step's new queries, every cached
        key and value of its sequences, all packed; their Packing; the mask type). The new tokens
        are their sequences' last, so causal types align to the bottom right, as in Transformer
        Engine, and the plain types become their padding twins."""
        self._check_cached_call(mask_type, attention_mask, fmt, q, k, v)
        params._check_stepped("step")
        q, k, v = (params.packed_tokens(t, fmt) for t in (q, k, v))
        k, v = params.cached_step(self.layer_number, k, v)
        packed = (Packing(params.cu_seqlens_q, max(params.step_lens)),
                  Packing(params.cu_seqlens_kv, max(params.sequences.values())))
        return q, k, v, packed, CACHED_MASK_TYPE[mask_type]

    def get_extra_state(self) -> Tensor:
        """Nothing to keep (attention is not quantized): Transformer Engine's empty uint8 tensor;
        the key exists, as in Transformer Engine's checkpoints, so state dicts load both ways."""
        return extra_state_bytes.encode(None)

    def set_extra_state(self, state) -> None:
        """Accepts Transformer Engine's extra state: empty, or FP8-attention scales, which
        te-core has no use for (it computes attention in high precision), so it warns."""
        from ..compat.te_checkpoint import holds_fp8_scales, is_te_tensor_form

        state = extra_state_bytes.from_text(state)  # (te_core.distributed.state_dict's form)
        te_form = is_te_tensor_form(state) or isinstance(state, io.BytesIO)
        if te_form and holds_fp8_scales(state):
            warnings.warn("DotProductAttention: the checkpoint's FP8 attention state is not used; te-core "
                          "computes attention in high precision", UserWarning, stacklevel=2)
        elif state is not None and not te_form:
            raise ValueError(f"DotProductAttention: unrecognised extra state {type(state).__name__}")

    @staticmethod
    def _to_bhsd(t: Tensor, arg: str, fmt: str, packed: Optional[Packing] = None) -> Tensor:
        ndim = 3 if fmt == "thd" else 4
        if not isinstance(t, Tensor) or t.dim() != ndim:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"DotProductAttention: {arg} must be {ndim}-D ({fmt}), got shape {shape}")
        if t.dtype not in HP_DTYPES:
            raise TypeError(f"DotProductAttention: {arg} has dtype {t.dtype}; expected float32, bfloat16 or float16")
        if packed is not None:  # one (1, h, t, d) view of the packed tokens, for the shape checks
            return t.unsqueeze(0).transpose(1, 2)
        return t.permute(1, 2, 0, 3) if fmt == "sbhd" else t.permute(0, 2, 1, 3)

    def _check_heads(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        name = "DotProductAttention"
        d_k = self.hidden_size_per_attention_head_k
        per_rank = f" / tp_size={self.tp_size}" if self.tp_size > 1 else ""  # (each rank gets its share)
        if q.shape[1] != self.num_attention_heads_per_partition or q.shape[3] != d_k:
            raise ValueError(
                f"{name}: query_layer has {q.shape[1]} heads of size {q.shape[3]}; expected "
                f"num_attention_heads={self.num_attention_heads}{per_rank} heads of kv_channels={d_k}"
            )
        for t, arg, d in (
            (k, "key_layer", self.hidden_size_per_attention_head_k),
            (v, "value_layer", self.hidden_size_per_attention_head_v),
        ):
            if t.shape[1] != self.num_gqa_groups_per_partition or t.shape[3] != d:
                raise ValueError(
                    f"{name}: {arg} has {t.shape[1]} heads of size {t.shape[3]}; expected "
                    f"num_gqa_groups={self.num_gqa_groups}{per_rank} heads of size {d}"
                )
        if k.shape[0] != q.shape[0] or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"{name}: batch / sequence sizes of query_layer, key_layer, value_layer do not agree")


def _kv_channels(kv_channels, module: str) -> Tuple[int, int]:
    """(key, value) head sizes from kv_channels: one positive int for both, or a pair of them."""
    pair = tuple(kv_channels) if isinstance(kv_channels, (tuple, list)) else (kv_channels, kv_channels)
    if len(pair) != 2 or not all(isinstance(c, int) and not isinstance(c, bool) for c in pair):
        raise TypeError(f"{module}: kv_channels must be a positive int, or a (key, value) pair of them, got "
                        f"{kv_channels!r} ({type(kv_channels).__name__})")
    return tuple(check_positive(c, name="kv_channels", module=module) for c in pair)


def _check_window(window_size, module: str):
    if window_size is None:
        return None
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise ValueError(f"{module}: window_size must be None or (left, right) ints >= -1 (-1 = unbounded), "
                         f"got {window_size!r}")
    return tuple(window_size)


def _shaped(out: Tensor, fmt: str, packed, restore) -> Tensor:
    """The op's (b, h, s, dv) output as (s, b, h * dv) / (b, s, h * dv), or packed (t, h * dv),
    passed through `restore` where one is set."""
    if packed is not None:
        out = out.flatten(1)
        return out if restore is None else restore(out)
    b, h, s, dv = out.shape
    if fmt == "sbhd":
        out = out.permute(2, 0, 1, 3).reshape(s, b, h * dv)
    else:
        out = out.permute(0, 2, 1, 3).reshape(b, s, h * dv)
    return out if restore is None else restore(out)


def _scatter_rows(out: Tensor, rows: Tensor, total: int) -> Tensor:
    return out.new_zeros(total, out.shape[1]).index_copy(0, rows.to(out.device), out)


@torch.no_grad()
def max_logit(q: Tensor, k: Tensor, options: dict, packed=None) -> Tensor:
    """Transformer Engine's max_logit (for QK-clip with Muon): per query head, the largest logit
    any query gives a key it sees, S = mask(q k^T * scale + bias), over the whole batch; float32
    (h,), -inf for a head that sees no key. It takes one float32 (b, h, sq, sk) score matrix
    besides attention's (the padded batch for packed sequences)."""
    if packed is not None:  # the (1, h, t, d) views of packed tokens, padded per sequence
        (cu_q, s_q), (cu_kv, s_kv) = packed
        q, k = q[0].transpose(0, 1), k[0].transpose(0, 1)
        where_q, where_kv = padded_layout(cu_q, s_q, q.shape[0]), padded_layout(cu_kv, s_kv, k.shape[0])
        q, k = to_padded(q, where_q), to_padded(k, where_kv)
        options = dict(options, attention_mask=where_kv.padding, query_padding_mask=where_q.padding)
    scores, masked = attention_logits(q, k, **options)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    return scores.amax(dim=(0, 2, 3))


def _read_mask(mask, mask_type: str):
    """The attention_mask the mask type reads: None for the types that take none (causal,
    no_mask, ...), as Transformer Engine reads the mask only for padding types and 'arbitrary'.
    Megatron-LM passes its data loader's causal mask with attn_mask_type='causal'; a mask given
    there is left out with a warning, since it might hold padding the type does not apply."""
    if mask is None or mask_type in PADDING_MASK_TYPES or mask_type == "arbitrary":
        return mask
    warnings.warn(f"DotProductAttention: attention_mask is not read with attn_mask_type={mask_type!r} (as in "
                  "Transformer Engine); pass a padding type or 'arbitrary' for the mask to apply", stacklevel=3)
    return None


def _mask_options(mask, mask_type: str, q: Tensor, k: Tensor) -> dict:
    """attention_mask (and query_padding_mask) for ops.attention from Transformer Engine's
    forms: a padding mask for both sides of self-attention, or a (query, key/value) pair."""
    name = "DotProductAttention"
    if mask_type not in PADDING_MASK_TYPES and mask_type != "arbitrary":
        return {}
    if mask is None:
        raise ValueError(f"{name}: attn_mask_type={mask_type!r} needs attention_mask (bool, True = masked out)")
    if mask_type == "arbitrary":
        return dict(attention_mask=mask)
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    if isinstance(mask, (tuple, list)):
        if len(mask) != 2:
            raise ValueError(f"{name}: a padding attention_mask pair is (query mask, key/value mask), "
                             f"got {len(mask)} tensors")
        q_mask, kv_mask = mask
    elif sq == sk:
        q_mask = kv_mask = mask
    else:
        raise ValueError(f"{name}: query and key lengths differ ({sq} vs {sk}); give attn_mask_type={mask_type!r} "
                         "a pair of padding masks (query mask (b, 1, 1, sq), key/value mask (b, 1, 1, sk))")
    # (b, s) is the (b, 1, 1, s) mask unsqueezed: Transformer Engine squeezes a padding mask to
    # (b, s) before counting its tokens, so tutorials pass `input_ids == pad_id` as it is
    q_mask, kv_mask = (t.reshape(b, 1, 1, s) if isinstance(t, Tensor) and tuple(t.shape) == (b, s) else t
                       for t, s in ((q_mask, sq), (kv_mask, sk)))
    for arg, t, s in (("query", q_mask, sq), ("key/value", kv_mask, sk)):
        if not isinstance(t, Tensor) or t.dtype != torch.bool or tuple(t.shape) != (b, 1, 1, s):
            got = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: the {arg} padding mask must be a bool tensor of shape {(b, 1, 1, s)} "
                             f"or {(b, s)} (True = padding), got {got}")
    return dict(attention_mask=kv_mask, query_padding_mask=q_mask)


def _extensions(**values) -> dict:
    """The optional ops.attention arguments that differ from their defaults: a backend that
    predates them still serves calls without them."""
    return {k: v for k, v in values.items()
            if v is not None and not (k == "core_attention_bias_type" and v == "no_bias")}


def _core_attention(q, k, v, options: dict, checkpoint: bool, packed=None) -> Tensor:
    """ops.attention on (b, h, s, d) tensors; with `packed` (the (query, key/value) Packing of
    thd inputs, given as (1, h, t, d) views), ops.attention_varlen on the (t, h, d) tokens."""
    def run(q, k, v):
        if packed is None:
            return ops.attention(q, k, v, **options)
        (cu_q, s_q), (cu_kv, s_kv) = packed
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
        return ops.attention_varlen(q, k, v, cu_q, cu_kv, s_q, s_kv, **options)

    if checkpoint and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(run, q, k, v, use_reentrant=False)
    return run(q, k, v)
