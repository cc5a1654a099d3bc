"""torch.compile(fullgraph=True) of tensor-parallel steps on 2 gloo ranks: column- and
row-parallel Linear, LayerNormLinear, LayerNormMLP and TransformerLayer, with and without
sequence parallelism, in bf16 and under each recipe (mostly delayed and current scaling). Over
several steps the compiled step equals the eager one bit for bit on the reference backend:
outputs, input and parameter gradients (the norm's partial gradients under sequence parallelism included), and
the delayed-scaling state, whose amaxes are reduced over the tensor-parallel group inside the
graph (so it is also identical on both ranks). Later steps replay the first graph (no retrace)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import te_core as te
import te_core.modules as tm
from te_core import recipe
from te_core.distributed import RNGStatesTracker

from ._pool import pool_of

HIDDEN, FFN, HEADS, SEQ, BATCH = 64, 128, 4, 16, 2
STEPS = 3
RECIPES = {None: None, "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
           "current": recipe.Float8CurrentScaling, "block": recipe.Float8BlockScaling,
           "mxfp8": recipe.MXFP8BlockScaling}


@pytest.fixture(scope="module")
def pool():
    yield from pool_of(2)


@dataclass(frozen=True)
class Case:
    kind: str  # "Linear-column", "Linear-row", "LayerNormLinear", "LayerNormMLP", "TransformerLayer"
    sp: bool
    recipe: Optional[str] = None  # a key of RECIPES
    dtype: str = "bfloat16"
    backend: str = "aot_eager"
    compile_model: bool = False  # torch.compile(model) called inside an eager te.autocast

    def __str__(self) -> str:
        return (f"{self.kind}{'-sp' if self.sp else ''}-{self.recipe or self.dtype}-{self.backend}"
                f"{'-model' if self.compile_model else ''}")


def _build(case: Case, group):
    tp = dict(tp_group=group, tp_size=2, sequence_parallel=case.sp, params_dtype=getattr(torch, case.dtype))
    if case.kind == "Linear-column":
        return tm.Linear(HIDDEN, FFN, parallel_mode="column", **tp)
    if case.kind == "Linear-row":
        return tm.Linear(FFN, HIDDEN, parallel_mode="row", **tp)
    if case.kind == "LayerNormLinear":
        return tm.LayerNormLinear(HIDDEN, FFN, parallel_mode="column", **tp)
    if case.kind == "LayerNormMLP":
        return tm.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=True, **tp)
    return tm.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, set_parallel_mode=True,
                               **tp)


def _twins(case: Case, group):
    """Two modules with the same random weights (process groups do not deepcopy): each rank's own
    GEMM weights (its shards), vectors (norms, replicated biases) the same on both ranks."""
    eager, compiled = _build(case, group), _build(case, group)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for a, b in zip(eager.parameters(), compiled.parameters()):
            values = torch.randn(a.shape, generator=gen)
            if a.dim() == 2:
                values = values.roll(dist.get_rank(group), 0) / a.shape[1] ** 0.5
            a.copy_((values if a.dim() == 2 else 1 + 0.2 * values).to(a.dtype))
            b.copy_(a)
    return eager, compiled


def _input(case: Case, step: int, rank: int) -> torch.Tensor:
    """This rank's input: its own values on each rank (its sequence shard, or its feature block)."""
    seq = SEQ // 2 if case.sp and case.kind != "Linear-row" else SEQ
    features = FFN // 2 if case.kind == "Linear-row" else HIDDEN
    gen = torch.Generator().manual_seed(100 + 10 * step + rank)
    return torch.randn(seq, BATCH, features, generator=gen).to(getattr(torch, case.dtype))


