"""The compiled code's launches of te_triton's cast kernels (te_backend_cuda.traced_kernels):
current-scaling and block-scaled casts of KERNEL_MIN_NUMEL elements and up, under inductor,
give the eager cuda op's bytes (the same kernels), on inputs with NaN, inf, zero runs and rows
of very different magnitudes, whole and partial tiles; the compiled call launches te_triton's
kernels, not the compiler's reduction (for sizes inductor leaves symbolic too, while
traced_kernels.SYMBOLIC is on, its default); a compiled te.Linear of that size matches eager.
Below the threshold the compiler's casts stay. On the CPU, whatever the GPU: each twin's launches
(kernel, grid, tiles, flags, argument layouts) are the ones te_triton's eager op makes, so a
change to either that the other misses fails here."""
import contextlib
import copy
import re

import pytest
import torch

import te_core as te
from te_backend_cuda import traced, traced_block, traced_kernels
from te_core import backend, recipe

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# at least KERNEL_MIN_NUMEL elements: whole tiles, partial tiles both ways, a wide one
SHAPES = [(1024, 1024), (1040, 1100), (640, 2048)]
# No two sizes alike: dynamo gives equal sizes one symbol (duck sizing), and the next shape
# without that equality is a second graph whatever the kernels do.
SYMBOLIC_SHAPES = [(1040, 1100), (640, 2048), (1536, 1024)]


def _input(shape, dtype=torch.bfloat16, special=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-3, 4, (m, 1), generator=g)
    if special:
        x[0, 3] = float("nan")
        x[2, 130] = float("-inf")
    x[m - 1, :128] = 0.0
    return x.to(dtype).cuda()


def _assert_same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"output {i}"
        if w is None:
            continue
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), \
            f"output {i}: {g.dtype} {g.shape}, {w.dtype} {w.shape}"
        if g.dim() == 2 and w.dtype == torch.float32:  # scale grids: the layout the GEMM reads
            assert g.stride() == w.stride(), f"output {i}: strides {g.stride()} against {w.stride()}"
        assert torch.equal(g.flatten().view(torch.uint8), w.flatten().view(torch.uint8)), f"output {i}"


def test_the_threshold_and_what_it_declines():
    assert traced_kernels.KERNEL_MIN_NUMEL == 1 << 20
    big = torch.empty(1024, 1024, dtype=torch.bfloat16, device="meta")
    assert not traced_kernels.takes(big)  # not a CUDA device
    if torch.cuda.is_available():
        x = torch.empty(1024, 1024, dtype=torch.bfloat16, device="cuda")
        assert traced_kernels.takes(x)
        assert not traced_kernels.takes(x[:, :1000])  # strided
        assert not traced_kernels.takes(x[:1023])  # fewer elements


def test_gpus_whose_convert_does_not_saturate_keep_the_compilers_cast(monkeypatch):
    """The kernels leave saturation to the convert (compute capability 8.9 and up), as the eager
    ops' supports() checks; on an older GPU the twin keeps the compiler's cast, which clamps."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_backend_cuda.ops import checks

    with FakeTensorMode():  # a CUDA tensor as the trace sees it, on any machine
        x = torch.empty(1024, 1024, dtype=torch.bfloat16, device="cuda")
    monkeypatch.setattr(checks, "fp8_convert_ok", lambda index: (True, ""))
    assert traced_kernels.takes(x)
    monkeypatch.setattr(checks, "fp8_convert_ok", lambda index: (False, "compute capability 8.0"))
    assert not traced_kernels.takes(x)


CURRENT = [(False, False, 0.0), (True, False, 0.0), (True, True, 0.0), (True, False, 1e-3), (False, True, 0.0)]


@GPU
@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("setting", CURRENT, ids=lambda s: f"t{int(s[0])}-pow2{int(s[1])}-eps{s[2]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_current_scaling_cast_compiled_is_the_cuda_op(shape, setting, fp8_dtype, special):
    from te_backend_cuda import ops

    torch._dynamo.reset()
    with_transpose, pow2, eps = setting
    kwargs = dict(with_transpose=with_transpose, force_pow2_scales=pow2, amax_epsilon=eps)
    x = _input(shape, special=special, seed=1)
    got = torch.compile(lambda t: traced.quantize_fp8_current(t, fp8_dtype, **kwargs), fullgraph=True)(x)
    _assert_same(got, ops.quantize_fp8_current(x, fp8_dtype, **kwargs))
    torch._dynamo.reset()


BLOCK = [(False, False, True, 0.0), (False, True, True, 0.0), (True, False, True, 0.0), (True, True, True, 0.0),
         (True, True, False, 1e-3)]


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("setting", BLOCK, ids=lambda s: f"{'2d' if s[0] else '1d'}-t{int(s[1])}-pow2{int(s[2])}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_block_cast_compiled_is_the_cuda_op(shape, setting, dtype):
    from te_backend_cuda import ops

    torch._dynamo.reset()
    block_2d, with_transpose, pow2, eps = setting
    kwargs = dict(block_2d=block_2d, with_transpose=with_transpose, force_pow2_scales=pow2, amax_epsilon=eps)
    x = _input(shape, dtype=dtype, seed=2)
    got = torch.compile(lambda t: traced_block.quantize_blockwise(t, E4M3, **kwargs), fullgraph=True)(x)
    _assert_same(got, ops.quantize_blockwise(x, E4M3, **kwargs))
    torch._dynamo.reset()


def _joins(names):
    """The compiler's kernels among `names` that join tensors (a cat; not a scatter)."""
    return [n for n in names if re.search(r"(?<![a-z])cat(?![a-z])", n)]


def _kernels(fn, x, with_ops=False):
    """The names of the kernels fn(x) runs (after a first call), and with_ops, of the ops it calls."""
    fn(x)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if with_ops else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn(x)
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if with_ops or e.device_type == torch.autograd.DeviceType.CUDA}


@GPU
def test_compiled_casts_launch_te_triton_kernels_above_the_threshold_only():
    torch._dynamo.reset()
    current = torch.compile(lambda t: traced.quantize_fp8_current(t, E4M3, with_transpose=True), fullgraph=True)
    names = _kernels(current, _input((1024, 1024), special=False))
    assert {"_quantize_kernel", "_cast_transpose_kernel"} <= names and not any("amax" in n for n in names), names
    block = torch.compile(lambda t: traced_block.quantize_blockwise(t, E4M3, with_transpose=True), fullgraph=True)
    names = _kernels(block, _input((1024, 1024), special=False))
    assert "_blockwise_kernel" in names and not any("amax" in n for n in names), names
    torch._dynamo.reset()
    small = _kernels(current, _input((256, 512), special=False))  # the compiler's amax reduction
    assert "_cast_transpose_kernel" not in small and any("amax" in n for n in small), small
    torch._dynamo.reset()


@GPU
@pytest.mark.parametrize("cast", ["current", "current-transpose", "delayed", "delayed-transpose"])
def test_casts_with_symbolic_sizes_launch_te_triton_kernels(monkeypatch, cast):
    """With traced_kernels.SYMBOLIC on, compiled with dynamic=True (every size symbolic, as
    torch.compile's automatic dynamic shapes make a token count that changed), the plain casts
    still launch te_triton's kernels, with grids the compiled code works out per call: one
    graph for every shape, each call the eager op's bytes (a delayed cast's amax maxed into its
    history slot alike), whole and partial tiles, NaN and inf included."""
    from te_backend_cuda import ops

    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)

    transpose = cast.endswith("transpose")
    if cast.startswith("current"):
        def twin(t, slot):
            return traced.quantize_fp8_current(t, E4M3, with_transpose=transpose)

        def eager(t, slot):
            return ops.quantize_fp8_current(t, E4M3, with_transpose=transpose)
    else:
        scale = torch.full((1,), 0.5, device="cuda")

        def twin(t, slot):
            fn = traced.cast_transpose_fp8 if transpose else traced.quantize_fp8
            return fn(t, scale, E4M3, amax_out=slot)

        def eager(t, slot):
            fn = ops.cast_transpose_fp8 if transpose else ops.quantize_fp8
            return fn(t, scale, E4M3, amax_out=slot)

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(twin, fullgraph=True, dynamic=True)
    for shape in SYMBOLIC_SHAPES:
        x = _input(shape, seed=shape[0])
        slots = [torch.full((4,), 2.0, device="cuda")[1:2] for _ in range(2)]  # a history's row, not its start
        _assert_same(compiled(x, slots[0]), eager(x, slots[1]))
        assert torch.equal(slots[0].view(torch.int32), slots[1].view(torch.int32))  # (NaN: the same NaN)
    # Graphs kept, not backend calls: with every float symbolic too, a trace whose float
    # (amax_epsilon, a default here) reaches a kernel argument is restarted once with it
    # specialized, which calls the backend a second time for the same frame.
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs for {len(SYMBOLIC_SHAPES)} shapes"
    names = _kernels(lambda t: compiled(t, torch.zeros(1, device="cuda")), _input((1536, 1024), special=False))
    want = "_cast_transpose_kernel" if transpose else "_quantize_kernel"
    assert want in names and not any("amax" in n for n in names), names
    torch._dynamo.reset()


@GPU
@pytest.mark.parametrize("cast", ["block", "block-transpose", "block-2d", "block-2d-transpose", "block-dbias"])
def test_block_casts_with_symbolic_sizes_launch_te_triton_kernels(monkeypatch, cast):
    """With traced_kernels.SYMBOLIC and SYMBOLIC_BLOCK on, compiled with dynamic=True: the block
    casts launch te_triton's kernel with grids and scale grids the compiled code works out per
    call, one graph for every shape, each call the eager op's bytes, scales (and their layout)
    and bias gradient, whole and partial blocks, NaN and inf included."""
    from te_backend_cuda import ops

    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_BLOCK", True)
    kwargs = dict(block_2d="-2d" in cast, with_transpose=cast.endswith("transpose"), force_pow2_scales=True,
                  amax_epsilon=0.0)
    if cast == "block-dbias":
        def twin(t):
            return traced_block.dbias_cast_transpose_blockwise([t], E4M3)

        def eager(t):
            return ops.dbias_cast_transpose_blockwise([t], E4M3)
    else:
        def twin(t):
            return traced_block.quantize_blockwise(t, E4M3, **kwargs)

        def eager(t):
            return ops.quantize_blockwise(t, E4M3, **kwargs)

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(twin, fullgraph=True, dynamic=True)
    for shape in SYMBOLIC_SHAPES:
        x = _input(shape, seed=shape[0])
        _assert_same(compiled(x), eager(x))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs for {len(SYMBOLIC_SHAPES)} shapes"
    names = _kernels(compiled, _input((1536, 1024), special=False))
    assert "_blockwise_kernel" in names, names
    torch._dynamo.reset()


