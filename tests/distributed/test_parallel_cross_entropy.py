"""te.parallel_cross_entropy (Transformer Engine's): on one rank against torch's cross-entropy in
float64, and with the vocabulary split over 2 gloo ranks against the whole vocabulary on one
process (loss and logit gradients), label smoothing and ignored targets included."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import te_core as te

from ._pool import pool_of

B, SQ, V = 3, 5, 16


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, SQ, V, generator=g) * 3
    target = torch.randint(0, V, (B, SQ), generator=g)
    target[0, 1] = target[2, 4] = -100  # ignored
    return logits, target


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_one_rank_is_torchs_cross_entropy_per_token(smoothing):
    logits, target = _inputs()
    x = logits.clone().requires_grad_()
    loss = te.parallel_cross_entropy(x, target, label_smoothing=smoothing)
    assert loss.shape == (B, SQ) and loss.dtype == torch.float32
    x64 = logits.double().requires_grad_()
    want = F.cross_entropy(x64.reshape(-1, V), target.reshape(-1), reduction="none",
                           label_smoothing=smoothing).view(B, SQ)
    torch.testing.assert_close(loss.double(), want, rtol=1.3e-6, atol=1e-5)
    mean = te.parallel_cross_entropy(logits, target, label_smoothing=smoothing, reduce_loss=True)
    assert mean.shape == (1,)  # as Transformer Engine returns the reduced loss
    torch.testing.assert_close(mean.double(), (want.sum() / 13).reshape(1), rtol=1.3e-6, atol=1e-5)  # 13 of 15
    loss.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1.3e-6, atol=1e-5)


def _split(ctx, smoothing, reduce_loss):
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, target = _inputs(1)
    whole = logits.clone().requires_grad_()
    want = te.parallel_cross_entropy(whole, target, label_smoothing=smoothing, reduce_loss=reduce_loss)
    want.sum().backward()
    shard = V // world
    mine = logits[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
    got = te.parallel_cross_entropy(mine, target, label_smoothing=smoothing, reduce_loss=reduce_loss,
                                    dist_process_group=dist.group.WORLD)
    got.sum().backward()
    return ((got - want).abs().max().item(),
            (mine.grad - whole.grad[..., rank * shard:(rank + 1) * shard]).abs().max().item())


@pytest.mark.parametrize("smoothing, reduce_loss", [(0.0, False), (0.1, False), (0.1, True)])
def test_a_split_vocabulary_gives_the_whole_vocabularys_loss_and_gradients(pool, smoothing, reduce_loss):
    for loss_diff, grad_diff in pool.run(_split, smoothing, reduce_loss):
        assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (loss_diff, grad_diff)


def _outside(ctx):
    logits, target = _inputs()
    target[1, 1] = V  # no rank holds it
    try:
        te.parallel_cross_entropy(logits[..., :V // 2], target, dist_process_group=dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return None


def test_a_target_no_rank_holds_is_an_error(pool):
    for message in pool.run(_outside):
        assert message is not None and "a target outside [0, 16)" in message
    with pytest.raises(ValueError, match="inp must be"):
        te.parallel_cross_entropy(torch.randn(4, V), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\]"):
        te.parallel_cross_entropy(torch.randn(4, V), torch.zeros(4, dtype=torch.long), label_smoothing=1.5)


def _unequal(ctx):
    logits, target = _inputs()
    mine = logits[..., :10] if ctx.rank == 0 else logits[..., 10:]  # shards of 10 and 6 logits
    try:
        te.parallel_cross_entropy(mine, target.clamp(0, 11), dist_process_group=dist.group.WORLD)
    except ValueError as err:
        return str(err)
    return None


def test_unequal_vocabulary_shards_are_an_error_on_every_rank(pool):
    """Rank r's logits start at r * shard, so shards of different sizes would count some logits
    on two ranks (a silently wrong loss); every rank raises, none is left in a collective."""
    for message in pool.run(_unequal):
        assert message is not None and "vocabulary shards of different sizes (6 to 10 logits" in message
