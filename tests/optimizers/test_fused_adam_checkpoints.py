"""FusedAdam resuming checkpoints written elsewhere: Transformer Engine's (a master weight kept
for every parameter, a capturable step count of shape [1]), a non-capturable one resumed
capturable, and torch.optim.Adam's / AdamW's (per-parameter step counts), each continued as the
optimizer that wrote it would have, against a float64 Adam step or torch.optim itself."""
import copy

import pytest
import torch

import te_core as te
from te_core.optimizers import FusedAdam
from te_core.recipe import Float8CurrentScaling

FP32 = dict(rtol=1.3e-6, atol=1e-5)
BETAS, EPS = (0.9, 0.99), 1e-8


def randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def adamw64(p, g, m, v, step, lr, weight_decay=0.0):
    """One torch.optim.AdamW step in float64 from (p, m, v) at step count `step`: the new p."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    p = p * (1 - lr * weight_decay)
    m = BETAS[0] * m + (1 - BETAS[0]) * g
    v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    return p - lr / (1 - BETAS[0]**step) * m / ((v / (1 - BETAS[1]**step)).sqrt() + EPS)


def moments(shape, seed):
    return randn(*shape, seed=seed) * 0.1, randn(*shape, seed=seed + 1).square() * 0.01


def te_group(params, step, lr=1e-3, **extra):
    return [{"lr": lr, "bias_correction": True, "betas": BETAS, "eps": EPS, "weight_decay": 0.0, "step": step,
             "params": list(range(len(params))), **extra}]


@pytest.mark.parametrize("capturable", [False, True])
def test_te_master_weight_checkpoint_keeps_float32_parameters_where_they_are(capturable):
    """Transformer Engine's FusedAdam(master_weights=True) saves a master weight for a float32
    parameter too, never stepped (its initial value), and steps the parameter itself: the
    float32 parameter continues from its own value and the stale copy is dropped, while a bf16
    parameter's master weight (the one it steps) is the one continued."""
    w32_now, w32_init = randn(4, 3, seed=0), randn(4, 3, seed=1)
    w16_master = randn(5, seed=2)
    p32, p16 = torch.nn.Parameter(w32_now.clone()), torch.nn.Parameter(w16_master.bfloat16())
    (m32, v32), (m16, v16) = moments((4, 3), 3), moments((5,), 5)
    saved = {"state": {0: {"exp_avg": m32.clone(), "exp_avg_sq": v32.clone(), "master_param": w32_init.clone()},
                       1: {"exp_avg": m16.clone(), "exp_avg_sq": v16.clone(), "master_param": w16_master.clone()}},
             "param_groups": te_group([p32, p16], step=10)}
    opt = FusedAdam([p32, p16], lr=1e-3, betas=BETAS, eps=EPS, master_weights=True, capturable=capturable)
    opt.load_state_dict(saved)
    assert "master_param" not in opt.state[p32] and "master_param" in opt.state[p16]
    g32, g16 = randn(4, 3, seed=7), randn(5, seed=8)
    p32.grad, p16.grad = g32.clone(), g16.bfloat16()
    opt.step()
    torch.testing.assert_close(p32.detach().double(), adamw64(w32_now, g32, m32, v32, 11, 1e-3), **FP32)
    want16 = adamw64(w16_master, g16.bfloat16(), m16, v16, 11, 1e-3)
    torch.testing.assert_close(opt.state[p16]["master_param"].double(), want16, **FP32)
    assert torch.equal(p16.detach(), opt.state[p16]["master_param"].bfloat16())
    assert "master_param" not in opt.state_dict()["state"][0]


def test_a_master_weight_of_an_fp8_float32_parameter_is_kept_from_a_te_checkpoint():
    """An FP8 parameter of nominal dtype float32 steps through its master weight (as in
    Transformer Engine), so the checkpoint's master is the one continued, not the parameter."""
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=Float8CurrentScaling()):
        weight = te.Linear(32, 32, bias=False).weight
    assert weight.dtype == torch.float32
    master = weight.dequantize(dtype=torch.float32) + randn(32, 32, seed=1) * 1e-3  # finer than FP8
    m, v = moments((32, 32), 2)
    opt = FusedAdam([weight], lr=1e-3, betas=BETAS, eps=EPS, master_weights=True)
    opt.load_state_dict({"state": {0: {"exp_avg": m.clone(), "exp_avg_sq": v.clone(), "master_param": master.clone()}},
                         "param_groups": te_group([weight], step=4)})
    g = randn(32, 32, seed=4)
    weight.grad = g.clone()
    opt.step()
    torch.testing.assert_close(opt.state[weight]["master_param"].double(), adamw64(master, g, m, v, 5, 1e-3), **FP32)


