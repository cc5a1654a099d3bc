"""Float8BlockScaling under torch.compile: the block cast's plain-torch twin
(te_backend_cuda.traced_block) and the block-scaled GEMM's (traced.gemm_fp8). On the CPU: the
cast bit for bit the reference on fresh random inputs (partial edge blocks, NaN, inf, zero
blocks, epsilon, scales with and without power-of-two rounding), the same under inductor, what
the twins decline, and modules compiled with Float8BlockScaling on a CPU backend carrying the
cast's twin, with no block cast left opaque. On the GPU: the cast bit for bit the cuda op
(Triton kernel), the GEMM the eager cuBLASLt call, eager and compiled, and compiled modules on
the cuda backend against eager."""
import pytest
import torch

import te_core as te
from te_backend_cuda import traced, traced_block
from te_core import backend, recipe
from te_core.backend.types import BLOCK_1x128_1x128, BLOCK_1x128_128x128
from te_core.reference import activation as ref_act
from te_core.reference import cast as ref_cast

from test_cuda_traced_fused import (MODULES, _assert_relative_errors, _capture, _compare_compiled, _fwd_bwd,
                                    _opaque_ops, _step)
from twin_backends import cpu_backend_with

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(256, 384), (130, 300), (5, 129)]  # whole blocks, partial edge blocks both ways, fewer rows than a tile
SETTINGS = [  # (block_2d, with_transpose, force_pow2_scales, amax_epsilon)
    (False, False, True, 0.0), (False, True, True, 0.0), (True, False, True, 0.0), (True, True, True, 0.0),
    (False, True, False, 0.0), (True, True, False, 1e-3)]


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(traced, "DEVICE_TYPE", "cpu")


def _input(shape, dtype, device="cpu", seed=0):
    """Random rows of very different magnitudes, with a NaN, an inf, an all-zero 1x128 run and
    a run of values so small that the epsilon decides its scale."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-3, 4, (m, 1), generator=g)
    x[0, 3] = float("nan")
    x[min(2, m - 1), min(130, k - 1)] = float("-inf")
    x[m - 1, :min(k, 128)] = 0.0
    if m > 3:
        x[3, :min(k, 128)] *= 1e-6
    return x.to(dtype).to(device)


def _assert_same_bits(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"{what} output {i}"
        if w is None:
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what} output {i}: {g.dtype} {g.shape} vs {w.dtype} {w.shape}"
        assert torch.equal(g.flatten().view(torch.uint8), w.flatten().view(torch.uint8)), f"{what} output {i}"


def _case_ids():
    return [f"{s[0]}x{s[1]}-{'2d' if b2 else '1d'}{'-t' if t else ''}{'' if p else '-nopow2'}{'-eps' if e else ''}"
            for s in SHAPES for b2, t, p, e in SETTINGS]


CASES = [(s, st) for s in SHAPES for st in SETTINGS]


def _declined(shape, setting) -> bool:
    """The one combination the twin leaves to the opaque op (see traced_block._takes)."""
    block_2d, with_transpose, pow2, _ = setting
    return not pow2 and with_transpose and not block_2d and shape[1] % 128 != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape,setting", CASES, ids=_case_ids())
def test_twin_is_the_reference_bit_for_bit(on_cpu, shape, setting, fp8_dtype, dtype):
    block_2d, with_transpose, pow2, eps = setting
    x = _input(shape, dtype)
    kwargs = dict(block_2d=block_2d, with_transpose=with_transpose, force_pow2_scales=pow2, amax_epsilon=eps)
    got = traced_block.quantize_blockwise(x, fp8_dtype, **kwargs)
    want = ref_cast.quantize_blockwise(x, fp8_dtype, **kwargs)
    if _declined(shape, setting):
        assert got is NotImplemented  # declined (traced_block._takes), so the opaque op runs
        return
    assert got is not NotImplemented
    _assert_same_bits(got, want, "twin")
    assert torch.isnan(got[0].float()).any()  # the specials reached the data
    if not block_2d or shape[0] > 128:  # (both tiles of 5x129 hold a NaN or an inf: scale 1)
        assert got[1].unique().numel() > 2


@pytest.mark.parametrize("shape,setting", [CASES[i] for i in (1, 3, 4, 9, 17)],
                         ids=[_case_ids()[i] for i in (1, 3, 4, 9, 17)])
def test_twin_under_inductor_is_the_reference(on_cpu, shape, setting):
    """Compiled by inductor (fullgraph) from a bfloat16 producer it fuses with the cast, still
    the reference's bytes and scales (the input is read as stored)."""
    torch._dynamo.reset()
    block_2d, with_transpose, pow2, eps = setting
    kwargs = dict(block_2d=block_2d, with_transpose=with_transpose, force_pow2_scales=pow2, amax_epsilon=eps)
    x = _input(shape, torch.float32, seed=3)

    def produce_and_cast(x):
        return traced_block.quantize_blockwise((x * 1.5).to(torch.bfloat16), E4M3, **kwargs)

    got = torch.compile(produce_and_cast, fullgraph=True)(x)
    want = ref_cast.quantize_blockwise((x * 1.5).to(torch.bfloat16), E4M3, **kwargs)
    _assert_same_bits(got, want, "inductor")
    torch._dynamo.reset()


