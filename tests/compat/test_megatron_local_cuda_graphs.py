"""The Transformer Engine calls Megatron-LM's own CUDA graphs (`cuda_graph_impl=local`) make with
FP8 on, in its order, with the values TE gives them: the weight-refresh flag its runners set, the
fp8_meta writes and global-buffer registration before each forward replay, and the backward
update after each backward replay. Graphs cannot be captured on the CPU: a replay is stood in for
by writing the amaxes its kernels would record (no module Python runs)."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core._graph_replay import scaling_groups
from te_core.compat import te_graph
from te_core.compat.transformer_engine import FP8GlobalStateManager as Manager
from te_core.recipe import DelayedScaling, Format

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@pytest.fixture(autouse=True)
def no_flag_left():
    yield
    te_graph.set_capture_end()
    from te_core.quantization import weight_refresh

    weight_refresh._FLAG.tensor = None  # (the process-wide flag: no later test's capture reads it)


def _settled_linear(recipe, seed: int = 0):
    """A Linear after one eager FP8 step (every scale set, as after Megatron's recording step)."""
    torch.manual_seed(seed)
    linear = te.Linear(32, 32, bias=False)
    with te.autocast(recipe=recipe):
        linear(torch.randn(16, 32), is_first_microbatch=True).sum().backward()
    return linear


def test_skip_flag_is_one_device_tensor_kept_at_its_address():
    Manager.set_skip_fp8_weight_update_tensor(False)  # what each _CudaGraphRunner.__init__ does with FP8
    flag = Manager.get_skip_fp8_weight_update_tensor()
    assert flag.shape == (1,) and flag.dtype == torch.float32 and flag.item() == 0.0
    Manager.set_skip_fp8_weight_update_tensor(True)
    assert Manager.get_skip_fp8_weight_update_tensor() is flag and flag.item() == 1.0
    with pytest.raises(TypeError, match="skip must be True or False"):
        Manager.set_skip_fp8_weight_update_tensor(1)


def test_captured_weight_cast_follows_the_flag_not_is_first_microbatch():
    """Megatron's TE wrappers pass is_first_microbatch=False while it captures; the flag, set
    between replays, decides whether the cached FP8 weight is kept (and its amax not recorded)."""
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    linear = _settled_linear(recipe)
    x = torch.randn(16, 32)
    group = scaling_groups(linear)[0]
    weight_group = next(g for g in group if g.names == ("weight",))
    Manager.set_skip_fp8_weight_update_tensor(False)
    with te.autocast(recipe=recipe):
        te_graph.set_capture_start()
        first = linear(x, is_first_microbatch=False)  # refreshes: the weight as it is now
        with torch.no_grad():  # an optimizer step between two steps' replays (within the weight's scale)
            linear.weight.mul_(-0.75).add_(torch.rand_like(linear.weight) * 0.01)
        amax_before = weight_group.amax_history[0].clone()
        Manager.set_skip_fp8_weight_update_tensor(True)
        kept = linear(x, is_first_microbatch=False)
        amax_after_kept = weight_group.amax_history[0].clone()
        Manager.set_skip_fp8_weight_update_tensor(False)
        refreshed = linear(x, is_first_microbatch=False)
        amax_after_refresh = weight_group.amax_history[0].clone()
        te_graph.set_capture_end()
        eager = linear(x)  # a fresh cast of the new weight, at the same (not yet updated) scale
    torch.testing.assert_close(kept, first, rtol=0, atol=0)
    torch.testing.assert_close(amax_after_kept, amax_before, rtol=0, atol=0)
    torch.testing.assert_close(refreshed, eager, rtol=0, atol=0)
    assert not torch.equal(refreshed, first)
    expected = torch.maximum(amax_before, linear.weight.detach().abs().max().float())
    torch.testing.assert_close(amax_after_refresh, expected, rtol=0, atol=0)
    # and the FP8 result is the weight's: against float64 on the E4M3 tolerances
    reference = (x.double() @ linear.weight.detach().double().t()).float()
    torch.testing.assert_close(refreshed, reference, rtol=0.125, atol=0.0675)


def _replay_forward(module, amaxes):
    """What _CudagraphReplayNode.forward does under DelayedScaling, then the replay's kernels
    recording `amaxes` (one per forward group, maxed into history row 0)."""
    module.fp8_meta["fp8_group"] = Manager.get_fp8_group()
    module.fp8_meta["recipe"] = Manager.get_fp8_recipe()
    Manager.add_fp8_tensors_to_global_buffer(module.fp8_meta)
    for group, amax in zip(scaling_groups(module)[0], amaxes):
        group.amax_history[0].copy_(torch.maximum(group.amax_history[0], amax))


class _ReplayNode(torch.autograd.Function):
    """Megatron's replay node, as far as FP8 goes: the backward graph records the gradient amaxes,
    then reduce_and_update_fp8_tensors(forward=False) runs."""

    @staticmethod
    def forward(ctx, module, grad_amax, x):
        ctx.module, ctx.grad_amax = module, grad_amax
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        for group in scaling_groups(ctx.module)[1]:
            group.amax_history[0].copy_(torch.maximum(group.amax_history[0], ctx.grad_amax))
        Manager.reduce_and_update_fp8_tensors(forward=False)
        return None, None, grad


def test_replayed_layers_update_forward_scales_at_autocast_exit_and_backward_once_per_pass():
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=3, margin=1)
    layers = [_settled_linear(recipe, seed) for seed in (1, 2)]
    histories = {id(g): g.amax_history.clone() for m in layers for g in sum(scaling_groups(m), [])}
    forward_amaxes = [[torch.rand(len(g.names)) * 10 + 0.5 for g in scaling_groups(m)[0]] for m in layers]
    grad_amaxes = [torch.rand(1) * 1e-3 + 1e-4 for _ in layers]
    x = torch.randn(4, 8, requires_grad=True)
    with te.autocast(recipe=recipe):  # Megatron's outer autocast around the block, delayed scaling
        out = x
        for layer, amaxes, grad_amax in zip(layers, forward_amaxes, grad_amaxes):
            _replay_forward(layer, amaxes)
            out = _ReplayNode.apply(layer, grad_amax, out)
        for layer in layers:  # nothing updates before the outermost exit
            for group in scaling_groups(layer)[0]:
                assert torch.equal(group.amax_history[1:], histories[id(group)][1:])
    for layer, amaxes in zip(layers, forward_amaxes):
        for group, amax in zip(scaling_groups(layer)[0], amaxes):
            old = histories[id(group)].double()
            window = torch.maximum(old[0], amax.double()).unsqueeze(0)
            expected_scale = E4M3_MAX / torch.cat([window, old[1:]]).max(dim=0).values / 2
            torch.testing.assert_close(group.scale.double(), expected_scale, rtol=1.3e-6, atol=1e-5)
            assert torch.equal(group.amax_history[0], torch.zeros_like(group.amax_history[0]))  # rolled once
    out.sum().backward()  # two backward replays, two reduce_and_update calls, one update each
    for layer, grad_amax in zip(layers, grad_amaxes):
        (group,) = scaling_groups(layer)[1]
        old = histories[id(group)].double()
        window = torch.cat([torch.maximum(old[0], grad_amax.double()).unsqueeze(0), old[1:]])
        expected_scale = E5M2_MAX / window.max(dim=0).values / 2
        torch.testing.assert_close(group.scale.double(), expected_scale, rtol=1.3e-6, atol=1e-5)
        # (TE's roll: row 0 becomes the newest entry, last; the oldest, row 1, drops; row 0 zeroed)
        rolled_once = torch.cat([torch.zeros_like(window[:1]), window[2:], window[:1]]).float()
        torch.testing.assert_close(group.amax_history, rolled_once, rtol=0, atol=0)


def test_global_buffer_calls_outside_their_place_say_what_to_do():
    recipe = DelayedScaling()
    linear = _settled_linear(recipe)
    with pytest.raises(RuntimeError, match="outside te.autocast.*call it inside the autocast"):
        Manager.add_fp8_tensors_to_global_buffer(linear.fp8_meta)
    with pytest.raises(TypeError, match="takes a te-core module's fp8_meta"):
        Manager.add_fp8_tensors_to_global_buffer({"recipe": recipe})
    with te.autocast(recipe=recipe), pytest.raises(TypeError, match="read-only view"):
        linear.fp8_meta["fp8_group"] = object()  # not the autocast's group
    plain = te.Linear(8, 8)  # no delayed-scaling state: nothing to register, as in TE
    Manager.add_fp8_tensors_to_global_buffer(plain.fp8_meta)
