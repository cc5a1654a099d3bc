"""The compiled code's launches of te_triton's cast kernels (te_backend_cuda.traced_kernels):
current-scaling and block-scaled casts of KERNEL_MIN_NUMEL elements and up, under inductor,
give the eager cuda op's bytes (the same kernels), on inputs with NaN, inf, zero runs and rows
of very different magnitudes, whole and partial tiles; the compiled call launches te_triton's
kernels, not the compiler's reduction; a compiled te.Linear of that size matches eager. Below
the threshold, and for sizes inductor leaves symbolic, the compiler's casts stay. On the CPU,
whatever the GPU: each twin's launches (kernel, grid, tiles, flags, argument layouts) are the
ones te_triton's eager op makes, so a change to either that the other misses fails here."""
import pytest
import torch

import te_core as te
from te_backend_cuda import traced, traced_block, traced_kernels
from te_core import backend, recipe

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# at least KERNEL_MIN_NUMEL elements: whole tiles, partial tiles both ways, a wide one
SHAPES = [(1024, 1024), (1040, 1100), (640, 2048)]


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


def _kernels(fn, x):
    fn(x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA}


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
@pytest.mark.parametrize("make", [recipe.Float8CurrentScaling, recipe.Float8BlockScaling], ids=["current", "block"])
def test_compiled_linear_of_that_size_matches_eager(make):
    """te.Linear(1024, 1024) on 1024 tokens: every cast of the step is at the threshold. The
    forward output is eager's bit for bit (same casts, same GEMM); the gradients within
    bfloat16's tolerance (the bias gradient sums in another order)."""
    backend.set_backend("cuda")
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = te.Linear(1024, 1024, params_dtype=torch.bfloat16, device="cuda")
        rec = make()

        def step(inp):
            with te.autocast(recipe=rec):
                return model(inp)

        compiled = torch.compile(step, fullgraph=True)
        for i in range(2):
            x = (torch.randn(1024, 1024, device="cuda") * (i + 1)).to(torch.bfloat16)
            dy = torch.randn(1024, 1024, device="cuda").to(torch.bfloat16)
            outs = []
            for fn in (step, compiled):
                xi = x.clone().requires_grad_(True)
                y = fn(xi)
                y.backward(dy)
                outs.append([y.detach(), xi.grad, model.weight.grad.clone(), model.bias.grad.clone()])
                model.zero_grad(set_to_none=True)
            assert torch.equal(outs[1][0], outs[0][0])
            for got, want in zip(outs[1][1:], outs[0][1:]):
                torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)
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


@pytest.fixture
def sm90(monkeypatch):
    """The H100's tuning table (132 SMs) for every device index: what the twins read on a GPU."""
    from te_backend_cuda import configs

    tuning = configs.sm90(132)
    monkeypatch.setattr(configs, "for_device", lambda index: tuning)
    return tuning


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
