"""Transformer Engine's state-dict names that differ from te-core's: a MultiheadAttention with
fuse_qkv_params=False keeps separate query/key/value parameters where te-core keeps one fused
weight (load and save hooks translate), and TE's norms write an `_extra_state` entry that te-core's
norms have no use for; to_transformer_engine_state_dict writes a model's state in TE's names."""
from __future__ import annotations

import warnings

import torch
from torch import Tensor


def _interleave(parts, groups: int) -> Tensor:
    """Rows of `parts` ([q,] k, v) regrouped per kv group: TE's interleaved fused-QKV layout."""
    return torch.cat([p.reshape(groups, -1, *p.shape[1:]) for p in parts], dim=1).reshape(-1, *parts[0].shape[1:])


def load_split_qkv_names(mha, state_dict, prefix, *_):
    """load_state_dict pre-hook of MultiheadAttention: TE's separate q/k/v parameters
    (fuse_qkv_params=False: query_weight, key_weight, value_weight and their biases) become
    te-core's fused weight, in the row order the module reads (interleaved per kv group when
    mha.qkv_weight_interleaved)."""
    for sub, (names, _) in _qkv_parts(mha).items():
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{sub}.{n}_{kind}" for n in names]
            if not all(k in state_dict for k in keys):
                continue  # te-core's own names, or an incomplete set that load_state_dict reports
            tensors = [state_dict.pop(k) for k in keys]
            fused = (_interleave(tensors, mha.num_gqa_groups_per_partition) if mha.qkv_weight_interleaved
                     else torch.cat(tensors))
            state_dict[f"{prefix}{sub}.{kind}"] = fused


def accept_te_norm_extra_state(module, state_dict, prefix, *_):
    """load_state_dict pre-hook of LayerNorm / RMSNorm: Transformer Engine's norms write an
    `_extra_state` entry (empty: uint8, or TE 1.13's float32 torch.Tensor(); or TE 2.3-2.8's pickled
    {}, without FP8 state), which te-core's norms have no use for; one that holds FP8 scales is
    dropped with a warning. A non-empty tensor of another dtype is left for load_state_dict to refuse."""
    from .te_checkpoint import holds_fp8_scales, is_te_tensor_form

    state = state_dict.get(prefix + "_extra_state")
    if is_te_tensor_form(state):
        del state_dict[prefix + "_extra_state"]
        if holds_fp8_scales(state):
            warnings.warn(f"{type(module).__name__}: the checkpoint's Transformer Engine extra state is not used "
                          "(te-core's norms keep no FP8 state)", UserWarning, stacklevel=3)


def accept_l2_qk_norm_extra_state(mha, state_dict, prefix, *_):
    """load_state_dict pre-hook of a MultiheadAttention with qk_norm_type="L2Normalization": its
    q_norm / k_norm (one ops.L2Normalization) have an `_extra_state`, as TE's, which te-core state
    dicts written before they were that operation lack (then it loads as empty), and TE's forms of
    "no FP8 state" load as before; one that holds FP8 scales is dropped with a warning, as te-core's
    norms drop it, rather than refused as the operation alone refuses it."""
    for name in ("q_norm", "k_norm"):
        norm_prefix = f"{prefix}{name}."
        accept_te_norm_extra_state(getattr(mha, name), state_dict, norm_prefix)
        state_dict.setdefault(norm_prefix + "_extra_state", torch.empty(0, dtype=torch.uint8, device="cpu"))


def to_transformer_engine_state_dict(model) -> dict:
    """`model`'s state dict in the names Transformer Engine's modules of the same configuration
    load: q/k/v weights split where fuse_qkv_params=False, and an `_extra_state` entry for each
    norm (TE's norms are fusible operations, which have one). Extra state is written empty (TE's
    form for "no FP8 state"), so TE restarts the scales: TE reads its recipe state only from its
    own pickled objects."""
    from ..modules.multihead_attention import MultiheadAttention

    state = model.state_dict()
    for name in [k for k in state if k.endswith("_extra_state")]:
        state[name] = torch.empty(0, dtype=torch.uint8, device="cpu")
    _add_norm_extra_states(model, state)
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if isinstance(module, MultiheadAttention) and not module.fuse_qkv_params:
            _split_qkv(module, state, prefix)
    return state


