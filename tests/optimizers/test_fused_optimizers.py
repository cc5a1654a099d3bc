"""te.optimizers.FusedAdam / FusedSGD against torch.optim on fresh random parameters."""
import pytest
import torch

import te_core as te
from te_core.optimizers import FusedAdam, FusedSGD

FP32 = dict(rtol=1.3e-6, atol=1e-5)
SHAPES = [(7, 13), (31,), (3, 5, 2)]


def fresh(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def run(opt_params, opt, steps=4, seed=1, decoupled=False):
    """`steps` steps with the same random gradients for every optimizer given the same seed."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in opt_params:
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            if decoupled:
                p.decoupled_grad = grad
            else:
                p.grad = grad
        opt.step()


def groups(params, lrs=(1e-2, 3e-2)):
    return [{"params": params[:2], "lr": lrs[0]}, {"params": params[2:], "lr": lrs[1]}]


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_torch(adam_w_mode, capturable):
    ours, theirs = fresh(), fresh()
    hyper = dict(betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    run(ours, FusedAdam(groups(ours), adam_w_mode=adam_w_mode, capturable=capturable, **hyper))
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    run(theirs, cls(groups(theirs), foreach=False, **hyper))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **FP32)
    assert not torch.equal(ours[0], fresh()[0])


@pytest.mark.parametrize("capturable", [False, True])
def test_fused_adam_master_weights_keep_float32_copies(capturable):
    """bf16 parameters, float32 master copies stepped as torch.optim.AdamW steps float32 ones."""
    ours = fresh(torch.bfloat16)
    opt = FusedAdam(ours, lr=1e-3, weight_decay=0.01, master_weights=True, capturable=capturable)
    run(ours, opt)
    theirs = [p.detach().float().requires_grad_() for p in fresh(torch.bfloat16)]
    ref = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.01, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for p in theirs:
            p.grad = torch.randn(p.shape, generator=g).bfloat16().float()
        ref.step()
    for p, want in zip(ours, theirs):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(master, want, **FP32)
        assert torch.equal(p, master.bfloat16())


def test_fused_adam_without_bias_correction():
    (p,) = fresh()[:1]
    p0 = p.detach().clone()
    opt = FusedAdam([p], lr=0.1, betas=(0.8, 0.9), eps=1e-6, bias_correction=False)
    grad = torch.randn(p.shape)
    p.grad = grad
    opt.step()
    g64 = grad.double()
    m, v = 0.2 * g64, 0.1 * g64 * g64
    torch.testing.assert_close(p.double(), p0.double() - 0.1 * m / (v.sqrt() + 1e-6), **FP32)


def test_fused_adam_decoupled_grad_and_zero_grad():
    ours, theirs = fresh(), fresh()
    opt = FusedAdam(ours, lr=1e-2, use_decoupled_grad=True)
    run(ours, opt, decoupled=True)
    run(theirs, torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.0, foreach=False))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **FP32)
    opt.zero_grad(set_to_none=False)
    assert all(p.decoupled_grad is not None and not p.decoupled_grad.any() for p in ours)
    opt.zero_grad()
    assert all(p.decoupled_grad is None for p in ours)


def test_fused_adam_rejects_amsgrad_and_unknown_state_dtypes():
    with pytest.raises(NotImplementedError, match="amsgrad"):
        FusedAdam(fresh(), amsgrad=True)
    for kwargs, name in ((dict(exp_avg_dtype=torch.float64), "exp_avg_dtype"),
                         (dict(exp_avg_sq_dtype=torch.int8), "exp_avg_sq_dtype"),
                         (dict(master_weights=True, master_weight_dtype=torch.bfloat16), "master_weight_dtype")):
        with pytest.raises(ValueError, match=f"{name} must be one of"):
            FusedAdam(fresh(), **kwargs)
    with pytest.raises(ValueError, match="needs exp_avg_dtype and exp_avg_sq_dtype alike and unscaled"):
        FusedAdam(fresh(), capturable=True, exp_avg_dtype=torch.float16, exp_avg_sq_dtype=torch.float16)
    for kwargs in (dict(master_weight_dtype=torch.float16), dict(store_param_remainders=True)):
        with pytest.raises(ValueError, match="capturable=True keeps float32 master weights"):
            FusedAdam(fresh(torch.bfloat16), capturable=True, master_weights=True, **kwargs)


def test_fused_adam_capturable_needs_alike_moment_dtypes():
    with pytest.raises(ValueError, match="capturable=True needs exp_avg_dtype and exp_avg_sq_dtype alike"):
        FusedAdam(fresh(), capturable=True, exp_avg_dtype=torch.bfloat16)


def test_fused_adam_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="betas"):
        FusedAdam(fresh(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr must be >= 0.0, got -1.0"):
        FusedAdam(fresh(), lr=-1.0)


@pytest.mark.parametrize("hyper", [
    dict(), dict(momentum=0.9), dict(momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(momentum=0.8, nesterov=True, weight_decay=0.02),
])
def test_fused_sgd_matches_torch(hyper):
    ours, theirs = fresh(), fresh()
    run(ours, FusedSGD(groups(ours), lr=0.05, **hyper))
    run(theirs, torch.optim.SGD(groups(theirs), lr=0.05, foreach=False, **hyper))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **FP32)


def test_fused_sgd_weight_decay_after_momentum():
    (p,) = fresh()[:1]
    p64 = p.detach().double()
    opt = FusedSGD([p], lr=0.1, momentum=0.9, weight_decay=0.1, wd_after_momentum=True)
    g = torch.Generator().manual_seed(5)
    buf = None
    for _ in range(3):
        grad = torch.randn(p.shape, generator=g)
        p.grad = grad
        opt.step()
        buf = grad.double() if buf is None else 0.9 * buf + grad.double()
        p64 = p64 - 0.1 * (buf + 0.1 * p64)
    torch.testing.assert_close(p.double(), p64, **FP32)


def test_fused_sgd_checks_its_arguments():
    with pytest.raises(ValueError, match="nesterov"):
        FusedSGD(fresh(), lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match="materialize_master_grads must be a bool"):
        FusedSGD(fresh(), lr=0.1, materialize_master_grads="no")
    with pytest.warns(DeprecationWarning, match="set_grad_none"):
        opt = FusedSGD(fresh(), lr=0.1, set_grad_none=False)
    with pytest.raises(ValueError, match="contradicts"):
        opt.zero_grad(set_to_none=True)


def test_exported_as_te_optimizers():
    assert te.optimizers.FusedAdam is FusedAdam and te.optimizers.FusedSGD is FusedSGD


def test_te_import_path_resolves_with_the_stand_in():
    import importlib.util
    import sys

    from te_core.compat.transformer_engine import uninstall_transformer_engine

    if "transformer_engine" not in sys.modules and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("a real transformer_engine is installed here")
    uninstall_transformer_engine()
    te.install_as_transformer_engine()
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam as TEFusedAdam
        import transformer_engine.pytorch as te_pytorch

        assert TEFusedAdam is FusedAdam and te_pytorch.optimizers.FusedSGD is FusedSGD
    finally:
        uninstall_transformer_engine()
    assert "transformer_engine.pytorch.optimizers" not in sys.modules


@pytest.mark.parametrize("make", [lambda ps: FusedAdam(ps, lr=1e-2), lambda ps: FusedSGD(ps, lr=0.1)])
def test_step_with_a_closure_returns_its_loss(make):
    params = fresh()
    opt = make(params)

    def closure():
        opt.zero_grad()
        loss = sum((p * p).sum() for p in params)
        loss.backward()
        return loss

    before = closure().item()
    loss = opt.step(closure)
    assert loss.item() == pytest.approx(before) and sum((p * p).sum() for p in params).item() < before


@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(groups(ps), master_weights=True, weight_decay=0.01),
    lambda ps: FusedAdam(groups(ps), weight_decay=0.01),
    lambda ps: FusedAdam(groups(ps), master_weights=True, capturable=True),
    lambda ps: FusedAdam(groups(ps), master_weights=True, exp_avg_dtype=torch.bfloat16,
                         exp_avg_sq_dtype=torch.bfloat16),
    lambda ps: FusedSGD(groups(ps), momentum=0.9, nesterov=True),
], ids=["adam-master-weights", "adam", "adam-capturable", "adam-bf16-moments", "sgd-momentum"])
def test_a_resumed_optimizer_keeps_float32_states_and_steps_as_the_original(make):
    """torch's load_state_dict casts states to their bf16 parameters' dtype: a resumed optimizer
    must keep the float32 master weights, moments and momentum it saved (the bf16 moments it was
    asked for), and step bit for bit as the one that never stopped."""
    import io

    params = fresh(torch.bfloat16)
    original = make(params)
    run(params, original, steps=2)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    resumed_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = make(resumed_params)
    resumed.load_state_dict(torch.load(buffer))
    for p, q in zip(params, resumed_params):
        saved, loaded = original.state[p], resumed.state[q]
        assert saved.keys() == loaded.keys() and saved
        for name, value in saved.items():
            if torch.is_tensor(value) and value.is_floating_point() and value.dim():
                kept = original.state_dtype(name)  # float32, or the bf16 asked for the moments
                assert value.dtype == kept and loaded[name].dtype == kept and torch.equal(loaded[name], value), name
    run(params, original, steps=2, seed=3)
    run(resumed_params, resumed, steps=2, seed=3)
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)
        for name, value in original.state[p].items():
            if torch.is_tensor(value):
                assert torch.equal(resumed.state[q][name], value), name


def test_a_capturable_optimizers_step_and_lr_reload_in_the_form_each_optimizer_steps_with():
    """A capturable FusedAdam keeps its step count as an int32 tensor of shape [1] and its lr as a
    float32 tensor on the parameters' device, as Transformer Engine's: a checkpoint's (here float64,
    as a loader might hand them over) come back so, and a non-capturable FusedAdam resuming the same
    checkpoint gets plain numbers."""
    import io

    params = fresh()
    original = FusedAdam(params, lr=1e-2, capturable=True)
    run(params, original, steps=2)
    saved = original.state_dict()
    for group in saved["param_groups"]:
        group["step"], group["lr"] = group["step"].double(), group["lr"].double()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    twin_params = [p.detach().clone().requires_grad_() for p in params]
    resumed = FusedAdam(twin_params, lr=1e-2, capturable=True)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer))
    group = resumed.param_groups[0]
    for key, value, dtype, shape in (("step", 2, torch.int32, (1,)), ("lr", 1e-2, torch.float32, ())):
        assert group[key].dtype == dtype and group[key].device == twin_params[0].device
        assert group[key].shape == shape and group[key].item() == pytest.approx(value)
    run(params, original, steps=2, seed=3)
    run(twin_params, resumed, steps=2, seed=3)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)
    plain_params = [p.detach().clone().requires_grad_() for p in params]
    plain = FusedAdam(plain_params, lr=1e-2)
    buffer.seek(0)
    plain.load_state_dict(torch.load(buffer))
    assert plain.param_groups[0]["step"] == 2 and type(plain.param_groups[0]["step"]) is int
    assert type(plain.param_groups[0]["lr"]) is float
    run(plain_params, plain, steps=1, seed=5)
    assert plain.param_groups[0]["step"] == 3


def test_fused_sgd_materialize_master_grads_steps_alike():
    """materialize_master_grads (Transformer Engine's; it only matters with apex amp's master
    parameters) is kept, and either value steps bit for bit as the other."""
    ours, theirs = fresh(), fresh()
    kept = FusedSGD(ours, lr=0.1, momentum=0.9, materialize_master_grads=False)
    run(ours, kept)
    run(theirs, FusedSGD(theirs, lr=0.1, momentum=0.9))
    assert kept.materialize_master_grads is False
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


NAN = float("nan")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(lr=NAN), ValueError, r"FusedAdam: lr must be >= 0.0, got nan"),
    (dict(eps=NAN), ValueError, r"FusedAdam: eps must be >= 0.0, got nan"),
    (dict(eps=-1e-8), ValueError, r"FusedAdam: eps must be >= 0.0, got -1e-08"),
    (dict(weight_decay=NAN), ValueError, r"FusedAdam: weight_decay must be >= 0.0, got nan"),
    (dict(betas=(NAN, 0.9)), ValueError, r"FusedAdam: betas\[0\] must be >= 0.0 and < 1.0, got nan"),
    (dict(betas=(0.9, -0.1)), ValueError, r"FusedAdam: betas\[1\] must be >= 0.0 and < 1.0, got -0.1"),
    (dict(betas=0.9), ValueError, r"FusedAdam: betas must be a pair \(beta1, beta2\) in \[0, 1\), got 0.9"),
    (dict(betas=(0.9, 0.99, 0.999)), ValueError, r"betas must be a pair"),
    (dict(lr="0.1"), TypeError, r"FusedAdam: lr must be a real number, got str '0.1'"),
])
def test_fused_adam_names_the_bad_hyperparameter(kwargs, error, message):
    with pytest.raises(error, match=message):
        FusedAdam(fresh(), **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(lr=NAN), ValueError, r"FusedSGD: lr must be >= 0.0, got nan"),
    (dict(lr=0.1, momentum=NAN), ValueError, r"FusedSGD: momentum must be >= 0.0, got nan"),
    (dict(lr=0.1, weight_decay=NAN), ValueError, r"FusedSGD: weight_decay must be >= 0.0, got nan"),
    (dict(lr=0.1, dampening=NAN), ValueError, r"FusedSGD: dampening must be a number, got nan"),
    (dict(lr="a"), TypeError, r"FusedSGD: lr must be a real number, got str 'a'"),
])
def test_fused_sgd_names_the_bad_hyperparameter(kwargs, error, message):
    with pytest.raises(error, match=message):
        FusedSGD(fresh(), **kwargs)


@pytest.mark.parametrize("make", [lambda ps: FusedAdam(ps), lambda ps: FusedSGD(ps, lr=0.1)])
def test_parameter_group_hyperparameters_are_checked_as_the_constructors(make):
    """torch.optim takes any value in a group dict or add_param_group; these are checked alike."""
    params = fresh()
    name = "FusedAdam" if isinstance(make(fresh()), FusedAdam) else "FusedSGD"
    with pytest.raises(ValueError, match=rf"{name}: lr \(parameter group 1\) must be >= 0.0, got -1.0"):
        make([{"params": params[:1]}, {"params": params[1:], "lr": -1.0}])
    opt = make(params[:1])
    with pytest.raises(ValueError, match=rf"{name}: weight_decay \(parameter group 1\) must be >= 0.0, got nan"):
        opt.add_param_group({"params": params[1:], "weight_decay": NAN})
    assert len(opt.param_groups) == 1  # nothing half-added
    if name == "FusedAdam":
        with pytest.raises(ValueError, match=r"betas\[0\] \(parameter group 1\) must be >= 0.0 and < 1.0, got 1.5"):
            opt.add_param_group({"params": params[1:], "betas": (1.5, 0.9)})
    opt.add_param_group({"params": params[1:], "lr": 0.5})  # a valid group still goes in
    assert opt.param_groups[1]["lr"] == 0.5


@pytest.mark.parametrize("make", [lambda ps: FusedAdam(ps), lambda ps: FusedSGD(ps, lr=0.1)])
def test_a_parameter_listed_twice_is_refused(make):
    """Each occurrence would be stepped: two updates per step (torch only warns)."""
    params = fresh()
    with pytest.raises(ValueError, match=r"parameter group 0 holds a parameter \(shape \(7, 13\)\) more than once"):
        make([params[0], params[1], params[0]])


def _saved(make, seed=0):
    params = fresh(seed=seed)
    opt = make(params)
    run(params, opt, steps=2)
    return opt.state_dict()


ADAM, SGD = (lambda ps: FusedAdam(ps, lr=1e-2)), (lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9))


@pytest.mark.parametrize("make, edit, message", [
    (ADAM, lambda sd: sd["state"][1].__setitem__("exp_avg", torch.zeros(5)),
     r"FusedAdam.load_state_dict: state exp_avg of parameter 1 has shape \(5,\) but the parameter has \(31,\)"),
    (ADAM, lambda sd: sd["state"][0].pop("exp_avg_sq"),
     r"FusedAdam.load_state_dict: the state of parameter 0 lacks exp_avg_sq"),
    (ADAM, lambda sd: sd["state"].__setitem__(0, {"momentum_buffer": torch.zeros(7, 13)}),
     r"parameter 0 holds momentum_buffer, which FusedAdam does not keep.*another optimizer"),
    (SGD, lambda sd: sd["state"][2].__setitem__("momentum_buffer", torch.zeros(3, 5)),
     r"FusedSGD.load_state_dict: state momentum_buffer of parameter 2 has shape \(3, 5\) but the parameter has "
     r"\(3, 5, 2\)"),
    (SGD, lambda sd: sd["state"].__setitem__(0, {"exp_avg": torch.zeros(7, 13), "exp_avg_sq": torch.zeros(7, 13)}),
     r"parameter 0 holds exp_avg, exp_avg_sq, which FusedSGD does not keep"),
    (ADAM, lambda sd: sd.pop("param_groups"),
     r"FusedAdam.load_state_dict: expected an optimizer state dict \(keys 'state' and 'param_groups'"),
])
def test_a_mismatched_optimizer_state_is_refused_before_anything_loads(make, edit, message):
    """torch loads these and fails at the next step with a KeyError or a shape error, or not at all."""
    saved = _saved(make)
    edit(saved)
    params = fresh(seed=3)
    opt = make(params)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(saved)
    assert not opt.state  # nothing loaded


def test_a_model_state_dict_given_to_the_optimizer_is_named():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"got \['bias', 'weight'\]; a model's state dict goes to "
                                         r"model.load_state_dict"):
        FusedAdam(model.parameters()).load_state_dict(model.state_dict())


def test_torch_adam_state_dict_loads_into_fused_adam():
    """torch.optim.Adam's per-parameter 'step' is accepted (valid checkpoints keep loading)."""
    params = fresh()
    torch_adam = torch.optim.Adam(params, lr=1e-2)
    run(params, torch_adam, steps=1)
    opt = FusedAdam(fresh(seed=4), lr=1e-2)
    opt.load_state_dict(torch_adam.state_dict())
    assert torch.equal(opt.state[opt.param_groups[0]["params"][0]]["exp_avg"],
                       torch_adam.state[params[0]]["exp_avg"])


