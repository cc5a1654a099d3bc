"""FusedAdam's compact states, as Transformer Engine's: float16 and FP8 (torch.uint8) moments
and float16 master weights, each scaled per tensor, and bf16 parameters' float32 master weights
kept as int16 remainders (store_param_remainders)."""
import io

import pytest
import torch

from te_core.optimizers import FusedAdam
from te_core.optimizers import _scaled_states as compact

from .test_fused_optimizers import fresh, run

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
E4M3 = dict(rtol=0.125, atol=0.0675)


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_remainders_rebuild_the_float32_master_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0e38, -1e-40])])
    high, low = compact.split(x)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
    assert torch.equal(_bits(compact.join(high, low)), _bits(x))
    # the parameter is the master rounded to bf16: to nearest, ties (lower half 0x8000) away from zero
    not_tie = (_bits(x) & 0xFFFF) != 0x8000
    assert torch.equal(high[not_tie], x[not_tie].bfloat16())
    tie = torch.tensor([1.0 + 2**-8, -(1.0 + 2**-8)])  # exactly halfway between two bf16 values
    assert compact.split(tie)[0].tolist() == [1.0 + 2**-7, -(1.0 + 2**-7)]


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_param_remainders_step_as_float32_master_weights(adam_w_mode):
    """store_param_remainders=True: the same float32 master trajectory as master_weights=True,
    in half the memory; the bf16 parameters differ at most where a master sits exactly halfway
    between two bf16 values."""
    ours, theirs = fresh(torch.bfloat16), fresh(torch.bfloat16)
    opt = FusedAdam(ours, master_weights=True, store_param_remainders=True, adam_w_mode=adam_w_mode, **HYPER)
    ref = FusedAdam(theirs, master_weights=True, adam_w_mode=adam_w_mode, **HYPER)
    run(ours, opt)
    run(theirs, ref)
    for p, q in zip(ours, theirs):
        remainder = opt.state[p]["master_param"]
        assert remainder.dtype == torch.int16 and remainder.shape == p.shape
        master = ref.state[q]["master_param"]
        assert torch.equal(_bits(compact.join(p.detach(), remainder)), _bits(master))
        torch.testing.assert_close(opt.get_unscaled_state(p, "master_param"), remainder, rtol=0, atol=0)
        assert torch.equal(p[(_bits(master) & 0xFFFF) != 0x8000], q[(_bits(master) & 0xFFFF) != 0x8000])
    assert not torch.equal(ours[0], fresh(torch.bfloat16)[0])


def test_param_remainders_apply_to_bf16_parameters_with_float32_master_weights_only():
    params = fresh(torch.float16)
    opt = FusedAdam(params, master_weights=True, store_param_remainders=True, **HYPER)
    run(params, opt, steps=1)
    assert opt.state[params[0]]["master_param"].dtype == torch.float32  # float16 parameters: a float32 copy
    assert not FusedAdam(fresh(torch.bfloat16), store_param_remainders=True).store_param_remainders  # no masters


@pytest.mark.parametrize("dtype, storage, tol", [(torch.float16, torch.float16, dict(rtol=2e-3, atol=1e-6)),
                                                 (torch.uint8, torch.float8_e4m3fn, E4M3)])
def test_scaled_moments_follow_float32_ones_within_their_format(dtype, storage, tol):
    """float16 / FP8 moments: stored scaled (largest magnitude at the format's range: half of
    float16's maximum, 448 for E4M3), read back as stored value times scale, updated in float32."""
    ours, theirs = fresh(), fresh()
    opt = FusedAdam(ours, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype, **HYPER)
    ref = FusedAdam(theirs, **HYPER)
    run(ours, opt, steps=1)
    run(theirs, ref, steps=1)
    for p, q in zip(ours, theirs):
        for name in ("exp_avg", "exp_avg_sq"):
            stored, scale = opt.state[p][name], opt._scales[p][name]
            assert stored.dtype == storage and scale.dtype == torch.float32 and scale.numel() == 1
            want = ref.state[q][name]
            # the scale is the float32 moment's largest magnitude over the range; the stored value
            # the moment over the scale, rounded once
            assert scale.item() == pytest.approx(want.abs().max().item() / compact.RANGE[dtype], rel=1e-6)
            assert stored.float().abs().max().item() == pytest.approx(compact.RANGE[dtype], rel=2**-10)
            torch.testing.assert_close(opt.get_unscaled_state(p, name), stored.float() * scale, rtol=0, atol=0)
            torch.testing.assert_close(opt.get_unscaled_state(p, name), want, **tol)
    run(ours, opt, seed=2)
    run(theirs, ref, seed=2)
    for p, q in zip(ours, theirs):  # a few more steps stay near the float32 optimizer's parameters
        torch.testing.assert_close(p, q, rtol=0, atol=5 * HYPER["lr"] * tol["rtol"])
        assert not torch.equal(p, q) or dtype == torch.float16


