"""te.moe_permute / moe_unpermute / moe_sort_chunks_by_index (Transformer Engine's MoE token
permutation) against straightforward float64 references of their definitions, on fresh random
routings: tokens grouped by expert, unpermuted rows summed with their probabilities, chunks
reordered; gradients through autograd (gradcheck)."""
import pytest
import torch

import te_core as te

T, E, K, H = 10, 4, 2, 6


def _here(t):
    """t (made on the CPU, from a seeded CPU generator) on the backend's device under test."""
    return t.to(torch.get_default_device())


def _routing(seed=0):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=g, device="cpu")[:K] for _ in range(T)])  # [T, K], distinct
    mask = torch.zeros(T, E, dtype=torch.int32, device="cpu").scatter_(1, experts, 1)
    probs = torch.rand(T, E, generator=g, dtype=torch.float64, device="cpu") * mask
    return _here(experts), _here(mask), _here(probs)


def _tokens(seed=1):
    return _here(torch.randn(T, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64, device="cpu"))


def test_a_mask_permutation_groups_tokens_by_expert_and_unpermutes_with_probabilities():
    _, mask, probs = _routing()
    x = _tokens()
    out, row_id_map = te.moe_permute(x, mask, num_out_tokens=int(mask.sum()))
    want = torch.cat([x[mask[:, e].bool()] for e in range(E)])  # expert by expert, tokens in order
    assert torch.equal(out, want)
    # the experts as identity: each token comes back as its rows weighted and summed
    back = te.moe_unpermute(out, row_id_map, merging_probs=probs, restore_shape=x.shape)
    torch.testing.assert_close(back, x * probs.sum(1, keepdim=True), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(te.moe_unpermute(out, row_id_map), x * K, rtol=1e-12, atol=1e-12)
    permuted, permuted_probs, _ = te.moe_permute_with_probs(x, probs, mask, int(mask.sum()))
    assert torch.equal(permuted, want)
    assert torch.equal(permuted_probs, torch.cat([probs[mask[:, e].bool(), e] for e in range(E)]))


def test_an_index_permutation_sorts_by_expert_and_drops_past_the_capacity():
    experts, _, probs = _routing(2)
    x = _tokens(3)
    order = torch.argsort(experts.reshape(-1), stable=True)
    out, row_id_map = te.moe_permute(x, experts, map_type="index")
    assert torch.equal(out, x[order // K])
    weights = probs.gather(1, experts)
    back = te.moe_unpermute(out, row_id_map, merging_probs=weights, map_type="index")
    torch.testing.assert_close(back, x * weights.sum(1, keepdim=True), rtol=1e-12, atol=1e-12)
    kept, kept_map = te.moe_permute(x, experts, num_out_tokens=T * K - 3, map_type="index")
    assert torch.equal(kept, x[order[:T * K - 3] // K]) and int((kept_map < 0).sum()) == 3


def test_padding_aligns_each_experts_rows_and_unpermutes_through_it():
    _, mask, probs = _routing(4)
    x = _tokens(5)
    counts = mask.sum(0)
    out, permuted_probs, row_id_map, pad_offsets, padded = te.moe_permute_and_pad_with_probs(
        x, probs, mask, counts, align_size=4)
    assert torch.equal(padded, (counts + 3) // 4 * 4) and out.shape[0] == int(padded.sum())
    start = 0
    for e in range(E):  # each expert's rows, then zero rows up to the multiple of 4
        rows = out[start:start + int(padded[e])]
        assert torch.equal(rows[:int(counts[e])], x[mask[:, e].bool()])
        assert not rows[int(counts[e]):].any()
        assert not permuted_probs[start + int(counts[e]):start + int(padded[e])].any()
        start += int(padded[e])
    back = te.moe_unpermute(out, row_id_map, merging_probs=probs, pad_offsets=pad_offsets)
    torch.testing.assert_close(back, x * probs.sum(1, keepdim=True), rtol=1e-12, atol=1e-12)


def test_chunks_are_reordered_with_their_probabilities():
    x = _tokens(6)
    p = torch.rand(T, dtype=torch.float64)
    sizes, order = torch.tensor([3, 0, 5, 2]), torch.tensor([2, 0, 3, 1])
    pieces = torch.split(x, sizes.tolist())
    assert torch.equal(te.moe_sort_chunks_by_index(x, sizes, order), torch.cat([pieces[i] for i in order.tolist()]))
    out, out_p = te.moe_sort_chunks_by_index_with_probs(x, p, sizes, order)
    assert torch.equal(out_p, torch.cat([torch.split(p, sizes.tolist())[i] for i in order.tolist()]))


def test_gradients_flow_through_permute_and_unpermute():
    _, mask, probs = _routing(7)

    def roundtrip(x, w):
        out, row_id_map = te.moe_permute(x, mask)
        return te.moe_unpermute(out * 2.0, row_id_map, merging_probs=w)

    x = _tokens(8).requires_grad_()
    w = probs.clone().requires_grad_()
    assert torch.autograd.gradcheck(roundtrip, (x, w))


def test_bad_arguments_name_the_problem():
    experts, mask, probs = _routing()
    x = _tokens()
    with pytest.raises(ValueError, match="num_out_tokens=3 but the routing map routes 20"):
        te.moe_permute(x, mask, num_out_tokens=3)
    with pytest.raises(ValueError, match="map_type must be 'mask' or 'index'"):
        te.moe_permute(x, mask, map_type="dense")
    with pytest.raises(ValueError, match="routing_map must be"):
        te.moe_permute(x, mask[:5])
    with pytest.raises(ValueError, match="probs is the deprecated name of merging_probs"):
        te.moe_unpermute(x, mask, merging_probs=probs, probs=probs)
    with pytest.raises(ValueError, match="split_sizes must sum"):
        te.moe_sort_chunks_by_index(x, torch.tensor([3, 3]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        te.moe_permute_and_pad_with_probs(x, probs, mask, mask.sum(0) + 1, align_size=4)
