"""torch.compile(fullgraph=True) of te_core modules under te_core.autocast, every recipe:
forward and backward over several steps equal eager, and so does the delayed-scaling state
(scales and amax histories) after the steps. On the reference backend the compiled graph runs
the same op implementations as eager (the te_core custom ops), so results are compared bit for
bit. An accelerator backend's graph may run the plain-torch twins of its ops (OpImpl.traced):
GEMMs, sums and divisions the compiler schedules round differently in the last bits, and a
last-bit change before an FP8 cast moves an odd element by one FP8 step, which the next GEMM
spreads. There each tensor is compared as a whole: its relative error (L2) must stay below
1e-2, where a wrong result (a lost gradient, a misread scale) is off by order 1."""

import copy

import pytest
import torch

import te_core as te
import te_core.modules as tm
from te_core import recipe

RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "mxfp8": recipe.MXFP8BlockScaling,
}
HIDDEN, FFN, HEADS, SEQ, BATCH = 64, 128, 4, 16, 2
MODULES = {
    "Linear": lambda: tm.Linear(HIDDEN, FFN),
    "LayerNormLinear": lambda: tm.LayerNormLinear(HIDDEN, FFN),
    "LayerNormMLP": lambda: tm.LayerNormMLP(HIDDEN, FFN, normalization="RMSNorm", activation="swiglu"),
    "TransformerLayer": lambda: tm.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0),
}
STEPS = 3  # the later steps quantize with scales the earlier ones updated


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # each case compiles its own step function (same code object)
    yield
    torch._dynamo.reset()


def _like_compiled(eager_model, rec):
    """Make the eager twin's state ahead, as torch.compile makes the compiled one's: both then
    start from scale 1 (a state made by an eager forward scales its first casts by their own
    amaxes, which a graph does not; see test_first_scale)."""
    te.init_quantization_state(eager_model, rec)


def _step_fn(rec):
    def step(model, x):
        with te.autocast(recipe=rec):
            return model(x)

    return step


def _run(step, model, x):
    x = x.clone().requires_grad_(True)
    y = step(model, x)
    y.float().pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


def _scaling_state(model):
    state = model.quantization_state()
    return {(d, slot, k): t.clone() for d, slots in state.items() for slot, entry in slots.items()
            for k, t in entry.items()}


ACCELERATOR_RELATIVE_ERROR = 1e-2


def _assert_identical(got, want, what):
    assert len(got) == len(want)
    exact = te.get_backend().name == "reference"
    for i, (g, w) in enumerate(zip(got, want)):
        if exact:
            assert torch.equal(g, w), f"{what}[{i}]: compiled differs from eager by {(g - w).abs().max()}"
        else:
            _assert_relative_error(g, w, f"{what}[{i}]")


def _assert_relative_error(g, w, what):
    assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
    g, w = g.double(), w.double()
    error = (g - w).norm() / w.norm().clamp_min(1e-30)
    assert error <= ACCELERATOR_RELATIVE_ERROR, (
        f"{what}: compiled differs from eager by {error:.3g} (relative, L2), max |diff| {(g - w).abs().max():.3g}")


@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_fullgraph_matches_eager(name, module):
    _check_against_eager(name, module, "aot_eager")


@pytest.mark.parametrize("name", list(RECIPES))
def test_inductor_matches_eager(name):
    """Inductor lowers the te_core custom ops (and their in-place writes) as well."""
    _check_against_eager(name, "Linear", "inductor")


def _state_tensors(model):
    """(name, tensor) of every amax history and scale of the model's scaling groups."""
    return [(f"{path}.{role.name}.{attr}", getattr(group, attr)) for path, child in model.named_modules()
            if getattr(child, "_recipe_state", None) is not None
            for role, group in child._recipe_state.scaling_groups().items() for attr in ("amax_history", "scale")]