def test_twin_declines_what_it_does_not_take(on_cpu):
    x = _input((130, 300), torch.bfloat16)
    declined = [
        (x.reshape(-1), E4M3, {}),  # 1-D: the opaque op names the problem
        (x.to(torch.int32), E4M3, {}),
        (x, torch.bfloat16, {}),
        (x[:0], E4M3, {}),
        (x, E4M3, dict(amax_epsilon=-1.0)),
        (x, E4M3, dict(amax_epsilon=float("nan"))),
        (x, E4M3, dict(amax_epsilon=torch.tensor(0.0))),
        (x, E4M3, dict(block_2d=1)),
        (x, E4M3, dict(with_transpose=True, force_pow2_scales=False)),  # see traced_block._takes
    ]
    for args in declined:
        assert traced_block.quantize_blockwise(args[0], args[1], **args[2]) is NotImplemented, args[1:]


def test_block_gemm_twin_declines_scales_of_the_wrong_shape(on_cpu):
    a = torch.randn(256, 512).to(E4M3)
    b = torch.randn(384, 512).to(E4M3)
    for scaling, b_blocks in ((BLOCK_1x128_128x128, (3, 4)), (BLOCK_1x128_1x128, (384, 4))):
        for a_si, b_si in (((256, 3), b_blocks), ((256, 4), (b_blocks[0] + 1, 4)), ((4, 256), b_blocks)):
            got = traced.gemm_fp8(a, b, torch.ones(a_si), torch.ones(b_si), out_dtype=torch.bfloat16, scaling=scaling)
            assert got is NotImplemented, (scaling, a_si, b_si)


def test_gemm_twin_follows_the_capability_probe(monkeypatch):
    """A twin skips the dispatcher's capability check, so it asks the backend's probe itself: a
    scaling mode the GPU does not run natively is left to the opaque op (and so the reference)."""
    from te_backend_cuda import capabilities
    from te_core.backend.types import TENSORWISE, Capabilities

    seen = []

    def probed(index):
        seen.append(index)
        return Capabilities({"E4M3": 448.0}, frozenset({TENSORWISE, BLOCK_1x128_1x128}))

    monkeypatch.setattr(capabilities, "capabilities_for", probed)
    assert traced._gpu_runs(0, TENSORWISE) and traced._gpu_runs(1, BLOCK_1x128_1x128)
    assert not traced._gpu_runs(0, BLOCK_1x128_128x128)
    assert seen == [0, 1, 0]


def test_the_capability_probe_runs_for_real_while_dynamo_traces(monkeypatch):
    """The probe launches real GEMMs and reads their results: called while dynamo traces, it
    still runs on real tensors (not the tracer's fake ones, which cannot be read back), and
    the graph keeps its answer as a constant."""
    from te_backend_cuda import capabilities
    from te_core.backend.types import TENSORWISE, Capabilities

    calls = []

    def probed(index):
        probe = torch.ones(4) * 2  # a fake tensor here would fail .item()
        calls.append(probe.sum().item())
        return Capabilities({"E4M3": 448.0}, frozenset({TENSORWISE}))

    monkeypatch.setattr(capabilities, "capabilities_for", probed)
    torch._dynamo.reset()
    try:
        @torch.compile(fullgraph=True, backend="aot_eager")
        def step(x):
            return x * (2.0 if traced._gpu_runs(0, BLOCK_1x128_128x128) else 3.0)

        x = torch.randn(8)
        assert torch.equal(step(x), x * 3.0) and torch.equal(step(x), x * 3.0)
        assert calls and set(calls) == {8.0}
    finally:
        torch._dynamo.reset()


