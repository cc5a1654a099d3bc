"""The plain-torch twins torch.compile traces (te_backend_cuda.traced): their math against the
reference on the CPU (casts, casts maxing into an amax history slot), their slot writes kept
under torch.compile on the CPU, each twin against the eager op on the GPU (FP8 bytes, amaxes
and histories equal), and compiled modules with delayed scaling (equal to eager, with no
opaque cast left in the step and the scale update left the opaque op, which has no twin)."""
import copy

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import te_core as te
from te_backend_cuda import traced, traced_block, traced_fused, traced_kernels
from te_core import recipe
from te_core.reference import activation as ref_act
from te_core.reference import cast as ref_cast
from twin_backends import cpu_backend_with

F8 = (torch.float8_e4m3fn, torch.float8_e5m2)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _x(device="cpu", dtype=torch.bfloat16, shape=(96, 160)):
    x = torch.randn(*shape, device=device) * 3
    x[0, :4] = torch.tensor([1e6, -1e6, 0.0, -0.0])  # saturation both ways, signed zero
    return x.to(dtype)


def _bytes_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fp8_dtype", F8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cast_math_matches_reference(fp8_dtype, dtype):
    x = _x(dtype=dtype)
    scale = torch.tensor([0.37])
    data, amax = ref_cast.quantize_fp8(x, scale, fp8_dtype)
    _bytes_equal(traced._cast(x, scale, fp8_dtype), data)
    assert traced._amax(x).item() == amax.item()


def test_amax_keeps_nan():
    x = _x()
    x[3, 3] = float("nan")
    assert torch.isnan(traced._amax(x))


@pytest.mark.parametrize("eps,pow2", [(0.0, False), (0.0, True), (4.0, False)])
@pytest.mark.parametrize("amax", [3.7, 0.0, float("inf"), float("nan"), 1e-40])
def test_current_scale_rules_match_reference(amax, eps, pow2):
    fmax = 448.0
    got = traced._current_scale(torch.tensor([amax]), fmax, eps, pow2)
    want = ref_cast.scale_from_amax(torch.tensor([amax]), fmax, eps, pow2)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got, want)


def test_twins_decline_what_they_do_not_take():
    x = _x()  # on the CPU: the eager op's supports() sends it to the reference
    assert traced.quantize_fp8(x, torch.ones(1), torch.float8_e4m3fn) is NotImplemented
    assert traced.gemm_fp8(x, x, torch.ones(1), torch.ones(1), out_dtype=torch.bfloat16) is NotImplemented


@pytest.fixture
def on_cpu(monkeypatch, writes_state):
    """The twins take CPU tensors, so that their math and tracing can be checked without a GPU."""
    monkeypatch.setattr(traced, "DEVICE_TYPE", "cpu")


@pytest.fixture
def writes_state(monkeypatch):
    """The casts' history-slot writes traced (off by default: see traced.WRITES_SLOTS)."""
    monkeypatch.setattr(traced, "WRITES_SLOTS", True)


def test_state_writing_twins_are_off_by_default(monkeypatch):
    """Shipped default, where te_triton's kernels cannot be launched (here: tensors off a GPU):
    a cast maxing into a history slot stays the opaque op, a cast without a slot is traced, and
    the scale update stays the opaque op."""
    monkeypatch.setattr(traced, "DEVICE_TYPE", "cpu")
    x, scale = _x(), torch.ones(1)
    assert traced.quantize_fp8(x, scale, F8[0], amax_out=torch.zeros(1)) is NotImplemented
    assert traced.cast_transpose_fp8(x, scale, F8[0], amax_out=torch.zeros(1)) is NotImplemented
    assert traced.quantize_fp8(x, scale, F8[0]) is not NotImplemented
    histories, scales = [torch.zeros(16, 1)], [torch.ones(1)]
    assert traced.TRACED["delayed_scaling_update"](histories, scales, [448.0]) is NotImplemented


def test_twins_decline_bad_amax_out(on_cpu):
    """A slot other than the contract's stays with the opaque op, which names the problem."""
    x, scale = _x(), torch.ones(1)
    for slot in (torch.zeros(2), torch.zeros(1, dtype=torch.float64), torch.zeros(1, device="meta")):
        assert traced.quantize_fp8(x, scale, F8[0], amax_out=slot) is NotImplemented