def test_inductor_updates_histories_in_place():
    """Every delayed-scaling write of a compiled TransformerLayer (norm and activation casts that
    max their amax into the history, the scale update) lands in the module's own tensors, and
    inductor allocates no buffer of a history's shape: such a buffer holds a functionalized copy
    of a history, which CUDA graphs (mode="reduce-overhead") find alive after the graph. Values,
    state included, equal eager's."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    history_len = 7  # no other tensor of the layer has this dimension
    rec = recipe.DelayedScaling(amax_history_len=history_len)
    eager_model = MODULES["TransformerLayer"]()
    compiled_model = copy.deepcopy(eager_model)
    _like_compiled(eager_model, rec)
    te.init_quantization_state(compiled_model, rec)
    before = [(name, t, t.data_ptr()) for name, t in _state_tensors(compiled_model)]
    assert {tuple(t.shape) for name, t, _ in before if name.endswith("amax_history")} == {(history_len, 1), (history_len, 2)}
    step = _step_fn(rec)
    compiled = torch.compile(step, fullgraph=True)
    for i in range(2):
        x = torch.randn(SEQ, BATCH, HIDDEN)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got, code = run_and_get_code(_run, compiled, compiled_model, x)
        want = _run(step, eager_model, x)
        if te.get_backend().name == "reference":
            torch.testing.assert_close(got, want, rtol=0.125, atol=0.0675)
        else:
            for j, (g, w) in enumerate(zip(got, want)):
                _assert_relative_error(g, w, f"step {i}[{j}]")
        allocated = [line.strip() for src in code for line in src.splitlines()
                     if "empty_strided" in line and f"(({history_len}, " in line]
        assert not allocated, f"step {i}: the compiled graphs allocate history-shaped buffers: {allocated}"
        for (name, t, ptr), (_, now) in zip(before, _state_tensors(compiled_model)):
            assert now is t and now.data_ptr() == ptr, f"step {i}: {name} was replaced, not updated in place"
    want, got = _scaling_state(eager_model), _scaling_state(compiled_model)
    assert any(t.abs().sum() > 0 for (_, _, k), t in want.items() if k == "amax_history")
    _assert_identical(list(got.values()), list(want.values()), "scaling state")


def _check_against_eager(name, module, backend):
    torch.manual_seed(0)
    rec = RECIPES[name]()
    eager_model = MODULES[module]()
    compiled_model = copy.deepcopy(eager_model)  # its scaling state is made when first traced
    _like_compiled(eager_model, rec)
    step = _step_fn(rec)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for i in range(STEPS):
        x = torch.randn(SEQ, BATCH, HIDDEN)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):  # later steps replay the first graph
            got = _run(compiled, compiled_model, x)
        _assert_identical(got, _run(step, eager_model, x), f"step {i}")
    want, got = _scaling_state(eager_model), _scaling_state(compiled_model)
    assert want.keys() == got.keys()
    if name == "delayed":
        assert any(t.abs().sum() > 0 for (_, _, k), t in want.items() if k == "amax_history")
    _assert_identical(list(got.values()), list(want.values()), "scaling state")


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_compiled_model_under_eager_autocast(name):
    """torch.compile(model) of a model built from te_core modules, called inside an eager
    te_core.autocast: the forward scale updates run at that autocast's exit, the backward ones
    in the compiled backward; outputs, gradients and scaling state equal eager's."""
    torch.manual_seed(0)
    rec = RECIPES[name]()
    eager_model = torch.nn.Sequential(MODULES["LayerNormMLP"](), tm.Linear(HIDDEN, HIDDEN))
    compiled_model = copy.deepcopy(eager_model)
    _like_compiled(eager_model, rec)
    te.init_quantization_state(compiled_model, rec)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)

    def step(model, x):
        with te.autocast(recipe=rec):
            return model(x)

    for i in range(STEPS):
        x = torch.randn(SEQ, BATCH, HIDDEN)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = _run(lambda _, inp: step(compiled, inp), compiled_model, x)
        _assert_identical(got, _run(step, eager_model, x), f"step {i}")
    for eager_part, compiled_part in zip(eager_model, compiled_model):
        want, got = _scaling_state(eager_part), _scaling_state(compiled_part)
        _assert_identical(list(got.values()), list(want.values()), "scaling state")


def test_every_contract_op_has_a_library_twin():
    """Each contract op is recorded as torch.ops.te_core.<name> while traced (the schema comes
    from its stub), so a new op whose signature has no schema type fails here, not at trace."""
    for op in te.ops.CONTRACT.values():
        assert op.untraceable is None, f"{op.name}: {op.untraceable}"
        assert hasattr(torch.ops.te_core, op.name)


