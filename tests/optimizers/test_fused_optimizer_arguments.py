"""FusedAdam's and FusedSGD's hyperparameters given as one-element tensors of any shape (they
step as the numbers do, against torch.optim given numbers), and the parameter dtypes they step:
float64 ones are refused, as Transformer Engine refuses them, at construction, in
add_param_group and at a step after the model was converted."""
import pytest
import torch

from te_core.optimizers import FusedAdam, FusedSGD

FP32 = dict(rtol=1.3e-6, atol=1e-5)
SHAPES = [(7, 13), (31,), ()]


def fresh(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def run(pairs, steps=3, seed=1):
    """`steps` steps of each (params, optimizer) with the same random gradients."""
    for step in range(steps):
        for params, opt in pairs:
            g = torch.Generator().manual_seed(seed + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()


def one_element(shape):
    return lambda value: torch.full(shape, value)


TENSOR_SHAPES = pytest.mark.parametrize("as_tensor", [one_element((1,)), one_element(()), one_element((1, 1))],
                                        ids=["shape [1]", "0-dim", "shape [1, 1]"])


@TENSOR_SHAPES
@pytest.mark.parametrize("capturable", [False, True])
def test_fused_adam_takes_one_element_tensor_hyperparameters(as_tensor, capturable):
    ours, theirs = fresh(), fresh()
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    tensors = dict(lr=as_tensor(0.01), betas=(as_tensor(0.9), 0.99), eps=1e-8, weight_decay=as_tensor(0.05))
    opt = FusedAdam(ours, capturable=capturable, **tensors)
    run([(ours, opt), (theirs, torch.optim.AdamW(theirs, foreach=False, **hyper))])
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        torch.testing.assert_close(a.detach(), b.detach(), **FP32)
    assert not torch.equal(ours[0], fresh()[0])


@TENSOR_SHAPES
@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_takes_one_element_tensor_hyperparameters(as_tensor, nesterov):
    ours, theirs = fresh(), fresh()
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.05, nesterov=nesterov)
    tensors = dict(hyper, lr=as_tensor(0.1), momentum=as_tensor(0.9), weight_decay=as_tensor(0.05))
    if not nesterov:
        hyper["dampening"], tensors["dampening"] = 0.1, as_tensor(0.1)
    run([(ours, FusedSGD(ours, **tensors)), (theirs, torch.optim.SGD(theirs, foreach=False, **hyper))])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), **FP32)


def test_a_tensor_hyperparameter_set_after_construction_steps_too():
    """An LR scheduler, or a user, may put a shape-[1] tensor into a group later."""
    ours, theirs = fresh(), fresh()
    adam, ref = FusedAdam(ours, lr=0.02), torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.0, foreach=False)
    adam.param_groups[0]["lr"] = torch.tensor([0.01])
    run([(ours, adam), (theirs, ref)])
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.detach(), b.detach(), **FP32)


MAKERS = pytest.mark.parametrize("make, instead", [
    (lambda ps: FusedAdam(ps, lr=1e-3), "torch.optim.AdamW"),
    (lambda ps: FusedSGD(ps, lr=0.1), "torch.optim.SGD"),
], ids=["FusedAdam", "FusedSGD"])


def _refusal(instead):
    name = "FusedAdam" if "AdamW" in instead else "FusedSGD"
    return (rf"{name}: a parameter of parameter group 0 \(shape \(3,\)\) is torch.float64; {name} steps "
            rf"torch.float32, torch.float16 and torch.bfloat16 parameters only.*{instead}")


@MAKERS
def test_float64_parameters_are_refused_at_construction(make, instead):
    """Stepped in float32 they lost updates a float64 optimizer keeps (lr 1e-9 moved nothing)."""
    float64 = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match=_refusal(instead)) as caught:
        make([float64])
    assert isinstance(caught.value, RuntimeError)  # what Transformer Engine's FusedAdam raises
    opt = make(fresh())
    with pytest.raises(TypeError, match=_refusal(instead).replace("group 0", "group 1")):
        opt.add_param_group({"params": [float64]})
    assert len(opt.param_groups) == 1
    integer = torch.nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)
    make([*fresh(), integer])  # (no gradient can reach it: never stepped, so not refused)


@MAKERS
def test_a_model_converted_to_float64_after_construction_is_refused_at_the_step(make, instead):
    model = torch.nn.Linear(3, 3)
    opt = make(model.parameters())
    model.double()
    model(torch.ones(2, 3, dtype=torch.float64)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=rf"is torch.float64; .*{instead}"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_parameters_are_still_taken(dtype):
    params = fresh(dtype=dtype)
    start = [p.detach().clone() for p in params]
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    run([(params, opt)], steps=1)
    assert all(not torch.equal(p, s) for p, s in zip(params, start))


@pytest.mark.parametrize("make", [lambda ps: FusedAdam(ps, lr=1e-2), lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9)],
                         ids=["FusedAdam", "FusedSGD"])
@pytest.mark.parametrize("form", ["generator group", "added generator group", "named", "named group"])
def test_parameter_groups_of_every_form_torch_takes_train(make, form):
    """Parameters given as a generator inside a group dict (model.parameters(), read once: the
    group ended up empty and never trained) or as named parameters (model.named_parameters(),
    which raised) train as with torch.optim: every parameter in its group, and changed by a step."""
    torch.manual_seed(0)
    model, extra = torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)
    if form == "generator group":
        opt = make([{"params": model.parameters()}])
    elif form == "added generator group":
        opt = make([{"params": extra.parameters()}])
        opt.add_param_group({"params": model.parameters()})
    elif form == "named":
        opt = make(model.named_parameters())
    else:
        opt = make([{"params": model.named_parameters()}])
    assert sum(len(g["params"]) for g in opt.param_groups) == (4 if form == "added generator group" else 2)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    for b, p in zip(before, model.parameters()):
        assert not torch.equal(b, p)
