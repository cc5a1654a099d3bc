"""FusedAdam resuming checkpoints written elsewhere: Transformer Engine's (a master weight kept
for every parameter, a capturable step count of shape [1]), a non-capturable one resumed
capturable, and torch.optim.Adam's / AdamW's (per-parameter step counts), each continued as the
optimizer that wrote it would have, against a float64 Adam step or torch.optim itself."""
import copy
import io

import pytest
import torch

import te_core as te
from te_core.optimizers import FusedAdam
from te_core.optimizers import _scaled_states as compact
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
    saved32 = opt.state_dict()["state"][0]["master_param"]  # (saved as Transformer Engine does: a copy)
    assert torch.equal(saved32, p32.detach()) and saved32.data_ptr() != p32.data_ptr()


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


# Transformer Engine's FusedAdam checkpoint, read from its state_dict(), load_state_dict() and step():
# after a step, every parameter of a stepped group has states (those without a gradient too), each saved
# in float32 whatever it is kept in (bf16 moments converted, float16/FP8 ones unscaled), but for the
# int16 remainders of store_param_remainders (bf16 parameters with float32 master weights); with
# master_weights a "master_param" for every parameter, a float32 one's never stepped (its initial
# value). A group holds params, lr, bias_correction, betas, eps, weight_decay and step: numbers, or
# when capturable an int32 step count of shape [1] and a float32 0-dim lr on the parameters' device.
MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
SCALED = (torch.float16, torch.uint8)


def _te_options():
    options = []
    for master_weights, master_dtype, remainders in ((False, torch.float32, False), (True, torch.float32, False),
                                                     (True, torch.float32, True), (True, torch.float16, False)):
        for exp_avg_dtype in MOMENT_DTYPES:
            for exp_avg_sq_dtype in MOMENT_DTYPES:
                for capturable in (False, True):
                    for decoupled in (False, True):
                        kwargs = dict(master_weights=master_weights, master_weight_dtype=master_dtype,
                                      store_param_remainders=remainders, exp_avg_dtype=exp_avg_dtype,
                                      exp_avg_sq_dtype=exp_avg_sq_dtype, capturable=capturable,
                                      use_decoupled_grad=decoupled)
                        try:
                            FusedAdam([torch.nn.Parameter(torch.ones(1))], **kwargs)
                        except RuntimeError:
                            continue  # (one Transformer Engine refuses too: test_fused_adam_master)
                        options.append(pytest.param(kwargs, id="-".join(
                            f"{k}={str(v).replace('torch.', '')}" for k, v in kwargs.items())))
    return options


TE_OPTIONS = _te_options()


def _te_params():
    """[[float32, bf16], [float16, float32 without a gradient]]: Transformer Engine refuses float16
    and bf16 parameters in one group."""
    return [[torch.nn.Parameter(randn(4, 3, seed=0)), torch.nn.Parameter(randn(5, seed=1).bfloat16())],
            [torch.nn.Parameter(randn(2, 3, seed=2).half()), torch.nn.Parameter(randn(3, seed=3))]]


def _te_layout(groups, kwargs):
    """Transformer Engine's state dict structure after a step: {index: {state: (dtype, shape, device)}}
    and each group's keys with its step count's and lr's (type, dtype, shape, device)."""
    state, index = {}, 0
    names = ("exp_avg", "exp_avg_sq") + (("master_param",) if kwargs["master_weights"] else ())
    for group in groups:
        for p in group:
            remainders = kwargs["store_param_remainders"] and p.dtype == torch.bfloat16
            state[index] = {name: (torch.int16 if name == "master_param" and remainders else torch.float32,
                                   tuple(p.shape), p.device) for name in names}
            index += 1
    if kwargs["capturable"]:
        step, lr = (torch.Tensor, torch.int32, (1,), groups[0][0].device), (torch.Tensor, torch.float32, (),
                                                                           groups[0][0].device)
    else:
        step, lr = (int,), (float,)
    keys = {"params", "lr", "bias_correction", "betas", "eps", "weight_decay", "step"}
    return state, [(keys, step, lr)] * len(groups)


