"""te_core.router (Transformer Engine's transformer_engine.pytorch.router, which Megatron-LM calls
with --moe-router-fusion) against float64 computations of the rules it implements, on fresh random
logits: the top-k choice with softmax (before or after the top-k), sigmoid and sqrtsoftplus scores,
expert bias, grouped top-k, scaling; the aux-loss scores; the load-balancing loss and its gradient."""
from __future__ import annotations

import pytest
import torch

from te_core import router

T, E, K = 24, 8, 2


def _logits(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g, dtype=torch.float64, device="cpu").to(torch.get_default_device(), dtype)


def _reference(logits, topk, pre_softmax, groups, group_topk, scaling, fn, bias):
    """Straight from the rules, in float64."""
    x = logits.double()
    if fn == "softmax":
        ranked = torch.softmax(x, -1) if pre_softmax else x
    else:
        ranked = torch.sigmoid(x) if fn == "sigmoid" else torch.nn.functional.softplus(x).sqrt()
    choose = ranked + (bias.double() if bias is not None else 0)
    if group_topk:
        best_in_group = choose.view(T, groups, -1).topk(topk // group_topk, -1)[0].sum(-1)
        keep = torch.zeros(T, groups, dtype=torch.bool, device=x.device).scatter(
            1, best_in_group.topk(group_topk, -1)[1], True)
        choose = choose.masked_fill(~keep.repeat_interleave(E // groups, 1), float("-inf"))
    idx = choose.topk(topk, -1)[1]
    picked = ranked.gather(1, idx)
    if fn == "softmax":
        probs = picked if pre_softmax else torch.softmax(picked, -1)
    else:
        probs = picked / picked.sum(-1, keepdim=True) if topk > 1 else picked
    probs = probs * (1.0 if scaling is None else scaling)
    return torch.zeros_like(x).scatter(1, idx, probs), torch.zeros_like(x, dtype=torch.bool).scatter(1, idx, True)


CASES = [
    dict(pre_softmax=False, groups=None, group_topk=None, scaling=None, fn="softmax", bias=False),
    dict(pre_softmax=True, groups=None, group_topk=None, scaling=2.5, fn="softmax", bias=False),
    dict(pre_softmax=False, groups=None, group_topk=None, scaling=None, fn="sigmoid", bias=True),
    dict(pre_softmax=False, groups=4, group_topk=2, scaling=None, fn="sigmoid", bias=True),
    dict(pre_softmax=False, groups=None, group_topk=None, scaling=1.5, fn="sqrtsoftplus", bias=False),
    dict(pre_softmax=True, groups=2, group_topk=1, scaling=None, fn="softmax", bias=False),
    dict(pre_softmax=False, groups=None, group_topk=None, scaling=0.0, fn="sigmoid", bias=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_topk_with_score_function_follows_its_rules(case):
    logits = _logits(0)
    bias = _logits(1)[0] * 0.1 if case["bias"] else None
    probs, routing_map = router.fused_topk_with_score_function(
        logits, K, case["pre_softmax"], case["groups"], case["group_topk"], case["scaling"], case["fn"], bias)
    want_probs, want_map = _reference(logits, K, case["pre_softmax"], case["groups"], case["group_topk"],
                                      case["scaling"], case["fn"], bias)
    assert torch.equal(routing_map, want_map) and probs.dtype == logits.dtype
    torch.testing.assert_close(probs.double(), want_probs, rtol=1.3e-6, atol=1e-5)
    assert int(routing_map.sum()) == T * K


@pytest.mark.parametrize("case", CASES[2:4], ids=["plain", "grouped"])
def test_leading_dimensions_and_no_tokens(case):
    """Logits [..., num_experts] (Transformer Engine's: the leading dimensions are tokens) give
    outputs of their shape, equal to the flattened call's; a rank with no tokens gets empty
    outputs, grouped or not."""
    args = (K, case["pre_softmax"], case["groups"], case["group_topk"], case["scaling"], case["fn"], None)
    logits = _logits(7)
    probs, routing_map = router.fused_topk_with_score_function(logits.view(T // 2, 2, E), *args)
    flat_probs, flat_map = router.fused_topk_with_score_function(logits, *args)
    assert probs.shape == routing_map.shape == (T // 2, 2, E)
    assert torch.equal(probs.reshape(T, E), flat_probs) and torch.equal(routing_map.reshape(T, E), flat_map)
    scores_map, scores = router.fused_compute_score_for_moe_aux_loss(logits.view(2, T // 2, E), K, case["fn"])
    want_map, want_scores = router.fused_compute_score_for_moe_aux_loss(logits, K, case["fn"])
    assert torch.equal(scores_map.reshape(T, E), want_map) and torch.equal(scores.reshape(T, E), want_scores)
    none, none_map = router.fused_topk_with_score_function(logits[:0], *args)
    assert none.shape == none_map.shape == (0, E)


@pytest.mark.parametrize("scaling", [0.0, 0.5])
@pytest.mark.parametrize("fn", ["softmax", "sigmoid"])
def test_scaling_factor_scales_probabilities_and_gradients(fn, scaling):
    """Any scaling_factor given multiplies the probabilities, 0.0 included (as in Transformer
    Engine, where only None means 1), and so their gradient; the routing map is unscaled."""
    logits = _logits(8).requires_grad_(True)
    weights = _logits(9)
    probs, routing_map = router.fused_topk_with_score_function(logits, K, False, None, None, scaling, fn, None)
    (probs * weights).sum().backward()
    x = logits.detach().double().requires_grad_(True)
    want, want_map = _reference(x, K, False, None, None, None, fn, None)
    (want * scaling * weights.double()).sum().backward()
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs.double(), want.detach() * scaling, rtol=1.3e-6, atol=1e-5)
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1.3e-6, atol=1e-5)


def test_probabilities_come_back_in_the_logits_dtype_and_differentiate():
    logits = _logits(2, torch.bfloat16).requires_grad_(True)
    probs, _ = router.fused_topk_with_score_function(logits, K, False, None, None, None, "softmax", None)
    assert probs.dtype == torch.bfloat16
    want, _ = _reference(logits.detach(), K, False, None, None, None, "softmax", None)
    torch.testing.assert_close(probs.double(), want, rtol=1.6e-2, atol=1e-5)
    probs.float().pow(2).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad.float()).all()


@pytest.mark.parametrize("fn", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_loss_scores(fn):
    logits = _logits(3)
    routing_map, scores = router.fused_compute_score_for_moe_aux_loss(logits, K, fn)
    x = logits.double()
    want = torch.softmax(x, -1) if fn == "softmax" else (
        torch.sigmoid(x) if fn == "sigmoid" else torch.nn.functional.softplus(x).sqrt())
    if fn != "softmax":
        want = want / want.sum(-1, keepdim=True)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), want, rtol=1.3e-6, atol=1e-5)
    assert torch.equal(routing_map, torch.zeros_like(x, dtype=torch.bool).scatter(1, want.topk(K, -1)[1], True))


def test_load_balancing_loss_and_its_gradient():
    probs = torch.softmax(_logits(4), -1).double().requires_grad_(True)
    counts = torch.randint(0, 10, (E,), generator=torch.Generator().manual_seed(5), device="cpu").to(probs.device)
    total = int(counts.sum())
    loss = router.fused_moe_aux_loss(probs, counts, total, E, K, 0.01)
    want = (probs.detach().sum(0) * counts.double()).sum() * E * 0.01 / (K * total * total)
    torch.testing.assert_close(loss, want, rtol=1.3e-6, atol=1e-12)
    tensor_total = router.fused_moe_aux_loss(probs, counts, torch.tensor(total, device=probs.device), E, K, 0.01)
    torch.testing.assert_close(tensor_total, want, rtol=1.3e-6, atol=1e-12)
    assert torch.autograd.gradcheck(lambda p: router.fused_moe_aux_loss(p, counts, total, E, K, 0.01), (probs,))


def test_bad_arguments_name_the_problem():
    logits = _logits(6)
    with pytest.raises(ValueError, match="score_function must be one of"):
        router.fused_topk_with_score_function(logits, K, False, None, None, None, "relu", None)
    with pytest.raises(ValueError, match="float64 logits are not supported"):
        router.fused_compute_score_for_moe_aux_loss(logits.double(), K, "softmax")
    with pytest.raises(ValueError, match="routing_map_format must be 'bytemap' or 'bitmap_u8'"):
        router.fused_compute_score_for_moe_aux_loss(logits, K, "softmax", routing_map_format="BITMAP")
    with pytest.raises(ValueError, match="routing_map_format must be"):
        router.fused_topk_with_score_function(logits, K, False, None, None, None, "softmax", None, routing_map_format=2)
    with pytest.raises(NotImplementedError, match="quantile balancing"):
        router.fused_topk_with_score_function(logits, K, False, None, None, None, "sigmoid", None,
                                              qb_histogram_mode="two_kernel")
    with pytest.raises(ValueError, match="divisible by num_groups"):
        router.fused_topk_with_score_function(logits, K, False, 3, 1, None, "sigmoid", None)
    with pytest.raises(ValueError, match="expert_bias goes with the sigmoid"):
        router.fused_topk_with_score_function(logits, K, False, None, None, None, "softmax", logits[0])


@pytest.mark.parametrize("call, message", [
    (lambda x: router.fused_topk_with_score_function(x, E + 1, False, None, None, None, "softmax", None),
     r"fused_topk_with_score_function: topk must be in \[1, num_experts=8\].*got topk=9"),
    (lambda x: router.fused_topk_with_score_function(x, 0, False, None, None, None, "softmax", None),
     r"fused_topk_with_score_function: topk must be in \[1, num_experts=8\].*got topk=0"),
    (lambda x: router.fused_topk_with_score_function(x, 4, False, 2, 4, None, "sigmoid", None),
     r"group_topk must be in \[1, num_groups=2\].*got group_topk=4"),
    (lambda x: router.fused_topk_with_score_function(x, 6, False, 4, 2, None, "sigmoid", None),
     r"per-group topk \(topk // group_topk = 6 // 2 = 3\) must be in \[1, group size=2\]"),
    (lambda x: router.fused_compute_score_for_moe_aux_loss(x, E + 1, "softmax"),
     r"fused_compute_score_for_moe_aux_loss: topk must be in \[1, num_experts=8\].*got topk=9"),
    (lambda x: router.fused_compute_score_for_moe_aux_loss(x, 0, "softmax"),
     r"fused_compute_score_for_moe_aux_loss: topk must be in \[1, num_experts=8\].*got topk=0"),
    (lambda x: router.fused_moe_aux_loss(torch.softmax(x, -1), torch.ones(E), T, E, 0, 1.0),
     r"fused_moe_aux_loss: topk must be a positive int, got topk=0"),
    (lambda x: router.fused_moe_aux_loss(torch.softmax(x, -1), torch.ones(E), 0, E, K, 1.0),
     r"fused_moe_aux_loss: total_num_tokens must be positive .*got total_num_tokens=0"),
    (lambda x: router.fused_moe_aux_loss(torch.softmax(x, -1), torch.ones(E), -T, E, K, 1.0),
     r"fused_moe_aux_loss: total_num_tokens must be positive .*got total_num_tokens=-24"),
], ids=["topk_above_experts", "topk_0", "group_topk_above_groups", "per_group_topk_above_group_size",
        "aux_scores_topk_above_experts", "aux_scores_topk_0", "aux_loss_topk_0", "aux_loss_no_tokens",
        "aux_loss_negative_tokens"])
def test_out_of_range_counts_name_the_argument_and_its_range(call, message):
    """Transformer Engine's kernels refuse these (router.cpp, fused_topk_with_score_function.cu);
    torch's topk would fail without naming the argument, or the loss divide by zero."""
    with pytest.raises(ValueError, match=message):
        call(_logits(10))


@pytest.mark.parametrize("num_experts", [8, 13])
@pytest.mark.parametrize("spelling", ["bitmap_u8", 1, router.RoutingMapFormat.BITMAP_U8])
def test_bitmap_routing_maps_pack_the_bytemap_lsb_first(num_experts, spelling):
    """Transformer Engine's BITMAP_U8 layout: uint8 [..., ceil(E / 8)], bit e % 8 of byte e // 8
    set where the token routes to expert e; the same experts as the bytemap (3-D logits too)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5, num_experts)
    probs, bytemap = router.fused_topk_with_score_function(logits, 3, False, None, None, None, "sigmoid", None)
    probs_b, bitmap = router.fused_topk_with_score_function(logits, 3, False, None, None, None, "sigmoid", None,
                                                            routing_map_format=spelling)
    assert bitmap.dtype == torch.uint8 and bitmap.shape == (2, 5, -(-num_experts // 8))
    assert torch.equal(probs_b, probs)
    for expert in range(num_experts):
        bit = (bitmap[..., expert // 8].int() >> (expert % 8)) & 1
        assert torch.equal(bit.bool(), bytemap[..., expert])
    assert not ((bitmap[..., -1].int() >> (num_experts % 8 or 8)) & 0xFF).any()  # padding bits clear
    aux_map, scores = router.fused_compute_score_for_moe_aux_loss(logits, 3, "softmax", routing_map_format=spelling)
    byte_aux, scores_b = router.fused_compute_score_for_moe_aux_loss(logits, 3, "softmax")
    assert torch.equal(scores, scores_b) and aux_map.dtype == torch.uint8
    assert all(torch.equal(((aux_map[..., e // 8].int() >> (e % 8)) & 1).bool(), byte_aux[..., e])
               for e in range(num_experts))