def _run(fn, model, x):
    x = x.clone().requires_grad_(True)
    y = fn(model, x)
    y.float().pow(2).sum().backward()
    result = [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return result


def _state(model):
    return [t.clone() for slots in model.quantization_state().values() for entry in slots.values()
            for t in entry.values()]


def _assert_equal(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what}[{i}]: compiled differs from eager by {(g.float() - w.float()).abs().max()}"


def check_compiled_step(ctx, case: Case) -> str:
    torch._dynamo.reset()  # in the rank's process: each case compiles its own step (same code object)
    group = ctx.group(2)
    rank = dist.get_rank(group)
    rec = RECIPES[case.recipe]() if case.recipe else None
    eager_model, compiled_model = _twins(case, group)
    if rec is not None:  # the eager twin's state made ahead too: both start from scale 1 (test_first_scale)
        te.init_quantization_state(eager_model, rec)

    def step(model, x):
        if rec is None:
            return model(x)
        with te.autocast(recipe=rec, amax_reduction_group=group):
            return model(x)

    if case.compile_model:
        inner = torch.compile(compiled_model, backend=case.backend, fullgraph=True)
        compiled = lambda model, x: step(inner, x)  # noqa: E731
    else:
        compiled = torch.compile(step, backend=case.backend, fullgraph=True)
    for i in range(STEPS):
        x = _input(case, i, rank)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = _run(compiled, compiled_model, x)
        _assert_equal(got, _run(step, eager_model, x), f"{case} step {i}")
    if case.recipe == "delayed":
        want, got = _state(eager_model), _state(compiled_model)
        assert any(t.abs().sum() > 0 for t in got), "no amax was recorded"
        _assert_equal(got, want, f"{case} scaling state")
        for i, mine in enumerate(got):  # the amax reduction ran over the group: both ranks agree
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine, group=group)
            assert torch.equal(both[0], both[1]), f"{case} scaling state[{i}]: the ranks differ"
    return str(case)


CASES = [
    Case("Linear-column", False, "delayed"), Case("Linear-column", True, "delayed"),
    Case("Linear-column", True, "current", dtype="float32"),
    Case("Linear-row", False, "delayed"), Case("Linear-row", True, "current", dtype="float32"),
    Case("LayerNormLinear", True), Case("LayerNormLinear", True, "delayed"),
    Case("LayerNormMLP", False, "current", dtype="float32"), Case("LayerNormMLP", True, "delayed"),
    Case("LayerNormMLP", True, "delayed", compile_model=True),
    Case("TransformerLayer", True), Case("TransformerLayer", False, "delayed"),
    Case("Linear-column", True, "block", dtype="float32"), Case("LayerNormMLP", True, "mxfp8", dtype="float32"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_compiled_step_matches_eager(pool, case):
    assert pool.run(check_compiled_step, case, timeout=120) == [str(case)] * 2


def test_inductor_step_matches_eager(pool):
    """Inductor lowers the functional collectives with the te_core ops (one case: compiling is slow)."""
    case = Case("Linear-column", True, "delayed", backend="inductor")
    assert pool.run(check_compiled_step, case, timeout=180) == [str(case)] * 2


def _disagreeing_ranks(ctx):
    """A compiled graph traced before any eager call checks the ranks' input shapes when it runs."""
    torch._dynamo.reset()
    group = ctx.group(2)
    torch.manual_seed(0)
    model = tm.Linear(HIDDEN, FFN, parallel_mode="column", tp_group=group)
    compiled = torch.compile(lambda m, x: m(x), backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="disagree on the input's shape or dtype"):
        compiled(model, torch.randn(SEQ + 2 * dist.get_rank(group), HIDDEN))
    return True


def test_compiled_graph_checks_that_ranks_agree(pool):
    assert pool.run(_disagreeing_ranks) == [True, True]


def _tracker_fork(ctx):
    """Dropout under the RNG tracker cannot be in a whole graph: a clear error naming the fix."""
    torch._dynamo.reset()
    group = ctx.group(2)
    tracker = RNGStatesTracker()
    tracker.add("model-parallel-rng", 1234 + ctx.rank)
    torch.manual_seed(0)
    layer = tm.TransformerLayer(HIDDEN, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.1, set_parallel_mode=True,
                                tp_group=group, get_rng_state_tracker=lambda: tracker)
    compiled = torch.compile(lambda m, x: m(x), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="Compile without fullgraph=True"):
        compiled(layer, torch.randn(SEQ, BATCH, HIDDEN))
    return True


def test_rng_tracker_fork_in_fullgraph_is_a_clear_error(pool):
    assert pool.run(_tracker_fork) == [True, True]