def _add_norm_extra_states(model, state: dict) -> None:
    """An empty `_extra_state` (what TE's BasicOperation.set_extra_state takes as "no state")
    for each te.LayerNorm and te.RMSNorm in `model`, after the norm's parameters, where TE's state
    dict has it, in place. (MultiheadAttention's q_norm / k_norm L2Normalization is TE's operation,
    which writes its own.)"""
    from ..modules.layernorm import LayerNorm, RMSNorm

    prefixes = [f"{path}." if path else "" for path, module in model.named_modules(remove_duplicate=False)
                if isinstance(module, (LayerNorm, RMSNorm))]
    after = {}  # the norm's last own entry -> its extra state's key
    for prefix in prefixes:
        own = [k for k in state if k.startswith(prefix) and "." not in k[len(prefix):]]
        after.setdefault(own[-1] if own else None, []).append(prefix + "_extra_state")
    items = list(state.items())
    state.clear()
    for key, value in items:
        state[key] = value
        state.update((extra, torch.empty(0, dtype=torch.uint8, device="cpu")) for extra in after.get(key, ()))
    state.update((extra, torch.empty(0, dtype=torch.uint8, device="cpu")) for extra in after.get(None, ()))


def _qkv_parts(mha) -> dict:
    """{input projection's name: ((part names), (rows))} of a non-interleaved MultiheadAttention:
    the row blocks Transformer Engine keeps as separate parameters with fuse_qkv_params=False,
    for this rank's heads (all of them without tensor parallelism)."""
    from ..modules.multihead_attention import _input_proj_name

    h, g, d = mha.num_attention_heads_per_partition, mha.num_gqa_groups_per_partition, mha.kv_channels
    proj = _input_proj_name(mha.attention_type, mha.input_layernorm)
    if mha.attention_type == "self":
        return {proj: (("query", "key", "value"), (h * d, g * d, g * d))}
    parts = {"key_value": (("key", "value"), (g * d, g * d))}
    if proj != "query_layer":  # TE's plain cross-attention query projection keeps the name "weight"
        parts[proj] = (("query",), (h * d,))
    return parts


def _split_qkv(mha, state: dict, prefix: str, plain_only: bool = False) -> None:
    """Replace `state`'s fused q/k/v entries of `mha` by TE's per-part names, in place and in
    order; the parts are views of the fused tensor. `plain_only`: only plain tensors (see
    save_split_qkv_names)."""
    splits = {}
    for sub, (names, sizes) in _qkv_parts(mha).items():
        for kind in ("weight", "bias"):
            key = f"{prefix}{sub}.{kind}"
            fused = state.get(key)
            if fused is None or (plain_only and type(fused) is not torch.Tensor):
                continue
            splits[key] = [(f"{prefix}{sub}.{name}_{kind}", part) for name, part in zip(names, fused.split(sizes))]
    if not splits:
        return
    items = list(state.items())
    state.clear()
    for key, value in items:
        state.update(splits.get(key, ((key, value),)))


def expose_split_qkv_names(mha) -> None:
    """Give `mha`'s fused projections Transformer Engine's part names (fuse_qkv_params=False):
    `layernorm_qkv.query_weight` and the like read as row views of the fused weight, as the
    state dict names them (save_split_qkv_names), so code and tools that look a state dict's
    names up as attributes (torch.distributed.checkpoint's state-dict functions) find them."""
    for sub, (names, sizes) in _qkv_parts(mha).items():
        getattr(mha, sub).expose_row_views(tuple(zip(names, sizes)))


def save_split_qkv_names(mha, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook of MultiheadAttention with fuse_qkv_params=False: the q, k and v
    weights and biases under Transformer Engine's names (query_weight, key_weight, value_weight,
    query_bias, ...), as views of te-core's fused parameter, so that code written for TE's state
    dict (its Hugging Face loading recipes write `state_dict()[...query_weight].data[:]`) reads
    and writes the module's weights. Only plain tensors are split: `keep_vars=True` (the
    Parameters themselves), FP8 primary weights and sharded (DTensor) weights keep the fused
    name, as `named_parameters()` does. load_split_qkv_names reads both forms back."""
    _split_qkv(mha, state_dict, prefix, plain_only=True)