def test_twin_declines_other_devices():
    """With the backend's own device type (cuda), a CPU tensor stays the opaque op."""
    assert traced_block.quantize_blockwise(_input((130, 300), torch.bfloat16), E4M3) is NotImplemented


@pytest.fixture
def block_twin_backend(monkeypatch):
    """A CPU backend running the reference, with the block cast's twin as its traced."""
    monkeypatch.setattr(traced, "DEVICE_TYPE", "cpu")
    with cpu_backend_with(monkeypatch, "cpu_block_twin", traced_block.TRACED_BLOCK):
        yield


def _rope(module, device):
    return te.RotaryPositionEmbedding(16)(16).to(device) if module == "TransformerLayer" else None


@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_block_scaled_module_has_no_opaque_block_cast(block_twin_backend, module):
    """fullgraph compile with Float8BlockScaling: every block cast traced (the GEMMs stay the
    reference's opaque op here), and each step's outputs and gradients those of eager (the
    same casts, bit for bit; the traced math sums in another order)."""
    graphs = []
    results, _, _ = _compare_compiled(MODULES[module], recipe.Float8BlockScaling(), "cpu", torch.float32,
                                      _capture(graphs), _rope(module, "cpu"))
    left = _opaque_ops(graphs)
    assert graphs and "quantize_blockwise" not in left and "gemm_fp8" in left, sorted(left)
    for step, (got, want) in enumerate(results):
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=1.3e-6, atol=1e-5, msg=lambda m: f"step {step} tensor {i}: {m}")


# --- GPU -----------------------------------------------------------------------------------
@GPU
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("shape,setting", CASES, ids=_case_ids())
def test_twin_equals_the_cuda_op(shape, setting, compiled):
    from te_backend_cuda import ops

    torch._dynamo.reset()
    block_2d, with_transpose, pow2, eps = setting
    kwargs = dict(block_2d=block_2d, with_transpose=with_transpose, force_pow2_scales=pow2, amax_epsilon=eps)
    x = _input(shape, torch.bfloat16, device="cuda", seed=5)
    run = torch.compile(traced_block.quantize_blockwise, fullgraph=True) if compiled else traced_block.quantize_blockwise
    if _declined(shape, setting):
        pytest.skip("the twin declines this combination (the opaque op runs it)")
    got = run(x, E4M3, **kwargs)
    want = ops.quantize_blockwise(x, E4M3, **kwargs)
    _assert_same_bits(got, want, "cuda")
    torch._dynamo.reset()


@GPU
@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_block_scaled_module_on_cuda(module):
    """On the cuda backend with Float8BlockScaling: no block cast left opaque in the compiled
    step, and inductor's step within 1e-2 (relative, L2) of eager on every output and gradient."""
    backend.set_backend("cuda")
    try:
        torch._dynamo.reset()
        graphs = []
        _compare_compiled(MODULES[module], recipe.Float8BlockScaling(), "cuda", torch.bfloat16, _capture(graphs),
                          _rope(module, "cuda"))
        assert graphs and "quantize_blockwise" not in _opaque_ops(graphs), sorted(_opaque_ops(graphs))
        torch._dynamo.reset()
        results, _, _ = _compare_compiled(MODULES[module], recipe.Float8BlockScaling(), "cuda", torch.bfloat16,
                                          "inductor", _rope(module, "cuda"))
        _assert_relative_errors(results)
    finally:
        torch._dynamo.reset()
        backend.reset()