# dynamo inspects the cached operand's tensors when it stores them back on the module
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("name,module", [("delayed", "Linear"), ("delayed", "LayerNormMLP"), ("current", "Linear"),
                                         ("current+high_precision", "Linear"), ("delayed+wgrad_hp", "Linear")])
def test_weight_caching_matches_eager(name, module):
    """is_first_microbatch=True quantizes the weight and caches it; False reuses the cache (the
    weight's delayed scale is then not updated): compiled steps do the same as eager ones, also
    where the wgrad GEMM reads the input in high precision (a backward_override, DelayedScaling's
    wgrad override), which the backward then keeps."""
    torch.manual_seed(0)
    rec = {"current+high_precision": lambda: recipe.Float8CurrentScaling(backward_override="high_precision"),
           "delayed+wgrad_hp": lambda: recipe.DelayedScaling(amax_history_len=4,
                                                             override_linear_precision=(False, False, True)),
           }.get(name, RECIPES.get(name))()
    eager_model = MODULES[module]()
    compiled_model = copy.deepcopy(eager_model)
    _like_compiled(eager_model, rec)
    te.init_quantization_state(compiled_model, rec)

    def step(model, x, first):
        with te.autocast(recipe=rec):
            return model(x, is_first_microbatch=first)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i, first in enumerate([True, False, False, True, False]):
        x = torch.randn(SEQ, BATCH, HIDDEN)
        got = _run(lambda m, inp: compiled(m, inp, first), compiled_model, x)
        _assert_identical(got, _run(lambda m, inp: step(m, inp, first), eager_model, x), f"microbatch {i}")
    want, got = _scaling_state(eager_model), _scaling_state(compiled_model)
    _assert_identical(list(got.values()), list(want.values()), "scaling state")


def test_recipe_with_callables():
    """A recipe with a user callable (its config names it only), handed to the compiled step and
    given another margin between calls: the state made before tracing runs the recipe's own
    callable, and every step equals eager, the scaling state included."""
    rec = recipe.DelayedScaling(amax_history_len=4, amax_compute_algo=lambda history: history.mean(dim=0))
    torch.manual_seed(0)
    eager_model = MODULES["Linear"]()
    compiled_model = copy.deepcopy(eager_model)
    _like_compiled(eager_model, rec)

    def step(model, x, rec):
        with te.autocast(recipe=rec):
            return model(x)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i in range(STEPS + 2):
        if i == 2:
            rec.margin = 1
        x = torch.randn(SEQ, BATCH, HIDDEN)
        _assert_identical(_run(lambda m, t: compiled(m, t, rec), compiled_model, x),
                          _run(lambda m, t: step(m, t, rec), eager_model, x), f"step {i}")
    assert compiled_model._recipe_state.recipe.amax_compute_algo is rec.amax_compute_algo
    want, got = _scaling_state(eager_model), _scaling_state(compiled_model)
    _assert_identical(list(got.values()), list(want.values()), "scaling state")


def test_eager_casts_after_compiled_steps_see_scales_written_behind_torchs_back():
    """A compiled graph's scale updates run in kernels that torch's version counter may not see
    (on a GPU backend); eager casts after compiled steps must still use the live scale."""
    torch.manual_seed(0)
    rec = recipe.DelayedScaling(amax_history_len=4)
    layer = tm.Linear(32, 32)
    x = torch.randn(16, 32)

    def step(inp):
        with te.autocast(recipe=rec):
            return layer(inp)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    compiled(x).sum().backward()
    group = layer._recipe_state.groups[next(iter(layer._recipe_state.groups))]
    with torch.no_grad():
        step(x)
        group.scale_inv_of(0)  # a snapshot of the scale as it is now
        group.scale.data.mul_(0.5)  # a write torch's version counter of `scale` does not see
        snapshot = group.scale_inv_of(0).clone()
    torch.testing.assert_close(snapshot, torch.reciprocal(group.scale[0:1]), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(RECIPES))
