"""transformer_engine.pytorch.attention.inference's names: InferenceParams, and the paged cache
manager class that code written for Transformer Engine imports.

te-core's InferenceParams pages its caches itself (is_paged=True, total_num_pages, page_size):
it has no separate cache manager objects. PagedKVCacheManager is importable (Transformer Engine's
Mixtral tutorial only tests `isinstance(..., PagedKVCacheManager)`), and building one says what
to use instead."""
from __future__ import annotations

from typing import Optional

import torch


class PagedKVCacheManager:
    """Transformer Engine's paged KV-cache manager, by its constructor; not provided by te-core
    (see the module's docstring): constructing one raises NotImplementedError."""

    def __init__(self, total_num_pages: int, page_size: int, num_heads: int, head_dim_k: int, dtype: torch.dtype,
                 max_batch_size: int, max_seqlen: int, head_dim_v: Optional[int] = None):
        raise NotImplementedError(
            "PagedKVCacheManager is not provided by te-core: its InferenceParams pages the KV caches itself. Build "
            f"InferenceParams({max_batch_size}, {max_seqlen}, num_heads_kv={num_heads}, head_dim_k={head_dim_k}, "
            f"dtype={dtype}, head_dim_v={head_dim_v}, is_paged=True, total_num_pages={total_num_pages}, "
            f"page_size={page_size}) instead")