@pytest.mark.parametrize("before", [0.0, 2.5, 1e9, float("nan")])
@pytest.mark.parametrize("nan_in_x", [False, True])
def test_amax_into_a_history_slot_matches_reference(before, nan_in_x):
    """max(slot, amax) written into the slot (a view of the history), NaN winning; the slot
    itself comes back; the rest of the history is untouched."""
    x = _x()
    if nan_in_x:
        x[5, 7] = float("nan")
    history = torch.rand(4, 3) + 1
    history[0, 1] = before
    want = history.clone()
    ref_cast.merge_amax(ref_cast.amax_of(x), want[0][1:2])
    slot = history[0][1:2]
    assert traced.amax_into(traced._amax(x), slot) is slot
    assert torch.equal(history.isnan(), want.isnan())
    assert torch.equal(history.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("fp8_dtype", F8)
def test_cast_twins_with_amax_out_match_reference(on_cpu, fp8_dtype):
    x, scale = _x(dtype=torch.float32), torch.tensor([0.37])
    for name, ref in (("quantize_fp8", ref_cast.quantize_fp8), ("cast_transpose_fp8", ref_cast.cast_transpose_fp8),
                      ("dbias_cast_transpose", ref_act.dbias_cast_transpose)):
        slot_want, slot_got = torch.tensor([2.0]), torch.tensor([2.0])
        want = ref(x, scale, fp8_dtype, amax_out=slot_want)
        got = getattr(traced, name)(x, scale, fp8_dtype, amax_out=slot_got)
        assert got[-1] is slot_got, f"{name}: the amax output must be amax_out itself"
        assert torch.equal(slot_got, slot_want) and slot_got.item() > 2.0, name
        for g, w in zip(got[:2], want[:2]):
            _bytes_equal(g, w)
        if name == "dbias_cast_transpose":  # rows summed in another order
            torch.testing.assert_close(got[2], want[2], rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("widths", [(160,), (64, 32, 64)])
@pytest.mark.parametrize("pow2,eps", [(False, 0.0), (True, 4.0)])
def test_current_epilogue_twin_matches_reference(on_cpu, widths, pow2, eps):
    """Current scaling's output-gradient epilogue traced: the reference's FP8 bytes, scales and
    amax; its bias gradient to bf16's tolerance (rows summed in another order)."""
    parts = [_x(shape=(96, w)) for w in widths]
    kwargs = dict(force_pow2_scales=pow2, amax_epsilon=eps)
    got = traced.dbias_cast_transpose_current(parts, F8[1], **kwargs)
    want = ref_act.dbias_cast_transpose_current(parts, F8[1], **kwargs)
    _bytes_equal(got[0], want[0])
    _bytes_equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=1e-5)
    _assert_bits_equal([t.reshape(-1) for t in got[3:]], [t.reshape(-1) for t in want[3:]])
    bad_rows = [parts[0], _x(shape=(95, 32))]
    assert traced.dbias_cast_transpose_current(bad_rows, F8[1]) is NotImplemented


def _assert_bits_equal(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g.view(torch.int32), w.view(torch.int32)), f"[{i}]: {g} != {w}"


@pytest.mark.parametrize("before", [0.5, 1e9, float("nan")])
def test_twins_write_in_place_under_compile(on_cpu, before):
    """Traced with fullgraph=True, the slot write of a cast lands in the caller's history (a
    view of one slot, through the max_into op), equal to an eager run of the twin; the rest of
    the history is untouched."""
    torch.manual_seed(0)
    history, scale = torch.rand(4, 3) + 1, torch.tensor([0.37])
    history[0, 2] = before
    x = _x()

    def step(x, history):
        return traced.cast_transpose_fp8(x, scale, F8[0], amax_out=history[0][2:3])

    want_h = history.clone()
    want = step(x, want_h)
    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(x, history)
    torch._dynamo.reset()
    _bytes_equal(got[0], want[0])
    _bytes_equal(got[1], want[1])
    assert torch.equal(got[2].nan_to_num(), want[2].nan_to_num()) and torch.equal(got[2].isnan(), want[2].isnan())
    assert torch.equal(history.nan_to_num(), want_h.nan_to_num()) and torch.equal(history.isnan(), want_h.isnan())
    if before == 0.5:  # it held less: the slot now holds this cast's amax
        assert torch.equal(history[0, 2:3], traced._amax(x).reshape(1))


# --- compiled modules with delayed scaling: the twins as a backend's, against eager -----------
COVERED = ("quantize_fp8", "cast_transpose_fp8", "dbias_cast_transpose", "transpose_fp8", "dequantize_fp8",
           "quantize_fp8_current", "dbias_cast_transpose_current")  # every twin but the GEMMs' (torch._scaled_mm: the GPU's)
MODULES = {  # (device, params_dtype) -> module
    "Linear": lambda *f: te.Linear(256, 512, device=f[0], params_dtype=f[1]),
    "TransformerLayer": lambda *f: te.TransformerLayer(256, 1024, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                                       device=f[0], params_dtype=f[1]),
}
SHAPES = {"Linear": ((128, 256), (128, 512)), "TransformerLayer": ((64, 2, 256), (64, 2, 256))}  # x, y


@pytest.fixture
def cpu_backend_with_twins(monkeypatch, on_cpu):
    """A CPU backend running the reference ops eagerly and these twins when traced."""
    twins = {**{name: traced.TRACED[name] for name in COVERED}, **traced_fused.twins("cpu")}
    with cpu_backend_with(monkeypatch, "cpu_cast_twins", twins):
        yield


def _fwd_bwd(step, model, x, dy):
    x = x.clone().requires_grad_(True)
    y = step(model, x)
    y.backward(dy)
    out = [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _compiled_and_eager(module, device, dtype, inner_backend, steps=3):
    """([(compiled results, eager results)] per fwd+bwd step with DelayedScaling, the compiled
    step, its model, the eager model, and dynamo's graphs)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    rec = recipe.DelayedScaling(amax_history_len=4)
    eager = MODULES[module](device, dtype)
    compiled_model = copy.deepcopy(eager)
    for model in (eager, compiled_model):
        te.init_quantization_state(model, rec)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(inner_backend)(gm, example_inputs)

    def step(model, x):
        with te.autocast(recipe=rec):
            return model(x)

    compiled = torch.compile(step, backend=capture, fullgraph=True)
    results = []
    for i in range(steps):  # growing inputs: the scales change at every update
        x_shape, y_shape = SHAPES[module]
        x = (torch.randn(x_shape, device=device) * (i + 1)).to(dtype)
        dy = torch.randn(y_shape, device=device).to(dtype)
        results.append((_fwd_bwd(compiled, compiled_model, x, dy), _fwd_bwd(step, eager, x, dy)))
    return results, (compiled, compiled_model, eager, graphs)


def _opaque_ops(graphs):
    """The te_core custom ops left in dynamo's graphs (autograd.Function bodies included)."""
    targets = {str(node.target) for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
               for node in sub.graph.nodes}
    return {t.split(".")[1].removesuffix("_into") for t in targets if t.startswith("te_core.")}


def _assert_only_the_update_opaque(graphs, update_traced=False):
    """Every cast the twins cover traced; the delayed-scaling update opaque, but where its twin
    (te_triton's kernel launched by the compiled code, on a GPU) takes it."""
    opaque = _opaque_ops(graphs)
    assert not opaque & (set(COVERED) | set(traced_fused.TRACED_FUSED)), sorted(opaque)
    assert ("delayed_scaling_update" in opaque) != update_traced, sorted(opaque)


def _state(model):
    return {(d, slot, k): t.clone() for d, slots in model.quantization_state().items()
            for slot, entry in slots.items() for k, t in entry.items()}


@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_delayed_scaling_on_cpu_twins_equals_eager(cpu_backend_with_twins, module):
    """Compiled (aot_eager: AOTAutograd's min-cut partitioner, as inductor's) with the twins for
    every cast, the scale update left the opaque op, fwd+bwd over 3 steps equals the eager
    reference bit for bit, delayed-scaling state included: the slot writes and the update land
    in the module's tensors, and no FP8 copy the backward uses is recomputed with a scale
    updated meanwhile."""
    results, (_, compiled_model, eager, graphs) = _compiled_and_eager(module, "cpu", torch.float32, "aot_eager")
    _assert_only_the_update_opaque(graphs)
    for i, (got, want) in enumerate(results):
        for j, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"step {i} tensor {j}: differs by {(g - w).abs().max()}"
    want, got = _state(eager), _state(compiled_model)
    assert want.keys() == got.keys()
    assert any(t.abs().sum() > 0 for (_, _, k), t in want.items() if k == "amax_history")
    _assert_bits_equal(list(got.values()), list(want.values()))


@GPU
@pytest.mark.parametrize("fp8_dtype", F8)
def test_twins_equal_eager_ops_on_gpu(fp8_dtype):
    from te_backend_cuda import ops

    x = _x("cuda", shape=(256, 384))
    scale = torch.tensor([0.37], device="cuda")
    want = ops.cast_transpose_fp8(x, scale, fp8_dtype)
    got = traced.cast_transpose_fp8(x, scale, fp8_dtype)
    _bytes_equal(got[0], want[0])
    _bytes_equal(got[1], want[1])
    assert torch.equal(got[2].reshape(()), want[2].reshape(()))
    want = ops.dbias_cast_transpose(x, scale, fp8_dtype)
    got = traced.dbias_cast_transpose(x, scale, fp8_dtype)
    _bytes_equal(got[0], want[0])
    torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=1e-5)  # rows summed in another order
    want = ops.quantize_fp8_current(x, fp8_dtype, with_transpose=True)
    got = traced.quantize_fp8_current(x, fp8_dtype, with_transpose=True)
    for g, w in zip(got, want):  # data, data_t, scale, scale_inv, amax
        assert torch.equal(g.flatten().view(torch.uint8), w.flatten().view(torch.uint8))
    parts = [x[:, :128].contiguous(), x[:, 128:].contiguous()]
    want = ops.dbias_cast_transpose_current(parts, fp8_dtype)
    got = traced.dbias_cast_transpose_current(parts, fp8_dtype)
    for i in (0, 1, 3, 4, 5):  # data, data_t, scale, scale_inv, amax
        assert torch.equal(got[i].flatten().view(torch.uint8), want[i].flatten().view(torch.uint8)), i
    torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=1e-5)


