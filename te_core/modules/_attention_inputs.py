"""DotProductAttention's inputs as Transformer Engine lays them out: separate or packed q/k/v
(qkv_layer, kv_layer), padded sequences with masks or cu_seqlens, packed sequences ("thd"),
with or without padding between them, turned into what the attention ops take."""
from __future__ import annotations

import torch
from torch import Tensor

from ..ops.attention import ATTN_MASK_TYPES, PADDING_MASK_TYPES
from ._common import check_choice, check_not_meta
from ._packed import PADDED_MASK_TYPE, packing, unpadded_rows


def mask_type_spelling(attn_mask_type):
    """Transformer Engine's other spellings of a mask type, as it reads them: commas for
    underscores, and "causal_padding" (so also "causal,padding") for "padding_causal"."""
    if not isinstance(attn_mask_type, str):
        return attn_mask_type  # (check_choice names what it is)
    spelled = attn_mask_type.replace(",", "_")
    return "padding_causal" if spelled == "causal_padding" else spelled


def check_mask_type(attn_mask_type, *, name: str, module: str) -> str:
    """attn_mask_type, one of ATTN_MASK_TYPES in any of Transformer Engine's spellings."""
    return check_choice(mask_type_spelling(attn_mask_type), ATTN_MASK_TYPES, name=name, module=module)


def check_max_seqlens(fmt: str, q, k, max_seqlens, context_parallel: bool = False) -> None:
    """sbhd / bshd: max_seqlen_q / max_seqlen_kv, where given, are the query's and the key's
    sequence lengths (under context parallelism this rank's shares, as Transformer Engine reads them)."""
    for arg, t, given in (("max_seqlen_q", q, max_seqlens[0]), ("max_seqlen_kv", k, max_seqlens[1])):
        s = t.shape[0 if fmt == "sbhd" else 1] if isinstance(t, Tensor) and t.dim() == 4 else None
        if given is not None and given != s:
            share = (" (under context parallelism max_seqlen_q / max_seqlen_kv are this rank's share of the sequence, "
                     "as in Transformer Engine)") if context_parallel else ""
            raise ValueError(f"DotProductAttention: {arg}={given} but the {fmt} tensor holds sequences of {s}{share}")


def sequence_layout(fmt, q, k, mask_type, attention_mask, cu_seqlens, max_seqlens):
    """(the (query, key/value) Packing of thd inputs or None, mask type, attention mask): thd
    takes its padding from cu_seqlens; sbhd/bshd may give padding masks as cu_seqlens."""
    if fmt == "thd":
        packed = _packings(q, k, *cu_seqlens, *max_seqlens, attention_mask, mask_type)
        return packed, PADDED_MASK_TYPE[mask_type], None
    check_max_seqlens(fmt, q, k, max_seqlens)
    if cu_seqlens[0] is not None or cu_seqlens[1] is not None:
        attention_mask = _padding_from_lengths(q, k, fmt, *cu_seqlens, attention_mask, mask_type)
    return None, mask_type, attention_mask


def unpack_qkv(qkv_layer, kv_layer, q, k, v, fmt: str, dim: int):
    """(query, key, value): as given, or views of Transformer Engine's packed inputs: qkv_layer
    ((b, s, 3, h, d) / (b, s, h, 3, d) in bshd, likewise sbhd, (t, 3, h, d) / (t, h, 3, d) in thd,
    the 3 at qkv_interleave_dim -3 or -2), or query_layer with kv_layer (the 2 of k and v there)."""
    name = "DotProductAttention"
    if qkv_layer is None and kv_layer is None:
        if q is None or k is None or v is None:
            raise ValueError(f"{name}: give query_layer, key_layer and value_layer, or the packed qkv_layer, or "
                             "query_layer with kv_layer")
        return q, k, v
    if qkv_layer is not None and kv_layer is not None:
        raise ValueError(f"{name}: qkv_layer and kv_layer exclude each other")
    if isinstance(dim, bool) or dim not in (-3, -2):
        raise ValueError(f"{name}: qkv_interleave_dim must be -3 (e.g. bs3hd) or -2 (e.g. bsh3d), got {dim!r}")
    packed, count, what = (qkv_layer, 3, "qkv_layer") if qkv_layer is not None else (kv_layer, 2, "kv_layer")
    taken = (q, k, v) if qkv_layer is not None else (k, v)
    if any(t is not None for t in taken):
        raise ValueError(f"{name}: {what} already holds " + ("query, key and value: pass no query_layer, key_layer "
                         "or value_layer" if count == 3 else "key and value: pass no key_layer or value_layer"))
    if count == 2 and q is None:
        raise ValueError(f"{name}: kv_layer holds only key and value: pass query_layer too")
    rank = 4 if fmt == "thd" else 5
    if not isinstance(packed, Tensor) or packed.dim() != rank or packed.shape[dim] != count:
        shape = tuple(packed.shape) if isinstance(packed, Tensor) else type(packed).__name__
        raise ValueError(f"{name}: {what} must be {rank}-D for qkv_format={fmt!r} with {count} at "
                         f"qkv_interleave_dim={dim}, got {shape}")
    views = [packed.select(dim, i) for i in range(count)]
    return tuple(views) if count == 3 else (q, *views)


