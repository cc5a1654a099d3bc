"""DotProductAttention's tensor and context parallelism (Transformer Engine's arguments): the
heads split over the tensor-parallel ranks, attention dropout in the RNG tracker's fork, and the
sequence split over the context-parallel ranks (te_core.modules._context_parallel)."""
from __future__ import annotations

import contextlib

import torch

from ..distributed import tensor_parallel
from ..distributed.groups import check_ranks_agree, group_size
from ..distributed.random import MODEL_PARALLEL_RNG_TRACKER_NAME
from . import _context_parallel
from ._attention_inputs import check_max_seqlens
from ._common import check_bool


class AttentionParallelMixin:
    """For DotProductAttention: call _init_tensor_parallel and set_context_parallel_group in
    __init__ (after num_attention_heads and num_gqa_groups are set)."""

    def _init_tensor_parallel(self, tp_group, tp_size, sequence_parallel, get_rng_state_tracker) -> None:
        """Transformer Engine's tensor-parallel arguments: the heads (and GQA groups) are split over
        tp_size ranks (the group's size where a group is given), each rank's module takes its own
        heads and communicates nothing; attention dropout draws from the tracker's fork where a
        tracker is given, except under sequence parallelism (as Transformer Engine)."""
        module = "DotProductAttention"
        if tp_group is not None:
            tp_size = group_size(tp_group, module)
        tensor_parallel.check_tp_arguments(module, tp_size, get_rng_state_tracker)
        self.tp_size, self.tp_group = tp_size, tp_group
        self.sequence_parallel = check_bool(False if sequence_parallel is None else sequence_parallel,
                                            name="sequence_parallel", module=module)
        self.get_rng_state_tracker = get_rng_state_tracker
        self.num_attention_heads_per_partition = tensor_parallel.split_size(
            self.num_attention_heads, tp_size, what="num_attention_heads", module=module)
        self.num_gqa_groups_per_partition = tensor_parallel.split_size(
            self.num_gqa_groups, tp_size, what="num_gqa_groups", module=module)

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Transformer Engine's: the group of this module's tensor-parallel ranks (its size must be
        tp_size; the module itself communicates nothing)."""
        tensor_parallel.check_group_size("DotProductAttention", tp_group, self.tp_size)
        self.tp_group = tp_group

    def set_context_parallel_group(self, cp_group, cp_global_ranks=None, cp_stream=None,
                                   cp_comm_type: str = "p2p") -> None:
        """Transformer Engine's: the context-parallel group whose ranks each hold a load-balanced
        slice of every sequence (te_core.modules._context_parallel). cp_global_ranks and cp_stream
        (the group's ranks, a stream to overlap Transformer Engine's ring steps on) change no value."""
        module = "DotProductAttention"
        self.cp_comm_type = _context_parallel.check_comm_type(cp_comm_type, module, active=cp_group is not None)
        # the group the collectives run over ('a2a+p2p' over a list whose other group has one rank: TE's fallback)
        self._cp_run_group, self._cp_run_comm_type = _context_parallel.resolve_hierarchical(cp_group, cp_comm_type,
                                                                                             module)
        self.cp_size = _context_parallel.cp_size_of(self._cp_run_group, module)
        self.cp_rank = torch.distributed.get_rank(self._cp_run_group) if self.cp_size > 1 else 0
        self.cp_group, self.cp_global_ranks, self.cp_stream = cp_group, cp_global_ranks, cp_stream
        self._cp_shapes_checked = False  # (a new group: its ranks compare their shards at the next call)

    def _check_context_parallel_layout(self, fmt: str, padded: bool, q, k, max_seqlens) -> None:
        """Before the inputs are unpacked or gathered: the layouts context parallelism does not
        take are refused (ahead of the checks of thd offsets, which Transformer Engine gives in
        the whole sequences' terms under it), and max_seqlen_q / max_seqlen_kv are this rank's
        shares of the sequence, as Transformer Engine reads them."""
        refuse_under_context_parallelism([what for what, bad in (
            ("the thd format", fmt == "thd"), ("padding between sequences", padded)) if bad])
        check_max_seqlens(fmt, q, k, max_seqlens, context_parallel=True)

    def _context_parallel(self, fmt, mask_type, query_layer, key_layer, value_layer, attention_mask, window_size,
                          core_attention_bias_type, alibi_slopes, inference_params, padded, check_window):
        """(keys, values, mask type, mask) of a context-parallel call (the whole sequence's keys
        and values, masked by global position), or a clear error for what it does not take."""
        module = "DotProductAttention"
        window = self.window_size if window_size is None else check_window(window_size, module)
        unsupported = [what for what, bad in (
            ("the thd format", fmt == "thd"), ("inference_params", inference_params is not None),
            ("padding between sequences", padded), ("an attention_mask", attention_mask is not None),
            (f"attn_mask_type {mask_type!r}", mask_type not in _context_parallel.MASK_TYPES),
            ("a sliding window", window not in (None, (-1, -1), (-1, 0))),
            ("an attention bias or alibi", core_attention_bias_type != "no_bias" or alibi_slopes is not None))
            if bad]
        refuse_under_context_parallelism(unsupported)
        if not self.__dict__.get("_cp_shapes_checked", False):
            # ranks whose shards differ would hang or abort inside the all-gather: at the first call
            # (and in every run of a graph traced before one), one small all-gather compares them
            check_ranks_agree(key_layer, self._cp_run_group, module, what="context-parallel")
            if not torch.compiler.is_compiling():
                self._cp_shapes_checked = True
        return _context_parallel.gathered(query_layer, key_layer, value_layer, fmt, mask_type, self._cp_run_group,
                                          self.cp_size, self.cp_rank, self._cp_run_comm_type, module)

    def _dropout_context(self, dropout: bool):
        if not dropout or self.get_rng_state_tracker is None or self.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.tracker_of(self.get_rng_state_tracker, type(self).__name__).fork(
            MODEL_PARALLEL_RNG_TRACKER_NAME)


def refuse_under_context_parallelism(unsupported) -> None:
    if unsupported:
        raise NotImplementedError(f"DotProductAttention: context parallelism (cp_group) is not supported by te-core "
                                  f"with {', '.join(unsupported)}; it takes sbhd or bshd inputs with attn_mask_type "
                                  "'causal' or 'no_mask'")
