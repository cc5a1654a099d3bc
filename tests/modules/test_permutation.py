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
    # a buffer larger than the routed rows: zeros after them, as with a mask
    roomy, roomy_map = te.moe_permute(x, experts, num_out_tokens=T * K + 5, map_type="index")
    assert roomy.shape[0] == T * K + 5 and torch.equal(roomy[:T * K], out) and not roomy[T * K:].any()
    assert torch.equal(roomy_map, row_id_map)


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


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_bf16_rows_merge_in_float32(map_type):
    """bf16 expert outputs merged with float32 probabilities: weighted and summed in float32 and
    rounded once (as Transformer Engine's kernel), so probabilities 1e-4 apart stay apart and
    their gradient keeps float32's precision."""
    experts, mask, probs = _routing(3)
    probs = probs.float()
    x = _tokens(4).to(torch.bfloat16)
    if map_type == "mask":
        out, row_id_map = te.moe_permute(x, mask, map_type="mask")
        merging = probs.clone().requires_grad_()
    else:
        out, row_id_map = te.moe_permute(x, experts.int(), map_type="index")
        merging = probs.gather(1, experts).clone().requires_grad_()
    # two experts of token 0 give opposite outputs with nearly equal probabilities
    rows = out.detach().clone()
    kept = row_id_map[0][row_id_map[0] >= 0]
    rows[kept[0]], rows[kept[1]] = 1.0, -1.0
    with torch.no_grad():
        picks = [i for i in range(merging.shape[1]) if row_id_map[0, i] >= 0]
        merging[0, picks[0]], merging[0, picks[1]] = 0.3, 0.2999
    rows.requires_grad_()
    y = te.moe_unpermute(rows, row_id_map, merging, map_type=map_type)
    dy = torch.randn(y.shape, dtype=torch.float64, device=y.device)
    y.backward(dy.to(y.dtype))
    # float64 reference of the same definition: y[t] = sum over t's rows of prob * row
    taken = row_id_map >= 0
    token = torch.arange(T, device=y.device)[:, None].expand_as(row_id_map)[taken]
    r64 = rows.detach().double()[row_id_map[taken]]
    want = torch.zeros(T, H, dtype=torch.float64, device=y.device).index_add(
        0, token, r64 * merging.detach().double()[taken][:, None])
    torch.testing.assert_close(y, want.to(torch.bfloat16), rtol=1.6e-2, atol=1e-5)
    assert y[0].abs().max() > 0  # (bf16 probabilities would cancel: both round to 0.30078125)
    grad = torch.zeros_like(merging.detach(), dtype=torch.float64)
    grad[taken] = (dy.to(torch.bfloat16).double()[token] * r64).sum(1)
    torch.testing.assert_close(merging.grad.double(), grad, rtol=1.3e-6, atol=1e-5)


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
    with pytest.raises(ValueError, match=rf"probs must hold one probability per row of inp "
                                         rf"\(\[num_tokens\] = \[{T}\]\), got shape \({T - 1},\)"):
        te.moe_sort_chunks_by_index_with_probs(x, torch.rand(T - 1), torch.tensor([3, T - 3]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="tokens_per_expert"):
        te.moe_permute_and_pad_with_probs(x, probs, mask, mask.sum(0) + 1, align_size=4)


@pytest.mark.parametrize("map_type", ["mask", "index"])
def test_unpermuting_fewer_rows_than_the_map_routes_names_the_problem(map_type):
    experts, mask, probs = _routing()
    permuted, row_id_map = te.moe_permute(_tokens(), mask if map_type == "mask" else experts, map_type=map_type)
    with pytest.raises(ValueError, match=f"row_id_map routes {T * K} rows but inp has {T * K - 1}"):
        te.moe_unpermute(permuted[:-1], row_id_map, map_type=map_type)
    back = te.moe_unpermute(permuted, row_id_map, map_type=map_type)  # the whole output still unpermutes
    torch.testing.assert_close(back, _tokens() * K, rtol=1.3e-6, atol=1e-5)


def test_a_routed_slot_of_probability_zero_is_a_zero_row_whose_gradient_still_flows():
    """As Transformer Engine's permute kernel: a routed slot whose probability is 0 (padding of a
    routing map to a capacity) is written as a zero row, with and without alignment padding,
    while the permutation's backward still sends that row's gradient to its token."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    routing_map = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [0, 0, 1]], dtype=torch.int32)
    probs = (torch.rand(4, 3) + 0.1) * routing_map
    probs[1, 2] = 0.0
    out, permuted_probs, _ = te.moe_permute_with_probs(x, probs, routing_map, num_out_tokens=7)
    zero = (permuted_probs == 0).nonzero().flatten()
    assert zero.tolist() == [5]  # expert 2's second token: token 1
    assert torch.equal(out[5], torch.zeros(8))
    kept = torch.ones(7, dtype=torch.bool)
    kept[5] = False
    expected_rows = x.detach()[torch.tensor([0, 2, 1, 2, 0, 1, 3])]
    assert torch.equal(out[kept], expected_rows[kept])
    dy = torch.randn(7, 8)
    out.backward(dy)
    sources = torch.tensor([0, 2, 1, 2, 0, 1, 3])
    torch.testing.assert_close(x.grad, torch.zeros(4, 8).index_add(0, sources, dy), rtol=1.3e-6, atol=1e-5)
    padded, padded_probs, *_ = te.moe_permute_and_pad_with_probs(x.detach(), probs, routing_map, routing_map.sum(0), 4)
    assert torch.equal(padded[padded_probs == 0], torch.zeros(int((padded_probs == 0).sum()), 8))


# --- quantized (FP8) tokens: permuted in their quantized form, as Transformer Engine's

QT, QH = 13, 160  # an odd token count; 160 columns: a partial 1x128 block, five 1x32 MXFP8 blocks


def _quantizer(kind, fp8_dtype=torch.float8_e4m3fn):
    from te_core.quantization import Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer, Role

    if kind == "float8":  # (power-of-two scale: the test's own cast with it is exact)
        return Float8CurrentScalingQuantizer(Role.INPUT, fp8_dtype, power_2_scale=True)
    if kind == "blockwise":
        return Float8BlockQuantizer(Role.INPUT, fp8_dtype, block_2d=False)
    return MXFP8Quantizer(Role.INPUT, fp8_dtype)


def _cast_like(q, hp):
    """(data bytes, scale_inv) of hp cast as q's format casts: with q's one scale (per-tensor), or
    each row's own scales (whose cast of a row depends on that row alone)."""
    from te_core import ops

    if isinstance(q, te.Float8Tensor):
        data, _ = ops.quantize_fp8(hp, q._scale_inv.reciprocal(), q.fp8_dtype)
        return data.view(torch.uint8), q._scale_inv
    cast = q.quantizer.quantize(hp)
    return cast._data.view(torch.uint8), cast._scale_inv


def _fp8_routing(seed):
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(E, generator=g, device="cpu")[:K] for _ in range(QT)])
    mask = torch.zeros(QT, E, dtype=torch.int32, device="cpu").scatter_(1, experts, 1)
    probs = (torch.rand(QT, E, generator=g, device="cpu") + 0.1) * mask
    probs[3, experts[3, 0]] = 0.0  # a routed slot of probability 0 (capacity padding): a zero row
    return _here(experts), _here(mask), _here(probs)


