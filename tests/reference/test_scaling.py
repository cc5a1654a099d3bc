"""Reference delayed-scaling update: new scales, kept scales, and the history roll."""
import pytest
import torch

from te_core.reference import scaling

F32_MAX = torch.finfo(torch.float32).max


def f32(x):
    return torch.tensor(x, dtype=torch.float32)


def test_update_max_and_roll():
    history = torch.rand(5, 4) * 10 + 0.1
    scales = torch.rand(4) + 0.5
    before = history.clone()
    scaling.delayed_scaling_update([history], [scales], [448.0], margin=1.0)
    want = torch.div(torch.full((4,), 448.0), before.amax(0)) / 2.0
    assert torch.equal(scales, want)
    assert torch.equal(history[0], torch.zeros(4))
    assert torch.equal(history[1:4], before[2:5]) and torch.equal(history[4], before[0])


def test_most_recent_and_several_tensors():
    h1, h2 = torch.rand(3, 2) + 0.5, torch.rand(1, 3) + 0.5
    s1, s2 = torch.ones(2), torch.ones(3)
    r1, r2 = h1[0].clone(), h2[0].clone()
    scaling.delayed_scaling_update([h1, h2], [s1, s2], [448.0, 57344.0], amax_compute_algo="most_recent")
    assert torch.equal(s1, torch.div(torch.full((2,), 448.0), r1))
    assert torch.equal(s2, torch.div(torch.full((3,), 57344.0), r2))
    assert torch.equal(h2, torch.zeros(1, 3))  # a one-row history only gets zeroed


def test_special_amaxes_keep_or_saturate_the_scale():
    history = f32([[0.0, float("inf"), float("nan"), 1e-44, 2.0]])
    scales = f32([3.0, 5.0, 7.0, 11.0, 13.0])
    scaling.delayed_scaling_update([history], [scales], [448.0], amax_compute_algo="most_recent")
    assert scales.tolist()[:3] == [3.0, 5.0, 7.0]  # 0, inf, NaN: old scale kept
    assert scales[3].item() == F32_MAX  # overflow to inf becomes float32 max
    assert scales[4].item() == 224.0
    # "max" over a history holding inf keeps the old scale too
    history = f32([[1.0, 1.0], [float("inf"), 4.0]])
    scales = f32([3.0, 3.0])
    scaling.delayed_scaling_update([history], [scales], [448.0])
    assert scales.tolist() == [3.0, 112.0]


def test_bad_inputs():
    h, s = torch.rand(2, 3), torch.ones(3)
    with pytest.raises(ValueError, match=r"amax_compute_algo='mean' is not supported; allowed values: 'max', 'most_recent'"):
        scaling.delayed_scaling_update([h], [s], [448.0], amax_compute_algo="mean")
    with pytest.raises(ValueError, match=r"scales\[0\] has shape \(2,\); amax_histories\[0\] \(2, 3\) needs \(3,\)"):
        scaling.delayed_scaling_update([h], [torch.ones(2)], [448.0])
    with pytest.raises(ValueError, match=r"must have the same length"):
        scaling.delayed_scaling_update([h], [s], [448.0, 448.0])
    with pytest.raises(ValueError, match=r"amax_histories\[0\] must be 2-D"):
        scaling.delayed_scaling_update([torch.rand(3)], [s], [448.0])
    with pytest.raises(TypeError, match=r"must be float32, got torch.float64"):
        scaling.delayed_scaling_update([h.double()], [s], [448.0])