@GPU
@pytest.mark.parametrize("dynamic", [True, False], ids=["symbolic", "plain"])
def test_fp8_transposes_launch_te_triton_kernels(dynamic):
    """The FP8 transpose twin compiled with plain or symbolic sizes (symbolic: one graph per format):
    te_triton's transpose kernel, and the bytes of data.t(), NaN and infinities included."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(traced.transpose_fp8, fullgraph=True, dynamic=dynamic)
    for shape in SYMBOLIC_SHAPES:
        for dtype in (E4M3, E5M2):
            data = _input(shape, seed=shape[0]).to(dtype)
            got = compiled(data)
            assert got.dtype == dtype and got.shape == shape[::-1]
            assert torch.equal(got.view(torch.uint8), data.t().contiguous().view(torch.uint8)), (shape, dtype)
    if dynamic:
        assert counters["stats"]["unique_graphs"] == 2  # one per FP8 format, each for every shape
    assert "_transpose_kernel" in _kernels(compiled, data)
    torch._dynamo.reset()


FUSED_NAMES = {"layernorm": "layernorm_fwd", "rmsnorm": "rmsnorm_fwd", "gelu": "activation_fwd",
               "swiglu": "activation_fwd"}


@GPU
@pytest.mark.parametrize("batch", [4, 0], ids=["tokens-x-batch", "rows"])
@pytest.mark.parametrize("cast", list(FUSED_NAMES))
def test_fused_forwards_over_changing_token_counts_launch_te_triton_kernels(monkeypatch, delayed, cast, batch):
    """With traced_kernels.SYMBOLIC and SYMBOLIC_FUSED on, a norm or activation forward with FP8
    output into a history slot, its token count marked dynamic (hidden size fixed): one graph
    for every token count, te_triton's kernel launched by it, and at each count the eager op's
    FP8 bytes, statistics and history, bit for bit; the 2-D input's row count is not known to
    fill the norm's steps (its masked variant), the 3-D one's is."""
    from te_backend_cuda import ops, traced_fused
    from torch._dynamo.utils import counters

    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", True)
    name, hidden = FUSED_NAMES[cast], 1024
    g = torch.Generator().manual_seed(3)
    w, b = [(torch.randn(hidden, generator=g) + 1).to(torch.bfloat16).cuda() for _ in range(2)]
    params = {"layernorm": (w, b, 1e-5), "rmsnorm": (w, 1e-5)}.get(cast, (cast,))
    kwargs = dict(fp8_scale=torch.full((1,), 20.0 if cast.endswith("norm") else 0.7, device="cuda"), fp8_dtype=E4M3)
    twin = traced_fused.TRACED_FUSED[name]
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(lambda x, h: twin(x, *params, **kwargs, amax_out=h[0][1:2]), fullgraph=True)
    for tokens in (260, 384, 520):
        width = 2 * hidden if cast == "swiglu" else hidden
        x = (torch.randn((tokens, batch, width) if batch else (tokens, width), generator=g) * 3 + 1)
        x = x.to(torch.bfloat16).cuda()
        x[1, 0] = float("nan") if tokens == 384 else x[1, 0]
        torch._dynamo.mark_dynamic(x, 0)
        history = torch.rand(4, 3, device="cuda") + 1
        want_history = history.clone()
        want = getattr(ops, name)(x, *params, **kwargs, amax_out=want_history[0][1:2])
        got = run(x, history)
        _assert_same([history, *got], [want_history, *want])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs for 3 token counts"
    names = _kernels(lambda h: run(x, h), history)
    assert ("_norm_fwd_kernel" if cast.endswith("norm") else "_act_fwd_kernel") in names, names
    torch._dynamo.reset()


@GPU
@pytest.mark.parametrize("cast", ["dbias", "gelu", "swiglu", "parts", "current"])
def test_bias_gradient_casts_over_changing_token_counts_launch_te_triton_kernels(monkeypatch, cast):
    """With traced_kernels.SYMBOLIC and SYMBOLIC_FUSED on, delayed scaling's bias-gradient casts into
    a history slot (alone, after an activation's backward, of joined column blocks) and current
    scaling's, the token count marked dynamic: one graph for every count, te_triton's kernel
    launched by it, and at each count the eager op's FP8 bytes of both layouts, history (or
    scales and amax) bit for bit, NaN included; the bias gradient within bf16's tolerance (its
    row groups' sums added in the compiler's order)."""
    from te_backend_cuda import ops, traced_fused
    from torch._dynamo.utils import counters

    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", True)
    scale = torch.full((1,), 0.7, device="cuda")
    g = torch.Generator().manual_seed(4)

    def rand(rows, width):
        return (torch.randn((rows, width), generator=g) * 3 + 1).to(torch.bfloat16).cuda()

    if cast == "dbias":
        twin, eager = traced.dbias_cast_transpose, ops.dbias_cast_transpose
    elif cast == "current":
        def twin(dy, scale, fp8_dtype, amax_out):
            return traced.dbias_cast_transpose_current([dy], fp8_dtype)

        def eager(dy, scale, fp8_dtype, amax_out):
            return ops.dbias_cast_transpose_current([dy], fp8_dtype)
    elif cast == "parts":
        twin, eager = traced_fused.TRACED_FUSED["dbias_cast_transpose_parts"], ops.dbias_cast_transpose_parts
    else:
        fused = traced_fused.TRACED_FUSED["activation_bwd_dbias_cast_transpose"]

        def twin(dy, x, scale, fp8_dtype, amax_out):
            return fused(dy, x, cast, scale, fp8_dtype, amax_out=amax_out)

        def eager(dy, x, scale, fp8_dtype, amax_out):
            return ops.activation_bwd_dbias_cast_transpose(dy, x, cast, scale, fp8_dtype, amax_out=amax_out)
    torch._dynamo.reset()
    counters.clear()
    if cast == "parts":
        run = torch.compile(lambda h, *p: twin(list(p), scale, E4M3, amax_out=h[0][1:2]), fullgraph=True)
    else:
        run = torch.compile(lambda h, *a: twin(*a, scale, E4M3, amax_out=h[0][1:2]), fullgraph=True)
    for rows in (1040, 2600, 4200):
        if cast == "parts":
            inputs = [rand(rows, w) for w in (256, 512, 256)]
        else:
            inputs = [rand(rows, 1024)] + ([] if cast in ("dbias", "current")
                                           else [rand(rows, 2048 if cast == "swiglu" else 1024)])
        inputs[0][1, 3] = float("nan") if rows == 2600 else inputs[0][1, 3]
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 0)
        history = torch.rand(4, 3, device="cuda") + 1
        want_history = history.clone()
        if cast == "parts":
            want = eager(inputs, scale, E4M3, amax_out=want_history[0][1:2])
        else:
            want = eager(*inputs, scale, E4M3, amax_out=want_history[0][1:2])
        got = run(history, *inputs)
        _assert_same([history, got[0], got[1], *got[3:]], [want_history, want[0], want[1], *want[3:]])
        torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=1e-5, equal_nan=True)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs for 3 token counts"
    assert "_dbias_ct_kernel" in _kernels(lambda h: run(h, *inputs), history)
    torch._dynamo.reset()


@GPU
@pytest.mark.parametrize("dynamic", [True, False], ids=["symbolic", "plain"])
@pytest.mark.parametrize("cast", ["layernorm", "layernorm-add", "rmsnorm", "rmsnorm-add"])
def test_norm_backwards_launch_te_triton_kernels(cast, dynamic):
    """Compiled norm backwards (traced_kernels.norm_bwd) of (tokens, 4, 1024) bfloat16 rows at three
    token counts, the count marked dynamic (one graph) or every size plain (a graph per count):
    te_triton's norm backward kernel launched, and at each count dx the eager op's bit for bit,
    the weight's (and bias's) gradient within bfloat16's tolerance (the programs' partial rows
    summed in the compiler's order); zero-centered gamma with LayerNorm's residual gradient."""
    from te_backend_cuda import ops, traced_fused
    from torch._dynamo.utils import counters

    rms, add = cast.startswith("rms"), cast.endswith("-add")
    name = ("rmsnorm_bwd" if rms else "layernorm_bwd") + ("_add" if add else "")
    twin, eager = traced_fused.TRACED_FUSED[name], getattr(ops, name)
    kwargs = dict(zero_centered_gamma=cast == "layernorm-add")
    g = torch.Generator().manual_seed(6)
    w, b = [(torch.randn(1024, generator=g) + 1).to(torch.bfloat16).cuda() for _ in range(2)]
    torch._dynamo.reset()
    counters.clear()
    run = torch.compile(lambda dy, x, stats, extra: twin(dy, x, *stats, w, *extra, **kwargs), fullgraph=True,
                        dynamic=None if dynamic else False)
    for tokens in (260, 384, 520):
        dy, x, res = [(torch.randn((tokens, 4, 1024), generator=g) * 3 + 1).to(torch.bfloat16).cuda() for _ in range(3)]
        stats = list(ops.rmsnorm_fwd(x, w, 1e-5)[1:2] if rms else ops.layernorm_fwd(x, w, b, 1e-5)[1:3])
        extra = [res] if add else []
        for t in [dy, x, *stats, *extra] if dynamic else []:
            torch._dynamo.mark_dynamic(t, 0)
        want = eager(dy, x, *stats, w, *extra, **kwargs)
        got = run(dy, x, stats, extra)
        assert len(got) == len(want) == (2 if rms else 3)
        _assert_same(got[:1], want[:1])
        for i, (a, e) in enumerate(zip(got[1:], want[1:])):
            torch.testing.assert_close(a, e, rtol=1.6e-2, atol=1e-5,
                                       msg=lambda m: f"{tokens} tokens, output {i + 1}: {m}")
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == (1 if dynamic else 3), f"{graphs} graphs for 3 token counts"
    assert "_norm_bwd_kernel" in _kernels(lambda d: run(d, x, stats, extra), dy)
    torch._dynamo.reset()


@contextlib.contextmanager
def _compiled_linear(make, build=None):
    """(model, an identical twin, step(module, x), that step compiled with fullgraph=True) on the
    cuda backend: a te.Linear(1024, 1024) (or what build() makes) forward under te.autocast with
    the recipe make() builds. Eager steps run the model and compiled ones the twin, so that
    delayed scaling's state advances alike in both."""
    backend.set_backend("cuda")
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = te.Linear(1024, 1024, params_dtype=torch.bfloat16, device="cuda") if build is None else build()
        twin = copy.deepcopy(model)
        rec = make()
        te.init_quantization_state(model, rec)  # as compiling makes the twin's: both start alike

        def step(module, inp):
            with te.autocast(recipe=rec):
                return module(inp)

        yield model, twin, step, torch.compile(step, fullgraph=True)
    finally:
        torch._dynamo.reset()
        backend.reset()


