"""The plain-torch twins of the norms, activations, backward epilogues and rotary embeddings
(te_backend_cuda.traced_fused). On the CPU: their math against the reference and float64,
FP8 output and amax_out (NaN included), what they decline, bfloat16 rounding kept under
inductor, and a compiled LayerNormMLP and TransformerLayer (fullgraph) on a CPU backend
carrying them, with none of the ops they take left opaque. On the GPU: each twin against
the eager cuda op, and compiled modules on the cuda backend against eager (CUDA graphs too)."""
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

import te_core as te
from te_backend_cuda import traced, traced_fused
from te_backend_cuda.traced_fused import MAX_NUMEL
from te_core import backend, recipe
from te_core.ops import CONTRACT
from te_core.reference import plugin as ref_plugin
from twin_backends import cpu_backend_with

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
COVERED = sorted(traced_fused.TRACED_FUSED)


@pytest.fixture(autouse=True)
def writes_state(monkeypatch):
    """The twins' amax_out writes on (off by default, see te_backend_cuda.traced.WRITES_SLOTS):
    these tests check their math; the reduce-overhead test sets it per case."""
    monkeypatch.setattr(traced, "WRITES_SLOTS", True)


def _traced_ops(rec: str) -> set:
    """The covered ops a compiled step under recipe `rec` must not leave opaque."""
    return set(COVERED)
TOL = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (1e-3, 1e-5),
       E4M3: (0.125, 0.0675), E5M2: (0.25, 0.125)}