def test_eager_steps_between_compiled_steps_do_not_recompile(name):
    """A module stepped both eagerly and compiled (an evaluation loop beside a compiled training
    step, a benchmark timing both) keeps one graph: what an eager step caches in the scaling state
    is never read by the trace, so no guard depends on it."""
    torch.manual_seed(0)
    rec = RECIPES[name]()
    layer = tm.Linear(32, 32)
    x = torch.randn(32, 32, requires_grad=True)  # (MXFP8 GEMMs take multiples of 32)
    step = _step_fn(rec)
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    for i in range(3):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled(layer, x).sum().backward()
        step(layer, x).sum().backward()


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
def test_wgrad_override_compiles_like_eager(module):
    """DelayedScaling(override_linear_precision=(False, False, True)): the compiled step keeps
    the high-precision input for its wgrad as eager does, with the same results."""
    torch.manual_seed(0)
    rec = recipe.DelayedScaling(amax_history_len=4, override_linear_precision=(False, False, True))
    eager_model = MODULES[module]()
    compiled_model = copy.deepcopy(eager_model)
    _like_compiled(eager_model, rec)
    step = _step_fn(rec)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i in range(STEPS):
        x = torch.randn(SEQ, BATCH, HIDDEN)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = _run(compiled, compiled_model, x)
        _assert_identical(got, _run(step, eager_model, x), f"step {i}")
    _assert_identical(list(_scaling_state(compiled_model).values()), list(_scaling_state(eager_model).values()),
                      "scaling state")


@pytest.mark.parametrize("name", ["current", "block"])
def test_recipe_assigned_between_compiled_steps(name):
    """A recipe compiled before any eager use, then a field assigned between compiled steps, as
    Transformer Engine's recipes take assignments: the next compiled step runs the new value
    (dynamo guards on the recipe's fields and its count of assignments) and equals the eager
    step of a twin given the changed recipe."""
    torch.manual_seed(0)
    rec = RECIPES[name]()
    compiled_model = MODULES["Linear"]()
    eager_model = copy.deepcopy(compiled_model)
    compiled = torch.compile(_step_fn(rec), backend="eager", fullgraph=True)
    x = torch.randn(SEQ, BATCH, HIDDEN)
    _run(compiled, compiled_model, x)
    rec.backward_override = "high_precision"
    got = _run(compiled, compiled_model, x)
    want = _run(_step_fn(rec), eager_model, x)
    _assert_identical(got, want, "after the assignment")
    unchanged = _run(_step_fn(RECIPES[name]()), copy.deepcopy(eager_model), x)
    assert torch.equal(got[0], unchanged[0]) and not torch.equal(got[1], unchanged[1])  # FP8 forward, other dgrad
    # traced, the module's state is now bound to `rec` itself; the next assignment still reaches it
    rec.backward_override = None
    _assert_identical(_run(compiled, compiled_model, x), unchanged, "after assigning None again")


def test_delayed_recipes_handed_to_a_compiled_step_change_between_calls():
    """A DelayedScaling recipe passed to the compiled step as an argument, then another of the
    same kind (another margin), then a field assigned on it: each compiled call retraces with the
    recipe it is given (fullgraph), its module state bound to that recipe outside the graph, and
    equals the eager twin's step given the same recipes, scaling state included."""
    torch.manual_seed(0)
    first, second = recipe.DelayedScaling(amax_history_len=3), recipe.DelayedScaling(amax_history_len=3, margin=2)
    compiled_model = MODULES["Linear"]()
    eager_model = copy.deepcopy(compiled_model)
    te.init_quantization_state(compiled_model, first)
    _like_compiled(eager_model, first)

    def step(model, x, rec):
        with te.autocast(recipe=rec):
            return model(x)

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    for i, rec in enumerate((first, second, second, first)):
        if i == 2:
            second.margin = 1
        x = torch.randn(SEQ, BATCH, HIDDEN)
        got = _run(lambda m, inp: compiled(m, inp, rec), compiled_model, x)
        want = _run(lambda m, inp: step(m, inp, rec), eager_model, x)
        _assert_identical(got, want, f"call {i}")
        _assert_identical(list(_scaling_state(compiled_model).values()), list(_scaling_state(eager_model).values()),
                          f"scaling state after call {i}")


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_new_but_equal_recipe_each_step_reuses_the_graph(name):
    """A training loop that builds its recipe anew each step (equal fields) and hands it to the
    compiled step: one graph, as the recipe's fields, not its identity, decide it."""
    torch.manual_seed(0)
    model = MODULES["Linear"]()

    def step(model, x, rec):
        with te.autocast(recipe=rec):
            return model(x)

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    for i in range(4):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled(model, torch.randn(SEQ, BATCH, HIDDEN), RECIPES[name]()).float().sum().backward()