_PERMUTES = {
    # op -> (x, routing) -> (permuted tokens, the source row of each output row or -1, blank rows)
    "mask": lambda x, r: te.moe_permute(x, r[1], num_out_tokens=QT * K + 3)[0],  # 3 rows of zeros after
    "index": lambda x, r: te.moe_permute(x, r[0], num_out_tokens=QT * K - 3, map_type="index")[0],  # 3 dropped
    "with_probs": lambda x, r: te.moe_permute_with_probs(x, r[2], r[1], num_out_tokens=QT * K)[0],
    "pad": lambda x, r: te.moe_permute_and_pad_with_probs(x, r[2], r[1], r[1].sum(0), align_size=4)[0],
    "chunks": lambda x, r: te.moe_sort_chunks_by_index_with_probs(x, r[2][:, 0], torch.tensor([4, 0, 6, 3]),
                                                                  torch.tensor([2, 0, 3, 1]))[0],
}


@pytest.mark.parametrize("op", list(_PERMUTES))
@pytest.mark.parametrize("kind,fp8_dtype", [("float8", torch.float8_e4m3fn), ("float8", torch.float8_e5m2),
                                            ("blockwise", torch.float8_e4m3fn), ("mxfp8", torch.float8_e4m3fn),
                                            ("mxfp8", torch.float8_e5m2)])