def _rand(*shape, device="cpu", dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _slot(device):
    return torch.rand(1, device=device)  # a previous amax that this step's may or may not exceed


def _cases(device):
    """(id, op name, args, kwargs) of every twin, on fresh random inputs."""
    r = lambda *s, **k: _rand(*s, device=device, **k)  # noqa: E731
    x, w, b = r(37, 160, scale=3), r(160), r(160, dtype=torch.float32)
    _, mean, rstd, _ = ref_plugin.implementations()["layernorm_fwd"](x, w, b, 1e-5)
    scale = torch.tensor([0.37], device=device)
    h, dh = r(37, 160, scale=2), r(37, 80)
    freqs = torch.rand(16, 1, 1, 8, device=device) * 6
    return [
        ("ln", "layernorm_fwd", (x, w, b, 1e-5), {}),
        ("ln-zc", "layernorm_fwd", (x, w, b, 1e-5), dict(zero_centered_gamma=True)),
        ("rms-fp32", "rmsnorm_fwd", (x.float(), w, 1e-6), {}),
        ("rms", "rmsnorm_fwd", (x, w, 1e-5), {}),
        ("ln-bwd", "layernorm_bwd", (r(37, 160), x, mean, rstd, w), {}),
        ("ln-bwd-add", "layernorm_bwd_add", (r(37, 160), x, mean, rstd, w, r(37, 160)),
         dict(zero_centered_gamma=True)),
        ("rms-bwd", "rmsnorm_bwd", (r(37, 160), x, rstd, w), {}),
        ("rms-bwd-add", "rmsnorm_bwd_add", (r(37, 160), x, rstd, w, r(37, 160)), {}),
        ("ln-fp8", "layernorm_fwd", (x, w, b, 1e-5), dict(fp8_scale=scale, fp8_dtype=E4M3, amax_out=_slot(device))),
        ("rms-fp8", "rmsnorm_fwd", (x, w, 1e-5), dict(fp8_scale=scale, fp8_dtype=E5M2)),
        ("gelu", "activation_fwd", (h, "gelu"), {}),
        ("swiglu-fp8", "activation_fwd", (h, "swiglu"), dict(fp8_scale=scale, fp8_dtype=E4M3, amax_out=_slot(device))),
        ("swiglu", "activation_fwd", (h, "swiglu"), {}),
        ("clamped", "activation_fwd", (h, "clamped_swiglu"), dict(limit=3.0, alpha=1.5)),
        ("srelu-bwd", "activation_bwd", (r(37, 160), h, "srelu"), {}),
        ("geglu-bwd", "activation_bwd", (dh, h, "geglu"), {}),
        ("dbias", "dbias", (r(3, 37, 160),), {}),
        ("swiglu-bwd-dbias-ct", "activation_bwd_dbias_cast_transpose", (dh, h, "swiglu", scale, E4M3),
         dict(amax_out=_slot(device))),
        ("gelu-bwd-dbias-ct", "activation_bwd_dbias_cast_transpose", (r(37, 160), h, "gelu", scale, E5M2), {}),
        ("parts", "dbias_cast_transpose_parts", ([r(37, 64), r(37, 32), r(37, 32)], scale, E4M3),
         dict(amax_out=_slot(device))),
        ("rope", "rope_fwd", (r(12, 2, 3, 16), freqs), {}),
        ("rope-bshd-interleaved", "rope_bwd", (r(2, 12, 3, 16), freqs),
         dict(tensor_format="bshd", interleaved=True)),
    ]


CASE_IDS = [c[0] for c in _cases("cpu")]


def _case(case_id, device):
    return next(c for c in _cases(device) if c[0] == case_id)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _outputs(result):
    return [result] if isinstance(result, torch.Tensor) else list(result)


def _assert_close(got, want, what, fused=False):
    """TE's tolerance of the dtype; FP8 data compared as the values it holds. `fused`: got was
    compiled by inductor, which keeps a bfloat16/float16 intermediate in float32 where it fuses
    its producer and consumer (its default numerics), so a sum over rows of such an
    intermediate (dbias of a rounded dx) is compared as a whole, by relative L2 error."""
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {got.shape} vs {want.dtype} {want.shape}"
    rtol, atol = TOL[got.dtype]
    if fused and got.dtype in (torch.bfloat16, torch.float16):
        error = _relative_error(got, want)
        assert error <= rtol, f"{what}: relative L2 error {error:.3g} > {rtol}"
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


# --- CPU: math -------------------------------------------------------------------------------
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_twin_is_the_reference(case_id):
    """Each twin takes the call and returns the reference's results, bit for bit, writing
    amax_out in place as the reference does and returning it as the amax."""
    _, name, args, kwargs = _case(case_id, "cpu")
    twin_kwargs = _clone(kwargs)
    got = traced_fused.twins("cpu")[name](*_clone(args), **twin_kwargs)
    want = ref_plugin.implementations()[name](*args, **kwargs)
    assert got is not NotImplemented
    for i, (g, w) in enumerate(zip(_outputs(got), _outputs(want))):
        assert (g is None) == (w is None), f"output {i}"
        if g is not None:
            assert g.dtype == w.dtype and torch.equal(g.view(torch.uint8) if g.dtype in (E4M3, E5M2) else g,
                                                      w.view(torch.uint8) if w.dtype in (E4M3, E5M2) else w), i
    if kwargs.get("amax_out") is not None:
        assert torch.equal(twin_kwargs["amax_out"], kwargs["amax_out"])
        assert _outputs(got)[-1] is twin_kwargs["amax_out"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_backward_epilogue_against_float64(fp8_dtype, dtype):
    """dx = dy * gelu'(x) rounded to x's dtype, then dx * scale saturated to the format (values
    beyond its max land on it), dbias = column sums of dx, amax = max|dx| maxed into
    amax_out; compared with float64 (autograd's tanh-GELU derivative)."""
    x, dy = _rand(64, 96, dtype=dtype, scale=3), _rand(64, 96, dtype=dtype, scale=2)
    fmax = torch.finfo(fp8_dtype).max
    scale, slot = torch.tensor([fmax / 2.0]), torch.tensor([0.5])  # |dx| above 2 saturates
    data, data_t, dbias, amax = traced_fused.twins("cpu")["activation_bwd_dbias_cast_transpose"](
        dy, x, "gelu", scale, fp8_dtype, amax_out=slot)
    x64 = x.double().requires_grad_(True)
    F.gelu(x64, approximate="tanh").backward(dy.double())
    dx = x64.grad.to(dtype)
    _assert_close(data, (dx.double() * scale.double()).clamp(-fmax, fmax).float().to(fp8_dtype), "FP8 data")
    assert torch.equal(data_t.view(torch.uint8), data.t().contiguous().view(torch.uint8))
    assert data.float().abs().max() == fmax  # saturated, not inf
    _assert_close(dbias, dx.double().sum(0).to(dtype), "dbias")
    assert amax is slot
    torch.testing.assert_close(slot, dx.double().abs().max().float().reshape(1), rtol=TOL[dtype][0], atol=0)


def test_bfloat16_as_stored_under_inductor():
    """as_stored keeps the rounding to bfloat16 that inductor drops between a fused producer
    and consumer: an FP8 cast after it sees the stored values (specials and subnormals too)."""
    torch._dynamo.reset()
    y32 = torch.randn(4096) * torch.exp(torch.randn(4096) * 8)
    y32[:7] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3961e38, -0.0, 1e-45, -1e-40])

    def cast(y, stored):
        y16 = y.to(torch.bfloat16)
        y16 = traced.as_stored(y16) if stored else y16
        return y16.float().to(E5M2), y16

    want, _ = cast(y32, False)
    got, y16 = torch.compile(cast, fullgraph=True)(y32, True)
    assert torch.equal(y16.view(torch.int16)[7:], y32.to(torch.bfloat16).view(torch.int16)[7:])
    assert torch.equal(got.view(torch.uint8)[1:], want.view(torch.uint8)[1:]) and torch.isnan(got[0].float())