def _guard_text(fn) -> str:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(fn.__code__)
    assert len(entries) == 1, f"{len(entries)} graphs compiled where one was expected"
    return str(entries[0].guard_manager)


@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_step_guards_no_recipe_field_one_by_one(name):
    """Dynamo checks a compiled function's guards on every call. The state a module made for an
    equal recipe is matched by the recipes' fields as one text, not field by field (a guard per
    field per module, each checked every step), and the state's device is checked where the state
    is made, not in the graph. (The fields the scale update uses are still read.) The graph is
    still reused with a new but equal recipe and recompiled with another (the tests above)."""
    torch.manual_seed(0)
    model = MODULES["LayerNormMLP"]()
    rec = RECIPES[name]()

    def step(x):
        with te.autocast(recipe=rec):
            return model(x)

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    compiled(torch.randn(SEQ, BATCH, HIDDEN)).float().sum().backward()
    guards = [line for line in _guard_text(step).splitlines() if "_recipe_state" in line]
    assert guards, "no guard on the module's recipe state: the test no longer sees the state"
    per_field = [line for line in guards if " in __eq__" in line]
    assert not per_field, "guards comparing the recipes field by field:\n" + "\n".join(per_field[:5])
    assert not [line for line in guards if "in follow_device" in line]


@pytest.mark.parametrize("name", [*RECIPES, "current with epsilon"])
def test_dynamic_shapes_compile_every_recipe(name):
    """torch.compile(dynamic=True, fullgraph=True): the recipe's integer and float fields become
    symbolic in the trace, yet the module state is made outside the graph and two batch sizes
    give the eager twin's results; current scaling's epsilons (read in the backward's trace too)
    included."""
    torch.manual_seed(0)
    rec = (recipe.Float8CurrentScaling(fp8_quant_bwd_grad=recipe.QParams(amax_epsilon=1e-3))
           if name == "current with epsilon" else RECIPES[name]())
    compiled_model = MODULES["Linear"]()
    eager_model = copy.deepcopy(compiled_model)
    _like_compiled(eager_model, rec)
    compiled = torch.compile(_step_fn(rec), backend="eager", fullgraph=True, dynamic=True)
    for batch in (2, 4):
        x = torch.randn(SEQ, batch, HIDDEN)
        _assert_identical(_run(compiled, compiled_model, x), _run(_step_fn(rec), eager_model, x), f"batch {batch}")


@pytest.mark.parametrize("name", list(RECIPES))
def test_changing_token_counts_under_inductor_match_eager(name):
    """torch.compile's default shapes under inductor: a second token count retraces with the
    count symbolic (automatic dynamic shapes), which then sizes the weight gradient's inner
    dimension and its block scales too; every step, the first count again included, gives the
    eager twin's results and scaling state."""
    torch.manual_seed(0)
    rec = RECIPES[name]()
    compiled_model = MODULES["Linear"]()
    eager_model = copy.deepcopy(compiled_model)
    _like_compiled(eager_model, rec)
    from torch._inductor.compile_fx import compile_fx

    symbolic = []

    def inductor(gm, example_inputs):  # inductor, noting whether dynamo passed it a symbolic size
        symbolic.append(any(isinstance(i, torch.SymInt) for i in example_inputs))
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(_step_fn(rec), backend=inductor, fullgraph=True)
    for seq in (SEQ, 3 * SEQ, SEQ):
        x = torch.randn(seq, BATCH, HIDDEN)
        _assert_identical(_run(compiled, compiled_model, x), _run(_step_fn(rec), eager_model, x), f"{seq} tokens")
    assert symbolic == [False, True], symbolic  # a static trace, a symbolic one; the first count again adds none
    state, want = _scaling_state(compiled_model), _scaling_state(eager_model)
    assert state.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(state[key], value), key


