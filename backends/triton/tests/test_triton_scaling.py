"""te_triton.scaling (one-launch delayed-scaling update) under the interpreter vs the reference."""
import pytest
import torch
import triton
from te_core.reference import scaling as ref
from te_triton import Config, scaling

SMALL = Config(block_m=4, block_n=32, num_warps=1)


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    hists = [torch.rand(5, 3, generator=g), torch.rand(1, 4, generator=g), torch.rand(13, 70, generator=g) * 100]
    hists[0][:, 1] = 0.0  # amax 0: keep the old scale
    hists[1][0, 2] = float("nan")  # NaN: keep
    hists[2][3, 5] = float("inf")  # inf: keep
    hists[2][0, 7] = 1e-39  # tiny amax: the scale overflows to float32 max
    hists[2][6, 9] = float("nan")  # NaN in an older row: ignored by "max", as fmaxf
    hists[2][0, 11] = 0.0  # nothing recorded this step: scale and history kept
    scales = [torch.rand(h.shape[1], generator=g) + 0.5 for h in hists]
    return hists, scales


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 2.0])
def test_update_matches_reference(algo, margin):
    hists, scales = _state(1)
    want_h, want_s = [h.clone() for h in hists], [s.clone() for s in scales]
    fmaxes = [448.0, 57344.0, 448.0]
    scaling.delayed_scaling_update(hists, scales, fmaxes, margin=margin, amax_compute_algo=algo, cfg=SMALL)
    ref.delayed_scaling_update(want_h, want_s, fmaxes, margin=margin, amax_compute_algo=algo)
    for h, wh, s, ws in zip(hists, want_h, scales, want_s):
        assert torch.equal(h.nan_to_num(), wh.nan_to_num()) and torch.equal(h.isnan(), wh.isnan())
        # the interpreter's div_rn can differ from a true quotient in the last bit; the GPU's cannot
        torch.testing.assert_close(s, ws, rtol=2.5e-7, atol=0)


@pytest.mark.parametrize("margin", [3.0, 130.0])
def test_margin_applies_first_and_scales_stay_normal(margin):
    """(fp8_max * 2^-margin) / amax, as the reference and Transformer Engine: a tiny amax keeps its
    margin (fp8_max / amax alone would overflow), and a scale that would fall below float32's
    smallest normal (a huge amax, a margin above 126 whose 2^-margin is subnormal) becomes 2^-126."""
    g = torch.Generator().manual_seed(2)
    hist = torch.rand(4, 6, generator=g) + 0.5
    hist[0, :3] = torch.tensor([5e-37, 2e-37, 1e-37])  # tiny: (448 / amax) overflows before the margin
    hist[:, 3] = 3e38  # huge
    scale = torch.rand(6, generator=g) + 0.5
    want_h, want_s = hist.clone(), scale.clone()
    scaling.delayed_scaling_update([hist], [scale], [448.0], margin=margin, cfg=SMALL)
    ref.delayed_scaling_update([want_h], [want_s], [448.0], margin=margin)
    assert torch.equal(hist, want_h)
    torch.testing.assert_close(scale, want_s, rtol=2.5e-7, atol=0)
    assert (scale >= torch.finfo(torch.float32).tiny).all() and torch.isfinite(torch.reciprocal(scale)).all()


def test_bad_inputs_name_the_problem():
    h, s = torch.rand(4, 3), torch.rand(3)
    with pytest.raises(ValueError, match="amax_compute_algo must be"):
        scaling.delayed_scaling_update([h], [s], [448.0], amax_compute_algo="mean")
    with pytest.raises(ValueError, match="pair up one to one"):
        scaling.delayed_scaling_update([h], [s, s], [448.0])
    with pytest.raises(ValueError, match="scales must be contiguous float32 with 3 elements"):
        scaling.delayed_scaling_update([h], [torch.rand(2)], [448.0])
    with pytest.raises(ValueError, match="contiguous float32 \\(L, n\\)"):
        scaling.delayed_scaling_update([h.double()], [s], [448.0])


def test_empty_histories_and_tensors_on_another_device_are_refused():
    """A history of no rows (L = 0, a null address) was read, and written past its end, by the
    kernels (a crash); the table's addresses are read on the first history's device."""
    h, s = torch.rand(4, 3), torch.rand(3)
    with pytest.raises(ValueError, match=r"with L >= 1, got torch.float32 \(0, 3\)"):
        scaling.delayed_scaling_update([h, torch.zeros(0, 3)], [s, s.clone()], [448.0, 448.0])
    with pytest.raises(ValueError, match="every history and scale must be on one device, got cpu and meta"):
        scaling.delayed_scaling_update([h], [s.to("meta")], [448.0])
    with pytest.raises(ValueError, match="every history and scale must be on one device, got meta and meta"):
        scaling.delayed_scaling_update([h, h.to("meta")], [s, s.to("meta")], [448.0, 448.0])


@pytest.mark.parametrize("length, cols", [(1024, 3), (37, 2), (300, 9)])
def test_long_history_few_columns(length, cols):
    """The shape modules have: a long history with a handful of columns (narrow, tall tiles)."""
    g = torch.Generator().manual_seed(length)
    hists = [torch.rand(length, cols, generator=g) * 10, torch.rand(length, 1, generator=g)]
    scales = [torch.rand(cols, generator=g) + 0.5, torch.rand(1, generator=g) + 0.5]
    want_h, want_s = [h.clone() for h in hists], [s.clone() for s in scales]
    scaling.delayed_scaling_update(hists, scales, [448.0, 57344.0])
    ref.delayed_scaling_update(want_h, want_s, [448.0, 57344.0])
    for h, wh, s, ws in zip(hists, want_h, scales, want_s):
        assert torch.equal(h, wh)
        torch.testing.assert_close(s, ws, rtol=2.5e-7, atol=0)