@GPU
@pytest.mark.parametrize("make", [recipe.Float8CurrentScaling, recipe.Float8BlockScaling], ids=["current", "block"])
def test_compiled_linear_of_that_size_matches_eager(make):
    """te.Linear(1024, 1024) on 1024 tokens: every cast of the step is at the threshold. The
    forward output is eager's bit for bit (same casts, same GEMM); the gradients within
    bfloat16's tolerance (the bias gradient sums in another order)."""
    with _compiled_linear(make) as (model, twin, step, compiled):
        for i in range(2):
            x = (torch.randn(1024, 1024, device="cuda") * (i + 1)).to(torch.bfloat16)
            dy = torch.randn(1024, 1024, device="cuda").to(torch.bfloat16)
            outs = []
            for fn, module in ((step, model), (compiled, twin)):
                xi = x.clone().requires_grad_(True)
                y = fn(module, xi)
                y.backward(dy)
                outs.append([y.detach(), xi.grad, module.weight.grad.clone(), module.bias.grad.clone()])
                module.zero_grad(set_to_none=True)
            assert torch.equal(outs[1][0], outs[0][0])
            for got, want in zip(outs[1][1:], outs[0][1:]):
                torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)


MODULES_WITH_FUSED_CASTS = {  # name -> the module, whose forward casts a norm's or activation's output
    "LayerNormLinear": lambda: te.LayerNormLinear(1024, 1024, params_dtype=torch.bfloat16, device="cuda"),
    "LayerNormLinear-RMSNorm": lambda: te.LayerNormLinear(1024, 1024, normalization="RMSNorm",
                                                          params_dtype=torch.bfloat16, device="cuda"),
    "LayerNormMLP": lambda: te.LayerNormMLP(1024, 4096, params_dtype=torch.bfloat16, device="cuda"),
}


KERNEL_TWINNED = ("norm_fwd", "activation_fwd", "activation_bwd_dbias_cast_transpose", "dbias_cast_transpose",
                  "quantize_fp8", "cast_transpose_fp8", "delayed_scaling_update")


@GPU
@pytest.mark.parametrize("module", list(MODULES_WITH_FUSED_CASTS))
def test_compiled_fused_casts_with_delayed_scaling_match_eager(delayed, module):
    """A module with DelayedScaling, compiled with the shipped settings: the norm's and the
    activation's FP8 outputs and the gradient epilogues into their history slots launch
    te_triton's kernels (none of those left an opaque op in a compiled step), and over three
    steps the forward output is eager's bit for bit, the input gradient within bfloat16's
    tolerance, the histories alike."""
    backend.set_backend("cuda")
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = MODULES_WITH_FUSED_CASTS[module]()
        twin = copy.deepcopy(model)
        rec = recipe.DelayedScaling()
        te.init_quantization_state(model, rec)

        def step(module, inp):
            with te.autocast(recipe=rec):
                return module(inp)

        compiled = torch.compile(step, fullgraph=True)
        for i in range(3):
            x = (torch.randn(256, 1024, device="cuda") * (i + 1)).to(torch.bfloat16)
            dy = torch.randn(256, 1024, device="cuda").to(torch.bfloat16)
            outs = []
            for fn, module in ((step, model), (compiled, twin)):
                xi = x.clone().requires_grad_(True)
                with torch.profiler.profile() as prof:
                    y = fn(module, xi)
                    y.backward(dy)
                opaque = {e.name for e in prof.events() if e.name.startswith("te_core::")
                          and any(op in e.name for op in KERNEL_TWINNED)}
                outs.append((y.detach(), xi.grad, opaque))
            assert torch.equal(outs[1][0], outs[0][0]), f"step {i}"
            torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1.6e-2, atol=1e-5)
            assert not outs[1][2], f"opaque ops in the compiled step: {sorted(outs[1][2])}"
        for (d, slots), (_, twin_slots) in zip(model.quantization_state().items(), twin.quantization_state().items()):
            for slot, entry in slots.items():
                assert torch.equal(entry["amax_history"], twin_slots[slot]["amax_history"]), (d, slot)
    finally:
        torch._dynamo.reset()
        backend.reset()


# --- the launches themselves, on the CPU: the twins' against te_triton's eager ones -------------
class _Recorder:
    """Stands in for a kernel launch: records (kernel name, grid, arguments, keywords)."""

    def __init__(self, calls, kernel):
        self.calls, self.kernel = calls, kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel.__name__, tuple(grid), args, kwargs))


def _described(value):
    """An argument as the kernel sees it: a tensor by dtype, shape and strides; else its value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.stride())
    return value


def _launches(run, monkeypatch, twin: bool):
    """The launches run() makes: through wrap_triton (the twins) or te_triton's launcher (eager)."""
    from te_triton import launch

    calls = []
    if twin:
        monkeypatch.setattr(traced_kernels, "_WRAP_TRITON", lambda kernel: _Recorder(calls, kernel))
    else:
        monkeypatch.setattr(launch.Launcher, "__getitem__", lambda self, grid: _Recorder(calls, self.kernel)[grid])
    run()
    monkeypatch.undo()
    return [(name, grid, [_described(a) for a in args], kwargs) for name, grid, args, kwargs in calls]


def _same_launches(twin, eager, unused=()):
    """Launch for launch, the same kernel, grid, keywords and arguments, but for the positions
    `unused` ((launch, argument) pairs): pointers that kernel variant never dereferences (for
    each, the eager launch passes another argument's tensor, the twin one of its own)."""
    assert [c[0] for c in twin] == [c[0] for c in eager]
    for i, ((name, grid, args, kwargs), (_, e_grid, e_args, e_kwargs)) in enumerate(zip(twin, eager)):
        assert (grid, kwargs) == (e_grid, e_kwargs), f"launch {i} ({name})"
        assert len(args) == len(e_args), f"launch {i} ({name})"
        for j, (a, e) in enumerate(zip(args, e_args)):
            if (i, j) not in unused:
                assert a == e, f"launch {i} ({name}) argument {j}: {a} against {e}"


def _slot_pointer(monkeypatch, slot_in_kernel, launch, position):
    """Sets SLOT_IN_KERNEL for the twin's launch (_launches undoes it); the (launch, argument)
    of its amax pointer where that is a zero of the twin's own (max_into then writes the slot),
    as _same_launches' `unused`. With the slot in the kernel the twin passes the slot, as eager."""
    monkeypatch.setattr(traced_kernels, "SLOT_IN_KERNEL", slot_in_kernel)
    return set() if slot_in_kernel else {(launch, position)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1024, 1024), (1040, 1100)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("setting", CURRENT, ids=lambda s: f"t{int(s[0])}-pow2{int(s[1])}-eps{s[2]}")
