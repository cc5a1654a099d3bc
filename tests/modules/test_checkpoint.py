"""te.checkpoint: gradients and the FP8 scaling state are exactly those of the same model run
without recompute, for several steps (delayed scaling, whose scales change between forward
and recompute, and current scaling)."""

import copy

import pytest
import torch

import te_core
import te_core.modules as tm
from te_core import recipe
from te_core.quantization import autocast


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = tm.LayerNormMLP(32, 64)
        self.proj = tm.Linear(32, 32)

    def forward(self, x):
        return self.proj(self.mlp(x))


def _torch_checkpoint(model, x):
    return torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False, context_fn=te_core.checkpoint_context)


def run(model, x, rec, use_checkpoint, steps=3, checkpoint_fn=None):
    grads = []
    for i in range(steps):
        model.zero_grad()
        with autocast(recipe=rec):
            xi = (x * (i + 1)).requires_grad_(True)  # amaxes change each step
            y = (checkpoint_fn or tm.checkpoint)(model, xi) if use_checkpoint else model(xi)
        y.pow(2).sum().backward()
        grads.append([xi.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    return grads


def states(model):
    return [m.quantization_state() for m in model.modules() if hasattr(m, "quantization_state")]


@pytest.mark.parametrize(
    "rec", [recipe.DelayedScaling(amax_history_len=3), recipe.Float8CurrentScaling()], ids=["delayed", "current"]
)
@pytest.mark.parametrize("checkpoint_fn", [None, _torch_checkpoint], ids=["te.checkpoint", "torch-context_fn"])
def test_checkpoint_reproduces_fp8_exactly(rec, checkpoint_fn):
    """te.checkpoint, and torch.utils.checkpoint given te_core.checkpoint_context, recompute
    with the forward's FP8 state: gradients and scaling state equal a run without recompute."""
    torch.manual_seed(0)
    plain = Block()
    ckpt = copy.deepcopy(plain)
    x = torch.randn(32, 32)
    ref = run(plain, x, rec, use_checkpoint=False)
    got = run(ckpt, x, rec, use_checkpoint=True, checkpoint_fn=checkpoint_fn)
    for step, (a, e) in enumerate(zip(got, ref)):
        for i, (ga, ge) in enumerate(zip(a, e)):
            torch.testing.assert_close(ga, ge, rtol=0, atol=0, msg=lambda m: f"step {step} grad {i}: {m}")
    for sa, se in zip(states(ckpt), states(plain)):
        for direction in ("forward", "backward"):
            for slot, entry in se[direction].items():
                for key, t in entry.items():
                    torch.testing.assert_close(sa[direction][slot][key], t, rtol=0, atol=0)


def _user_contexts(entered):
    """A torch.utils.checkpoint context_fn recording which phase it was entered in."""
    import contextlib

    @contextlib.contextmanager
    def phase(name):
        entered.append(name)
        yield

    return lambda: (phase("forward"), phase("recompute"))


def _te_checkpoint_with_user_contexts(entered):
    return lambda model, x: tm.checkpoint(model, x, context_fn=_user_contexts(entered))


def _te_checkpoint_positionally(model, x):
    """Transformer Engine's older form: distribute_saved_activations, get_rng_state_tracker and
    tp_group before the tensors."""
    tracker = te_core.distributed.RNGStatesTracker()
    with pytest.warns(DeprecationWarning, match="positionally is deprecated"):
        return tm.checkpoint(model, False, lambda: tracker, None, x)


@pytest.mark.parametrize("rec", [recipe.DelayedScaling(), recipe.Float8CurrentScaling()], ids=["delayed", "current"])
def test_checkpoint_takes_a_context_fn_and_the_older_positional_form(rec):
    """A user's context_fn (torch's) runs in the forward and in the recompute, inside te-core's
    own pair, still FP8-exact; the older positional form unpacks its three options with a
    DeprecationWarning (the function gets only the tensors)."""
    x = torch.randn(8, 32)
    torch.manual_seed(0)
    model = Block()
    reference = run(copy.deepcopy(model), x, rec, use_checkpoint=False)
    entered = []
    with_contexts = run(copy.deepcopy(model), x, rec, True, checkpoint_fn=_te_checkpoint_with_user_contexts(entered))
    assert entered == ["forward", "recompute"] * 3
    positional = run(copy.deepcopy(model), x, rec, True, checkpoint_fn=_te_checkpoint_positionally)
    for got in (with_contexts, positional):
        for step_got, step_want in zip(got, reference):
            assert all(torch.equal(g, w) for g, w in zip(step_got, step_want))


def test_checkpoint_saves_memory_path_and_passes_kwargs():
    torch.manual_seed(0)
    layer = tm.LayerNormMLP(16, 32)
    x = torch.randn(4, 16, requires_grad=True)
    y = tm.checkpoint(layer.forward, x, is_first_microbatch=None)
    y.sum().backward()
    ref_x = x.detach().clone().requires_grad_(True)
    layer2 = copy.deepcopy(layer)
    layer2.zero_grad()
    layer2(ref_x).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)


def test_checkpoint_rejects_tensor_parallel_options():
    with pytest.raises(NotImplementedError, match="distribute_saved_activations"):
        tm.checkpoint(torch.nn.Identity(), torch.randn(2, requires_grad=True), distribute_saved_activations=True)


def test_distribute_saved_activations_without_reentrance_warns_and_runs():
    """As in Transformer Engine: with use_reentrant=False the option has no effect (a warning),
    and the recompute gives the gradients of the plain call."""
    torch.manual_seed(0)
    layer = tm.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="distribute_saved_activations=True has no effect with use_reentrant=False"):
        tm.checkpoint(layer, x, distribute_saved_activations=True, use_reentrant=False).sum().backward()
    got = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
    x.grad = None
    layer.zero_grad(set_to_none=True)
    layer(x).sum().backward()
    for g, w in zip(got, [x.grad, *(p.grad for p in layer.parameters())]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_checkpoint_under_fp8_autocast_is_refused(use_reentrant):
    """torch.utils.checkpoint does not restore te.autocast: its recompute would run in high
    precision while the loss came from the FP8 forward (gradients off by several percent).
    That is an error naming te.checkpoint; without FP8, and after the module went back to
    high precision, torch.utils.checkpoint works as usual."""
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(16, 32, requires_grad=True)
    with autocast(recipe=recipe.DelayedScaling()):
        y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=use_reentrant)
    with pytest.raises(RuntimeError, match="te_core.checkpoint"):
        y.sum().backward()

    model.zero_grad(set_to_none=True)
    plain = copy.deepcopy(model)
    model(x)  # a high-precision forward: no longer an FP8 module
    x_ckpt, x_plain = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(model, x_ckpt, use_reentrant=use_reentrant).sum().backward()
    plain(x_plain).sum().backward()
    assert torch.equal(x_ckpt.grad, x_plain.grad)
    for got, want in zip(model.parameters(), plain.parameters()):
        assert torch.equal(got.grad, want.grad)


