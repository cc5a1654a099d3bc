"""The pooled amax zeros (te_backend_cuda.amax_slots) with streams and capture faked: runs on the CPU.
The pool on the GPU is covered by the conformance kit (each fused cast's amax against the reference)
and by test_cuda_graphs.py (casts inside captured graphs)."""
import pytest
import torch
from te_backend_cuda import amax_slots
from te_backend_cuda.amax_slots import ZeroedSlots

CPU = torch.device("cpu")


def _pool(chunk=4, capturing=False):
    state = {"stream": "s0", "capturing": capturing}
    return ZeroedSlots(lambda device: (device.type, state["stream"]), lambda: state["capturing"], chunk), state


def test_each_take_is_a_fresh_zero_never_handed_out_twice():
    pool, _ = _pool(chunk=4)
    slots = [pool.take(CPU) for _ in range(10)]  # spans three chunks
    assert all(s.dim() == 0 and s.dtype == torch.float32 and s.item() == 0.0 for s in slots)
    for i, s in enumerate(slots):
        s.fill_(i + 1.0)  # a kernel maxing into one slot must leave every other one alone
    assert [s.item() for s in slots] == [i + 1.0 for i in range(10)]
    addresses = {s.data_ptr() for s in slots}
    assert len(addresses) == 10
    assert slots[1].data_ptr() - slots[0].data_ptr() == 16  # in address order within a chunk
    # one alignment for all: Triton compiles a kernel variant per pointer alignment (mod 16)
    assert len({s.data_ptr() % 16 for s in slots}) == 1


def test_a_chunk_per_stream():
    pool, state = _pool(chunk=4)
    a = pool.take(CPU)
    state["stream"] = "s1"
    b = pool.take(CPU)
    assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()  # not zeroed on stream s0
    state["stream"] = "s0"
    c = pool.take(CPU)
    assert c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and c.data_ptr() == a.data_ptr() + 16


def test_none_while_capturing():
    """A replayed graph would max into a captured slot again and again: the kernels zero their own."""
    pool, state = _pool(capturing=True)
    assert pool.take(CPU) is None
    state["capturing"] = False
    assert pool.take(CPU).item() == 0.0


def test_fresh_keeps_a_given_amax_out(monkeypatch):
    pool, _ = _pool()
    monkeypatch.setattr(amax_slots, "SLOTS", pool)
    given = torch.tensor([3.0])
    assert amax_slots.fresh(given, torch.ones(2)) is given
    taken = amax_slots.fresh(None, torch.ones(2))
    assert taken is not None and taken.item() == 0.0


def test_chunks_kept_for_at_most_max_streams(monkeypatch):
    monkeypatch.setattr(amax_slots, "MAX_STREAMS", 3)
    pool, state = _pool(chunk=4)
    kept = []
    for i in range(5):
        state["stream"] = f"s{i}"
        kept.append(pool.take(CPU))
    assert len(pool._free) <= 3
    assert all(s.item() == 0.0 for s in kept)  # slots handed out stay valid after their chunk is dropped
    state["stream"] = "s4"
    assert pool.take(CPU).data_ptr() == kept[4].data_ptr() + 16  # the newest stream's chunk is kept


def test_clear_drops_the_chunks():
    pool, _ = _pool(chunk=8)
    first = pool.take(CPU)
    pool.clear()
    assert pool.take(CPU).untyped_storage().data_ptr() != first.untyped_storage().data_ptr()


@pytest.mark.parametrize("chunk", [1, 3])
def test_small_chunks(chunk):
    pool, _ = _pool(chunk=chunk)
    slots = [pool.take(CPU) for _ in range(7)]  # kept alive: a freed chunk's address may come back
    assert len({s.data_ptr() for s in slots}) == 7 and all(s.item() == 0.0 for s in slots)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rand(seed, shape=(256, 512)):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) * 5


@gpu
def test_gpu_casts_keep_their_own_amax():
    from te_backend_cuda import ops

    scale = torch.tensor([2.0], device="cuda")
    xs = [_rand(i) for i in range(3)]
    amaxes = [ops.quantize_fp8(x, scale, torch.float8_e4m3fn)[1] for x in xs]
    amaxes.append(ops.cast_transpose_fp8(xs[0] * 3, scale, torch.float8_e4m3fn)[2])
    amaxes.append(ops.quantize_fp8_current(xs[1] * 7, torch.float8_e4m3fn)[4])
    want = [x.abs().max().float() for x in xs] + [(xs[0] * 3).abs().max().float(), (xs[1] * 7).abs().max().float()]
    for got, w in zip(amaxes, want):
        assert got.dim() == 0 and torch.equal(got, w)
    assert len({a.data_ptr() for a in amaxes}) == len(amaxes)