@pytest.mark.parametrize("make", [lambda ps: FusedAdam(ps, lr=1e-2), lambda ps: FusedAdam(ps, lr=1e-2, capturable=True),
                                  lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9)], ids=["adam", "capturable", "sgd"])
def test_an_optimizer_loaded_from_a_live_state_dict_owns_its_states(make):
    """Loaded from another optimizer's state_dict in the same process, each keeps states of its
    own (Transformer Engine's FusedAdam copies them): stepping one leaves the other alone, and
    the same step on both gives the same parameters."""
    first_params = fresh()
    first = make(first_params)
    run(first_params, first, steps=2)
    second_params = [torch.nn.Parameter(p.detach().clone()) for p in first_params]
    second = make(second_params)
    second.load_state_dict(first.state_dict())
    for p, q in zip(first_params, second_params):
        for name, value in first.state[p].items():
            if torch.is_tensor(value) and value.numel() > 1:
                assert value.data_ptr() != second.state[q][name].data_ptr(), name
    run(first_params, first, steps=1, seed=5)
    run(second_params, second, steps=1, seed=5)
    for p, q in zip(first_params, second_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("capturable", [False, True])
def test_every_param_group_counts_the_step(capturable):
    """An empty group, and one whose parameters got no gradient, advance "step" with the others
    (Transformer Engine's rule: "step" is checkpointed per group, and a group can be empty on one
    data-parallel rank only); the stepped group's update equals torch's AdamW."""
    torch.manual_seed(0)
    stepped, idle = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(4))
    reference = torch.nn.Parameter(stepped.detach().clone())
    opt = FusedAdam([{"params": [stepped]}, {"params": []}, {"params": [idle]}], lr=1e-2, weight_decay=0.01,
                    capturable=capturable)
    torch_opt = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.01)
    idle_before = idle.detach().clone()
    for _ in range(3):
        grad = torch.randn(8)
        stepped.grad, reference.grad = grad.clone(), grad.clone()
        opt.step()
        torch_opt.step()
    assert [int(g["step"]) for g in opt.param_groups] == [3, 3, 3]
    assert [int(g["step"]) for g in opt.state_dict()["param_groups"]] == [3, 3, 3]
    assert torch.equal(idle.detach(), idle_before)
    torch.testing.assert_close(stepped.detach(), reference.detach(), rtol=1.3e-6, atol=1e-5)