def test_current_scaling_twin_launches_what_te_triton_launches(monkeypatch, sm90, setting, shape, dtype):
    """On the CPU, whatever the GPU: the kernels, grids, tiles, flags and argument layouts the twin
    launches are te_triton's eager ones (with the H100's table), so its bytes are the eager op's."""
    from te_triton import cast

    with_transpose, pow2, eps = setting
    x = torch.randn(shape).to(dtype)
    kwargs = dict(with_transpose=with_transpose, force_pow2_scales=pow2, amax_epsilon=eps)
    twin = _launches(lambda: traced_kernels.quantize_fp8_current(x, E4M3, **kwargs), monkeypatch, twin=True)
    eager = _launches(lambda: cast.quantize_fp8_current(x, E4M3, cfg=sm90.quantize, ct_cfg=sm90.cast_transpose,
                                                        **kwargs), monkeypatch, twin=False)
    assert len(eager) == 2
    # the amax pass: its scale and scale_inv pointers (eager: the amax buffer) are never read
    _same_launches(twin, eager, unused={(0, 2), (0, 6)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1024, 1024), (1040, 1100)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("setting", BLOCK, ids=lambda s: f"{'2d' if s[0] else '1d'}-t{int(s[1])}-pow2{int(s[2])}")
def test_block_twin_launches_what_te_triton_launches(monkeypatch, sm90, setting, shape, dtype):
    from te_triton import blockwise

    block_2d, with_transpose, pow2, eps = setting
    x = torch.randn(shape).to(dtype)
    kwargs = dict(block_2d=block_2d, with_transpose=with_transpose, force_pow2_scales=pow2, amax_epsilon=eps)
    cfg = sm90.blockwise_1d_transpose if with_transpose and not block_2d else sm90.blockwise
    twin = _launches(lambda: traced_kernels.quantize_blockwise(x, E4M3, **kwargs), monkeypatch, twin=True)
    eager = _launches(lambda: blockwise.quantize_blockwise(x, E4M3, cfg=cfg, **kwargs), monkeypatch, twin=False)
    assert len(eager) == 1
    # the bias-gradient pointer is never written without DBIAS; without the transpose, neither are
    # the transposed data and scales (nor their strides read)
    unused = {(0, 5)} | (set() if with_transpose else {(0, 3), (0, 4), (0, 13), (0, 14)})
    _same_launches(twin, eager, unused=unused)


@pytest.mark.parametrize("shape", [(1024, 1024), (128, 8192), (1040, 1100)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dbias_twin_launches_what_te_triton_launches(monkeypatch, sm90, shape):
    from te_triton import blockwise

    dy = torch.randn(shape).to(torch.bfloat16)
    twin = _launches(lambda: traced_kernels.dbias_cast_transpose_blockwise(
        dy, E4M3, force_pow2_scales=True, amax_epsilon=0.0), monkeypatch, twin=True)
    eager = _launches(lambda: blockwise.dbias_cast_transpose_blockwise(
        [dy], E4M3, force_pow2_scales=True, amax_epsilon=0.0, cfg=sm90.blockwise_1d_transpose), monkeypatch,
        twin=False)
    assert len(eager) == 1
    _same_launches(twin, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(1024, 1024), (128, 8192), (1040, 1100)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("setting", [(False, 0.0), (True, 1e-3)], ids=["plain", "pow2-eps"])
def test_current_dbias_twin_launches_what_te_triton_launches(monkeypatch, sm90, setting, shape, dtype):
    from te_triton import dbias

    pow2, eps = setting
    dy = torch.randn(shape).to(dtype)
    twin = _launches(lambda: traced_kernels.dbias_cast_transpose_current(
        dy, E5M2, force_pow2_scales=pow2, amax_epsilon=eps), monkeypatch, twin=True)
    eager = _launches(lambda: dbias.dbias_cast_transpose_current(
        [dy], E5M2, sm90.dbias_cast_transpose, force_pow2_scales=pow2, amax_epsilon=eps, amax_cfg=sm90.quantize),
        monkeypatch, twin=False)
    assert [c[0] for c in eager] == ["_quantize_kernel", "_dbias_ct_kernel"]
    # the amax pass: its scale and scale_inv pointers (eager: the amax buffer) are never read
    _same_launches(twin, eager, unused={(0, 2), (0, 6)})


@pytest.mark.parametrize("widths", [(1024, 512, 512), (512, 640)], ids=["three", "two"])
def test_current_parts_twin_launches_what_te_triton_launches(monkeypatch, sm90, widths):
    """Column blocks of whole strips read in place with current scaling: an amax pass over each
    block into one amax, then the dbias cast-transpose reading the blocks (PARTS), as te_triton's
    eager op launches them."""
    from te_triton import dbias

    g = torch.Generator().manual_seed(7)
    parts = [torch.randn(96, w, generator=g).to(torch.bfloat16) for w in widths]
    kwargs = dict(force_pow2_scales=False, amax_epsilon=0.0)
    twin = _launches(lambda: traced_kernels.dbias_cast_transpose_current(parts[0], E5M2, parts=parts, **kwargs),
                     monkeypatch, twin=True)
    eager = _launches(lambda: dbias.dbias_cast_transpose_current(
        parts, E5M2, sm90.dbias_cast_transpose, amax_cfg=sm90.quantize, **kwargs), monkeypatch, twin=False)
    assert [c[0] for c in eager] == ["_quantize_kernel"] * len(widths) + ["_dbias_ct_kernel"]
    assert eager[-1][3]["PARTS"] == len(widths)
    # the amax passes: their scale and scale_inv pointers (eager: the amax buffer) are never read
    _same_launches(twin, eager, unused={(i, j) for i in range(len(widths)) for j in (2, 6)})


@pytest.mark.parametrize("widths", [(512, 256, 256), (256, 200)], ids=["three", "two"])
def test_block_parts_twin_launches_what_te_triton_launches(monkeypatch, sm90, widths):
    """Column blocks read in place with block scaling: one launch per block, each writing its
    columns of the whole outputs (its first column in the last integer argument), as te_triton's
    eager op launches them."""
    from te_triton import blockwise

    g = torch.Generator().manual_seed(8)
    parts = [torch.randn(300, w, generator=g).to(torch.bfloat16) for w in widths]
    kwargs = dict(force_pow2_scales=True, amax_epsilon=0.0)
    twin = _launches(lambda: traced_kernels.dbias_cast_transpose_blockwise(parts[0], E4M3, parts=parts, **kwargs),
                     monkeypatch, twin=True)
    eager = _launches(lambda: blockwise.dbias_cast_transpose_blockwise(
        parts, E4M3, cfg=sm90.blockwise_1d_transpose, **kwargs), monkeypatch, twin=False)
    assert [c[0] for c in eager] == ["_blockwise_kernel"] * len(widths)
    assert [c[2][18] for c in eager] == [sum(widths[:i]) for i in range(len(widths))]
    _same_launches(twin, eager)


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("widths", [[1024], [512, 640], [1100]], ids=["whole", "two-parts", "partial-strips"])
@pytest.mark.parametrize("setting", [(False, 0.0), (True, 1e-3)], ids=["plain", "pow2-eps"])
def test_current_dbias_twin_compiled_is_the_cuda_op(setting, widths, dtype):
    """From the threshold on, compiled: te_triton's amax passes and fused dbias cast-transpose, the
    eager op's bytes, scales and amax (column blocks of whole strips read in place, as the eager
    op reads them, not joined by the compiler; others joined first); the bias gradient within
    bfloat16's tolerance (the row groups' sums are added in the compiler's order)."""
    from te_backend_cuda import ops

    torch._dynamo.reset()
    pow2, eps = setting
    full = _input((1040, sum(widths)), dtype=dtype, seed=4)
    parts = [p.contiguous() for p in torch.split(full, widths, dim=1)]
    kwargs = dict(force_pow2_scales=pow2, amax_epsilon=eps)
    run = torch.compile(lambda p: traced.dbias_cast_transpose_current(p, E5M2, **kwargs), fullgraph=True)
    got = run(parts)
    want = ops.dbias_cast_transpose_current(parts, E5M2, **kwargs)
    _assert_same(got[:2] + got[3:], want[:2] + want[3:])
    torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=1e-5, equal_nan=True)
    names = _kernels(run, parts)
    assert "_dbias_ct_kernel" in names, names
    if widths == [512, 640]:
        assert not _joins(names), names
    torch._dynamo.reset()


# --- delayed scaling: casts into a history slot (every size) and the update ----------------------
@pytest.mark.parametrize("slot_in_kernel", [False, True], ids=["max_into", "in-kernel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(128, 1024), (1040, 1100)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("cast", ["quantize", "cast_transpose", "dbias"])
def test_delayed_twins_launch_what_te_triton_launches(monkeypatch, sm90, cast, shape, dtype, slot_in_kernel):
    """A cast with a given scale maxing into a history slot, at small sizes too: te_triton's
    eager launch, with the slot itself as the amax pointer (SLOT_IN_KERNEL) or a zero of its
    own, which max_into then maxes into the slot."""
    monkeypatch.setattr(traced_kernels, "SLOT_IN_KERNEL", slot_in_kernel)
    from te_triton import cast as triton_cast
    from te_triton import dbias

    x, scale, slot = torch.randn(shape).to(dtype), torch.full((1,), 3.0), torch.zeros(1)
    twin_fn = {"quantize": traced_kernels.quantize_fp8, "cast_transpose": traced_kernels.cast_transpose_fp8,
               "dbias": traced_kernels.dbias_cast_transpose}[cast]
    eager_fn = {"quantize": lambda: triton_cast.quantize_fp8(x, scale, E4M3, sm90.quantize, amax_out=slot),
                "cast_transpose": lambda: triton_cast.cast_transpose_fp8(x, scale, E4M3, sm90.cast_transpose,
                                                                         amax_out=slot),
                "dbias": lambda: dbias.dbias_cast_transpose(x, scale, E4M3, sm90.dbias_cast_transpose,
                                                            amax_out=slot)}[cast]
    twin_slot, returned = torch.full((1,), 0.5), []
    twin = _launches(lambda: returned.append(twin_fn(x, scale, E4M3, amax_out=twin_slot)), monkeypatch, twin=True)
    monkeypatch.setattr(traced_kernels, "SLOT_IN_KERNEL", slot_in_kernel)  # (_launches undoes it)
    eager = _launches(eager_fn, monkeypatch, twin=False)
    assert len(eager) == 1
    amax_position = {"quantize": 3, "cast_transpose": 4, "dbias": 5}[cast]
    _same_launches(twin, eager, unused=set() if slot_in_kernel else {(0, amax_position)})
    if not slot_in_kernel:  # its own zero, maxed into the slot after the (recorded, not run) launch
        assert twin[0][2][amax_position] == ("tensor", torch.float32, (), ())
    assert returned[0][-1] is twin_slot and twin_slot.item() == 0.5  # the contract's amax: the slot


@pytest.mark.parametrize("column", [0, 1])
def test_delayed_twin_writes_column_0_through_its_history(monkeypatch, sm90, column):
    """te-core's slot of column 0 (te_slot_column) is its history's first element: the twin hands
    the kernel the history itself, whose in-place write the compiler keeps, where a kernel writing
    through a view of a graph input costs three more kernels. Another column's slot is passed as
    it is; so is a slot without the attribute."""
    from te_backend_cuda import configs

    x, scale = torch.randn(128, 1024), torch.full((1,), 3.0)
    history = torch.zeros(16, 2)
    slot = history[0, column : column + 1]
    slot.te_slot_column = column
    plain = history[0, column : column + 1]

    def amax_argument(amax_out):
        monkeypatch.setattr(traced_kernels, "SLOT_IN_KERNEL", True)  # (_launches undoes these)
        monkeypatch.setattr(configs, "for_device", lambda index: sm90)
        run = _launches(lambda: traced_kernels.cast_transpose_fp8(x, scale, E4M3, amax_out=amax_out), monkeypatch,
                        twin=True)
        return run[0][2][4]

    want = ("tensor", torch.float32, (16, 2), (2, 1)) if column == 0 else _described(slot)
    assert amax_argument(slot) == want
    assert amax_argument(plain) == _described(plain)


NORM_SHAPES = [(128, 1024), (3, 40, 1100), (8, 5000), (7, 96)]  # (8, 5000): LayerNorm's long-row config


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero-centered"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("slot_in_kernel", [True, False], ids=["in-kernel", "max_into"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_twin_launches_what_the_cuda_op_launches(monkeypatch, sm90, rms, shape, dtype, zero_centered,
                                                      slot_in_kernel):
    """A norm forward with FP8 output maxing into a history slot: te-backend-cuda's eager launch
    (its config for the row length, H100 table), the slot as the amax pointer or a zero of the
    twin's own (_slot_pointer) and, for RMSNorm, a tensor of its own where the kernel writes no
    mean."""
    from te_backend_cuda import configs
    from te_backend_cuda.ops import norm

    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g).to(dtype)
    w, b = torch.randn(shape[-1], generator=g).to(dtype), torch.randn(shape[-1], generator=g).to(dtype)
    scale, slot = torch.full((1,), 2.0), torch.zeros(1)
    kwargs = dict(zero_centered_gamma=zero_centered, fp8_scale=scale, fp8_dtype=E4M3, amax_out=slot)
    twin_slot, returned = torch.full((1,), 0.5), []
    amax_pointer = _slot_pointer(monkeypatch, slot_in_kernel, 0, 7)
    twin = _launches(lambda: returned.append(traced_kernels.norm_fwd(
        x, w, None if rms else b, 1e-5, **{**kwargs, "amax_out": twin_slot})), monkeypatch, twin=True)
    eager_fn = (lambda: norm.rmsnorm_fwd(x, w, 1e-5, **kwargs)) if rms else (lambda: norm.layernorm_fwd(
        x, w, b, 1e-5, **kwargs))
    monkeypatch.setattr(configs, "for_device", lambda index: sm90)  # (_launches undid sm90's)
    eager = _launches(eager_fn, monkeypatch, twin=False)
    assert len(eager) == 1 and eager[0][0] == "_norm_fwd_kernel"
    _same_launches(twin, eager, unused=amax_pointer | ({(0, 4)} if rms else set()))
    y, mean, rstd, amax = returned[0]
    assert y.dtype == E4M3 and y.shape == x.shape and rstd.shape == x.shape[:-1]
    assert (mean is None) == rms and (rms or mean.shape == x.shape[:-1])
    assert amax is twin_slot and twin_slot.item() == 0.5  # the contract's amax: the slot (launches not run)


def test_norm_twin_declines_what_the_kernel_does_not_take(monkeypatch):
    """Slot-writing norm forwards of LayerNorm and RMSNorm go to the kernel twin on a GPU whose
    convert saturates; without a slot, with a strided x or weight, rows longer than the kernel's,
    a size at the descriptor kernels' threshold, or DELAYED off, the kernel declines (the
    opaque op then takes a slot-writing call, the traced math one without a slot)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_backend_cuda import configs, traced_fused
    from te_triton import norm

    monkeypatch.setattr(traced_kernels, "_kernels_run_on", lambda index: True)
    calls = []
    monkeypatch.setattr(traced_kernels, "_WRAP_TRITON", lambda kernel: _Recorder(calls, kernel))
    monkeypatch.setattr(traced_kernels, "_norm_fwd_launch", lambda *a: (4, 1024, 1, 1, 1, True, False, True, 8))
    layernorm, rmsnorm = traced_fused.TRACED_FUSED["layernorm_fwd"], traced_fused.TRACED_FUSED["rmsnorm_fwd"]
    with FakeTensorMode():
        def cuda(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device="cuda")

        x, w, b, scale, slot = cuda(64, 256), cuda(256), cuda(256), cuda(1, dtype=torch.float32), cuda(
            1, dtype=torch.float32)
        fp8 = dict(fp8_scale=scale, fp8_dtype=E4M3)
        assert len(layernorm(x, w, b, 1e-5, amax_out=slot, **fp8)) == 4
        assert len(rmsnorm(x, w, 1e-5, amax_out=slot, **fp8)) == 3
        assert [c[0] for c in calls] == ["_norm_fwd_kernel"] * 2
        assert calls[1][2][2] is w and calls[1][3]["RMS"] and not calls[0][3]["RMS"]
        long, long_w = cuda(2, norm.MAX_N + 1), cuda(norm.MAX_N + 1)
        large = cuda(configs.TMA_MIN_NUMEL // 256, 256)
        strided_w = torch.empty_strided((256,), (2,), dtype=torch.bfloat16, device="cuda")
        for declined in (lambda: layernorm(x.t(), w, b, 1e-5, amax_out=slot, **fp8),
                         lambda: layernorm(x, strided_w, b, 1e-5, amax_out=slot, **fp8),
                         lambda: rmsnorm(long, long_w, 1e-5, amax_out=slot, **fp8),
                         lambda: rmsnorm(large, w, 1e-5, amax_out=slot, **fp8)):
            assert declined() is NotImplemented
        assert traced_fused._norm_fwd_kernel("cuda", x, w, b, 1e-5, **fp8) is NotImplemented  # no slot: the math
        monkeypatch.setattr(traced_kernels, "DELAYED", False)
        assert layernorm(x, w, b, 1e-5, amax_out=slot, **fp8) is NotImplemented
    assert len(calls) == 2


def _norm_bwd_inputs(shape, dtype, seed=5):
    """(dy, x, mean, rstd, weight, add): fresh random values of a norm backward's arguments."""
    g = torch.Generator().manual_seed(seed)
    dy, x, add = [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]
    mean, rstd = torch.randn(shape[:-1], generator=g), torch.rand(shape[:-1], generator=g) + 0.5
    return dy, x, mean, rstd, torch.randn(shape[-1], generator=g).to(dtype), add


@pytest.mark.parametrize("add", [False, True], ids=["plain", "add"])
@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero-centered"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_backward_twin_launches_what_the_cuda_op_launches(monkeypatch, sm90, rms, shape, dtype, zero_centered,
                                                               add):
    """A norm backward (a residual's gradient added or not): te-backend-cuda's eager launch (its
    pointer config for the row length, H100 table), but for RMSNorm's bias-gradient pointer,
    which that kernel never writes (the eager op passes the weight's, the twin one of its own)."""
    from te_backend_cuda import configs
    from te_backend_cuda.ops import norm

    dy, x, mean, rstd, w, res = _norm_bwd_inputs(shape, dtype)
    stats, extra = ((rstd,) if rms else (mean, rstd)), ((res,) if add else ())
    returned = []
    twin = _launches(lambda: returned.append(traced_kernels.norm_bwd(
        dy, x, None if rms else mean, rstd, w, res if add else None, zero_centered_gamma=zero_centered)),
        monkeypatch, twin=True)
    name = ("rmsnorm_bwd" if rms else "layernorm_bwd") + ("_add" if add else "")
    monkeypatch.setattr(configs, "for_device", lambda index: sm90)  # (_launches undid sm90's)
    eager = _launches(lambda: getattr(norm, name)(dy, x, *stats, w, *extra, zero_centered_gamma=zero_centered),
                      monkeypatch, twin=False)
    assert len(eager) == 1 and eager[0][0] == "_norm_bwd_kernel"
    assert eager[0][3]["ADD"] is add and eager[0][3]["ZERO_CENTERED"] is zero_centered
    _same_launches(twin, eager, unused={(0, 7)} if rms else set())
    dx, dw, db = returned[0]
    assert (dx.shape, dx.dtype, dw.shape, dw.dtype) == (x.shape, dtype, w.shape, dtype)
    assert (db is None) == rms and (rms or (db.shape, db.dtype) == (w.shape, dtype))


def test_norm_backward_twin_declines_what_the_kernel_does_not_take(monkeypatch):
    """Norm backwards go to the kernel twin, LayerNorm's and RMSNorm's, a residual's gradient
    added or not; a strided x, dy or weight, dy or add of another dtype, statistics not float32,
    rows longer than the kernel's, a size at the descriptor kernels' threshold, the _add op
    without its tensor, or NORM_BWD off: the kernel declines (the traced math, or the opaque op,
    then takes the call and names what is wrong)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_backend_cuda import configs, traced_fused
    from te_triton import norm

    calls = []
    monkeypatch.setattr(traced_kernels, "_WRAP_TRITON", lambda kernel: _Recorder(calls, kernel))
    monkeypatch.setattr(traced_kernels, "_norm_bwd_tiles", lambda *a: (264, 8))
    kernels, f32 = traced_fused._KERNELS, torch.float32
    with FakeTensorMode():
        def cuda(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device="cuda")

        dy, x, add, w, mean, rstd = cuda(64, 256), cuda(64, 256), cuda(64, 256), cuda(256), cuda(64, dtype=f32), \
            cuda(64, dtype=f32)
        assert len(traced_fused.TRACED_FUSED["layernorm_bwd"](dy, x, mean, rstd, w)) == 3
        assert len(traced_fused.TRACED_FUSED["layernorm_bwd_add"](dy, x, mean, rstd, w, add)) == 3
        assert len(traced_fused.TRACED_FUSED["rmsnorm_bwd"](dy, x, rstd, w)) == 2
        assert len(traced_fused.TRACED_FUSED["rmsnorm_bwd_add"](dy, x, rstd, w, add, zero_centered_gamma=True)) == 2
        assert [c[0] for c in calls] == ["_norm_bwd_kernel"] * 4
        assert [(c[3]["RMS"], c[3]["ADD"], c[3]["ZERO_CENTERED"]) for c in calls] == [
            (False, False, False), (False, True, False), (True, False, False), (True, True, True)]
        assert calls[1][2][8] is add and calls[0][2][8] is x  # (without add the kernel never reads that pointer)
        strided = torch.empty_strided((64, 256), (1, 64), dtype=torch.bfloat16, device="cuda")
        long, long_w = cuda(2, norm.MAX_N + 1), cuda(norm.MAX_N + 1)
        large = cuda(configs.TMA_MIN_NUMEL // 256, 256)
        large_rstd = cuda(configs.TMA_MIN_NUMEL // 256, dtype=f32)
        strided_w = torch.empty_strided((256,), (2,), dtype=torch.bfloat16, device="cuda")
        ln, ln_add, rms_add = kernels["layernorm_bwd"], kernels["layernorm_bwd_add"], kernels["rmsnorm_bwd_add"]
        declined = {
            "strided x": lambda: ln("cuda", dy, strided, mean, rstd, w),
            "strided dy": lambda: ln("cuda", strided, x, mean, rstd, w),
            "strided weight": lambda: ln("cuda", dy, x, mean, rstd, strided_w),
            "dy of another dtype": lambda: ln("cuda", dy.float(), x, mean, rstd, w),
            "add of another dtype": lambda: ln_add("cuda", dy, x, mean, rstd, w, add.float()),
            "bfloat16 statistics": lambda: ln("cuda", dy, x, mean, rstd.to(torch.bfloat16), w),
            "no mean": lambda: ln("cuda", dy, x, None, rstd, w),
            "no add": lambda: rms_add("cuda", dy, x, rstd, w, None),
            "rows too long": lambda: kernels["rmsnorm_bwd"]("cuda", long, long, cuda(2, dtype=f32), long_w),
            "descriptor size": lambda: kernels["rmsnorm_bwd"]("cuda", large, large, large_rstd, w),
        }
        for what, call in declined.items():
            assert call() is NotImplemented, what
        monkeypatch.setattr(traced_kernels, "NORM_BWD", False)
        assert ln("cuda", dy, x, mean, rstd, w) is NotImplemented
    assert len(calls) == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(128, 4096), (3, 40, 1100), (7, 96)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("slot_in_kernel", [True, False], ids=["in-kernel", "max_into"])
@pytest.mark.parametrize("kind", ["gelu", "swiglu", "srelu"])
def test_activation_twin_launches_what_the_cuda_op_launches(monkeypatch, sm90, kind, shape, dtype, slot_in_kernel):
    """An activation forward with FP8 output maxing into a history slot: te-backend-cuda's eager
    launch (its plain or gated config, H100 table), the slot or a zero as the amax pointer."""
    from te_backend_cuda import configs
    from te_backend_cuda.ops import activation

    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    scale, slot = torch.full((1,), 2.0), torch.zeros(1)
    twin_slot, returned = torch.full((1,), 0.5), []
    amax_pointer = _slot_pointer(monkeypatch, slot_in_kernel, 0, 3)
    twin = _launches(lambda: returned.append(traced_kernels.activation_fwd(
        x, kind, fp8_scale=scale, fp8_dtype=E5M2, amax_out=twin_slot)), monkeypatch, twin=True)
    monkeypatch.setattr(configs, "for_device", lambda index: sm90)  # (_launches undid sm90's)
    eager = _launches(lambda: activation.activation_fwd(x, kind, fp8_scale=scale, fp8_dtype=E5M2, amax_out=slot),
                      monkeypatch, twin=False)
    assert len(eager) == 1 and eager[0][0] == "_act_fwd_kernel"
    _same_launches(twin, eager, unused=amax_pointer)
    y, amax = returned[0]
    h = shape[-1] // 2 if kind == "swiglu" else shape[-1]
    assert y.dtype == E5M2 and y.shape == (*shape[:-1], h)
    assert amax is twin_slot and twin_slot.item() == 0.5


def test_activation_twin_declines_what_the_kernel_does_not_take(monkeypatch):
    """Slot-writing activation forwards go to the kernel twin; a kind without a kernel
    (clamped_swiglu, whose parameters come with it), a gated one over an odd last dimension, a
    strided x, no slot, or DELAYED off: the kernel declines."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_backend_cuda import traced_fused

    monkeypatch.setattr(traced_kernels, "_kernels_run_on", lambda index: True)
    calls = []
    monkeypatch.setattr(traced_kernels, "_WRAP_TRITON", lambda kernel: _Recorder(calls, kernel))
    monkeypatch.setattr(traced_kernels, "_act_fwd_launch", lambda *a: (4, 64, 64, False, 4))
    act, kernel = traced_fused.TRACED_FUSED["activation_fwd"], traced_fused._activation_fwd_kernel
    with FakeTensorMode():
        x = torch.empty(64, 256, dtype=torch.bfloat16, device="cuda")
        odd = torch.empty(64, 255, dtype=torch.bfloat16, device="cuda")
        strided = torch.empty_strided((64, 256), (1, 64), dtype=torch.bfloat16, device="cuda")
        scale, slot = [torch.empty(1, dtype=torch.float32, device="cuda") for _ in range(2)]
        fp8 = dict(fp8_scale=scale, fp8_dtype=E4M3)
        assert len(act(x, "swiglu", amax_out=slot, **fp8)) == 2
        assert [c[0] for c in calls] == ["_act_fwd_kernel"] and calls[0][3]["GATED"]
        for declined in (lambda: kernel("cuda", x, "clamped_swiglu", amax_out=slot, limit=7.0, alpha=1.702, **fp8),
                         lambda: kernel("cuda", x, "gelu", amax_out=slot, limit=7.0, **fp8),
                         lambda: kernel("cuda", odd, "geglu", amax_out=slot, **fp8),
                         lambda: kernel("cuda", strided, "gelu", amax_out=slot, **fp8),
                         lambda: kernel("cuda", x, "gelu", **fp8)):
            assert declined() is NotImplemented
        monkeypatch.setattr(traced_kernels, "DELAYED", False)
        assert kernel("cuda", x, "gelu", amax_out=slot, **fp8) is NotImplemented
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(128, 1024), (1040, 1100)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("slot_in_kernel", [True, False], ids=["in-kernel", "max_into"])
@pytest.mark.parametrize("kind", ["gelu", "srelu", "swiglu"])
def test_activation_epilogue_twin_launches_what_the_cuda_op_launches(monkeypatch, sm90, kind, shape, dtype,
                                                                     slot_in_kernel):
    """The activation's backward with the gradient's dbias cast-transpose into a history slot:
    te-backend-cuda's eager launches (one fused pass for a plain kind; the activation's backward
    kernel, then the dbias cast-transpose of its dx, for a gated one), the slot or a zero as the
    amax pointer."""
    from te_backend_cuda import configs
    from te_backend_cuda.ops import activation

    g = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=g).to(dtype)
    dy = torch.randn(shape[0], shape[1] // 2 if kind == "swiglu" else shape[1], generator=g).to(dtype)
    scale, slot = torch.full((1,), 2.0), torch.zeros(1)
    twin_slot, returned = torch.full((1,), 0.5), []
    last = 1 if kind == "swiglu" else 0
    amax_pointer = _slot_pointer(monkeypatch, slot_in_kernel, last, 5)
    twin = _launches(lambda: returned.append(traced_kernels.activation_bwd_dbias_cast_transpose(
        dy, x, kind, scale, E5M2, amax_out=twin_slot)), monkeypatch, twin=True)
    monkeypatch.setattr(configs, "for_device", lambda index: sm90)  # (_launches undid sm90's)
    eager = _launches(lambda: activation.activation_bwd_dbias_cast_transpose(dy, x, kind, scale, E5M2,
                                                                              amax_out=slot), monkeypatch, twin=False)
    names = ["_act_bwd_kernel", "_dbias_ct_kernel"] if kind == "swiglu" else ["_dbias_ct_kernel"]
    assert [c[0] for c in eager] == names
    # the dbias pass's second and third column blocks, past the last column, never read
    _same_launches(twin, eager, unused=amax_pointer | {(last, 11), (last, 12)})
    assert returned[0][-1] is twin_slot and twin_slot.item() == 0.5


@pytest.mark.parametrize("slot_in_kernel", [True, False], ids=["in-kernel", "max_into"])
@pytest.mark.parametrize("widths", [(1024, 512, 512), (512, 640), (256, 100), (1024,), (128, 128, 128, 128)],
                         ids=["three-in-place", "two-in-place", "joined", "whole", "four-joined"])
def test_parts_twin_launches_what_the_cuda_op_launches(monkeypatch, sm90, widths, slot_in_kernel):
    """Column blocks of a gradient cast into a history slot: te_triton's dbias cast-transpose as
    te-backend-cuda's eager op launches it, reading two or three blocks of whole strips in place
    (no join), joining others first."""
    from te_backend_cuda import configs
    from te_backend_cuda.ops import activation, launch

    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(96, w, generator=g).to(torch.bfloat16) for w in widths]
    scale, slot, twin_slot = torch.full((1,), 2.0), torch.zeros(1), torch.full((1,), 0.5)
    returned = []
    amax_pointer = _slot_pointer(monkeypatch, slot_in_kernel, 0, 5)
    twin = _launches(lambda: returned.append(traced_kernels.dbias_cast_transpose_parts(
        parts, scale, E4M3, amax_out=twin_slot)), monkeypatch, twin=True)
    monkeypatch.setattr(configs, "for_device", lambda index: sm90)
    monkeypatch.setattr(launch, "_current_device", lambda: -1)  # the CPU tensors' device: no guard
    eager = _launches(lambda: activation.dbias_cast_transpose_parts(parts, scale, E4M3, amax_out=slot), monkeypatch,
                      twin=False)
    assert [c[0] for c in eager] == ["_dbias_ct_kernel"]
    in_place = widths in ((1024, 512, 512), (512, 640))
    # the blocks the kernel reads: the parts themselves in place, else one joined gradient
    assert eager[0][3]["PARTS"] == (len(widths) if in_place else 1)
    assert eager[0][2][0][2] == ((96, widths[0]) if in_place else (96, sum(widths)))
    _same_launches(twin, eager, unused=amax_pointer)
    assert returned[0][0].shape == (96, sum(widths)) and returned[0][-1] is twin_slot


def test_epilogue_twins_decline_what_the_kernels_do_not_take(monkeypatch, sm90):
    """Slot-writing backward epilogues go to the kernel twins; a kind without a kernel, a
    parameter, a gradient not matching x, a strided or too large x, parts of different rows,
    or no slot: the kernels decline."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from te_backend_cuda import configs, traced_fused

    monkeypatch.setattr(traced_kernels, "_kernels_run_on", lambda index: True)
    calls = []
    monkeypatch.setattr(traced_kernels, "_WRAP_TRITON", lambda kernel: _Recorder(calls, kernel))
    monkeypatch.setattr(traced_kernels, "_dbias_pass",
                        lambda dy, *a, **k: calls.append(("_dbias_pass", None, (dy,), k)) or (dy, dy, dy))
    monkeypatch.setattr(traced_kernels, "_act_bwd_launch", lambda *a: (4, 64, 64, 4))
    epilogue, parts_twin = traced_fused._act_bwd_dbias_ct_kernel, traced_fused._dbias_ct_parts_kernel
    with FakeTensorMode():
        def cuda(*shape):
            return torch.empty(shape, dtype=torch.bfloat16, device="cuda")

        x, dy, half = cuda(64, 256), cuda(64, 256), cuda(64, 128)
        strided = torch.empty_strided((64, 256), (1, 64), dtype=torch.bfloat16, device="cuda")
        large = cuda(configs.TMA_MIN_NUMEL // 256, 256)
        scale, slot = [torch.empty(1, dtype=torch.float32, device="cuda") for _ in range(2)]
        assert len(epilogue("cuda", dy, x, "gelu", scale, E4M3, amax_out=slot)) == 4
        assert len(epilogue("cuda", half, x, "swiglu", scale, E4M3, amax_out=slot)) == 4
        assert len(parts_twin("cuda", [half, half], scale, E4M3, amax_out=slot)) == 4
        assert [c[0] for c in calls] == ["_dbias_pass", "_act_bwd_kernel", "_dbias_pass", "_dbias_pass"]
        assert calls[0][3]["act"][0] is x and calls[2][3].get("act") is None  # gated: the pass reads dx
        assert calls[3][3]["parts"] == [half, half]  # whole strips: read in place
        for declined in (lambda: epilogue("cuda", dy, x, "clamped_swiglu", scale, E4M3, amax_out=slot, limit=7.0),
                         lambda: epilogue("cuda", dy, x, "gelu", scale, E4M3, amax_out=slot, limit=7.0),
                         lambda: epilogue("cuda", half, x, "gelu", scale, E4M3, amax_out=slot),
                         lambda: epilogue("cuda", dy, strided, "gelu", scale, E4M3, amax_out=slot),
                         lambda: epilogue("cuda", large, large, "gelu", scale, E4M3, amax_out=slot),
                         lambda: epilogue("cuda", dy, x, "gelu", scale, E4M3),
                         lambda: parts_twin("cuda", [half, cuda(32, 128)], scale, E4M3, amax_out=slot),
                         lambda: parts_twin("cuda", [half, half], scale, E4M3)):
            assert declined() is NotImplemented
    assert len(calls) == 4


@pytest.fixture
def delayed(monkeypatch):
    """The delayed-scaling launches on (traced_kernels.DELAYED)."""
    monkeypatch.setattr(traced_kernels, "DELAYED", True)


def test_update_twin_launches_histories_of_one_tile_height_together(monkeypatch, delayed):
    """The update: te_triton's listed-histories kernel, one launch per tile height BL and up to
    ARGS_PER_LAUNCH histories, each with its columns, length and fp8 max scaled by 2^-margin in
    float32, the unused arguments None; its tile as the table kernel's (BN of the widest of the
    launch's histories). Histories too long for one tile, and a callable amax_compute_algo, stay
    the opaque op."""
    from te_triton import scaling as triton_scaling
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert triton_scaling.ARGS_PER_LAUNCH == 8
    shapes = [(1024, 1), (16, 20), (1000, 2)] + [(9 + i, 1 + i % 3) for i in range(8)]  # heights 1024, 16, 1024, 16...
    with FakeTensorMode():
        hists = [torch.zeros(*shape, device="cuda") for shape in shapes]
        scales = [torch.ones(shape[1], device="cuda") for shape in shapes]
        long, long_scales = [torch.zeros(4096, 4, device="cuda")], [torch.ones(4, device="cuda")]
    fmaxes = [448.0, 57344.0] * 5 + [448.0]
    calls = []
    monkeypatch.setattr(traced_kernels, "_WRAP_TRITON", lambda kernel: _Recorder(calls, kernel))
    assert traced.delayed_scaling_update(hists, scales, fmaxes, margin=2.0) is None
    scaled = {448.0: 112.0, 57344.0: 14336.0}

    def listed(indices):
        args = []
        for i in indices:
            args += [hists[i], scales[i], shapes[i][1], shapes[i][0], scaled[fmaxes[i]]]
        return args + [None] * 5 * (8 - len(indices))

    want = [((2, 1), listed([0, 2]), dict(COUNT=2, MOST_RECENT=False, BL=1024, BN=2, num_warps=4)),
            ((8, 2), listed([1, 3, 4, 5, 6, 7, 8, 9]), dict(COUNT=8, MOST_RECENT=False, BL=16, BN=16, num_warps=4)),
            ((1, 1), listed([10]), dict(COUNT=1, MOST_RECENT=False, BL=16, BN=2, num_warps=4))]
    assert [c[0] for c in calls] == ["_delayed_update_args_kernel"] * 3
    for (name, grid, args, kwargs), (want_grid, want_args, want_kwargs) in zip(calls, want):
        assert (grid, kwargs) == (want_grid, want_kwargs)
        assert len(args) == len(want_args) and all(a is b or (a == b and not isinstance(a, torch.Tensor))
                                                   for a, b in zip(args, want_args)), (args, want_args)
    assert traced.delayed_scaling_update(long, long_scales, [448.0]) is NotImplemented
    assert traced.delayed_scaling_update(hists, scales, fmaxes, amax_compute_algo=max) is NotImplemented


@GPU
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
@pytest.mark.parametrize("shape", [(128, 1024), (1040, 1100)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("name", ["quantize_fp8", "cast_transpose_fp8", "dbias_cast_transpose"])
def test_delayed_casts_compiled_write_the_history_as_eager(delayed, name, shape, nan):
    """Compiled, a cast into a history slot (a view of the history, as modules pass it) gives
    the eager op's FP8 bytes and leaves the history as the eager op leaves it, bit for bit; the
    bias gradient within bfloat16's tolerance (its row groups summed in the compiler's order)."""
    from te_backend_cuda import ops

    torch._dynamo.reset()
    x = _input(shape, special=nan, seed=5)
    scale = torch.full((1,), 0.37, device="cuda")
    history = torch.rand(4, 3, device="cuda") + 1
    history[0, 1] = 2.5
    want_history = history.clone()
    want = getattr(ops, name)(x, scale, E4M3, amax_out=want_history[0][1:2])
    run = torch.compile(lambda t, s, h: getattr(traced, name)(t, s, E4M3, amax_out=h[0][1:2]), fullgraph=True)
    got = run(x, scale, history)
    exact = 2 if name != "quantize_fp8" else 1
    _assert_same(got[:exact], want[:exact])
    if name == "dbias_cast_transpose":
        torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=1e-5, equal_nan=True)
    _assert_same([history, got[-1]], [want_history, want[-1]])
    torch._dynamo.reset()


def _compiled_with_slot(name, args, kwargs):
    """(compiled twin's result, eager cuda op's result, kernels a further compiled call ran) of op
    `name`, each maxing its amax into a slot of a history (a view, as modules pass it) of equal
    values, after checking that the two histories and returned amaxes are equal bit for bit."""
    from te_backend_cuda import ops, traced_fused

    torch._dynamo.reset()
    history = torch.rand(4, 3, device="cuda") + 1
    history[0, 1] = 0.25
    want_history = history.clone()
    want = getattr(ops, name)(*args, **kwargs, amax_out=want_history[0][1:2])
    twin = traced_fused.TRACED_FUSED[name]
    run = torch.compile(lambda a, h: twin(*a, **kwargs, amax_out=h[0][1:2]), fullgraph=True)
    got = run(args, history)
    _assert_same([history, got[-1]], [want_history, want[-1]])
    names = _kernels(lambda _: run(args, history.clone()), None)
    torch._dynamo.reset()
    return got, want, names


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(128, 1024), (3, 40, 1100), (8, 5000)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
def test_norm_with_slot_compiled_is_the_cuda_op(delayed, rms, shape, dtype):
    """Compiled, a norm forward with FP8 output maxing into a history slot launches te_triton's
    norm kernel, gives the eager op's FP8 bytes and statistics, and leaves the history as the
    eager op leaves it, bit for bit."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(dtype).cuda()
    w, b = [(torch.randn(shape[-1], generator=g) + 1).to(dtype).cuda() for _ in range(2)]
    params = (w,) if rms else (w, b)
    got, want, names = _compiled_with_slot("rmsnorm_fwd" if rms else "layernorm_fwd", (x, *params, 1e-5),
                                           dict(fp8_scale=torch.full((1,), 20.0, device="cuda"), fp8_dtype=E4M3))
    _assert_same(list(got[:-1]), list(want[:-1]))
    assert "_norm_fwd_kernel" in names, names


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["gelu", "swiglu", "relu"])
def test_activation_with_slot_compiled_is_the_cuda_op(delayed, kind, dtype):
    """Compiled, an activation forward with FP8 output maxing into a history slot launches
    te_triton's activation kernel and gives the eager op's FP8 bytes and history, bit for bit."""
    got, want, names = _compiled_with_slot("activation_fwd", (_input((120, 1100), dtype=dtype, seed=9), kind),
                                           dict(fp8_scale=torch.full((1,), 0.7, device="cuda"), fp8_dtype=E4M3))
    _assert_same([got[0]], [want[0]])
    assert "_act_fwd_kernel" in names, names


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["gelu", "srelu", "swiglu"])
def test_activation_epilogue_with_slot_compiled_is_the_cuda_op(delayed, kind, dtype):
    """Compiled, the activation's backward with the dbias cast-transpose of its gradient into a
    history slot launches te_triton's kernels and gives the eager op's FP8 bytes and history bit
    for bit; the bias gradient within bfloat16's tolerance (its row groups summed in torch's
    order where there are several)."""
    x = _input((1040, 1100), dtype=dtype, special=False, seed=10)
    dy = _input((1040, 550 if kind == "swiglu" else 1100), dtype=dtype, special=False, seed=11)
    got, want, names = _compiled_with_slot("activation_bwd_dbias_cast_transpose",
                                           (dy, x, kind, torch.full((1,), 0.3, device="cuda"), E4M3), {})
    _assert_same(list(got[:2]), list(want[:2]))
    torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=1e-5)
    assert "_dbias_ct_kernel" in names, names