COMPILE_RECIPES = {
    "bf16": lambda: None,
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=3),
}


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks"])
@pytest.mark.parametrize("name", list(COMPILE_RECIPES))
def test_checkpoint_under_torch_compile(name, fullgraph):
    """te.checkpoint inside a compiled function: the compiler's recompute, with the gradients of a
    run without recompute, for every recipe whose casts keep no state. Delayed scaling's casts
    write amax histories, which a compiled recompute region cannot hold: fullgraph=True refuses
    it, naming te_core.checkpoint; otherwise the region runs eagerly between graphs, FP8-exact."""
    torch._dynamo.reset()
    rec = COMPILE_RECIPES[name]()
    torch.manual_seed(0)
    model = Block()
    plain = copy.deepcopy(model)

    def step(x):
        with autocast(enabled=rec is not None, recipe=rec):
            return tm.checkpoint(model, x)

    compiled = torch.compile(step, fullgraph=fullgraph)
    try:
        if name == "delayed" and fullgraph:
            with pytest.raises(Exception, match="te_core.checkpoint under torch.compile with DelayedScaling"):
                compiled(torch.randn(32, 32, requires_grad=True))
            return
        exact = te_core.get_backend().name == "reference"
        for i in range(2):
            x = torch.randn(32, 32) * (i + 1)  # 32 tokens: MXFP8 GEMMs need multiples of 32
            x_ckpt, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
            compiled(x_ckpt).pow(2).sum().backward()
            with autocast(enabled=rec is not None, recipe=rec):
                y = plain(x_plain)
            y.pow(2).sum().backward()
            for got, want in zip([x_ckpt.grad, *(p.grad for p in model.parameters())],
                                 [x_plain.grad, *(p.grad for p in plain.parameters())]):
                if exact:
                    assert torch.equal(got, want)
                else:  # inductor's fused math rounds its own way, moving an FP8 element by a step now and then
                    scale = want.abs().max().clamp_min(1e-12)
                    torch.testing.assert_close(got / scale, want / scale, rtol=0.125, atol=0.0675)
            model.zero_grad(set_to_none=True)
            plain.zero_grad(set_to_none=True)
    finally:
        torch._dynamo.reset()


