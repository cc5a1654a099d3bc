"""tex.thd_get_partitioned_indices (te_core.compat.te_thd): a context-parallel rank's tokens of a
THD-packed batch, against a plain-Python reading of Transformer Engine's semantics."""
from __future__ import annotations

import random

import pytest
import torch

from te_core.compat.te_thd import thd_get_partitioned_indices


def _expected(offsets: list, total_tokens: int, world_size: int, rank: int) -> list:
    """Rank `rank`'s chunks rank and 2 * world_size - 1 - rank of each sequence, in order, cut to
    the first total_tokens / world_size."""
    out = []
    for start, end in zip(offsets, offsets[1:]):
        chunk = (end - start) // (2 * world_size)
        for c in (rank, 2 * world_size - 1 - rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return out[:total_tokens // world_size]


def _random_offsets(rng: random.Random, world_size: int) -> list:
    lengths = [2 * world_size * rng.randint(0, 7) for _ in range(rng.randint(1, 6))]
    lengths[rng.randrange(len(lengths))] += 2 * world_size  # at least one token
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


def test_transformer_engines_example():
    cu_seqlens = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert thd_get_partitioned_indices(cu_seqlens, 16, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    assert thd_get_partitioned_indices(cu_seqlens, 16, 2, 1).tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_matches_the_reference_on_random_packings(world_size):
    rng = random.Random(world_size)
    for _ in range(20):
        offsets = _random_offsets(rng, world_size)
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
        ranks = []
        for rank in range(world_size):
            got = thd_get_partitioned_indices(cu_seqlens, offsets[-1], world_size, rank)
            assert got.dtype == torch.int32 and got.device == cu_seqlens.device
            assert got.tolist() == _expected(offsets, offsets[-1], world_size, rank)
            ranks.append(got)
        # every token goes to exactly one rank
        assert sorted(torch.cat(ranks).tolist()) == list(range(offsets[-1]))


def test_fewer_total_tokens_than_the_batch_gives_the_first_ones():
    offsets = [0, 12, 24, 48]
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    for rank in range(3):
        assert thd_get_partitioned_indices(cu_seqlens, 30, 3, rank).tolist() == _expected(offsets, 30, 3, rank)


def test_megatron_scatter_and_gather_round_trip():
    """Megatron-LM's use: index_select a packed batch to each rank's share, and scatter back."""
    rng = random.Random(7)
    offsets = _random_offsets(rng, 4)
    tokens = torch.randn(offsets[-1], 5, dtype=torch.float64)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    back = torch.empty_like(tokens)
    for rank in range(4):
        index = thd_get_partitioned_indices(cu_seqlens, offsets[-1], 4, rank)
        back[index] = tokens.index_select(0, index)
    torch.testing.assert_close(back, tokens, rtol=0, atol=0)


@pytest.mark.parametrize("cu_seqlens,total_tokens,world_size,rank,match", [
    ([0, 8, 14], 16, 2, 0, r"multiple of 2 \* world_size = 4.*\(1, 6\).*cu_seqlens_padded"),
    ([0, 8, 16], 10, 2, 0, "total_tokens must be a positive multiple of 2 \\* world_size = 4 .*, got 10"),
    ([0, 8, 16], 0, 2, 0, "total_tokens must be a positive multiple"),
    ([0, 8, 16], 16, 2, 2, "0 <= rank < world_size.*world_size=2, rank=2"),
    ([0, 8, 16], 16, 0, 0, "world_size > 0"),
    ([0, 8, 16], 24, 2, 0, "total_tokens=24 exceeds the 16 tokens"),
    ([4, 8, 16], 16, 2, 0, "must start at 0 and never decrease"),
    ([0, 16, 8], 8, 2, 0, "must start at 0 and never decrease"),
    ([0], 4, 2, 0, "b \\+ 1 sequence offsets"),
])
def test_bad_arguments_say_what_is_wrong(cu_seqlens, total_tokens, world_size, rank, match):
    with pytest.raises(ValueError, match=match):
        thd_get_partitioned_indices(torch.tensor(cu_seqlens, dtype=torch.int32), total_tokens, world_size, rank)


def test_cu_seqlens_must_be_int32_as_in_transformer_engine():
    with pytest.raises(ValueError, match="1-D torch.int32 tensor.*torch.int64.*\\.int\\(\\)"):
        thd_get_partitioned_indices(torch.tensor([0, 8, 16]), 16, 2, 0)
    with pytest.raises(ValueError, match="1-D torch.int32 tensor.*2-D"):
        thd_get_partitioned_indices(torch.tensor([[0, 8, 16]], dtype=torch.int32), 16, 2, 0)
    with pytest.raises(TypeError, match="total_tokens must be an int, got Tensor"):
        thd_get_partitioned_indices(torch.tensor([0, 8, 16], dtype=torch.int32), torch.tensor(16), 2, 0)


def test_served_on_the_extension_module(stand_in):
    import transformer_engine_torch as tex

    assert tex.thd_get_partitioned_indices is thd_get_partitioned_indices
    from transformer_engine_torch import thd_get_partitioned_indices as imported

    assert imported is thd_get_partitioned_indices
    for name in ("thd_read_half_tensor", "thd_second_half_lse_correction", "thd_read_second_half_lse",
                 "thd_out_correction", "thd_grad_correction"):
        assert not hasattr(tex, name)  # not provided: explained (test_te_extension), never half-imitated
