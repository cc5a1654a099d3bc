"""te.InferenceParams: Transformer Engine's KV cache for generation, non-paged or paged.

A model called with `inference_params` attends each step's new tokens to everything its
sequences have seen: `pre_step({seq_id: new tokens})` says which sequences this step carries (in
the batch's order) and how many tokens each brings; every attention layer (by its layer_number)
then writes its new keys and values into its cache and attends the new queries to the cached
ones, causal types aligned to the bottom right (the new tokens are the sequences' last). A
sequence missing from a step has finished and frees its place for a new one.

Non-paged, each sequence keeps its row of the (max_batch_size, max_sequence_length, heads, dim)
caches for its lifetime, so no cache is reordered when others finish; paged, it takes pages of
the (total_num_pages, page_size, heads, dim) caches as it grows. The step's cache positions are
computed once in pre_step, as index tensors every layer uses. No gradient flows through the
caches (generation runs without autograd).

A step that cannot read anything on the host (compiled, or captured into a graph that replays
it) runs at fixed shapes instead (fixed_shape_step): pre_step also writes the step's layout into
one device buffer, in place, which such a step reads, so one graph serves every step.
"""
from __future__ import annotations

import numbers
import sys
from collections import OrderedDict
from collections.abc import Mapping
from itertools import accumulate
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..ops.packed_sequences import check_on_device, host_readable, token_positions
from ..quantization.scaling import graph_capture_active
from ._common import check_bool, check_positive, resolve_device


def fixed_shapes(t: Tensor) -> bool:
    """Whether a KV-cache step with input t runs at fixed shapes (fixed_shape_step): inside
    te.make_graphed_callables (its warm-up too, so that the capture finds the caches as the
    warm-up left them) and wherever t's values cannot be read on the host (host_readable)."""
    return graph_capture_active() or not host_readable(t)


def _token_count(n, seq, name: str) -> int:
    """A step's number of new tokens for `seq`: any positive integer (Python's, numpy's, or a
    0-d integer tensor's, as code that counts with tensors passes them)."""
    count = n
    if isinstance(n, torch.Tensor) and n.dim() == 0 and not n.is_floating_point() and n.dtype != torch.bool:
        count = n.item()
    if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
        raise ValueError(f"{name}: sequence {seq!r} brings {n!r} tokens; give a positive integer")
    return int(count)