def test_master_weights_are_dropped_without_master_weights():
    """Transformer Engine's FusedAdam(master_weights=False) steps a bf16 parameter itself, whatever
    master weight its checkpoint holds; so does te-core's."""
    w = randn(6, seed=0)
    p = torch.nn.Parameter(w.bfloat16())
    m, v = moments((6,), 1)
    opt = FusedAdam([p], lr=1e-2, betas=BETAS, eps=EPS)
    opt.load_state_dict({"state": {0: {"exp_avg": m.clone(), "exp_avg_sq": v.clone(),
                                       "master_param": randn(6, seed=9)}},
                         "param_groups": te_group([p], step=2, lr=1e-2)})
    assert "master_param" not in opt.state[p]
    g = randn(6, seed=3)
    p.grad = g.bfloat16()
    opt.step()
    want = adamw64(w.bfloat16(), g.bfloat16(), m, v, 3, 1e-2)
    torch.testing.assert_close(p.detach().double(), want.bfloat16().double(), rtol=2**-8, atol=0)


@pytest.mark.parametrize("step_shape", [(), (1,)], ids=["0-dim step", "shape-[1] step"])
@pytest.mark.parametrize("lr_shape", [(), (1,)], ids=["0-dim lr", "shape-[1] lr"])
def test_capturable_te_checkpoint_steps_a_0_dim_parameter(step_shape, lr_shape):
    """Transformer Engine's capturable step count is torch.tensor([n], dtype=torch.int): a 0-dim
    parameter (a learnable scalar) steps with it, and with a shape-[1] lr, as a float64 Adam."""
    params = [torch.nn.Parameter(randn(3, 4, seed=0)), torch.nn.Parameter(randn(seed=1))]
    starts = [p.detach().clone() for p in params]
    states = [moments(p.shape, 2 + 2 * i) for i, p in enumerate(params)]
    saved = {"state": {i: {"exp_avg": m.clone(), "exp_avg_sq": v.clone()} for i, (m, v) in enumerate(states)},
             "param_groups": te_group(params, step=torch.full(step_shape, 5, dtype=torch.int),
                                      lr=torch.full(lr_shape, 0.01))}
    opt = FusedAdam(params, lr=0.01, betas=BETAS, eps=EPS, capturable=True)
    opt.load_state_dict(saved)
    grads = [randn(*p.shape, seed=10 + i) for i, p in enumerate(params)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, start, g, (m, v) in zip(params, starts, grads, states):
        assert p.shape == start.shape
        torch.testing.assert_close(p.detach().double(), adamw64(start, g, m, v, 6, 0.01), **FP32)
    assert float(opt.param_groups[0]["step"]) == 6


def test_a_non_capturable_checkpoint_resumes_capturable_with_its_step_count():
    """The step count saved as a number becomes the capturable optimizer's tensor count (it used
    to restart at 0, so the bias correction restarted too)."""
    torch.manual_seed(0)
    start = torch.randn(7, 5)
    plain_p, capt_p = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    plain = FusedAdam([plain_p], lr=1e-2, betas=BETAS, eps=EPS)
    for seed in range(3):
        plain_p.grad = randn(7, 5, seed=seed)
        plain.step()
    capt_p.data.copy_(plain_p.detach())
    capturable = FusedAdam([capt_p], lr=1e-2, betas=BETAS, eps=EPS, capturable=True)
    capturable.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert torch.is_tensor(capturable.param_groups[0]["step"]) and float(capturable.param_groups[0]["step"]) == 3
    for opt, p in ((plain, plain_p), (capturable, capt_p)):
        p.grad = randn(7, 5, seed=9)
        opt.step()
    torch.testing.assert_close(capt_p.detach(), plain_p.detach(), **FP32)


def _torch_run(cls, steps, capturable=False, **hyper):
    params = [torch.nn.Parameter(randn(7, 13, seed=0)), torch.nn.Parameter(randn(31, seed=1)),
              torch.nn.Parameter(randn(seed=2))]
    opt = cls(params, foreach=False, capturable=capturable, **hyper)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = randn(*p.shape, seed=100 * step + i)
        opt.step()
    return params, opt


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("cls, adam_w_mode", [(torch.optim.AdamW, True), (torch.optim.Adam, False)],
                         ids=["AdamW", "Adam"])
def test_a_torch_adam_state_dict_continues_as_torch_would(cls, adam_w_mode, capturable):
    """torch.optim's per-parameter step counts become the group's, its groups get FusedAdam's
    bias_correction, and the next step equals torch's own next step."""
    hyper = dict(lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.05)
    theirs, torch_opt = _torch_run(cls, 5, **hyper)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    saved = torch_opt.state_dict()
    before = copy.deepcopy(saved)
    opt = FusedAdam(ours, adam_w_mode=adam_w_mode, capturable=capturable, **hyper)
    opt.load_state_dict(saved)
    assert saved["param_groups"] == before["param_groups"] and "step" in saved["state"][0]  # the caller's, unchanged
    assert int(opt.param_groups[0]["step"]) == 5 and opt.param_groups[0]["bias_correction"] is True
    assert all("step" not in opt.state[p] for p in ours)
    for step in (5, 6):
        for i, (a, b) in enumerate(zip(theirs, ours)):
            a.grad = randn(*a.shape, seed=100 * step + i)
            b.grad = a.grad.clone()
        torch_opt.step()
        opt.step()
        for a, b in zip(theirs, ours):
            torch.testing.assert_close(b.detach(), a.detach(), **FP32)
    assert int(opt.param_groups[0]["step"]) == 7


@pytest.mark.parametrize("hyper, edit, message", [
    (dict(amsgrad=True), None, r"parameter group 0 was saved by torch.optim.Adam\(W\) with AMSGrad"),
    (dict(maximize=True), None, r"with maximize=True \(FusedAdam minimizes\)"),
    (dict(weight_decay=0.1), None, r"with Adam's L2 weight decay, which this FusedAdam does not apply; construct "
                                   r"FusedAdam\(adam_w_mode=False\)"),
    (dict(), lambda sd: sd["state"][1].__setitem__("step", torch.tensor(3.0)),
     r"the parameters of parameter group 0 were stepped 2, 3 times .* FusedAdam keeps one step count per group"),
])
def test_a_torch_adam_state_dict_it_cannot_continue_is_refused(hyper, edit, message):
    _, torch_opt = _torch_run(torch.optim.Adam, 2, **hyper)
    saved = torch_opt.state_dict()
    if edit is not None:
        edit(saved)
    params = [torch.nn.Parameter(torch.zeros(7, 13)), torch.nn.Parameter(torch.zeros(31)),
              torch.nn.Parameter(torch.zeros(()))]
    opt = FusedAdam(params)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved)
    assert not opt.state