@GPU
def test_compiled_twins_equal_eager_ops():
    from te_backend_cuda import ops, scaled_mm

    x = _x("cuda", shape=(256, 384))
    w = _x("cuda", shape=(512, 384))
    scale = torch.tensor([0.37], device="cuda")

    def step(x, w):
        xq, _, _ = traced.cast_transpose_fp8(x, scale, torch.float8_e4m3fn)
        wq, _, _ = traced.cast_transpose_fp8(w, scale, torch.float8_e4m3fn)
        return traced.gemm_fp8(xq, wq, 1 / scale, 1 / scale, out_dtype=torch.bfloat16, fast_accumulation=True)

    xq = ops.cast_transpose_fp8(x, scale, torch.float8_e4m3fn)[0]
    wq = ops.cast_transpose_fp8(w, scale, torch.float8_e4m3fn)[0]
    want = scaled_mm.gemm_fp8(xq, wq, 1 / scale, 1 / scale, out_dtype=torch.bfloat16, fast_accumulation=True)
    got = torch.compile(step, fullgraph=True)(x, w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@GPU
@pytest.mark.parametrize("before", [0.0, 1e9])
@pytest.mark.parametrize("fp8_dtype", F8)
def test_cast_twins_with_amax_out_equal_eager_ops_on_gpu(writes_state, fp8_dtype, before):
    """Maxing into a history slot: FP8 bytes and the whole history equal the eager kernels'."""
    from te_backend_cuda import ops

    x, scale = _x("cuda", shape=(256, 384)), torch.tensor([0.37], device="cuda")
    for name in ("quantize_fp8", "cast_transpose_fp8", "dbias_cast_transpose"):
        history = torch.rand(4, 3, device="cuda") + 1
        history[0, 1] = before
        want_history = history.clone()
        want = getattr(ops, name)(x, scale, fp8_dtype, amax_out=want_history[0][1:2])
        slot = history[0][1:2]
        got = getattr(traced, name)(x, scale, fp8_dtype, amax_out=slot)
        assert got[-1] is slot, name
        _bytes_equal(got[0], want[0])
        if name != "quantize_fp8":
            _bytes_equal(got[1], want[1])
        assert torch.equal(history, want_history), (name, history, want_history)


OPAQUE_IN_PROFILE = {f"te_core::{name}{variant}" for name in COVERED for variant in ("", "_into")}
UPDATE_IN_PROFILE = {"te_core::delayed_scaling_update"}


def _relative_error(g, w):
    g, w = g.double(), w.double()
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


@GPU
@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_delayed_scaling_on_gpu_equals_eager(writes_state, module):
    """te.Linear and te.TransformerLayer with DelayedScaling compiled by inductor (fullgraph):
    3 fwd+bwd steps within 1e-2 (relative, L2) of eager, the histories advancing alike and the
    scales close; at these sizes no cast and no scale update is left an opaque op, in the graphs
    or in a profile of a further compiled step."""
    results, (compiled, compiled_model, eager, graphs) = _compiled_and_eager(module, "cuda", torch.bfloat16,
                                                                            "inductor")
    for i, (got, want) in enumerate(results):
        for j, (g, w) in enumerate(zip(got, want)):
            assert _relative_error(g, w) <= 1e-2, f"step {i} tensor {j}: {_relative_error(g, w):.3g}"
    want, got = _state(eager), _state(compiled_model)
    assert want.keys() == got.keys()
    for key, w in want.items():
        assert _relative_error(got[key], w) <= 1e-2, f"{key}: {_relative_error(got[key], w):.3g}"
        if key[2] == "amax_history":
            assert torch.equal(got[key] != 0, w != 0), key
    _assert_only_the_update_opaque(graphs, update_traced=traced_kernels.DELAYED)
    x_shape, y_shape = SHAPES[module]
    x = torch.randn(x_shape, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(y_shape, device="cuda", dtype=torch.bfloat16)
    with torch.profiler.profile() as prof:
        _fwd_bwd(compiled, compiled_model, x, dy)
    watched = OPAQUE_IN_PROFILE | (UPDATE_IN_PROFILE if traced_kernels.DELAYED else set())
    opaque = sorted({e.name for e in prof.events() if e.name in watched})
    assert not opaque, f"opaque ops in the compiled step: {opaque}"


DYNAMIC_RECIPES = {
    "delayed": lambda: recipe.DelayedScaling(amax_history_len=4),
    "current": recipe.Float8CurrentScaling,
    "block": recipe.Float8BlockScaling,
    "current with epsilon": lambda: recipe.Float8CurrentScaling(fp8_quant_bwd_grad=recipe.QParams(amax_epsilon=1e-3)),
    "block with epsilon": lambda: recipe.Float8BlockScaling(
        fp8_quant_bwd_grad=recipe.QParams(power_2_scale=True, amax_epsilon=1e-3)),
}


@pytest.mark.parametrize("name", list(DYNAMIC_RECIPES))
def test_dynamic_shapes_compile_with_twins(monkeypatch, on_cpu, name):
    """torch.compile(dynamic=True, fullgraph=True) of a Linear with every cast twin. The
    backward's casts read floats for the first time inside dynamo's speculation of the backward
    (the E5M2 format's max after E4M3 forward casts, the gradient quantizer's epsilon), where a
    float read from a module's dict or an object's attribute would be a symbolic input it
    cannot lift (traced.fp8_max, quantizers._float_as_text), or a symbolic epsilon the block
    twin would decline. Two batch sizes, each equal to the eager reference, with no
    self-scaled cast left opaque."""
    rec = DYNAMIC_RECIPES[name]()
    twins = {**{op: traced.TRACED[op] for op in COVERED}, **traced_fused.twins("cpu"), **traced_block.TRACED_BLOCK}
    with cpu_backend_with(monkeypatch, "cpu_dynamic_twins", twins):
        torch.manual_seed(0)
        compiled_model = te.Linear(128, 256)
        eager = copy.deepcopy(compiled_model)
        te.init_quantization_state(eager, rec)
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        def step(model, x):
            with te.autocast(recipe=rec):
                return model(x)

        compiled = torch.compile(step, backend=capture, fullgraph=True, dynamic=True)
        for batch in (2, 4):
            x = torch.randn(16, batch, 128)
            dy = torch.randn(16, batch, 256)
            for j, (g, w) in enumerate(zip(_fwd_bwd(compiled, compiled_model, x, dy), _fwd_bwd(step, eager, x, dy))):
                assert torch.equal(g, w), f"batch {batch} tensor {j}: differs by {(g - w).abs().max()}"
    self_scaled = {"quantize_fp8_current", "dbias_cast_transpose_current", "quantize_blockwise"}
    assert not _opaque_ops(graphs) & self_scaled, sorted(_opaque_ops(graphs))