@GPU
@pytest.mark.parametrize("widths", [(1024, 512, 512), (256, 100)], ids=["in-place", "joined"])
def test_parts_with_slot_compiled_is_the_cuda_op(delayed, widths):
    """Compiled, column blocks of a gradient cast into a history slot (read in place where they
    are whole strips wide, else joined first, as the eager op) give the eager op's bytes, bias
    gradient and history, bit for bit; blocks read in place are not joined by the compiler."""
    parts = [_input((520, w), special=False, seed=12 + i) for i, w in enumerate(widths)]
    got, want, names = _compiled_with_slot("dbias_cast_transpose_parts",
                                           (parts, torch.full((1,), 0.3, device="cuda"), E4M3), {})
    _assert_same(list(got[:3]), list(want[:3]))
    assert "_dbias_ct_kernel" in names, names
    if widths == (1024, 512, 512):
        assert not _joins(names), names


@GPU
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_update_compiled_is_the_cuda_op(delayed, algo):
    """Compiled, the update of histories holding NaN, inf, zero and unrecorded columns, of
    lengths 1 to 1024, gives the eager op's histories and scales bit for bit, through
    te_triton's listed-histories kernel (ten histories of one tile height in two launches)."""
    from te_backend_cuda import ops

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    hists = [torch.rand(5, 3, generator=g), torch.rand(1, 4, generator=g), torch.rand(13, 70, generator=g) * 100,
             torch.rand(1024, 1, generator=g)]
    hists += [torch.rand(5 + i % 4, 1 + i % 5, generator=g) * 10 for i in range(9)]  # height 8, as hists[0]
    hists[0][:, 1] = 0.0
    hists[1][0, 2] = float("nan")
    hists[2][3, 5] = float("inf")
    hists[2][0, 7] = 1e-39
    hists[2][6, 9] = float("nan")
    hists[2][0, 11] = 0.0
    hists = [h.cuda() for h in hists]
    scales = [(torch.rand(h.shape[1], generator=g) + 0.5).cuda() for h in hists]
    fmaxes = [448.0, 57344.0, 448.0, 448.0] + [448.0, 57344.0, 448.0] * 3
    want_h, want_s = [h.clone() for h in hists], [s.clone() for s in scales]
    ops.delayed_scaling_update(want_h, want_s, fmaxes, margin=1.0, amax_compute_algo=algo)

    def update(hs, ss):
        traced.delayed_scaling_update(hs, ss, fmaxes, margin=1.0, amax_compute_algo=algo)

    run = torch.compile(update, fullgraph=True)
    run(hists, scales)
    for h, wh, s, ws in zip(hists, want_h, scales, want_s):
        _assert_same([h, s], [wh, ws])
    names = _kernels(lambda _: run([h.clone() for h in hists], [s.clone() for s in scales]), None)
    assert "_delayed_update_args_kernel" in names, names
    torch._dynamo.reset()