def test_history_too_large_for_one_tile_is_rolled_in_chunks():
    """(L, columns) blocks beyond scaling.TILE_ELEMENTS take the chunked kernel; same result."""
    g = torch.Generator().manual_seed(5)
    assert 2048 * 8 > scaling.TILE_ELEMENTS
    hists = [torch.rand(2048, 5, generator=g) * 3]
    hists[0][7, 2] = float("nan")
    scales = [torch.rand(5, generator=g) + 0.5]
    want_h, want_s = [h.clone() for h in hists], [s.clone() for s in scales]
    scaling.delayed_scaling_update(hists, scales, [448.0], cfg=SMALL)
    ref.delayed_scaling_update(want_h, want_s, [448.0])
    assert torch.equal(hists[0].nan_to_num(), want_h[0].nan_to_num())
    torch.testing.assert_close(scales[0], want_s[0], rtol=2.5e-7, atol=0, equal_nan=True)


def test_cached_plan_follows_the_tensors():
    """The per-tensor-set plan is reused across steps and never applies to other tensors."""
    g = torch.Generator().manual_seed(9)
    hists = [torch.rand(16, 2, generator=g), torch.rand(16, 1, generator=g)]
    scales = [torch.ones(2), torch.ones(1)]
    want_h, want_s = [h.clone() for h in hists], [s.clone() for s in scales]
    for _ in range(2):  # the second call runs on the cached plan
        for h in hists + want_h:
            h[0] = torch.rand(h.shape[1], generator=g) * 5
        want_h[0][0].copy_(hists[0][0]), want_h[1][0].copy_(hists[1][0])
        scaling.delayed_scaling_update(hists, scales, [448.0, 448.0])
        ref.delayed_scaling_update(want_h, want_s, [448.0, 448.0])
        for h, wh, s, ws in zip(hists, want_h, scales, want_s):
            assert torch.equal(h, wh)
            torch.testing.assert_close(s, ws, rtol=2.5e-7, atol=0)
    moved = hists[0].clone()  # a new buffer (as after module.to): a new plan, with its address
    scaling.delayed_scaling_update([moved, hists[1]], scales, [448.0, 448.0])
    ref.delayed_scaling_update([want_h[0], want_h[1]], want_s, [448.0, 448.0])
    assert torch.equal(moved, want_h[0])
    with pytest.raises(ValueError, match="contiguous float32"):
        scaling.delayed_scaling_update([moved.t()], [torch.ones(16)], [448.0])


def _launch_listed(hists, scales, fmaxes, margin, algo):
    """_delayed_update_args_kernel over `hists` (all of one tile height), as one launch."""
    bl = triton.next_power_of_2(max(h.shape[0] for h in hists))
    cols = max(h.shape[1] for h in hists)
    bn = min(triton.next_power_of_2(cols), scaling.TILE_COLUMNS)
    args = []
    for h, s, fmax in zip(hists, scales, fmaxes):
        scaled = float(torch.tensor(2.0 ** -margin, dtype=torch.float32) * torch.tensor(fmax, dtype=torch.float32))
        args += [h, s, h.shape[1], h.shape[0], scaled]
    args += [None] * 5 * (scaling.ARGS_PER_LAUNCH - len(hists))
    scaling._delayed_update_args_kernel[(len(hists), triton.cdiv(cols, bn))](
        *args, COUNT=len(hists), MOST_RECENT=algo == "most_recent", BL=bl, BN=bn, num_warps=4)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 3.0])
def test_listed_histories_kernel_is_the_table_kernel(algo, margin):
    """_delayed_update_args_kernel (histories and their scales as arguments, for torch.compile's
    launches) gives the table kernel's bytes: NaN, inf, zero and unrecorded columns, lengths
    from 1 to 1024; one history per launch, and eight of one tile height (lengths 9 to 16,
    columns 1 to 20) in one launch."""
    hists, scales = _state(3)
    g = torch.Generator().manual_seed(4)
    hists.append(torch.rand(1024, 1, generator=g) * 7)
    scales.append(torch.rand(1, generator=g) + 0.5)
    fmaxes = [448.0, 57344.0, 448.0, 448.0]
    shared = [(torch.rand(length, cols, generator=g) * 3, torch.rand(cols, generator=g) + 0.5)
              for length, cols in [(16, 1), (9, 2), (13, 20), (16, 3), (10, 1), (11, 16), (16, 2), (12, 5)]]
    shared[2][0][0, 4] = float("nan")
    shared[5][0][0, 3] = 0.0
    shared_h, shared_s = [h for h, _ in shared], [s for _, s in shared]
    shared_f = [448.0, 57344.0] * 4
    want_h, want_s = [h.clone() for h in hists + shared_h], [s.clone() for s in scales + shared_s]
    scaling.delayed_scaling_update(want_h, want_s, fmaxes + shared_f, margin=margin, amax_compute_algo=algo)
    for h, s, fmax in zip(hists, scales, fmaxes):
        _launch_listed([h], [s], [fmax], margin, algo)
    _launch_listed(shared_h, shared_s, shared_f, margin, algo)
    for h, wh, s, ws in zip(hists + shared_h, want_h, scales + shared_s, want_s):
        assert torch.equal(h.view(torch.int32), wh.view(torch.int32))
        assert torch.equal(s.view(torch.int32), ws.view(torch.int32))