class InferenceParams:
    """Transformer Engine's InferenceParams. `qkv_format` is the new tokens' layout: "bshd" /
    "sbhd" (sequence j's new tokens first in its row, the rest padding) or "thd" (packed, with
    `max_ctx_len` the most tokens a sequence brings in one step). `is_paged`: the caches are
    (total_num_pages, page_size, heads, dim) pages that sequences take as they grow and give
    back when they finish (`page_table` lists the step's sequences' pages)."""

    def __init__(self, max_batch_size: int, max_sequence_length: int, num_heads_kv: Optional[int] = None,
                 head_dim_k: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                 head_dim_v: Optional[int] = None, is_paged: bool = False, total_num_pages: Optional[int] = None,
                 page_size: Optional[int] = None, max_ctx_len: Optional[int] = None, qkv_format: str = "bshd",
                 custom_cache_manager=None):
        name = "InferenceParams"
        if custom_cache_manager is not None:
            raise NotImplementedError(f"{name}: custom cache managers are not supported by te-core yet")
        if num_heads_kv is None or head_dim_k is None or dtype is None:
            raise ValueError(f"{name}: num_heads_kv, head_dim_k and dtype are required (as in Transformer Engine 2.2+)")
        if qkv_format not in ("bshd", "sbhd", "thd"):
            raise ValueError(f"{name}: qkv_format must be 'bshd', 'sbhd' or 'thd', got {qkv_format!r}")
        if qkv_format == "thd" and max_ctx_len is None:
            raise ValueError(f"{name}: qkv_format='thd' needs max_ctx_len (the most tokens a sequence brings per step)")
        self.max_batch_size = check_positive(max_batch_size, name="max_batch_size", module=name)
        self.max_sequence_length = check_positive(max_sequence_length, name="max_sequence_length", module=name)
        self.num_heads_kv = check_positive(num_heads_kv, name="num_heads_kv", module=name)
        self.head_dim_k = check_positive(head_dim_k, name="head_dim_k", module=name)
        self.head_dim_v = self.head_dim_k if head_dim_v is None else check_positive(head_dim_v, name="head_dim_v",
                                                                                     module=name)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{name}: dtype must be the caches' floating-point torch.dtype (the keys' and values'), "
                            f"got {dtype!r}")
        if max_ctx_len is not None and (check_positive(max_ctx_len, name="max_ctx_len", module=name)
                                        > max_sequence_length):
            raise ValueError(f"{name}: max_ctx_len={max_ctx_len} (the most tokens a sequence brings per step) exceeds "
                             f"max_sequence_length={max_sequence_length}")
        self.is_paged = check_bool(is_paged, name="is_paged", module=name)
        if self.is_paged:  # Transformer Engine's conditions on the pages
            self.page_size = check_positive(page_size, name="page_size", module=name) if page_size else None
            if self.page_size is None or max_sequence_length % self.page_size:
                raise ValueError(f"{name}: a paged cache needs a page_size that divides max_sequence_length="
                                 f"{max_sequence_length}, got {page_size!r}")
            self.max_pages_per_seq = max_sequence_length // self.page_size
            if total_num_pages != max_batch_size * self.max_pages_per_seq:
                raise ValueError(f"{name}: a paged cache needs total_num_pages = max_batch_size * max_sequence_length "
                                 f"/ page_size = {max_batch_size * self.max_pages_per_seq}, got {total_num_pages!r}")
            self.total_num_pages = total_num_pages
        # not paged: total_num_pages and page_size are not read, as in Transformer Engine (whose
        # Gemma tutorial passes them whether or not it pages)
        self.dtype, self.max_ctx_len = dtype, max_ctx_len
        self.input_qkv_format = qkv_format
        self.device = resolve_device(None)
        self.cache: Dict[int, Tuple[Tensor, Tensor]] = {}  # layer_number -> (k_cache, v_cache)
        # the caches' tokens flat, (slots, heads, dim), with one spare slot past them, where
        # fixed-shape writes of padding tokens land (fixed_shape_step)
        self._storage: Dict[int, Tuple[Tensor, Tensor]] = {}
        self._marked_static = False  # (_mark_static)
        # the step's layout at fixed shapes, refilled in place by pre_step, for steps that cannot
        # read it on the host (fixed_shape_step): per batch row, its new tokens, its tokens cached
        # before the step, and its cache row (or pages); rows past the step's batch bring nothing
        self._layout = torch.zeros(self.max_batch_size, 2 + (self.max_pages_per_seq if self.is_paged else 1),
                                   dtype=torch.long, device=self.device)
        self.reset()

    def reset(self) -> None:
        """Forget every sequence (the caches' memory is kept)."""
        self.sequences: "OrderedDict[object, int]" = OrderedDict()  # seq_id -> tokens cached after this step
        self._slots: Dict[object, int] = {}  # non-paged: seq_id -> its row of the caches
        self._pages: Dict[object, List[int]] = {}  # paged: seq_id -> its pages, in order
        self._free_pages = list(range(self.total_num_pages)) if self.is_paged else []
        self.batch_size = 0
        self.step_lens = []
        self._empty = True

    def allocate_memory(self, layer_number: int) -> None:
        """The key and value caches of one attention layer, zeros: `cache[layer_number]` has
        Transformer Engine's shape, a view of flat storage one token longer (the spare slot)."""
        if self.is_paged:
            rows = (self.total_num_pages, self.page_size)
        else:
            rows = (self.max_batch_size, self.max_sequence_length)
        storage = tuple(torch.zeros(rows[0] * rows[1] + 1, self.num_heads_kv, dim, dtype=self.dtype,
                                    device=self.device) for dim in (self.head_dim_k, self.head_dim_v))
        self._storage[layer_number] = storage
        self.cache[layer_number] = tuple(t[:-1].view(*rows, *t.shape[1:]) for t in storage)
        self._marked_static = False
        self._mark_static()

    def pre_step(self, step_dict: "OrderedDict[object, int]") -> None:
        """The next step: {seq_id: new tokens} in the batch's order. A sequence seen before
        continues, one missing has finished (its slot or pages are freed), a new one takes a
        free slot (pages as it needs them)."""
        name = "InferenceParams.pre_step"
        if not isinstance(step_dict, Mapping):
            raise TypeError(f"{name}: give an OrderedDict {{seq_id: new tokens}} in the batch's order, got "
                            f"{type(step_dict).__name__}")
        if not step_dict or len(step_dict) > self.max_batch_size:
            raise ValueError(f"{name}: a step carries 1 to max_batch_size={self.max_batch_size} sequences, "
                             f"got {len(step_dict)}")
        step_dict = OrderedDict((seq, _token_count(n, seq, name)) for seq, n in step_dict.items())
        totals = {seq: (self.sequences.get(seq, 0) if seq in self._held() else 0) + n for seq, n in step_dict.items()}
        for seq, total in totals.items():
            if total > self.max_sequence_length:
                raise ValueError(f"{name}: sequence {seq!r} would hold {total} tokens, more than "
                                 f"max_sequence_length={self.max_sequence_length}")
        for seq in [s for s in self._held() if s not in step_dict]:  # finished: give back its place
            self._slots.pop(seq, None)
            self._free_pages.extend(self._pages.pop(seq, []))
        for seq, total in totals.items():
            if self.is_paged:
                pages = self._pages.setdefault(seq, [])
                while len(pages) * self.page_size < total:
                    pages.append(self._free_pages.pop(0))
            elif seq not in self._slots:
                self._slots[seq] = min(set(range(self.max_batch_size)) - set(self._slots.values()))
        self.sequences = OrderedDict(totals)
        self.batch_size, self.step_lens = len(step_dict), list(step_dict.values())
        pre = [totals[s] - n for s, n in step_dict.items()]
        as_device = lambda values: torch.tensor(values, dtype=torch.int32, device=self.device)  # noqa: E731
        self.pre_step_seqlens = as_device(pre)
        self.cu_seqlens_q = as_device(_cumulative(self.step_lens))
        self.cu_seqlens_kv = as_device(_cumulative(list(totals.values())))
        # the step's indices, made once for every layer (vectorized: a long context is many
        # tokens): where each new token sits in the padded input (batch row, position), where it
        # goes in the caches, and where every cached token of the step's sequences is; made on the
        # host (also inside a torch.device(...) context), then moved once
        order, none = list(step_dict), [0] * self.batch_size
        if self.is_paged:
            table = torch.tensor([self._pages[s] + [0] * (self.max_pages_per_seq - len(self._pages[s]))
                                  for s in order], dtype=torch.long, device="cpu")
            self.page_table = table.to(device=self.device, dtype=torch.int32)
        else:
            table = torch.tensor([self._slots[s] for s in order], dtype=torch.long, device="cpu")
        to_device = lambda pair: tuple(t.to(self.device) for t in pair)  # noqa: E731
        self._new_rows = to_device(_token_rows(none, self.step_lens))
        self._writes = to_device(self._in_cache(table, *_token_rows(pre, self.step_lens)))
        self._reads = to_device(self._in_cache(table, *_token_rows(none, list(totals.values()))))
        self._fill_layout(step_dict, pre, table)
        self._mark_static()
        self._empty = False

    def _mark_static(self) -> None:
        """Once torch.compile is in use (torch._dynamo imported: torch.compile imports it), the
        tensors a compiled step writes or reads across steps are marked as static inputs, so
        that CUDA graphs (mode="reduce-overhead") replay their in-place updates instead of
        skipping the graph for its mutated inputs; te_core does not import dynamo itself."""
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None or self._marked_static:  # (marked once; a new layer's caches unset it)
            return
        for t in (self._layout, *(t for storage in self._storage.values() for t in storage)):
            dynamo.mark_static_address(t)
        self._marked_static = True

    def _fill_layout(self, step_dict, pre: List[int], table: Tensor) -> None:
        """The step's layout into the fixed-shape buffer, in place (one copy to the device)."""
        layout = torch.zeros(self._layout.shape, dtype=torch.long, device="cpu")  # padding rows read row 0, masked
        b = self.batch_size
        layout[:b, 0] = torch.tensor(self.step_lens, device="cpu")
        layout[:b, 1] = torch.tensor(pre, device="cpu")
        if self.is_paged:
            for row, seq in enumerate(step_dict):
                layout[row, 2:2 + len(self._pages[seq])] = torch.tensor(self._pages[seq], device="cpu")
        else:
            layout[:b, 2] = table
        self._layout.copy_(layout)

    def fixed_shape_step(self, layer_number: int, new_k: Tensor, new_v: Tensor, qkv_format: str):
        """cached_step for a step that cannot read the layout on the host (torch.compile, graph
        capture): everything at shapes fixed by the inputs and the caches, the layout read from
        the buffer pre_step refills, so one graph serves every step. new_k / new_v: the step's
        (B, S, h, d) ("bshd") or (S, B, h, d) ("sbhd") inputs, B up to max_batch_size rows (rows
        past the step's sequences are padding); packed ("thd") tokens are laid out so first
        (fixed_shape_padded). Writes the new tokens into the layer's cache and
        returns (every key and value of the rows' sequences, (B, max_sequence_length, h, d) in
        the input's format; the query padding mask (B, 1, 1, S); the key padding mask (B, 1, 1,
        max_sequence_length), True = padding) for a padded attention over them."""
        self._check_stepped("step")
        if layer_number not in self.cache:
            if not host_readable(new_k):  # a graph would hold the new cache's zero fill, and clear it at every replay
                raise RuntimeError(
                    f"InferenceParams: layer {layer_number}'s KV cache does not exist yet, and a compiled or captured "
                    "step cannot allocate it. Run one step eagerly (or warm up before capturing), or call "
                    "allocate_memory(layer_number) for every attention layer first")
            self.allocate_memory(layer_number)
        new_k, new_v = ((t.transpose(0, 1) if qkv_format == "sbhd" else t) for t in (new_k, new_v))
        rows, s = new_k.shape[:2]
        if rows > self.max_batch_size:
            raise ValueError(f"InferenceParams: the input holds {rows} sequences, more than max_batch_size="
                             f"{self.max_batch_size}")
        for new, cache, what in ((new_k, self.cache[layer_number][0], "keys"),
                                 (new_v, self.cache[layer_number][1], "values")):
            if new.shape[2:] != cache.shape[2:]:
                raise ValueError(f"InferenceParams: the new {what} have shape {tuple(new.shape)}, but the cache holds "
                                 f"(..., {', '.join(map(str, cache.shape[2:]))}); build InferenceParams with the "
                                 "layer's num_heads_kv and head dims")
        layout = self._layout
        lens, pre, table = layout[:rows, 0], layout[:rows, 1], layout[:rows, 2:]
        check_on_device(torch.cat([lens <= s, layout[rows:, 0] == 0]),
                        f"InferenceParams: pre_step's sequences must fit the input: at most {rows} of them (its "
                        f"rows), bringing at most {s} tokens each (its sequence length)")
        positions = torch.arange(s, device=layout.device)
        padding_q = positions[None, :] >= lens[:, None]  # (rows, s)
        at = pre[:, None] + positions[None, :]  # each new token's position in its sequence
        length = self.max_sequence_length
        if self.is_paged:  # the token's page, and its offset there
            page = table.gather(1, (at // self.page_size).clamp(max=self.max_pages_per_seq - 1))
            slot = page * self.page_size + at % self.page_size
        else:  # the sequence's row, and its position there
            slot = table[:, :1] * length + at.clamp(max=length - 1)
        storage = self._storage[layer_number]
        slot = slot.masked_fill(padding_q, storage[0].shape[0] - 1)  # padding tokens: the spare slot
        for new, flat in zip((new_k, new_v), storage):
            flat.index_put_((slot,), new.detach().to(flat.dtype))
        if self.is_paged:
            k_all, v_all = (cache[table].reshape(rows, length, *cache.shape[2:]) for cache in self.cache[layer_number])
        else:
            k_all, v_all = (cache.index_select(0, table[:, 0]) for cache in self.cache[layer_number])
        padding_kv = torch.arange(length, device=layout.device)[None, :] >= (pre + lens)[:, None]
        if qkv_format == "sbhd":
            k_all, v_all = k_all.transpose(0, 1), v_all.transpose(0, 1)
        return k_all, v_all, padding_q.view(rows, 1, 1, s), padding_kv.view(rows, 1, 1, length)

    def _packed_layout(self, tokens: int) -> Tuple[Tensor, Tensor, Tensor]:
        """(row, position in the step, padding) of each of `tokens` packed new tokens, from the
        fixed-shape buffer: the step's sequences' tokens in order, then padding up to `tokens`."""
        lens = self._layout[:, 0]
        ends = lens.cumsum(0)
        index = torch.arange(tokens, device=lens.device)
        row = torch.searchsorted(ends, index, right=True).clamp(max=self.max_batch_size - 1)
        check_on_device(ends[-1:] <= tokens, f"InferenceParams: pre_step's sequences bring more tokens than the "
                                             f"packed input holds ({tokens})")
        return row, index - (ends - lens)[row], index >= ends[-1]

    def fixed_shape_padded(self, *xs: Tensor) -> Tuple[Tensor, ...]:
        """Packed new tokens xs (T, ...) of a fixed-shape step (query, key, value: one layout for
        all) as (max_batch_size, max_ctx_len, ...) rows, zeros past each sequence's tokens
        (tokens past the step's are padding, dropped)."""
        row, position, padding = self._packed_layout(xs[0].shape[0])
        check_on_device(self._layout[:, 0] <= self.max_ctx_len, f"InferenceParams: a sequence brings more than "
                                                                f"max_ctx_len={self.max_ctx_len} tokens")
        where = (row, position.clamp(max=self.max_ctx_len).masked_fill(padding, self.max_ctx_len))
        padded = []
        for x in xs:
            full = x.new_zeros(self.max_batch_size, self.max_ctx_len + 1, *x.shape[1:])  # the last column: padding
            padded.append(full.index_put_(where, x)[:, :self.max_ctx_len])
        return tuple(padded)

    def fixed_shape_packed(self, out: Tensor, tokens: int) -> Tensor:
        """fixed_shape_padded's inverse for an output (max_batch_size, max_ctx_len, ...): the
        `tokens` packed rows, zeros for the padding tokens."""
        row, position, padding = self._packed_layout(tokens)
        picked = out[row, position.clamp(max=self.max_ctx_len - 1)]
        return picked.masked_fill(padding.view(-1, *([1] * (picked.dim() - 1))), 0)

    def fixed_shape_positions(self, tokens: int) -> Tensor:
        """Each of `tokens` packed new tokens' position in its sequence (0 for padding tokens):
        the rotary embedding's positions in a fixed-shape thd step."""
        self._check_stepped("get_seqlens_pre_step")
        row, position, padding = self._packed_layout(tokens)
        return (self._layout[:, 1][row] + position).masked_fill(padding, 0)

    def padded_positions(self, rows: int, seq: int) -> Tensor:
        """(rows, seq): each token's position in its sequence for a padded (bshd) step input of
        `rows` sequences of `seq` tokens: the sequence's cached tokens plus the token's place
        among its new ones. A padding token takes its row's last new token's position (0 in a
        padding row), so the rotary table needs only as many positions as the sequences hold
        (a decoding row padded to a prompt's length would reach past them otherwise). From the
        layout buffer: the same in eager, compiled and captured steps."""
        self._check_stepped("get_seqlens_pre_step")
        lens, pre = self._layout[:rows, 0], self._layout[:rows, 1]
        last = (lens - 1).clamp(min=0)
        return pre[:, None] + torch.minimum(torch.arange(seq, device=pre.device)[None, :], last[:, None])

    def check_rotary_reach(self, positions: int, on_device: bool) -> None:
        """A clear error where a sequence of the step holds more tokens than the rotary table
        `positions` has angles for (on the device where the step cannot read the host's count)."""
        message = (f"apply_rotary_pos_emb: a sequence of this step reaches position {{}}, but freqs hold positions "
                   f"0..{positions - 1}: make the rotary embedding for at least max_sequence_length="
                   f"{self.max_sequence_length} positions, e.g. RotaryPositionEmbedding(dim)(max_sequence_length)")
        if on_device:
            check_on_device((self._layout[:, 0] + self._layout[:, 1] <= positions).all(), message.format("past them"))
            return
        longest = max(self.sequences.values(), default=0)
        if longest > positions:
            raise ValueError(message.format(longest - 1))

    def _held(self):
        return self._pages if self.is_paged else self._slots

    def _in_cache(self, table: Tensor, row: Tensor, position: Tensor) -> Tuple[Tensor, Tensor]:
        """Where tokens (the step's sequence `row`, `position` in it) sit in the caches' first two
        dimensions: (page, offset in it) through the page table, else (the sequence's row, position)."""
        if self.is_paged:
            return table[row, position // self.page_size], position % self.page_size
        return table[row], position

    def get_seqlens_pre_step(self) -> Tensor:
        """Each sequence's cached tokens before this step (the rotary embedding's start positions)."""
        self._check_stepped("get_seqlens_pre_step")
        return self.pre_step_seqlens

    def _check_stepped(self, what: str) -> None:
        if self._empty:
            raise RuntimeError(f"InferenceParams.{what}: call pre_step({{seq_id: new tokens}}) before the model")

    def packed_tokens(self, x: Tensor, qkv_format: str) -> Tensor:
        """This step's new tokens of `x` ((b, s, ...) / (s, b, ...) padded, or packed (t, ...)) as
        one packed (t, ...) tensor, in the batch's order. Packed rows past the step's tokens are
        padding (a caller rounding the token count up for FP8 GEMMs), dropped as a fixed-shape
        step drops them and as Transformer Engine's cache reads only the step's cu_seqlens_q."""
        if qkv_format == "thd":
            tokens = sum(self.step_lens)
            if x.shape[0] < tokens:
                raise ValueError(f"InferenceParams: the step's sequences bring {tokens} tokens, but the packed input "
                                 f"holds {x.shape[0]}; give every new token of the step's sequences, in their order "
                                 "(padding rows may follow them)")
            return x[:tokens] if x.shape[0] > tokens else x
        x = x.transpose(0, 1) if qkv_format == "sbhd" else x
        if x.shape[0] != self.batch_size or x.shape[1] < max(self.step_lens):
            raise ValueError(f"InferenceParams: pre_step gave {self.batch_size} sequences bringing up to "
                             f"{max(self.step_lens)} tokens, but the {qkv_format} input has shape {tuple(x.shape)}")
        batch, position = self._new_rows
        return x[batch, position]

    def unpacked(self, out: Tensor, qkv_format: str, like_shape) -> Tensor:
        """The packed `out` back in the input's layout (`like_shape`'s leading two dimensions, or
        its tokens when packed), zeros in the padding rows."""
        if qkv_format == "thd":  # the padding rows past the step's tokens come back as zeros
            pad = like_shape[0] - out.shape[0]
            return torch.cat([out, out.new_zeros(pad, *out.shape[1:])]) if pad else out
        b, s = (like_shape[1], like_shape[0]) if qkv_format == "sbhd" else (like_shape[0], like_shape[1])
        full = out.new_zeros(b, s, *out.shape[1:])
        full[self._new_rows] = out
        return full.transpose(0, 1) if qkv_format == "sbhd" else full

    def cached_step(self, layer_number: int, new_k: Tensor, new_v: Tensor) -> Tuple[Tensor, Tensor]:
        """Write this step's packed new keys and values into the layer's cache; return every
        cached token of the step's sequences, packed ((t_kv, heads, dim), cu_seqlens_kv's order)."""
        self._check_stepped("step")
        if layer_number not in self.cache:
            self.allocate_memory(layer_number)
        k_cache, v_cache = self.cache[layer_number]
        for new, cache, what in ((new_k, k_cache, "keys"), (new_v, v_cache, "values")):
            if new.shape[1:] != cache.shape[2:]:
                raise ValueError(f"InferenceParams: the new {what} have shape {tuple(new.shape)}, but the cache holds "
                                 f"(tokens, {', '.join(map(str, cache.shape[2:]))}); build InferenceParams with the "
                                 "layer's num_heads_kv and head dims")
        k_cache[self._writes] = new_k.detach().to(k_cache.dtype)
        v_cache[self._writes] = new_v.detach().to(v_cache.dtype)
        return k_cache[self._reads], v_cache[self._reads]

    def step(self, layer_number: int, new_k: Tensor, new_v: Tensor, qkv_format: str):
        """Transformer Engine's step: write the new tokens; return (the key and value caches: the
        step's sequences' rows (b, max_sequence_length, heads, dim), or every page when paged
        (see page_table); cu_seqlens_q, cu_seqlens_kv, max_sequence_length, the attention's format)."""
        self.cached_step(layer_number, self.packed_tokens(new_k, qkv_format), self.packed_tokens(new_v, qkv_format))
        k_cache, v_cache = self.cache[layer_number]
        if not self.is_paged:
            index = torch.tensor([self._slots[s] for s in self.sequences], device=self.device)
            k_cache, v_cache = k_cache.index_select(0, index), v_cache.index_select(0, index)
        out_format = "bshd" if qkv_format == "bshd" else f"{qkv_format}_2bshd"
        return k_cache, v_cache, self.cu_seqlens_q, self.cu_seqlens_kv, self.max_sequence_length, out_format

    def convert_paged_to_nonpaged(self, layer_number: int) -> Tuple[Tensor, Tensor]:
        """A paged layer's caches as the step's sequences' rows, (b, max_sequence_length, heads, dim)."""
        if not self.is_paged:
            raise ValueError("InferenceParams.convert_paged_to_nonpaged: this cache is not paged")
        self._check_stepped("convert_paged_to_nonpaged")
        pages = self.page_table.flatten().long()
        return tuple(cache[pages].reshape(self.batch_size, self.max_sequence_length, *cache.shape[2:])
                     for cache in self.cache[layer_number])

    def __repr__(self) -> str:
        paged = (f"total_pages={self.total_num_pages}, page_size={self.page_size}" if self.is_paged else
                 f"max_batch_size={self.max_batch_size}, max_seqlen={self.max_sequence_length}")
        return (f"InferenceParams(dtype={self.dtype}, is_paged={self.is_paged}, {paged}, "
                f"num_heads={self.num_heads_kv}, head_dim_k={self.head_dim_k}, head_dim_v={self.head_dim_v})")


def _token_rows(starts, counts) -> Tuple[Tensor, Tensor]:
    """(row j, position) of counts[j] tokens of each row j from position starts[j] on, in order."""
    row, position = token_positions(torch.tensor(_cumulative(counts), device="cpu"), sum(counts))
    return row, position + torch.tensor(starts, dtype=torch.long, device="cpu")[row]


def _cumulative(lengths) -> list:
    return list(accumulate(lengths, initial=0))