@gpu
def test_gpu_on_a_side_stream():
    from te_backend_cuda import ops

    x = _rand(5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        amax = ops.quantize_fp8(x, torch.tensor([1.0], device="cuda"), torch.float8_e4m3fn)[1]
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(amax, x.abs().max().float())


@gpu
def test_gpu_captured_cast_zeroes_its_amax_on_each_replay():
    from te_backend_cuda import ops

    scale = torch.tensor([1.0], device="cuda")
    x = _rand(7)
    ops.quantize_fp8(x, scale, torch.float8_e4m3fn)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        _, amax = ops.quantize_fp8(x, scale, torch.float8_e4m3fn)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    for factor in (4.0, 0.5):  # a smaller max after a larger one: the slot must start from zero
        x.copy_(_rand(8) * factor)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(amax, x.abs().max().float())


def test_current_slots_hold_amax_scale_and_scale_inv_each_aligned():
    """A current-scaling cast's slot: a 0-dim amax zero, a (1,) scale and a (1,) scale_inv, each at
    a 16-byte aligned address as a buffer of its own would be (so a cast inside a CUDA-graph
    capture, which allocates its own, runs the kernel variant compiled in eager steps), none
    shared with another slot."""
    state = {"stream": "s0", "capturing": False}
    pool = ZeroedSlots(lambda device: (device.type, state["stream"]), lambda: state["capturing"], 3,
                       floats=amax_slots.CURRENT_FLOATS, split=amax_slots.current_slots)
    taken = [pool.take(CPU) for _ in range(7)]  # spans three chunks
    for amax, scale, scale_inv in taken:
        assert amax.shape == () and scale.shape == (1,) and scale_inv.shape == (1,)
        assert amax.item() == 0.0 and amax.data_ptr() % 16 == torch.empty(1).data_ptr() % 16
        assert scale.data_ptr() == amax.data_ptr() + 16 and scale_inv.data_ptr() == amax.data_ptr() + 32
    for i, (amax, scale, scale_inv) in enumerate(taken):
        amax.fill_(i), scale.fill_(i + 0.5), scale_inv.fill_(-i)
    assert [(a.item(), s.item(), si.item()) for a, s, si in taken] == [(i, i + 0.5, -i) for i in range(7)]
    assert taken[1][0].data_ptr() - taken[0][0].data_ptr() == 48
    state["capturing"] = True
    assert pool.take(CPU) is None


def test_fresh_current_gives_nones_while_capturing(monkeypatch):
    state = {"capturing": True}
    pool = ZeroedSlots(lambda device: "s0", lambda: state["capturing"], 4, floats=amax_slots.CURRENT_FLOATS,
                       split=amax_slots.current_slots)
    monkeypatch.setattr(amax_slots, "CURRENT_SLOTS", pool)
    assert amax_slots.fresh_current(torch.ones(2)) == (None, None, None)
    state["capturing"] = False
    amax, scale, scale_inv = amax_slots.fresh_current(torch.ones(2))
    assert amax.item() == 0.0 and scale.shape == scale_inv.shape == (1,)


def test_slots_cut_in_inference_mode_take_in_place_writes_in_training():
    """An evaluation step under torch.inference_mode may cut the chunk whose slots training
    steps take later; those slots are written in place there (an FP8 weight's scale_inv is
    refreshed by copy_ when the optimizer requantizes it)."""
    pool = ZeroedSlots(lambda device: "s0", lambda: False, 4, floats=amax_slots.CURRENT_FLOATS,
                       split=amax_slots.current_slots)
    with torch.inference_mode():
        first = pool.take(CPU)
    later = pool.take(CPU)
    for slot in (*first, *later):
        assert not slot.is_inference()
    later[2].copy_(torch.tensor([0.5]))
    first[1].add_(1.0)
    assert later[2].item() == 0.5 and first[1].item() == 1.0