@pytest.mark.parametrize("max_programs", [0, 7], ids=["uncapped", "capped"])
def test_programs_is_grid_size_for_plain_and_symbolic_sizes(max_programs):
    """The grid of a launch with symbolic sizes (traced_kernels.SYMBOLIC): te_triton's grid_size
    for every size, worked out on each call of one compiled graph (no guard on the cap), and
    plain ints for plain sizes."""
    from te_triton._common import Config, cdiv, grid_size

    cfg = Config(block=64, max_programs=max_programs)
    torch._dynamo.reset()
    frames = []

    def counting(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    def grid(x):
        return x.new_zeros(traced_kernels._programs(cdiv(x.numel(), 64), max_programs))

    compiled = torch.compile(grid, backend=counting, fullgraph=True, dynamic=True)
    for n in (64, 65, 448, 449, 5000, 3):  # (not 1: dynamo keeps a size of 1 a plain int)
        assert compiled(torch.ones(n)).numel() == grid_size(cdiv(n, 64), cfg), n
    assert len(frames) == 1
    for n in (1, 64, 449, 5000):
        assert traced_kernels._programs(cdiv(n, 64), max_programs) == grid_size(cdiv(n, 64), cfg), n
    assert type(traced_kernels._programs(9, max_programs)) is int
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [None, True, False], ids=["automatic", "dynamic", "static"])
def test_static_sizes_tells_a_symbolic_size_while_dynamo_traces(dynamic):
    """Inside dynamo's trace a symbolic size passes type() and isinstance() as an int; the
    kernel paths must still see it (a launch configuration read at trace time needs plain ints).
    torch.compile's default makes a size symbolic once it changes (automatic dynamic shapes)."""
    torch._dynamo.reset()
    assert traced_kernels.static_sizes(torch.ones(3, 4), torch.ones(5))
    run = torch.compile(lambda x: x * 2 if traced_kernels.static_sizes(x) else x * 3, fullgraph=True,
                        dynamic=dynamic)
    got = [run(torch.ones(n, 4))[0, 0].item() for n in (5, 7, 9)]
    assert got == {None: [2.0, 3.0, 3.0], True: [3.0, 3.0, 3.0], False: [2.0, 2.0, 2.0]}[dynamic]
    torch._dynamo.reset()