def test_checkpoint_replays_dropout_drawn_from_the_rng_tracker():
    """te.checkpoint(get_rng_state_tracker=...) (Transformer Engine's and Megatron-LM's use): the
    recompute draws the same dropout mask inside tracker.fork() as the forward did, so the
    gradients equal a run without recompute; tp_group is accepted (TE reads it only to split the
    saved input, distribute_saved_activations, which te-core refuses by name)."""
    tracker = te_core.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    lin = tm.Linear(32, 32)

    def region(x):
        with tracker.fork("model-parallel-rng"):
            return torch.nn.functional.dropout(lin(x), p=0.5)

    x = torch.randn(32, 32)
    states = tracker.get_states()
    x_plain = x.clone().requires_grad_(True)
    region(x_plain).pow(2).sum().backward()
    want = (x_plain.grad, lin.weight.grad.clone())
    lin.zero_grad()
    tracker.set_states(states)
    x_ckpt = x.clone().requires_grad_(True)
    out = tm.checkpoint(region, x_ckpt, get_rng_state_tracker=lambda: tracker, tp_group=object())
    out.pow(2).sum().backward()
    assert torch.equal(x_ckpt.grad, want[0]) and torch.equal(lin.weight.grad, want[1])
    with pytest.raises(NotImplementedError, match="distribute_saved_activations=True"):
        tm.checkpoint(region, x_ckpt, distribute_saved_activations=True)
    with pytest.raises(TypeError, match="get_rng_state_tracker must be a callable"):
        tm.checkpoint(region, x_ckpt, get_rng_state_tracker=tracker)


def _assert_same_run(got, want):
    """(gradients, scaling states) of two runs: equal bit for bit."""
    for g, w in zip(got[0], want[0]):
        assert torch.equal(g, w)
    for g, w in zip(got[1], want[1]):
        for direction in ("forward", "backward"):
            for slot, entry in w[direction].items():
                for key, value in entry.items():
                    assert torch.equal(g[direction][slot][key], value), (direction, slot, key)


def _framework_recompute_run(rec, recompute: bool, microbatches: int = 2, steps: int = 2):
    """Microbatches forward, then their backwards in the same order (a pipeline's pattern), for
    `steps` steps; with `recompute`, each forward runs without autograd under
    activation_recompute_forward(True, False) and is recomputed before its backward under
    activation_recompute_forward(True, True) inside an autocast, as Megatron-LM's checkpoint
    functions do. Returns the gradients and the final scaling state."""
    from te_core.modules.checkpoint import activation_recompute_forward

    torch.manual_seed(0)
    model = Block()
    xs = [torch.randn(32, 32, device="cpu", generator=torch.Generator().manual_seed(10 + i)).to(
        torch.get_default_device()) for i in range(microbatches)]  # (the device under test)
    for step in range(steps):
        model.zero_grad()
        kept = []
        for i, x in enumerate(xs):
            x = x * (step + 1)
            with autocast(recipe=rec):
                if recompute:
                    with torch.no_grad(), activation_recompute_forward(activation_recompute=True):
                        model(x)
                    kept.append(x)
                else:
                    kept.append(model(x.requires_grad_(True)))
        for item in kept:
            if recompute:
                with torch.enable_grad(), autocast(recipe=rec), activation_recompute_forward(True, True):
                    item = model(item.requires_grad_(True))
            item.pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()], states(model)