def _block_magnitudes(rows, cols, block_rows, g):
    """2^k factors, k in [-6, 6], one per block of block_rows x 128: every block's scale differs
    from its neighbours', so a scale read from the wrong block moves the GEMM's result."""
    k = torch.randint(-6, 7, (-(-rows // block_rows), cols // 128), generator=g, device="cuda")
    return (2.0 ** k).repeat_interleave(block_rows, 0)[:rows].repeat_interleave(128, 1)


def _block_operands(scaling, seed=0):
    from te_backend_cuda import ops

    g = torch.Generator(device="cuda").manual_seed(seed)
    w_rows = 128 if scaling == BLOCK_1x128_128x128 else 1
    x = (torch.randn(256, 512, device="cuda", generator=g) * _block_magnitudes(256, 512, 1, g)).to(torch.bfloat16)
    w = (torch.randn(384, 512, device="cuda", generator=g) * _block_magnitudes(384, 512, w_rows, g)).to(torch.bfloat16)
    a, a_si, _, _ = ops.quantize_blockwise(x, E4M3)
    b, b_si, _, _ = ops.quantize_blockwise(w, E4M3, block_2d=scaling == BLOCK_1x128_128x128)
    assert a_si.unique().numel() > 4 and b_si.unique().numel() > 4  # the scales vary from block to block
    return a, b, a_si, b_si


@GPU
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("scaling", [BLOCK_1x128_128x128, BLOCK_1x128_1x128])
def test_block_gemm_twin_equals_the_cuda_op(scaling, with_bias):
    """The twin runs the eager op's cuBLASLt call: the same bytes as it is; compiled (inductor
    lays the scales out itself), within bfloat16's tolerance of it; both within bfloat16's
    tolerance of the float64 product of the dequantized operands. The scales differ from block
    to block, so a scale read from another block fails the comparisons."""
    from te_backend_cuda import scaled_mm

    torch._dynamo.reset()
    a, b, a_si, b_si = _block_operands(scaling)
    bias = torch.randn(384, device="cuda").to(torch.bfloat16) if with_bias else None
    kwargs = dict(out_dtype=torch.bfloat16, scaling=scaling, bias=bias)
    want = scaled_mm.gemm_fp8(a, b, a_si, b_si, **kwargs)
    got = traced.gemm_fp8(a, b, a_si, b_si, **kwargs)
    assert got is not NotImplemented and torch.equal(got, want)
    exact = scaled_mm.emulate(a, b, a_si, b_si, scaling).double() + (0 if bias is None else bias.double())
    scale = exact.abs().max()  # relative to the largest element: the terms' magnitudes set a GEMM's error
    torch.testing.assert_close(want.double() / scale, exact / scale, rtol=1.6e-2, atol=1e-3)
    compiled = torch.compile(lambda *t: traced.gemm_fp8(*t, **kwargs), fullgraph=True)(a, b, a_si, b_si)
    torch.testing.assert_close(compiled, want, rtol=1.6e-2, atol=1e-5)
    torch._dynamo.reset()


@GPU
def test_compiled_block_scaled_linear_on_cuda_traces_casts_and_gemms():
    """A te.Linear whose GEMMs cuBLASLt takes in blocks: compiled (fullgraph) with
    Float8BlockScaling, neither a block cast nor an FP8 GEMM is left opaque, and two inductor
    steps equal eager within 1e-2 (relative, L2) on the output and every gradient."""
    import copy

    backend.set_backend("cuda")
    try:
        torch.manual_seed(0)
        eager = te.Linear(512, 512, params_dtype=torch.bfloat16, device="cuda")  # every K a multiple of 512
        g = torch.Generator(device="cuda").manual_seed(0)
        with torch.no_grad():  # tile scales that differ, so that a misplaced scale shows
            eager.weight.mul_(_block_magnitudes(512, 512, 128, g))
        step = _step(recipe.Float8BlockScaling(), None)

        for backend_fn in (_capture(graphs := []), "inductor"):
            torch._dynamo.reset()
            model = copy.deepcopy(eager)
            compiled = torch.compile(step, fullgraph=True, backend=backend_fn)
            for i in range(2):
                x = (torch.randn(512, 512, device="cuda") * _block_magnitudes(512, 512, 1, g) * (i + 1)).to(torch.bfloat16)
                dy = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
                got, want = _fwd_bwd(compiled, model, x, dy), _fwd_bwd(step, eager, x, dy)
                if backend_fn == "inductor":
                    _assert_relative_errors([(got, want)])
        left = _opaque_ops(graphs)
        assert graphs and not left & {"quantize_blockwise", "gemm_fp8"}, sorted(left)
    finally:
        torch._dynamo.reset()
        backend.reset()


@GPU
def test_block_gemm_twin_declines_a_mode_the_gpu_does_not_run(monkeypatch):
    from te_backend_cuda import capabilities
    from te_core.backend.types import TENSORWISE, Capabilities

    monkeypatch.setattr(capabilities, "capabilities_for",
                        lambda index: Capabilities({"E4M3": 448.0}, frozenset({TENSORWISE})))
    a, b, a_si, b_si = _block_operands(BLOCK_1x128_128x128)
    got = traced.gemm_fp8(a, b, a_si, b_si, out_dtype=torch.bfloat16, scaling=BLOCK_1x128_128x128)
    assert got is NotImplemented


# --- the fused gradient cast's twin -----------------------------------------------------------
PARTS = [[(130, 256), (130, 300)], [(256, 384)], [(5, 129)]]  # column blocks; whole and partial blocks


def _parts(widths, dtype, device="cpu", seed=7):
    rows = widths[0][0]
    dy = _input((rows, sum(k for _, k in widths)), dtype, device=device, seed=seed)
    return list(torch.split(dy, [k for _, k in widths], dim=1)), dy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", PARTS, ids=lambda w: "+".join(f"{m}x{k}" for m, k in w))
def test_dbias_twin_is_the_reference(on_cpu, widths, dtype):
    """Below the kernel's threshold: the joined gradient's casts bit for bit the reference's,
    the bias gradient within float32 summation's tolerance of it."""
    parts, _ = _parts(widths, dtype)
    got = traced_block.dbias_cast_transpose_blockwise(parts, E5M2, force_pow2_scales=True, amax_epsilon=0.0)
    want = ref_act.dbias_cast_transpose_blockwise(parts, E5M2, force_pow2_scales=True, amax_epsilon=0.0)
    assert got is not NotImplemented
    _assert_same_bits(got[:4], want[:4], "dbias twin")
    finite = torch.isfinite(want[4])
    assert not finite.all()  # the NaN and inf columns reach the bias gradient
    torch.testing.assert_close(got[4][finite], want[4][finite], rtol=1.3e-6 if dtype == torch.float32 else 1.6e-2,
                               atol=1e-5)
    assert torch.equal(torch.isnan(got[4]), torch.isnan(want[4]))


def test_dbias_twin_declines_what_it_does_not_take(on_cpu):
    parts, dy = _parts([(130, 256), (130, 300)], torch.bfloat16)
    declined = [
        ([], {}),
        (dy, {}),  # a tensor, not a list of parts
        ([dy.reshape(-1)], {}),
        ([parts[0], parts[1][:64]], {}),  # rows differ: the opaque op names the mismatch
        ([parts[0], parts[1].float()], {}),
        ([dy.to(torch.int32)], {}),
        ([dy], dict(force_pow2_scales=False)),  # a partial 1x128 block both ways (traced_block._takes)
        ([dy], dict(amax_epsilon=-1.0)),
    ]
    for args, kwargs in declined:
        assert traced_block.dbias_cast_transpose_blockwise(args, E4M3, **kwargs) is NotImplemented, kwargs


def test_traces_names_the_ops_a_backend_gives_twins(block_twin_backend):
    assert backend.traces("quantize_blockwise") and backend.traces("dbias_cast_transpose_blockwise")
    assert not backend.traces("layernorm_fwd")


def test_the_reference_backend_traces_nothing():
    backend.set_backend("reference")
    try:
        assert not backend.traces("quantize_blockwise") and not backend.traces("dbias_cast_transpose_blockwise")
    finally:
        backend.reset()


@GPU
@pytest.mark.parametrize("widths", [[(1024, 1024)], [(1024, 512), (1024, 640)], [(1024, 512), (1024, 256), (1024, 256)],
                                    [(1040, 1100)], [(128, 8192)]],
                         ids=["whole", "two-parts", "three-parts", "partial-blocks", "one-row-block"])
def test_dbias_twin_compiled_is_the_cuda_op(widths):
    """From the kernel's threshold on, compiled: te_triton's fused kernel, the eager op's bytes
    and scales, its bias gradient within bfloat16's tolerance (the row blocks' sums are added in
    the compiler's order; one row block's sums are the gradient itself, bit for bit). Column
    blocks are read in place, as the eager op reads them: no join of the compiler's."""
    from test_cuda_traced_kernels import _joins, _kernels

    from te_backend_cuda import ops

    torch._dynamo.reset()
    # contiguous blocks, as split_grads hands them over (column views of one tensor are joined first, eagerly too)
    parts = [p.contiguous() for p in _parts(widths, torch.bfloat16, device="cuda", seed=9)[0]]
    run = torch.compile(lambda p: traced_block.dbias_cast_transpose_blockwise(p, E4M3), fullgraph=True)
    got = run(parts)
    if len(parts) > 1:
        assert not _joins(_kernels(run, parts))
    want = ops.dbias_cast_transpose_blockwise(parts, E4M3)
    _assert_same_bits(got[:4], want[:4], "cuda")
    assert got[1].stride() == want[1].stride() and got[3].stride() == want[3].stride()
    if widths[0][0] <= 128:
        assert torch.equal(got[4].view(torch.int16), want[4].view(torch.int16))
    else:
        torch.testing.assert_close(got[4], want[4], rtol=1.6e-2, atol=1e-5, equal_nan=True)
    torch._dynamo.reset()