@pytest.mark.parametrize("case_id", ["swiglu-bwd-dbias-ct", "parts"])
def test_nan_reaches_the_amax(case_id):
    """A NaN in the input becomes the amax written into amax_out (NaN wins over the slot)."""
    _, name, args, kwargs = _case(case_id, "cpu")
    first = args[0][0] if isinstance(args[0], list) else args[0]
    first[5, 7] = float("nan")
    result = traced_fused.twins("cpu")[name](*args, **kwargs)
    assert torch.isnan(kwargs["amax_out"]).all() and _outputs(result)[-1] is kwargs["amax_out"]


def test_gated_activation_against_float64():
    x = _rand(40, 256, dtype=torch.float32, scale=2)
    y, amax = traced_fused.twins("cpu")["activation_fwd"](x, "swiglu")
    a, g = x.double().chunk(2, dim=-1)
    _assert_close(y, (F.silu(a) * g).float(), "swiglu")
    assert amax is None


# --- CPU: what the twins decline ------------------------------------------------------------
def test_twins_decline_other_devices():
    """TRACED_FUSED takes CUDA tensors only: a CPU call stays the opaque op (the reference)."""
    for _, name, args, kwargs in _cases("cpu"):
        assert traced_fused.TRACED_FUSED[name](*args, **kwargs) is NotImplemented, name