def test_float16_master_weights_are_scaled_and_parameters_get_their_value():
    ours, theirs = fresh(torch.bfloat16), fresh(torch.bfloat16)
    opt = FusedAdam(ours, master_weights=True, master_weight_dtype=torch.float16, **HYPER)
    ref = FusedAdam(theirs, master_weights=True, **HYPER)
    run(ours, opt)
    run(theirs, ref)
    for p, q in zip(ours, theirs):
        assert opt.state[p]["master_param"].dtype == torch.float16
        master = opt.get_unscaled_state(p, "master_param")
        torch.testing.assert_close(master, ref.state[q]["master_param"], rtol=2e-3, atol=1e-5)
        torch.testing.assert_close(p.float(), master, rtol=1.6e-2, atol=1e-5)


def test_an_all_zero_scaled_state_stays_zero():
    params = fresh()
    opt = FusedAdam(params, exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16, **HYPER)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        for name in ("exp_avg", "exp_avg_sq"):
            assert opt._scales[p][name].item() == 0.0
            assert torch.equal(opt.get_unscaled_state(p, name), torch.zeros_like(p))


def test_set_and_get_a_scaled_state():
    params = fresh()
    opt = FusedAdam(params, exp_avg_dtype=torch.uint8, **HYPER)
    value = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(5))
    opt.set_scaled_state(params[0], "exp_avg", value)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float8_e4m3fn
    torch.testing.assert_close(opt.get_unscaled_state(params[0], "exp_avg"), value, **E4M3)
    with pytest.raises(ValueError, match="int16 remainder"):
        remainders = FusedAdam(fresh(torch.bfloat16), master_weights=True, store_param_remainders=True)
        remainders.set_scaled_state(remainders.param_groups[0]["params"][0], "master_param", value)


@pytest.mark.parametrize("kwargs", [dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.float16),
                                    dict(master_weights=True, master_weight_dtype=torch.float16),
                                    dict(master_weights=True, store_param_remainders=True)])
def test_a_checkpoint_holds_float32_values_and_resumes_in_the_compact_forms(kwargs):
    """state_dict() holds scaled states unscaled in float32 (remainders as int16), as Transformer
    Engine saves them; a fresh optimizer loading it keeps them in their compact forms."""
    params = fresh(torch.bfloat16 if kwargs.get("master_weights") else torch.float32)
    opt = FusedAdam(params, **kwargs, **HYPER)
    run(params, opt, steps=2)
    saved = opt.state_dict()
    for index, p in enumerate(params):
        for name, value in saved["state"][index].items():
            if not torch.is_tensor(value) or value.dim() == 0:
                continue
            kept = opt.state[p][name]
            if kept.dtype in (torch.float16, torch.float8_e4m3fn):
                assert value.dtype == torch.float32
                assert torch.equal(value, opt.get_unscaled_state(p, name))
            else:
                assert value.dtype == kept.dtype
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    twins = [p.detach().clone().requires_grad_() for p in params]
    resumed = FusedAdam(twins, **kwargs, **HYPER)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for p, q in zip(params, twins):
        for name, kept in opt.state[p].items():
            if not torch.is_tensor(kept) or kept.dim() == 0:
                continue
            again = resumed.state[q][name]
            assert again.dtype == kept.dtype, name
            if kept.dtype == torch.int16:
                assert torch.equal(again, kept)
            else:
                tol = E4M3 if kept.dtype == torch.float8_e4m3fn else dict(rtol=1e-3, atol=1e-6)
                torch.testing.assert_close(resumed.get_unscaled_state(q, name), opt.get_unscaled_state(p, name), **tol)
    run(params, opt, steps=1, seed=3)
    run(twins, resumed, steps=1, seed=3)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=2 * HYPER["lr"] * E4M3["rtol"])