def test_quantized_tokens_keep_their_bytes_and_scales(op, kind, fp8_dtype):
    """A quantized input gives a quantized output of its kind whose rows are the input rows' bytes
    with their scales: byte for byte the cast of the high-precision permutation (a row's cast
    does not depend on where it stands). Zero rows (dropped, padding, probability 0) are zero
    bytes. The gradient is the high-precision permutation's."""
    routing = _fp8_routing(11)
    x = _here(torch.randn(QT, QH, generator=torch.Generator().manual_seed(12), device="cpu") * 3)
    q = _quantizer(kind, fp8_dtype).quantize(x)
    out = _PERMUTES[op](q, routing)
    assert type(out) is type(q) and out.fp8_dtype == fp8_dtype and not out.has_columnwise
    want = _PERMUTES[op](x, routing)  # the high-precision permutation, zero rows included
    data, scale_inv = _cast_like(q, want)
    assert torch.equal(out._data.view(torch.uint8), data)
    live = want.ne(0).any(1)  # rows with a source row (a zero row's scales are not the cast's)
    if kind == "float8":
        assert torch.equal(out._scale_inv, scale_inv)
    else:
        assert torch.equal(out._scale_inv[live], scale_inv[live]) and out._scale_inv.stride() == scale_inv.stride()
    assert torch.equal(out.dequantize(), _PERMUTES[op](q.dequantize(), routing))
    # backward: the high-precision gradient of the same permutation of the dequantized tokens
    leaf, hp = q.detach().requires_grad_(), q.dequantize().requires_grad_()
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(13), device="cpu").to(want.device)
    _PERMUTES[op](leaf, routing).backward(dy)
    _PERMUTES[op](hp, routing).backward(dy)
    assert type(leaf.grad) is torch.Tensor
    torch.testing.assert_close(leaf.grad, hp.grad, rtol=1.3e-6, atol=1e-5)
    assert leaf.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["float8", "blockwise", "mxfp8"])
def test_quantized_gradients_follow_transformer_engine(kind):
    """moe_permute's backward refuses an FP8 gradient; moe_sort_chunks_by_index's and
    moe_unpermute's without probabilities move its rows in its quantized form; moe_unpermute's
    with probabilities refuses it (Transformer Engine's rules)."""
    quantizer = _quantizer(kind)
    _, mask, probs = _fp8_routing(14)
    g = torch.Generator().manual_seed(15)
    x = _here(torch.randn(QT, QH, generator=g, device="cpu"))
    leaf = quantizer.quantize(x).requires_grad_()
    out, row_id_map = te.moe_permute(leaf, mask)
    with pytest.raises(TypeError, match="backward of moe_permute takes a high-precision gradient"):
        out.backward(quantizer.quantize(_here(torch.randn(out.shape, generator=g, device="cpu"))))
    sizes, order = torch.tensor([4, 0, 6, 3]), torch.tensor([2, 0, 3, 1])
    dy = quantizer.quantize(_here(torch.randn(QT, QH, generator=g, device="cpu")))
    leaf = quantizer.quantize(x).requires_grad_()
    te.moe_sort_chunks_by_index(leaf, sizes, order).backward(dy)
    assert type(leaf.grad) is type(dy)
    # sorting the chunks back (the inverse order) is the gradient's permutation
    inverse = torch.argsort(order)
    back = te.moe_sort_chunks_by_index(dy.dequantize(), sizes[order], inverse)
    assert torch.equal(leaf.grad.dequantize(), back)
    rows = _here(torch.randn(QT * K, QH, generator=g, device="cpu")).requires_grad_()
    dy = quantizer.quantize(_here(torch.randn(QT, QH, generator=g, device="cpu")))
    te.moe_unpermute(rows, row_id_map).backward(dy)
    assert type(rows.grad) is type(dy)
    want = te.moe_permute(dy.dequantize(), mask)[0]
    assert torch.equal(rows.grad.dequantize(), want)
    with pytest.raises(TypeError, match="moe_unpermute with merging_probs takes a high-precision gradient"):
        te.moe_unpermute(rows, row_id_map, merging_probs=probs).backward(dy)


def test_quantized_inputs_transformer_engine_refuses_name_the_problem(monkeypatch):
    from te_core.quantization import Float8BlockQuantizer, Role

    _, mask, _ = _fp8_routing(16)
    x = _here(torch.randn(QT, QH, generator=torch.Generator().manual_seed(17), device="cpu"))
    q = _quantizer("float8").quantize(x)
    permuted, row_id_map = te.moe_permute(q, mask)
    with pytest.raises(TypeError, match="moe_unpermute does not take FP8 rows.*inp.dequantize"):
        te.moe_unpermute(permuted, row_id_map)
    tiles = Float8BlockQuantizer(Role.WEIGHT, torch.float8_e4m3fn, block_2d=True).quantize(x)
    with pytest.raises(ValueError, match="128x128 blocks, whose scales span 128 rows"):
        te.moe_permute(tiles, mask)
    only_t = _quantizer("blockwise").quantize(x, columnwise=True).columnwise_only()
    with pytest.raises(RuntimeError, match="keeps only its column-wise copy"):
        te.moe_permute(only_t, mask)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="quantized \\(FP8\\) input is not supported under torch.compile"):
        te.moe_permute(q, mask)