def _match_eager_over_changing_token_counts(model, twin, step, compiled):
    """Steps at 1024, 1536, 2048 and again 1024 tokens (the second count makes torch.compile retrace
    with it symbolic): each compiled step's output and input gradient within 1e-2 (relative, L2)
    of the eager model's."""
    for tokens in (1024, 1536, 2048, 1024):
        x = torch.randn(tokens, 1024, device="cuda").to(torch.bfloat16)
        dy = torch.randn(tokens, 1024, device="cuda").to(torch.bfloat16)
        outs = []
        for fn, module in ((compiled, twin), (step, model)):
            xi = x.clone().requires_grad_(True)
            y = fn(module, xi)
            y.backward(dy)
            outs.append((y.float(), xi.grad.float()))
        for got, want in zip(*outs):
            assert ((got - want).norm() / want.norm()).item() <= 1e-2, tokens


@GPU
@pytest.mark.parametrize("make", [recipe.DelayedScaling, recipe.Float8CurrentScaling, recipe.Float8BlockScaling],
                         ids=["delayed", "current", "block"])
@pytest.mark.parametrize("symbolic", [False, True], ids=["plain-sizes", "symbolic-sizes"])
def test_compiled_linear_with_changing_token_counts(monkeypatch, make, delayed, symbolic):
    """A second token count makes torch.compile retrace with it symbolic (automatic dynamic
    shapes): that trace's plain casts launch te_triton's kernels with symbolic grids when
    traced_kernels.SYMBOLIC is on, and keep the compiler's versions otherwise (delayed scaling's:
    the opaque ops); every step's output and input gradient within 1e-2 (relative, L2) of an
    identical eager module's."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", symbolic)
    with _compiled_linear(make) as (model, twin, step, compiled):
        _match_eager_over_changing_token_counts(model, twin, step, compiled)


@GPU
@pytest.mark.parametrize("symbolic", [False, True], ids=["opaque", "symbolic-fused"])
def test_compiled_layernorm_mlp_with_changing_token_counts(monkeypatch, delayed, symbolic):
    """LayerNormMLP under delayed scaling, compiled, over changing token counts (its norm and
    activation forwards and its bias gradients cast FP8 into histories): with
    traced_kernels.SYMBOLIC_FUSED on, the symbolic trace launches te_triton's kernels for them
    (off, the opaque ops do; the profiled forward shows the forwards'), and the FP8 outputs'
    column-wise copies are te_triton's transposes; either way every step's output and input
    gradient within 1e-2 (relative, L2) of an identical eager module's."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", symbolic)

    def build():
        return te.LayerNormMLP(1024, 4096, params_dtype=torch.bfloat16, device="cuda")

    with _compiled_linear(recipe.DelayedScaling, build) as (model, twin, step, compiled):
        _match_eager_over_changing_token_counts(model, twin, step, compiled)
        xi = torch.randn(1536, 1024, device="cuda").to(torch.bfloat16)
        events = _kernels(lambda t: compiled(twin, t), xi, with_ops=True)
        assert {"_norm_fwd_kernel", "_act_fwd_kernel"} <= events, sorted(events)  # the same kernels either way,
        ops = sorted(e for e in events if e.startswith("te_core::"))  # launched by the compiled code or the op
        for op in ("te_core::layernorm_fwd", "te_core::activation_fwd"):  # (a slot-writing op's name ends in _into)
            assert any(e.startswith(op) for e in ops) != symbolic, (op, ops)
        # the column-wise copies of their FP8 outputs: te_triton's transposes, not the compiler's
        assert "_transpose_kernel" in events, sorted(events)