def test_twins_decline_max_numel():
    """From MAX_NUMEL elements on, the Triton kernels run (meta tensors: no memory)."""
    big = torch.empty(MAX_NUMEL // 1024, 1024, device="meta", dtype=torch.bfloat16)
    w = torch.empty(1024, device="meta", dtype=torch.bfloat16)
    meta = traced_fused.twins("meta")
    assert meta["layernorm_fwd"](big, w, w, 1e-5) is NotImplemented
    assert meta["activation_bwd"](big, big, "gelu") is NotImplemented
    assert meta["dbias"](big) is NotImplemented
    half = big[: big.shape[0] // 2]
    assert meta["dbias_cast_transpose_parts"]([half, half], torch.ones(1, device="meta"), E4M3) is NotImplemented
    assert meta["layernorm_fwd"](half, w, w, 1e-5) is not NotImplemented


def _declined_calls():
    x, w, b = _rand(8, 32), _rand(32), _rand(32)
    s = torch.ones(1)
    return {
        "float64 x": ("layernorm_fwd", (x.double(), w, b, 1e-5), {}),
        "float16 x": ("activation_bwd", (x.half(), x.half(), "gelu"), {}),
        "FP8 output with a float64 scale": ("layernorm_fwd", (x, w, b, 1e-5),
                                            dict(fp8_scale=s.double(), fp8_dtype=E4M3)),
        "FP8 output with a 2-element amax_out": ("activation_fwd", (x, "gelu"),
                                                 dict(fp8_scale=s, fp8_dtype=E4M3, amax_out=torch.zeros(2))),
        "empty x": ("rmsnorm_fwd", (x[:0], w, 1e-5), {}),
        "float16 scale": ("activation_bwd_dbias_cast_transpose", (x, x, "gelu", s.half(), E4M3), {}),
        "2-element scale": ("dbias_cast_transpose_parts", ([x, x], torch.ones(2), E4M3), {}),
        "scale on another device": ("dbias_cast_transpose_parts", ([x, x], s.to("meta"), E4M3), {}),
        "amax_out without FP8": ("layernorm_fwd", (x, w, b, 1e-5), dict(amax_out=torch.zeros(1))),
        "bfloat16 amax_out": ("activation_bwd_dbias_cast_transpose", (x, x, "relu", s, E4M3),
                              dict(amax_out=torch.zeros(1, dtype=torch.bfloat16))),
        "not an FP8 dtype": ("activation_bwd_dbias_cast_transpose", (x, x, "gelu", s, torch.int8), {}),
        "3-D x": ("activation_bwd_dbias_cast_transpose", (x[None], x[None], "gelu", s, E4M3), {}),
        "bias on another device": ("layernorm_fwd", (x, w, b.to("meta"), 1e-5), {}),
        "rstd on another device": ("rmsnorm_bwd", (x, x, torch.ones(8, device="meta"), w), {}),
        "no parts": ("dbias_cast_transpose_parts", ([], s, E4M3), {}),
        "integer part": ("dbias_cast_transpose_parts", ([x, x.to(torch.int32)], s, E4M3), {}),
        "freqs on another device": ("rope_fwd", (_rand(4, 1, 2, 8), torch.ones(4, 1, 1, 8, device="meta")), {}),
    }


@pytest.mark.parametrize("what", list(_declined_calls()))
def test_twins_decline_what_the_kernels_do_not_take(what):
    name, args, kwargs = _declined_calls()[what]
    assert traced_fused.twins("cpu")[name](*args, **kwargs) is NotImplemented


def test_bad_arguments_raise_the_references_error():
    """A call the twin takes but the contract rejects raises the reference's error."""
    x = _rand(8, 32)
    with pytest.raises(ValueError, match="weight has shape"):
        traced_fused.twins("cpu")["rmsnorm_fwd"](x, _rand(16), 1e-5)
    with pytest.raises(ValueError, match="kind="):
        traced_fused.twins("cpu")["activation_fwd"](x, "tanh")


@pytest.mark.parametrize("name", COVERED)
def test_twin_signatures_follow_the_contract(name):
    """Each decline rule takes the op's arguments as the contract names them (a contract
    change fails here, not while a model is traced)."""
    takes = list(inspect.signature(traced_fused._TAKES[name]).parameters.values())[1:]  # after device_type
    contract = list(CONTRACT[name].signature.parameters.values())

    def names(params, kind):
        return [p.name for p in params if p.kind is kind]

    positional, keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    assert names(takes, positional) == names(contract, positional)
    taken, wanted = set(names(takes, keyword)), set(names(contract, keyword))
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes)
    assert taken <= wanted and (any_keyword or taken == wanted), (taken, wanted)
    assert all(p.default is not p.empty for p in takes if p.kind is keyword)


# --- CPU: under torch.compile ----------------------------------------------------------------
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_twin_traces_without_graph_breaks(case_id):
    torch._dynamo.reset()
    _, name, args, kwargs = _case(case_id, "cpu")
    twin = traced_fused.twins("cpu")[name]
    compiled_kwargs = _clone(kwargs)
    got = torch.compile(twin, backend="aot_eager", fullgraph=True)(*_clone(args), **compiled_kwargs)
    want = twin(*args, **kwargs)
    for i, (g, w) in enumerate(zip(_outputs(got), _outputs(want))):
        if w is not None:
            _assert_close(g, w, f"{case_id} output {i}")
    if kwargs.get("amax_out") is not None:
        assert torch.equal(compiled_kwargs["amax_out"], kwargs["amax_out"])


@pytest.fixture
def cpu_twins_backend(monkeypatch):
    """A CPU backend running the reference, with the twins (as twins("cpu")) as its traced."""
    with cpu_backend_with(monkeypatch, "cpu_twins", traced_fused.twins("cpu")):
        yield


MODULES = {  # (device, params_dtype) -> module
    "LayerNormMLP": lambda *f: te.LayerNormMLP(64, 128, device=f[0], params_dtype=f[1]),
    "LayerNormMLP-rms-swiglu": lambda *f: te.LayerNormMLP(64, 128, normalization="RMSNorm", activation="swiglu",
                                                          device=f[0], params_dtype=f[1]),
    "TransformerLayer": lambda *f: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                                       normalization="RMSNorm", activation="swiglu", device=f[0],
                                                       params_dtype=f[1]),
}
RECIPES = {"high-precision": None, "delayed": lambda: recipe.DelayedScaling(amax_history_len=4)}