def check_qkv(q, k, v) -> None:
    """Query, key and value as the attention ops read them together: tensors of one dtype on one
    real device (check_not_meta)."""
    name = "DotProductAttention"
    for arg, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    check_not_meta(q, name="query_layer", module=name)
    for arg, t in (("key_layer", k), ("value_layer", v)):
        if t.device != q.device:
            raise ValueError(f"{name}: {arg} is on {t.device} but query_layer is on {q.device}; query, key and "
                             f"value must be on one device ({arg}.to(query_layer.device))")
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: {arg} has dtype {t.dtype} but query_layer has {q.dtype}; query, key and "
                            f"value must share one dtype ({arg}.to(query_layer.dtype))")


def between_seqs(fmt: str, cu_seqlens, cu_seqlens_padded, totals):
    """(query rows, key/value rows) of the sequences' tokens in Transformer Engine's
    pad_between_seqs layout (thd with cu_seqlens_q_padded / cu_seqlens_kv_padded)."""
    name = "DotProductAttention"
    if fmt != "thd":
        raise ValueError(f"{name}: cu_seqlens_q_padded / cu_seqlens_kv_padded (pad_between_seqs) describe packed "
                         f"sequences, qkv_format='thd'; got {fmt!r}")
    if any(c is None for c in (*cu_seqlens, *cu_seqlens_padded)):
        raise ValueError(f"{name}: padding between packed sequences needs cu_seqlens_q and cu_seqlens_kv (the "
                         "lengths) and cu_seqlens_q_padded and cu_seqlens_kv_padded (where the sequences start)")
    return tuple(unpadded_rows(cu, padded, total, arg, name) for cu, padded, total, arg in
                 zip(cu_seqlens, cu_seqlens_padded, totals, ("cu_seqlens_q", "cu_seqlens_kv")))


def _packings(q, k, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, attention_mask, mask_type):
    """(query, key/value) Packing of qkv_format="thd" inputs."""
    name = "DotProductAttention"
    if cu_seqlens_q is None or cu_seqlens_kv is None:
        raise ValueError(f"{name}: qkv_format='thd' needs cu_seqlens_q and cu_seqlens_kv (the b + 1 offsets of "
                         "the packed sequences)")
    if attention_mask is not None or mask_type not in PADDED_MASK_TYPE:
        raise ValueError(f"{name}: qkv_format='thd' takes its padding from cu_seqlens: no attention_mask, and "
                         f"attn_mask_type one of {', '.join(PADDED_MASK_TYPE)} (got {mask_type!r})")
    for arg, t in (("query_layer", q), ("key_layer", k)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: {arg} must be 3-D (thd), got {getattr(t, 'shape', type(t).__name__)}")
    where_q = packing(cu_seqlens_q, max_seqlen_q, q.shape[0], "cu_seqlens_q", name)
    where_kv = packing(cu_seqlens_kv, max_seqlen_kv, k.shape[0], "cu_seqlens_kv", name)
    if where_q.cu_seqlens.numel() != where_kv.cu_seqlens.numel():
        raise ValueError(f"{name}: cu_seqlens_q and cu_seqlens_kv describe different numbers of sequences")
    return where_q, where_kv


def _padding_from_lengths(q, k, fmt, cu_seqlens_q, cu_seqlens_kv, attention_mask, mask_type):
    """sbhd/bshd with cu_seqlens, as Transformer Engine allows for padding types: the padding
    masks of sequences right-padded to the tensors' length."""
    name = "DotProductAttention"
    if attention_mask is not None or mask_type not in PADDING_MASK_TYPES or cu_seqlens_q is None \
            or cu_seqlens_kv is None:
        raise ValueError(f"{name}: with qkv_format={fmt!r}, cu_seqlens_q and cu_seqlens_kv stand for the "
                         "attention_mask of a padding attn_mask_type; give both, with a padding type and no mask")
    masks = []
    for arg, t, cu in (("cu_seqlens_q", q, cu_seqlens_q), ("cu_seqlens_kv", k, cu_seqlens_kv)):
        s = t.shape[0 if fmt == "sbhd" else 1]
        lengths = cu.diff() if isinstance(cu, Tensor) and cu.dim() == 1 and not cu.is_floating_point() else None
        if lengths is None or bool((lengths < 0).any()) or bool((lengths > s).any()):
            raise ValueError(f"{name}: {arg} must be 1-D offsets of sequences no longer than {s}, got {cu!r}")
        b = t.shape[1 if fmt == "sbhd" else 0]
        if lengths.numel() != b:
            raise ValueError(f"{name}: {arg} describes {lengths.numel()} sequences, but the {fmt} tensors hold {b} "
                             f"(give b + 1 = {b + 1} offsets)")
        masks.append((torch.arange(s, device=t.device)[None, :] >= lengths[:, None]).view(-1, 1, 1, s))
    return tuple(masks)