def test_grouped_linear_splits_stay_symbolic_under_compile():
    """m_splits that change every step (MoE routing) do not recompile the graph per split: after
    the first change they are symbolic (only which experts get no tokens specializes it), and
    every call equals eager."""
    torch.manual_seed(0)
    layer = tm.GroupedLinear(3, 32, 64)
    compiled = torch.compile(lambda x, splits: layer(x, splits), backend="eager", fullgraph=True)
    x = torch.randn(96, 32)
    torch._dynamo.utils.counters.clear()
    for splits in ([16, 32, 48], [48, 16, 32], [32, 32, 32], [80, 8, 8], [8, 80, 8], [40, 40, 16]):
        assert torch.equal(compiled(x, splits), layer(x, splits)), splits
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP", "TransformerLayer"])
@pytest.mark.parametrize("calibrating", [False, True])
def test_module_used_twice_in_a_step_matches_eager(module, calibrating):
    """A module applied twice in one step (shared weights): eagerly its gradient's scaling group
    is updated once, when the backward pass ends, so both uses' backwards cast with the step's
    scale. A traced graph has no end of backward: the backward of the first use, which runs
    last, updates it, once. Compiled steps equal eager ones, the scaling state included."""
    torch.manual_seed(0)
    rec = RECIPES["delayed"]()
    square = {"Linear": lambda: tm.Linear(HIDDEN, HIDDEN), "LayerNormMLP": lambda: tm.LayerNormMLP(HIDDEN, FFN),
              "TransformerLayer": MODULES["TransformerLayer"]}[module]
    eager_model = square()
    compiled_model = copy.deepcopy(eager_model)
    _like_compiled(eager_model, rec)
    te.init_quantization_state(compiled_model, rec)

    def step(model, x):
        with te.autocast(enabled=not calibrating, calibrating=calibrating, recipe=rec):
            return model(torch.relu(model(x)))

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i in range(STEPS):
        x = torch.randn(SEQ, BATCH, HIDDEN)
        _assert_identical(_run(compiled, compiled_model, x), _run(step, eager_model, x), f"step {i}")
    want, got = _scaling_state(eager_model), _scaling_state(compiled_model)
    _assert_identical(list(got.values()), list(want.values()), "scaling state")


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_made_inside_the_compiled_step(name):
    """A training step that builds its recipe itself (`te.autocast(recipe=Float8CurrentScaling())`
    inside the compiled function, as scripts written for eager mode do) compiles with
    fullgraph=True (the recipes' object defaults come from functions dynamo traces) and equals
    eager steps."""
    torch.manual_seed(0)
    eager_model = MODULES["Linear"]()
    compiled_model = copy.deepcopy(eager_model)
    _like_compiled(eager_model, RECIPES[name]())

    def step(model, x):
        with te.autocast(recipe=RECIPES[name]()):
            return model(x)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for i in range(STEPS):
        x = torch.randn(SEQ, BATCH, HIDDEN)
        _assert_identical(_run(compiled, compiled_model, x), _run(step, eager_model, x), f"step {i}")


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_grouped_linear_expert_without_tokens_with_weight_caching(name):
    """An expert without tokens on a step that caches the FP8 weights (is_first_microbatch True,
    then False) compiles with fullgraph=True and equals eager, outputs and gradients."""
    torch.manual_seed(0)
    rec = RECIPES[name]()
    eager_layer = tm.GroupedLinear(3, HIDDEN, FFN)
    compiled_layer = copy.deepcopy(eager_layer)
    _like_compiled(eager_layer, rec)

    def step(layer, x, first):
        with te.autocast(recipe=rec):
            return layer(x, [16, 0, 16], is_first_microbatch=first)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for first in (True, False, False):
        x = torch.randn(32, HIDDEN)
        _assert_identical(_run(lambda m, t: compiled(m, t, first), compiled_layer, x),
                          _run(lambda m, t: step(m, t, first), eager_layer, x), f"is_first_microbatch={first}")
