"""Transformer Engine's token permutation for mixture-of-experts layers (`te.moe_permute`,
`te.moe_unpermute`, `te.moe_sort_chunks_by_index` and their `_with_probs` / padding variants),
in plain torch operations, so they run on every backend and autograd differentiates them.

`moe_permute` groups the tokens by the expert they are routed to: every row of expert 0 (in
token order), then expert 1's, and so on, a token routed to k experts appearing k times. The
routing is a mask ([tokens, experts], nonzero: routed) or, with map_type="index", each token's
expert indices ([tokens, top_k]). `moe_unpermute` takes the expert outputs back to token order,
summing a token's rows, weighted by `merging_probs` where given. The `row_id_map` that
moe_permute returns is what moe_unpermute needs, in te-core's own layout (Transformer Engine's
is its kernels'; both are only handed from one call to the other): for a mask, the output row
of each (token, expert) pair or -1, [tokens, experts]; for indices, the output row of each
(token, k) pair or -1 (dropped), [tokens, top_k].

A quantized input (Float8Tensor, 1x128 Float8BlockwiseTensor, MXFP8Tensor) is permuted in its
quantized form, as Transformer Engine's: the output is a tensor of the same kind whose rows are
the input rows' FP8 bytes, with the per-tensor scale, or each row's own scales, moved with them
(row-wise data only; a Float8Tensor's column-wise copy is remade from it when a GEMM needs it).
The permutation's gradient is in high precision. moe_unpermute, which sums rows, takes
high-precision rows, as Transformer Engine's.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .quantization.tensor import QUANTIZED, QuantizedTensor, gather_rows

__all__ = ["moe_permute", "moe_permute_with_probs", "moe_permute_and_pad_with_probs", "moe_unpermute",
           "moe_sort_chunks_by_index", "moe_sort_chunks_by_index_with_probs"]


class _SelectRows(torch.autograd.Function):
    """QuantizedTensor.select_rows as an autograd node: the high-precision gradient of each output
    row goes back to the row it came from (summed over a token's rows). A quantized gradient is
    refused (moe_permute) or, for a permutation of whole chunks (`invertible`), has its rows moved
    back in its quantized form, as Transformer Engine's."""

    @staticmethod
    def forward(ctx, inp: QuantizedTensor, source: Tensor, blank: Optional[Tensor], name: str, invertible: bool):
        ctx.save_for_backward(source)
        ctx.num_rows, ctx.name, ctx.invertible = inp.shape[0], name, invertible
        return inp.select_rows(source, blank)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (source,) = ctx.saved_tensors
        if isinstance(grad, QuantizedTensor):
            if not ctx.invertible:
                raise TypeError(f"the backward of {ctx.name} takes a high-precision gradient, got a "
                                f"{type(grad).__name__} (as Transformer Engine's, it does not take FP8 gradients); "
                                "let the op after the permutation return its input gradient unquantized")
            inverse = torch.empty_like(source).index_copy_(0, source, torch.arange(source.numel(),
                                                                                    device=source.device))
            return grad.select_rows(inverse), None, None, None, None
        valid = source >= 0
        out = grad.new_zeros(ctx.num_rows, *grad.shape[1:])
        return out.index_add(0, source[valid], grad[valid]), None, None, None, None


def _check_quantized(inp, name: str) -> bool:
    """Whether inp is quantized (and so permuted in its quantized form), refusing what cannot be."""
    if not isinstance(inp, QUANTIZED):
        return False
    if torch.compiler.is_compiling():
        raise RuntimeError(f"{name} with a quantized (FP8) input is not supported under torch.compile (as in "
                           "Transformer Engine); quantize after the permutation, or outside the compiled region")
    return True


def _select_rows(inp: QuantizedTensor, source: Tensor, name: str, blank: Optional[Tensor] = None,
                 invertible: bool = False) -> QuantizedTensor:
    """inp's rows `source` (-1: a row of zeros) in inp's quantized form, differentiable."""
    return _SelectRows.apply(inp, source, blank, name, invertible)


def _padded_source(tokens: Tensor, num_out_tokens: Optional[int]) -> Tensor:
    """The source row of each of num_out_tokens output rows: `tokens`, then -1 (zero rows)."""
    if num_out_tokens is None or num_out_tokens <= tokens.numel():
        return tokens
    return torch.cat([tokens, tokens.new_full((num_out_tokens - tokens.numel(),), -1)])


def _check_tokens(inp: Tensor, name: str) -> None:
    if not isinstance(inp, Tensor) or inp.dim() != 2:
        raise ValueError(f"{name}: inp must be [num_tokens, hidden_size], got "
                         f"{tuple(inp.shape) if isinstance(inp, Tensor) else type(inp).__name__}")


def _mask_rows(routing_map: Tensor, num_tokens: int, name: str) -> Tuple[Tensor, Tensor]:
    """(the token of each output row, grouped by expert; the [tokens, experts] output row of each
    routed pair or -1)."""
    if routing_map.dim() != 2 or routing_map.shape[0] != num_tokens:
        raise ValueError(f"{name}: routing_map must be [num_tokens={num_tokens}, num_experts] for map_type 'mask', "
                         f"got {tuple(routing_map.shape)}")
    routed = routing_map.bool().T  # [experts, tokens]
    tokens = torch.arange(num_tokens, device=routing_map.device).expand_as(routed).masked_select(routed)
    rows = torch.full(routed.shape, -1, dtype=torch.long, device=routing_map.device)
    rows[routed] = torch.arange(tokens.numel(), device=routing_map.device)
    return tokens, rows.T.contiguous()


def _out_count(routed: int, num_out_tokens: Optional[int], name: str) -> int:
    """The output rows of a mask permutation: num_out_tokens (<= 0 or None: as many as routed)."""
    if num_out_tokens is None or num_out_tokens <= 0:
        return routed
    if num_out_tokens < routed:
        raise ValueError(f"{name}: num_out_tokens={num_out_tokens} but the routing map routes {routed} token rows; "
                         "give at least that many (drop tokens by removing them from the routing map)")
    return num_out_tokens


def _rows_out(inp: Tensor, tokens: Tensor, num_out_tokens: Optional[int], name: str) -> Tensor:
    """inp's rows `tokens`, in num_out_tokens rows (<= 0 or None: as many as routed; more: the
    rest zeros, as a buffer of that size holds them)."""
    routed = tokens.numel()
    num_out_tokens = _out_count(routed, num_out_tokens, name)
    if isinstance(inp, QuantizedTensor):
        return _select_rows(inp, _padded_source(tokens, num_out_tokens), name)
    out = inp.index_select(0, tokens)
    if num_out_tokens > routed:
        out = torch.cat([out, out.new_zeros(num_out_tokens - routed, inp.shape[1])])
    return out


def moe_permute(inp: Tensor, routing_map: Tensor, num_out_tokens: int = -1, max_token_num: int = -1,
                map_type: str = "mask") -> Tuple[Tensor, Tensor]:
    """(the tokens grouped by expert, row_id_map), Transformer Engine's arguments. With
    map_type="index", num_out_tokens < num_tokens x top_k keeps the first rows (capacity dropping:
    the rows of the highest expert indices are dropped first); a larger num_out_tokens gives zero
    rows after the routed ones, with either map type (Transformer Engine leaves them
    uninitialized); max_token_num sizes Transformer Engine's workspace and changes nothing here."""
    name = "moe_permute"
    quantized = _check_quantized(inp, name)
    _check_tokens(inp, name)
    if map_type == "mask":
        tokens, rows = _mask_rows(routing_map, inp.shape[0], name)
        return _rows_out(inp, tokens, num_out_tokens, name), rows
    if map_type == "index":
        if routing_map.dim() == 1:
            routing_map = routing_map[:, None]
        if routing_map.dim() != 2 or routing_map.shape[0] != inp.shape[0]:
            raise ValueError(f"{name}: routing_map must be [num_tokens, top_k] expert indices for map_type 'index', "
                             f"got {tuple(routing_map.shape)}")
        top_k = routing_map.shape[1]
        order = torch.argsort(routing_map.reshape(-1), stable=True)  # (token, k) pairs by expert
        kept = order.numel() if num_out_tokens is None or num_out_tokens <= 0 else min(num_out_tokens, order.numel())
        rows = torch.full((order.numel(),), -1, dtype=torch.long, device=inp.device)
        rows[order[:kept]] = torch.arange(kept, device=inp.device)
        if quantized:
            return _select_rows(inp, _padded_source(order[:kept] // top_k, num_out_tokens), name), rows.view(-1, top_k)
        out = inp.index_select(0, order[:kept] // top_k)
        if num_out_tokens is not None and num_out_tokens > kept:  # (a larger buffer: zeros past the rows, as "mask")
            out = torch.cat([out, out.new_zeros(num_out_tokens - kept, inp.shape[1])])
        return out, rows.view(-1, top_k)
    raise ValueError(f"{name}: map_type must be 'mask' or 'index', got {map_type!r}")


def moe_permute_with_probs(inp: Tensor, probs: Tensor, routing_map: Tensor,
                           num_out_tokens: int = -1) -> Tuple[Tensor, Tensor, Tensor]:
    """(the tokens grouped by expert, their probabilities likewise, row_id_map): probs and
    routing_map are [num_tokens, num_experts]."""
    name = "moe_permute_with_probs"
    quantized = _check_quantized(inp, name)
    _check_tokens(inp, name)
    tokens, rows = _mask_rows(routing_map, inp.shape[0], name)
    if probs.shape != routing_map.shape:
        raise ValueError(f"{name}: probs must match routing_map's shape {tuple(routing_map.shape)}, "
                         f"got {tuple(probs.shape)}")
    permuted_probs = probs.T.masked_select(routing_map.bool().T)
    num_out = _out_count(tokens.numel(), num_out_tokens, name)
    if num_out > permuted_probs.numel():
        permuted_probs = torch.cat([permuted_probs, permuted_probs.new_zeros(num_out - permuted_probs.numel())])
    # A routed slot of probability 0 is padding (routing maps padded to a capacity): its row is
    # zero, as Transformer Engine's kernel writes it, so that it adds nothing to an expert's FP8
    # amax; its gradient still reaches the token, as TE's backward sends it. (Quantized, the zero
    # row keeps its token's scales, as TE's kernel leaves them.)
    padding = permuted_probs == 0
    if quantized:
        return _select_rows(inp, _padded_source(tokens, num_out), name, blank=padding), permuted_probs, rows
    out = _rows_out(inp, tokens, num_out, name)
    out = out - (out * padding.unsqueeze(1)).detach()
    return out, permuted_probs, rows


def moe_permute_and_pad_with_probs(inp: Tensor, probs: Tensor, routing_map: Tensor, tokens_per_expert: Tensor,
                                   align_size: int):
    """moe_permute_with_probs with each expert's rows padded with zero rows to a multiple of
    align_size: (output, permuted probs, row_id_map, pad_offsets (each expert's padding before
    its rows, or None without padding), the padded row counts per expert)."""
    name = "moe_permute_and_pad_with_probs"
    quantized = _check_quantized(inp, name)
    if tokens_per_expert is None:
        raise ValueError(f"{name}: tokens_per_expert must be given (the routed rows per expert)")
    if isinstance(align_size, bool) or not isinstance(align_size, int) or align_size <= 0:
        raise ValueError(f"{name}: align_size must be a positive int, got {align_size!r}")
    counts = tokens_per_expert.to(device=inp.device, dtype=torch.long)
    routed = routing_map.bool().sum(0).to(counts.device)
    if not torch.equal(counts, routed):
        raise ValueError(f"{name}: tokens_per_expert {counts.tolist()} differs from the routing map's counts "
                         f"{routed.tolist()}")
    padded = (counts + align_size - 1) // align_size * align_size
    out, permuted_probs, rows = moe_permute_with_probs(inp, probs, routing_map)
    if torch.equal(padded, counts):
        return out, permuted_probs, rows, None, padded
    pad_offsets = torch.cumsum(padded - counts, 0) - (padded - counts)  # padding before each expert's rows
    expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=inp.device), counts)
    target = torch.arange(out.shape[0], device=inp.device) + pad_offsets[expert_of_row]
    total = int(padded.sum())
    if quantized:
        source = torch.full((total,), -1, dtype=torch.long, device=inp.device)
        padded_out = _select_rows(out, source.index_copy(0, target, torch.arange(out.shape[0], device=inp.device)),
                                  name)
    else:
        padded_out = out.new_zeros(total, out.shape[1]).index_copy(0, target, out)
    padded_probs = permuted_probs.new_zeros(total).index_copy(0, target, permuted_probs)
    rows = torch.where(rows >= 0, rows + pad_offsets[None, :], rows)
    return padded_out, padded_probs, rows, pad_offsets, padded


def moe_unpermute(inp: Tensor, row_id_map: Tensor, merging_probs: Optional[Tensor] = None,
                  restore_shape: Optional[Union[torch.Size, Sequence[int]]] = None, map_type: str = "mask",
                  probs: Optional[Tensor] = None, pad_offsets: Optional[Tensor] = None) -> Tensor:
    """The expert outputs back in token order: each token's rows summed, weighted by
    merging_probs ([num_tokens, num_experts] for a mask, [num_tokens, top_k] for indices) where
    given. `probs` is Transformer Engine's deprecated name of merging_probs; `pad_offsets` (from
    moe_permute_and_pad_with_probs) is already in row_id_map here and only checked for presence."""
    name = "moe_unpermute"
    if probs is not None:
        if merging_probs is not None:
            raise ValueError(f"{name}: probs is the deprecated name of merging_probs; give only merging_probs")
        merging_probs = probs
    if map_type not in ("mask", "index"):
        raise ValueError(f"{name}: map_type must be 'mask' or 'index', got {map_type!r}")
    if map_type == "mask" and isinstance(inp, QUANTIZED):  # (with indices TE's kernel reads it dequantized)
        raise TypeError(f"{name}: inp is a {type(inp).__name__}; as Transformer Engine's, moe_unpermute does not "
                        "take FP8 rows (it sums them in high precision): pass inp.dequantize()")
    _check_tokens(inp, name)
    num_tokens = row_id_map.shape[0]
    if restore_shape is not None and tuple(restore_shape)[0] != num_tokens:
        raise ValueError(f"{name}: restore_shape {tuple(restore_shape)} has not the row_id_map's {num_tokens} tokens")
    if merging_probs is not None and merging_probs.shape != row_id_map.shape:
        raise ValueError(f"{name}: merging_probs must be {tuple(row_id_map.shape)} (tokens x "
                         f"{'experts' if map_type == 'mask' else 'top_k'}), got {tuple(merging_probs.shape)}")
    taken = row_id_map >= 0
    token = torch.arange(num_tokens, device=inp.device)[:, None].expand_as(row_id_map)[taken]
    # weighted and summed in float32 (at least), rounded once to inp's dtype (Transformer Engine's kernel does
    # the same): in bf16 two probabilities 1e-4 apart round alike, and their gradient loses ~3 digits
    compute = torch.promote_types(inp.dtype, torch.float32)
    ids = row_id_map[taken]
    if ids.numel() > inp.shape[0]:  # (free: the mask's size is known on the host; one id per routed row)
        raise ValueError(f"{name}: row_id_map routes {ids.numel()} rows but inp has {inp.shape[0]}; pass the "
                         "expert outputs of the moe_permute call that made this row_id_map")
    if map_type == "mask" and merging_probs is None:
        return _MergeRows.apply(inp, ids, token, num_tokens)
    rows = inp.index_select(0, ids).to(compute)
    if merging_probs is not None:
        rows = rows * merging_probs[taken][:, None].to(compute)
    out = rows.new_zeros(num_tokens, inp.shape[1]).index_add(0, token, rows).to(inp.dtype)
    if map_type == "mask" and out.requires_grad:
        out.register_hook(_refuse_quantized_grad)
    return out


def _refuse_quantized_grad(grad: Tensor) -> None:
    if isinstance(grad, QuantizedTensor):
        raise TypeError(f"the backward of moe_unpermute with merging_probs takes a high-precision gradient, got a "
                        f"{type(grad).__name__} (as Transformer Engine's, it does not take FP8 gradients); let the op "
                        "after moe_unpermute return its input gradient unquantized")


class _MergeRows(torch.autograd.Function):
    """moe_unpermute of a mask's rows without probabilities: each token's rows summed (in float32
    at least). The gradient of a row is its token's, a quantized one moved in its quantized form
    (QuantizedTensor.select_rows), as Transformer Engine's backward permutes an FP8 gradient."""

    @staticmethod
    def forward(ctx, inp: Tensor, ids: Tensor, token: Tensor, num_tokens: int) -> Tensor:
        source = torch.full((inp.shape[0],), -1, dtype=torch.long, device=inp.device)
        ctx.save_for_backward(source.index_copy_(0, ids, token))  # each row's token; -1: padding, no token
        compute = torch.promote_types(inp.dtype, torch.float32)
        rows = inp.index_select(0, ids).to(compute)
        return rows.new_zeros(num_tokens, inp.shape[1]).index_add(0, token, rows).to(inp.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (source,) = ctx.saved_tensors
        if isinstance(grad, QuantizedTensor):
            return grad.select_rows(source), None, None, None
        return gather_rows(grad, source), None, None, None


def _chunk_order(split_sizes, sorted_index, total: int, device, name: str) -> Tensor:
    sizes = [int(s) for s in (split_sizes.tolist() if isinstance(split_sizes, Tensor) else split_sizes)]
    order = [int(i) for i in (sorted_index.tolist() if isinstance(sorted_index, Tensor) else sorted_index)]
    if sum(sizes) != total or sorted(order) != list(range(len(sizes))):
        raise ValueError(f"{name}: split_sizes must sum to the {total} rows and sorted_index be a permutation of "
                         f"the {len(sizes)} chunks; got {sizes} and {order}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([torch.arange(starts[i], starts[i] + sizes[i], device=device) for i in order]) if order \
        else torch.zeros(0, dtype=torch.long, device=device)


def _sorted_chunks(inp: Tensor, rows: Tensor, quantized: bool, name: str) -> Tensor:
    return _select_rows(inp, rows, name, invertible=True) if quantized else inp.index_select(0, rows)


def moe_sort_chunks_by_index(inp: Tensor, split_sizes, sorted_index) -> Tensor:
    """inp cut along dim 0 into chunks of split_sizes, then put in the order sorted_index gives."""
    name = "moe_sort_chunks_by_index"
    quantized = _check_quantized(inp, name)
    return _sorted_chunks(inp, _chunk_order(split_sizes, sorted_index, inp.shape[0], inp.device, name), quantized,
                          name)


def moe_sort_chunks_by_index_with_probs(inp: Tensor, probs: Tensor, split_sizes, sorted_index) -> Tuple[Tensor, Tensor]:
    """moe_sort_chunks_by_index of inp and of its per-row probs alike."""
    name = "moe_sort_chunks_by_index_with_probs"
    quantized = _check_quantized(inp, name)
    if not isinstance(probs, Tensor) or probs.dim() == 0 or probs.shape[0] != inp.shape[0]:
        got = f"shape {tuple(probs.shape)}" if isinstance(probs, Tensor) else f"a {type(probs).__name__}"
        raise ValueError(f"{name}: probs must hold one probability per row of inp ([num_tokens] = [{inp.shape[0]}]), "
                         f"got {got}")
    rows = _chunk_order(split_sizes, sorted_index, inp.shape[0], inp.device, name)
    return _sorted_chunks(inp, rows, quantized, name), probs.index_select(0, rows)