@pytest.mark.parametrize(
    "rec", [recipe.DelayedScaling(amax_history_len=3), recipe.Float8CurrentScaling()], ids=["delayed", "current"]
)
def test_activation_recompute_forward_reproduces_fp8_exactly(rec):
    """Transformer Engine's activation_recompute_forward (transformer_engine.pytorch.distributed):
    two microbatches recorded, then recomputed first in first out, give the gradients and the
    scaling state of the same steps without recompute."""
    _assert_same_run(_framework_recompute_run(rec, recompute=True), _framework_recompute_run(rec, recompute=False))


class Bf16Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = tm.LayerNormLinear(64, 128, params_dtype=torch.bfloat16)
        self.b = tm.Linear(128, 64, params_dtype=torch.bfloat16)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x)))


@pytest.mark.parametrize("steps", [1, 2])
def test_checkpoint_recomputes_a_first_fp8_step_exactly_in_bfloat16(steps):
    """A fresh delayed-scaling state's first cast scales by its own amax and quantizes the norm's
    bfloat16 output afterwards; the recompute replaying that step must take the same path (a
    fused norm-to-FP8 cast rounds once where the forward rounded twice), else the first step's
    recomputed activations, its gradients and, through the amax history, later steps differ."""
    def run(use_checkpoint):
        torch.manual_seed(0)
        blocks = [Bf16Block() for _ in range(2)]
        x = torch.randn(32, 64, device="cpu", generator=torch.Generator().manual_seed(3)).to(
            torch.get_default_device(), torch.bfloat16)
        rec = recipe.DelayedScaling()
        for _ in range(steps):
            for blk in blocks:
                blk.zero_grad()
            xi = x.clone().requires_grad_(True)
            with autocast(recipe=rec):
                h = xi
                for blk in blocks:
                    h = tm.checkpoint(blk, h) if use_checkpoint else blk(h)
            h.float().pow(2).mean().backward()
        grads = [xi.grad] + [p.grad for blk in blocks for p in blk.parameters()]
        return grads, [s for blk in blocks for s in states(blk)]

    _assert_same_run(run(True), run(False))


@pytest.mark.parametrize("rec", [recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.Float8BlockScaling])
def test_nested_checkpoints_recompute_fp8_exactly(rec):
    """A checkpointed block whose MLP checkpoints itself (and a te.checkpoint inside that): the
    outer recompute runs the inner regions' forwards again in the backward, outside te.autocast,
    with the steps the original forward recorded; three steps bit-identical to no recompute."""
    g = torch.Generator().manual_seed(9)
    dev = torch.get_default_device()
    plain_mlp, plain_lin = tm.LayerNormMLP(128, 256), tm.Linear(128, 128)
    mlp, lin = copy.deepcopy(plain_mlp), copy.deepcopy(plain_lin)
    mlp.checkpoint = True
    x = torch.randn(32, 128, generator=g, device="cpu").to(dev)
    recipe_ = rec()
    results = []
    for nested in (False, True):
        inp = x.clone().requires_grad_()
        for _ in range(3):
            with te_core.autocast(recipe=recipe_):
                if nested:
                    y = te_core.checkpoint(lambda t: lin(te_core.checkpoint(mlp, t)), inp)
                else:
                    y = plain_lin(plain_mlp(inp))
            y.sum().backward()
        m = mlp if nested else plain_mlp
        results.append([y.detach(), inp.grad, m.fc1_weight.grad, m.layer_norm_weight.grad])
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)