def test_a_capturable_checkpoint_with_an_empty_group_loads():
    """An empty group (one rank's share of a sharded optimizer) has no parameter to put its step
    count beside: it goes where the optimizer's parameters are, and still counts."""
    param = torch.nn.Parameter(randn(4, seed=0))
    saved_opt = FusedAdam([{"params": [param]}, {"params": []}], lr=1e-2, capturable=True)
    param.grad = randn(4, seed=1)
    saved_opt.step()
    opt = FusedAdam([{"params": [torch.nn.Parameter(param.detach().clone())]}, {"params": []}], lr=1e-2,
                    capturable=True)
    opt.load_state_dict(saved_opt.state_dict())
    assert [float(g["step"]) for g in opt.param_groups] == [1, 1]
    assert all(g["step"].device == param.device for g in opt.param_groups)


def test_a_capturable_optimizer_resumes_through_distributed_checkpoint(tmp_path):
    """capturable=True makes each group's lr a float32 tensor on the parameters' device in the
    constructor and in add_param_group, as Transformer Engine does: torch's distributed
    checkpoint, which plans a load by the fresh optimizer's types, then loads a checkpoint saved
    after steps (lr a tensor there), and the resumed optimizer steps as the one that saved it."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(0)
    model, extra = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)
    opt = FusedAdam(model.parameters(), lr=1e-2, capturable=True)
    assert torch.is_tensor(opt.param_groups[0]["lr"]) and opt.param_groups[0]["lr"].dtype == torch.float32
    opt.add_param_group({"params": extra.parameters(), "lr": 5e-3})
    assert torch.is_tensor(opt.param_groups[1]["lr"]) and opt.param_groups[1]["lr"].item() == pytest.approx(5e-3)
    both = torch.nn.Sequential(model, extra)
    x = torch.randn(3, 8)
    for _ in range(2):
        both(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's: no process group, one process)
        dcp.save({"optim": get_optimizer_state_dict(both, opt)}, checkpoint_id=str(tmp_path))
        twin = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
        twin.load_state_dict(both.state_dict())
        resumed = FusedAdam(twin[0].parameters(), lr=1e-2, capturable=True)
        resumed.add_param_group({"params": twin[1].parameters(), "lr": 5e-3})
        loaded = {"optim": get_optimizer_state_dict(twin, resumed)}
        dcp.load(loaded, checkpoint_id=str(tmp_path))
        set_optimizer_state_dict(twin, resumed, loaded["optim"])
    for model_, opt_ in ((both, opt), (twin, resumed)):
        model_(x).square().sum().backward()
        opt_.step()
    for p, q in zip(both.parameters(), twin.parameters()):
        assert torch.equal(p, q)