def _step(rec, rope):
    def step(model, x):
        kwargs = {} if rope is None else {"rotary_pos_emb": rope}
        with te.autocast(enabled=rec is not None, recipe=rec):
            return model(x, **kwargs)
    return step


def _fwd_bwd(step, model, x, dy):
    """[y, dx, parameter gradients], copied (a CUDA graph's replay overwrites its outputs)."""
    x = x.clone().requires_grad_(True)
    y = step(model, x)
    y.backward(dy)
    out = [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _opaque_ops(graphs):
    """The contract ops left opaque in dynamo's graphs (autograd.Function bodies included): the
    te_core custom ops, by op name (a call writing amax_out records the `<name>_into` variant)."""
    targets = {str(node.target) for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
               for node in sub.graph.nodes}
    names = {t.split(".")[1] for t in targets if t.startswith("te_core.")}
    return {n[: -len("_into")] if n.endswith("_into") else n for n in names}


def _compare_compiled(make, rec, device, dtype, backend_fn, rope=None, mode=None, steps=2):
    """[(compiled outputs and gradients, eager ones) of each step], and the two models."""
    torch.manual_seed(0)
    eager = make(device, dtype)
    compiled_model = copy.deepcopy(eager)
    if rec is not None:  # as compiling makes the twin's: both start at scale 1
        te.init_quantization_state(eager, rec)
    step = _step(rec, rope)
    compiled = torch.compile(step, fullgraph=True, backend=backend_fn, mode=mode)
    results = []
    for i in range(steps):
        x = _rand(16, 2, 64, device=device, dtype=dtype, scale=i + 1)
        dy = _rand(16, 2, 64, device=device, dtype=dtype)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        results.append((_fwd_bwd(compiled, compiled_model, x, dy), _fwd_bwd(step, eager, x, dy)))
    return results, compiled_model, eager


def _capture(graphs):
    def backend_fn(gm, example_inputs):  # dynamo's graphs, run as traced
        graphs.append(gm)
        return gm.forward
    return backend_fn


@pytest.mark.parametrize("rec", list(RECIPES))
@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_module_has_no_covered_opaque_op(cpu_twins_backend, module, rec):
    graphs = []
    rope = te.RotaryPositionEmbedding(16)(16) if module == "TransformerLayer" else None
    results, _, _ = _compare_compiled(MODULES[module], RECIPES[rec] and RECIPES[rec](), "cpu", torch.float32,
                                      _capture(graphs), rope)
    left = _opaque_ops(graphs)
    assert graphs and not left & _traced_ops(rec), sorted(left)
    for step, (got, want) in enumerate(results):
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"step {step} tensor {i}")


def test_inductor_writes_the_history_slots_in_place(cpu_twins_backend):
    """Under inductor the twins max their amaxes into the module's own amax histories (the
    same tensors, updated in place), and outputs, gradients and histories equal eager's."""
    torch.manual_seed(0)
    rec = recipe.DelayedScaling(amax_history_len=4)
    eager = MODULES["LayerNormMLP"]("cpu", torch.float32)
    compiled_model = copy.deepcopy(eager)
    for model in (eager, compiled_model):  # both start at scale 1, as compiling makes a state
        te.init_quantization_state(model, rec)
    histories = [g.amax_history for g in compiled_model._recipe_state.scaling_groups().values()]
    step = _step(rec, None)
    compiled = torch.compile(step, fullgraph=True)
    for i in range(2):
        x, dy = _rand(16, 2, 64, dtype=torch.float32, scale=i + 1), _rand(16, 2, 64, dtype=torch.float32)
        got, want = _fwd_bwd(compiled, compiled_model, x, dy), _fwd_bwd(step, eager, x, dy)
        for j, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"step {i} tensor {j}")
    now = [g.amax_history for g in compiled_model._recipe_state.scaling_groups().values()]
    assert all(a is b for a, b in zip(now, histories)) and all(h.abs().sum() > 0 for h in now)
    for a, b in zip(now, [g.amax_history for g in eager._recipe_state.scaling_groups().values()]):
        torch.testing.assert_close(a, b, rtol=1.3e-6, atol=1e-5)