def _layout(saved):
    def kind(v):
        return (torch.Tensor, v.dtype, tuple(v.shape), v.device) if torch.is_tensor(v) else (type(v),)

    state = {i: {name: (v.dtype, tuple(v.shape), v.device) for name, v in s.items()} for i, s in saved["state"].items()}
    return state, [(set(g), kind(g["step"]), kind(g["lr"])) for g in saved["param_groups"]]


def _te_checkpoint(opt, initial):
    """The state dict Transformer Engine's FusedAdam with the same states would save: each state its
    float32 value (remainders as they are), a float32 parameter's master weight its initial value."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state = {}
    for i, p in enumerate(params):
        state[i] = {name: opt.get_unscaled_state(p, name).clone() for name in ("exp_avg", "exp_avg_sq")}
        if opt.master_weights:
            kept = "master_param" in opt.state[p]
            state[i]["master_param"] = opt.get_unscaled_state(p, "master_param").clone() if kept else initial[i]
    groups, start = [], 0
    for group in opt.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = list(range(start, start + len(group["params"])))
        start += len(group["params"])
        if opt.capturable:
            device = group["params"][0].device
            saved["step"] = torch.tensor([int(group["step"])], dtype=torch.int, device=device)
            saved["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def _give_grads(groups, seed, decoupled):
    grads = []
    for i, p in enumerate(p for group in groups for p in group):
        g = None if i == 3 else randn(*p.shape, seed=seed + i).to(p.dtype)  # (the last one gets none)
        setattr(p, "decoupled_grad" if decoupled else "grad", g)
        grads.append(g)
    return grads


def _working(opt, p):
    """(float32 value the step updates, exp_avg, exp_avg_sq) of `p`, as float32."""
    state = opt.state[p]
    master = state.get("master_param")
    if master is None:
        target = p.detach().float().clone()
    elif master.dtype == torch.int16:
        target = compact.join(p.detach(), master)
    else:
        target = opt.get_unscaled_state(p, "master_param")
    return target.clone(), *(opt.get_unscaled_state(p, name).clone() for name in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("kwargs", TE_OPTIONS)
def test_checkpoints_are_transformer_engines_and_resume_from_its(kwargs):
    """te-core's state dict has Transformer Engine's structure for every combination of its options, and
    one built as Transformer Engine's code builds it loads into te-core and continues as the optimizer that
    wrote it (bit for bit where every state is kept unscaled; float16 and FP8 states are scaled again on
    load, as Transformer Engine does), each step a float64 Adam step of the loaded values."""
    hyper = dict(lr=1e-3, betas=BETAS, eps=EPS, weight_decay=0.01)
    decoupled = kwargs["use_decoupled_grad"]
    groups = _te_params()
    initial = [p.detach().float().clone() for group in groups for p in group]
    opt = FusedAdam([{"params": g} for g in groups], **hyper, **kwargs)
    for step in range(3):
        _give_grads(groups, 10 * step, decoupled)
        opt.step()
    expected = _te_layout(groups, kwargs)
    assert _layout(opt.state_dict()) == expected
    buffer = io.BytesIO()
    torch.save(_te_checkpoint(opt, initial), buffer)
    buffer.seek(0)
    te_saved = torch.load(buffer, weights_only=True)
    twins = [[torch.nn.Parameter(p.detach().clone()) for p in group] for group in groups]
    resumed = FusedAdam([{"params": g} for g in twins], **hyper, **kwargs)
    resumed.load_state_dict(te_saved)
    assert _layout(resumed.state_dict()) == expected
    flat, flat_twins = [p for g in groups for p in g], [p for g in twins for p in g]
    before = [_working(resumed, p) for p in flat_twins]
    grads = _give_grads(groups, 100, decoupled)
    _give_grads(twins, 100, decoupled)
    opt.step()
    resumed.step()
    exact = not {kwargs["exp_avg_dtype"], kwargs["exp_avg_sq_dtype"]} & set(SCALED) and not (
        kwargs["master_weights"] and kwargs["master_weight_dtype"] == torch.float16)
    for p, q, g, (target, m, v) in zip(flat, flat_twins, grads, before):
        if exact:
            assert torch.equal(q, p)
            for name, value in opt.state[p].items():
                assert torch.equal(resumed.state[q][name], value), name
        else:
            torch.testing.assert_close(q.detach().float(), p.detach().float(), rtol=0, atol=2 * hyper["lr"] * 0.125)
        want = target.double() if g is None else adamw64(target, g, m, v, 4, hyper["lr"], hyper["weight_decay"])
        got = _working(resumed, q)[0]
        tol = FP32 if got.dtype == torch.float32 and "master_param" in resumed.state[q] or q.dtype == torch.float32 \
            else dict(rtol=1.6e-2, atol=1e-5)
        if q.dtype != torch.float32 and "master_param" not in resumed.state[q]:
            want = want.to(q.dtype).double()  # (stepped in place: rounded to the parameter's dtype)
        if kwargs["master_weights"] and kwargs["master_weight_dtype"] == torch.float16 and q.dtype != torch.float32:
            tol = dict(rtol=2e-3, atol=1e-5)  # (the float16 master, scaled again on load)
        torch.testing.assert_close(got.double(), want, **tol)


def _checkpoint_of(**kwargs):
    params = [torch.nn.Parameter(randn(4, 3, seed=0).bfloat16()), torch.nn.Parameter(randn(5, seed=1).bfloat16())]
    opt = FusedAdam(params, lr=1e-3, **kwargs)
    for i, p in enumerate(params):
        p.grad = randn(*p.shape, seed=5 + i).bfloat16()
    opt.step()
    return params, copy.deepcopy(opt.state_dict())


@pytest.mark.parametrize("saved_with, loaded_with, edit, message", [
    (dict(master_weights=True), dict(master_weights=True), lambda sd: sd["state"][1].pop("master_param"),
     r"the state of parameter 1 \('b'\) \(shape \(5,\), torch.bfloat16\) lacks master_param, its master weight, "
     r"which the checkpoint holds for other parameters.*state_dict\['state'\]\[1\]\['master_param'\] = "),
    (dict(master_weights=True), dict(master_weights=True),
     lambda sd: sd["state"][0].__setitem__("exp_avg", torch.zeros(3, 4)),
     r"state exp_avg of parameter 0 \('a'\) has shape \(3, 4\) but the parameter has \(4, 3\)"),
    (dict(master_weights=True, store_param_remainders=True), dict(master_weights=True), None,
     r"parameter 0 \('a'\) .* holds master_param as int16 remainders \(saved with store_param_remainders=True\) "
     r"but this optimizer keeps a float32 master weight for it; construct FusedAdam\(master_weights=True, "
     r"store_param_remainders=True\)"),
    (dict(master_weights=True), dict(master_weights=True, store_param_remainders=True), None,
     r"parameter 0 \('a'\) .* holds a torch.float32 master weight but this optimizer keeps the int16 remainders "
     r"of store_param_remainders=True for it; construct FusedAdam with store_param_remainders=False"),
    (dict(), dict(), lambda sd: sd["state"][1].__setitem__("exp_avg_sq", torch.zeros(5, dtype=torch.int32)),
     r"parameter 1 \('b'\) .* holds exp_avg_sq as a torch.int32 tensor; a moment is a floating-point tensor"),
])
def test_a_state_dict_that_cannot_load_is_refused_naming_the_parameter(saved_with, loaded_with, edit, message):
    """Nothing loads, rather than a master weight restarting from its rounded parameter (one missing
    from a checkpoint that holds the others), int16 remainders read as float values, or a shape or
    dtype that fails later; the error names the parameter."""
    params, saved = _checkpoint_of(**saved_with)
    if edit is not None:
        edit(saved)
    opt = FusedAdam([("a", torch.nn.Parameter(params[0].detach().clone())),
                     ("b", torch.nn.Parameter(params[1].detach().clone()))], lr=1e-3, **loaded_with)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved)
    assert not opt.state


def test_bf16_moments_are_saved_in_float32_and_reload_bit_for_bit():
    """Transformer Engine saves bf16 moments converted to float32; they reload into bf16 exactly."""
    params, saved = _checkpoint_of(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for state in saved["state"].values():
        assert {v.dtype for v in state.values()} == {torch.float32}
    opt = FusedAdam(params, lr=1e-3, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    opt.load_state_dict(saved)
    for i, p in enumerate(params):
        for name in ("exp_avg", "exp_avg_sq"):
            assert opt.state[p][name].dtype == torch.bfloat16
            assert torch.equal(opt.state[p][name].float(), saved["state"][i][name])