# --- GPU -----------------------------------------------------------------------------------
@GPU
@pytest.mark.parametrize("case_id", CASE_IDS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_twin_equals_the_cuda_op(case_id, compiled):
    """Each twin (run as it is, and compiled by inductor) against the op as the cuda backend
    runs it eagerly (its kernel, or the reference where its supports() declines, as for
    clamped_swiglu): within TE's tolerance of the dtype (the FP8 data as the values it
    holds), amax_out as written."""
    torch._dynamo.reset()
    _, name, args, kwargs = _case(case_id, "cuda")
    twin = traced_fused.TRACED_FUSED[name]
    twin_kwargs = _clone(kwargs)
    run = torch.compile(twin, fullgraph=True) if compiled else twin
    got = run(*_clone(args), **twin_kwargs)
    backend.set_backend("cuda")
    try:
        want = getattr(te.ops, name)(*args, **kwargs)
    finally:
        backend.reset()
    assert got is not NotImplemented
    for i, (g, w) in enumerate(zip(_outputs(got), _outputs(want))):
        assert (g is None) == (w is None), f"output {i}"
        if w is not None:
            _assert_close(g.reshape(w.shape), w, f"{case_id} output {i}", fused=compiled)
    if kwargs.get("amax_out") is not None:  # compiled: the amax of a bfloat16 intermediate kept in float32
        rtol = TOL[torch.bfloat16][0] if compiled else 1e-5
        torch.testing.assert_close(twin_kwargs["amax_out"], kwargs["amax_out"], rtol=rtol, atol=0)


def _relative_error(g, w):
    g, w = g.double(), w.double()
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


@GPU
@pytest.mark.parametrize("rec", list(RECIPES))
@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_module_on_cuda(module, rec):
    """On the cuda backend: the compiled step records none of the covered ops it takes as an
    opaque op, and inductor's step equals eager within 1e-2 relative (L2) on every output and
    gradient."""
    backend.set_backend("cuda")
    try:
        rope = te.RotaryPositionEmbedding(16)(16).cuda() if module == "TransformerLayer" else None
        make, make_rec = MODULES[module], RECIPES[rec]
        torch._dynamo.reset()
        graphs = []
        _compare_compiled(make, make_rec and make_rec(), "cuda", torch.bfloat16, _capture(graphs), rope)
        left = _opaque_ops(graphs)
        assert graphs and not left & _traced_ops(rec), sorted(left)
        torch._dynamo.reset()
        results, _, _ = _compare_compiled(make, make_rec and make_rec(), "cuda", torch.bfloat16, "inductor", rope)
        _assert_relative_errors(results)
    finally:
        torch._dynamo.reset()
        backend.reset()  # the next test selects as it would have


def _assert_relative_errors(results):
    for step, (got, want) in enumerate(results):
        for i, (g, w) in enumerate(zip(got, want)):
            assert _relative_error(g, w) <= 1e-2, f"step {step} tensor {i}: {_relative_error(g, w):.3g}"


def _scaling_state(model):
    """{(module, slot, name): amax history or scale} of every delayed-scaling quantizer."""
    return {(d, slot, k): v.clone() for d, slots in model.quantization_state().items()
            for slot, entry in slots.items() for k, v in entry.items()}


@GPU
@pytest.mark.parametrize("slots", [False, True], ids=["shipped", "slot-writes"])
@pytest.mark.parametrize("module", ["LayerNormMLP", "TransformerLayer"])
def test_reduce_overhead_keeps_the_histories_advancing(module, slots, monkeypatch):
    """mode="reduce-overhead" (CUDA graphs) with the shipped twins (the history-slot writes left
    to the opaque ops), and with the slot writes traced (WRITES_SLOTS): every replay equals
    eager within 1e-2 relative (L2), and the histories equal eager's after the replays (they
    kept advancing)."""
    monkeypatch.setattr(traced, "WRITES_SLOTS", slots)
    backend.set_backend("cuda")
    try:
        torch._dynamo.reset()
        rope = te.RotaryPositionEmbedding(16)(16).cuda() if module == "TransformerLayer" else None
        results, compiled_model, eager = _compare_compiled(
            MODULES[module], recipe.DelayedScaling(amax_history_len=4), "cuda", torch.bfloat16, "inductor", rope,
            mode="reduce-overhead", steps=5)
        _assert_relative_errors(results)
        got, want = _scaling_state(compiled_model), _scaling_state(eager)
        assert got.keys() == want.keys() and any(k[2] == "amax_history" for k in want)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-2, atol=1e-5, msg=lambda m: f"{key}: {m}")
    finally:
        torch._dynamo.reset()
        backend.reset()
