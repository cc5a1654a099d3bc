"""The plain and block casts' twins traced by torch.compile with every size symbolic, on any
machine: Triton compiles a kernel to its IR (which dynamo reads to learn what a launch writes)
for a stand-in CUDA target without a GPU, and the launches are recorded, not run, so the trace
and its guards are the ones a GPU gets, while their bytes are checked on a GPU
(test_cuda_traced_kernels.py). With traced_kernels.SYMBOLIC on (and SYMBOLIC_BLOCK, for the
block casts), one graph serves every shape and launches te_triton's kernels with grids worked
out from the sizes, at each shape the launches te_triton's eager op makes; off, such sizes keep
the compiler's casts or the opaque ops."""
import pytest
import torch
from test_cuda_traced_kernels import _described

from te_backend_cuda import traced, traced_block, traced_kernels

triton = pytest.importorskip("triton")
E4M3 = torch.float8_e4m3fn
# No two sizes alike (dynamo gives equal sizes one symbol, and a shape without that equality
# is a graph of its own), every one at least traced_kernels.KERNEL_MIN_NUMEL elements.
SHAPES = [(1040, 1100), (640, 2048), (1536, 1024)]
CASTS = ["current", "current-transpose", "delayed", "delayed-transpose"]
BLOCK_CASTS = ["block", "block-transpose", "block-2d", "block-2d-transpose", "block-dbias"]


class _StandInDriver:
    """Triton's active driver for a machine without a GPU: a Hopper target to compile IR for."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@pytest.fixture
def stand_in_gpu(monkeypatch, sm90):
    """CPU tensors taken as the GPU's by the twins and traced as a GPU's launches (see the module
    docstring); everything restored afterwards."""
    from torch._C import DispatchKey

    try:
        import torch.utils._triton as torch_triton
        from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_mutation as launch_op
        from triton.runtime import driver
    except ImportError as exc:
        pytest.skip(f"this torch or Triton lacks what the stand-in needs: {exc}")
    if traced_kernels._WRAP_TRITON is None or not hasattr(driver, "_active"):
        pytest.skip("this torch has no torch.library.wrap_triton, or this Triton no settable active driver")
    monkeypatch.setattr(torch_triton, "has_triton", lambda: True)
    launched = []  # each launch the compiled code makes, as the launch op gets it: recorded, not run
    monkeypatch.setitem(launch_op.py_kernels, DispatchKey.CompositeExplicitAutograd,
                        lambda *args, **kwargs: launched.append(kwargs))
    launch_op._dispatch_cache.clear()
    for module in (traced, traced_kernels):
        monkeypatch.setattr(module, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(traced_kernels, "_kernels_run_on", lambda index: True)
    monkeypatch.setattr(driver, "_active", _StandInDriver())  # (restored as it was: None where no GPU)
    torch._dynamo.reset()
    yield launched
    torch._dynamo.reset()
    launch_op._dispatch_cache.clear()


SCALE = 0.5  # delayed scaling's


def _block_kwargs(cast):
    return dict(block_2d="-2d" in cast, with_transpose=cast.endswith("transpose"), force_pow2_scales=True,
                amax_epsilon=0.0)


def _twin(cast):
    transpose = cast.endswith("transpose")
    if cast.startswith("current"):
        return lambda x, slot: traced.quantize_fp8_current(x, E4M3, with_transpose=transpose)
    if cast == "block-dbias":
        return lambda x, slot: traced_block.dbias_cast_transpose_blockwise([x], E4M3)
    if cast.startswith("block"):
        return lambda x, slot: traced_block.quantize_blockwise(x, E4M3, **_block_kwargs(cast))
    scale = torch.full((1,), SCALE)
    fn = traced.cast_transpose_fp8 if transpose else traced.quantize_fp8
    return lambda x, slot: fn(x, scale, E4M3, amax_out=slot)


def _eager(cast, x, slot, tuning):
    """te_triton's eager op for `cast` on x, with `tuning` (the H100's table), as the cuda op calls it."""
    from te_triton import blockwise
    from te_triton import cast as triton_cast

    transpose = cast.endswith("transpose")
    if cast.startswith("current"):
        return triton_cast.quantize_fp8_current(x, E4M3, with_transpose=transpose, cfg=tuning.quantize,
                                                ct_cfg=tuning.cast_transpose)
    if cast == "block-dbias":
        return blockwise.dbias_cast_transpose_blockwise([x], E4M3, force_pow2_scales=True, amax_epsilon=0.0,
                                                        cfg=tuning.blockwise_1d_transpose)
    if cast.startswith("block"):
        kwargs = _block_kwargs(cast)
        cfg = tuning.blockwise_1d_transpose if transpose and not kwargs["block_2d"] else tuning.blockwise
        return blockwise.quantize_blockwise(x, E4M3, cfg=cfg, **kwargs)
    scale = torch.full((1,), SCALE)
    if transpose:
        return triton_cast.cast_transpose_fp8(x, scale, E4M3, tuning.cast_transpose, amax_out=slot)
    return triton_cast.quantize_fp8(x, scale, E4M3, tuning.quantize, amax_out=slot)


def _by_name(kernel, grid, values):
    """(kernel name, 3-D grid, {parameter: its described value}) of one launch."""
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    return kernel.__name__, grid, {name: _described(value) for name, value in values.items()}


def _recorded(launched):
    """The compiled code's launches (the launch op's keywords) by _by_name: a launch with launch
    options (num_warps) names a one-config autotuner wrapping the kernel."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.autotuner import Autotuner

    out = []
    for call in launched:
        kernel = kernel_side_table.get_kernel(call["kernel_idx"])
        values = {**kernel_side_table.get_constant_args(call["constant_args_idx"]), **call["kwargs"]}
        if isinstance(kernel, Autotuner):
            values["num_warps"] = kernel.configs[0].num_warps
            kernel = kernel.fn
        out.append(_by_name(kernel.fn, call["grid"][0], values))
    return out


def _eager_launches(run, monkeypatch):
    """The launches te_triton's eager op makes in run(), recorded through its launcher, not run."""
    from te_triton import launch

    calls = []

    def record(self, grid):
        def call(*args, **kwargs):
            calls.append(_by_name(self.kernel.fn, grid, {**dict(zip(self.kernel.arg_names, args)), **kwargs}))
        return call

    with monkeypatch.context() as patch:
        patch.setattr(launch.Launcher, "__getitem__", record)
        run()
    return calls


def _differing(values, eager_values, skip):
    """{parameter: (compiled launch's value, eager launch's)} where the two differ, but for `skip`."""
    return {k: (values[k], eager_values[k]) for k in values if k not in skip and values[k] != eager_values[k]}


def _unused(cast):
    """Per launch, the parameters that variant never reads, which each side passes a tensor of its
    own: current scaling's amax pass writes no scales; a block cast writes no bias gradient, nor,
    without the transpose, the transposed copy and its scales (whose strides it never reads)."""
    if cast.startswith("current"):
        return [{"scale_ptr", "scale_inv_ptr"}, set()]
    if cast == "block-dbias" or not cast.startswith("block"):
        return [set()]
    return [{"db_ptr"} | (set() if cast.endswith("transpose") else {"yt_ptr", "st_ptr", "st_row", "st_col"})]


def _traced(cast, shapes, dynamic):
    """(graphs dynamo kept, [(kernel name, grid) of each launch in each graph's last trace])."""
    from torch._dynamo.utils import counters
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    counters.clear()
    launches = []

    def backend(gm, example_inputs):
        launches.clear()  # (a trace restarted to specialize a float calls this again: keep its last)
        for node in gm.graph.nodes:
            if node.op == "call_function" and "triton_kernel_wrapper" in str(node.target):
                kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
                launches.append((kernel.fn.__name__, node.kwargs["grid"]))
        return gm.forward

    compiled = torch.compile(_twin(cast), backend=backend, fullgraph=True, dynamic=dynamic)
    for shape in shapes:
        x = torch.randn(shape).to(torch.bfloat16)
        compiled(x, torch.full((4,), 2.0)[1:2])  # a history's row as the slot
    return counters["stats"]["unique_graphs"], launches


@pytest.mark.parametrize("cast", CASTS + BLOCK_CASTS)
def test_one_graph_launches_the_kernels_for_every_shape(stand_in_gpu, monkeypatch, cast):
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_BLOCK", True)
    graphs, launches = _traced(cast, SHAPES, dynamic=True)
    assert graphs == 1, f"{graphs} graphs for {len(SHAPES)} shapes"
    if cast.startswith("block"):
        want = ["_blockwise_kernel"]
    else:
        want = ["_quantize_kernel"] if cast.startswith("current") else []  # current scaling's amax pass
        want.append("_cast_transpose_kernel" if cast.endswith("transpose") else "_quantize_kernel")
    assert [name for name, _ in launches] == want
    for name, grid in launches:  # each grid an expression of the sizes, not a number of one shape
        assert isinstance(grid[0][0], torch.fx.Node), (name, grid)


@pytest.mark.parametrize("cast", CASTS + BLOCK_CASTS)
def test_at_each_shape_the_compiled_code_launches_what_the_eager_op_launches(stand_in_gpu, monkeypatch, sm90, cast):
    """One graph, traced with every size symbolic, run at three shapes: each call's launches (the
    grids and sizes the compiled code works out, the tiles, flags, warps and argument layouts)
    are te_triton's eager ones at that shape, with the H100's table."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_BLOCK", True)
    compiled = torch.compile(_twin(cast), backend="aot_eager", fullgraph=True, dynamic=True)
    unused = _unused(cast)
    for shape in SHAPES:
        x = torch.randn(shape).to(torch.bfloat16)
        stand_in_gpu.clear()
        compiled(x, torch.full((4,), 2.0)[1:2])
        got = _recorded(stand_in_gpu)
        want = _eager_launches(lambda: _eager(cast, x, torch.full((1,), 2.0), sm90), monkeypatch)
        assert [(name, grid) for name, grid, _ in got] == [(name, grid) for name, grid, _ in want], shape
        assert len(got) == len(unused), shape
        for (name, _, values), (_, _, eager_values), skip in zip(got, want, unused):
            assert values.keys() == eager_values.keys(), (shape, name)
            differ = _differing(values, eager_values, skip)
            assert not differ, (shape, name, differ)


@pytest.mark.parametrize("cast", CASTS + BLOCK_CASTS)
def test_symbolic_sizes_keep_the_compilers_casts_while_symbolic_is_off(stand_in_gpu, monkeypatch, cast):
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", False)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_BLOCK", True)
    _, launches = _traced(cast, SHAPES[:1], dynamic=True)
    assert launches == []
    _, launches = _traced(cast, SHAPES[:1], dynamic=False)  # plain sizes: the kernels, whatever SYMBOLIC says
    assert launches and all(isinstance(grid[0][0], int) for _, grid in launches), launches


@pytest.mark.parametrize("cast", BLOCK_CASTS)
def test_symbolic_block_sizes_keep_the_compilers_casts_while_symbolic_block_is_off(stand_in_gpu, monkeypatch, cast):
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_BLOCK", False)
    _, launches = _traced(cast, SHAPES[:1], dynamic=True)
    assert launches == []


def test_a_shape_with_equal_sizes_is_a_graph_of_its_own(stand_in_gpu, monkeypatch):
    """Why SHAPES has no two sizes alike: a square first shape gives both sizes one symbol."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    graphs, _ = _traced("delayed", [(1024, 1024)] + SHAPES[:2], dynamic=True)
    assert graphs == 2


# --- delayed scaling's norm and activation forwards with FP8 output (traced_kernels.SYMBOLIC_FUSED)
FUSED = ["layernorm", "rmsnorm", "gelu", "swiglu"]
HIDDEN = 1024
TOKENS = [260, 384, 520]  # sequence lengths of one graph (batch and hidden fixed); no two alike


def _fused_params():
    torch.manual_seed(1)
    return torch.randn(HIDDEN).to(torch.bfloat16), torch.randn(HIDDEN).to(torch.bfloat16)


def _fused_input(cast, tokens, batch):
    width = 2 * HIDDEN if cast == "swiglu" else HIDDEN
    shape = (tokens, batch, width) if batch else (tokens, width)
    return torch.randn(shape).to(torch.bfloat16)


def _fused_twin(cast):
    """The twin of `cast` taking CPU tensors (the stand-in's), with delayed scaling's scale:
    twin(slot, x)."""
    from te_backend_cuda import traced_fused

    twins = traced_fused.twins("cpu")
    scale = torch.full((1,), SCALE)
    w, b = _fused_params()
    kwargs = dict(fp8_dtype=E4M3)
    if cast == "layernorm":
        return lambda slot, x: twins["layernorm_fwd"](x, w, b, 1e-5, fp8_scale=scale, amax_out=slot, **kwargs)
    if cast == "rmsnorm":
        return lambda slot, x: twins["rmsnorm_fwd"](x, w, 1e-5, fp8_scale=scale, amax_out=slot, **kwargs)
    return lambda slot, x: twins["activation_fwd"](x, cast, fp8_scale=scale, amax_out=slot, **kwargs)


def _fused_eager(cast, x, slot, tuning):
    """te_triton's eager op for `cast` with `tuning`'s config, as the cuda op calls it below the
    descriptor kernels' size."""
    from te_triton import activation, norm

    from te_backend_cuda.ops.activation import fwd_cfg
    from te_backend_cuda.ops.norm import fp8_pointer_cfg

    scale = torch.full((1,), SCALE)
    w, b = _fused_params()
    if cast in ("layernorm", "rmsnorm"):
        rms = cast == "rmsnorm"
        return norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms, fp8_scale=scale, fp8_dtype=E4M3,
                             cfg=fp8_pointer_cfg(tuning, HIDDEN, rms), amax_out=slot)
    return activation.activation_fwd(x, cast, fp8_scale=scale, fp8_dtype=E4M3, cfg=fwd_cfg(tuning, cast),
                                     amax_out=slot)


def _launches_per_count(twin, counts, inputs_at, eager, stand_in_gpu, monkeypatch, dynamic=True):
    """[(the compiled twin's launches, te_triton's eager launches)] at each of `counts`, and the
    number of graphs dynamo kept: twin(slot, *inputs_at(count)) compiled with the inputs' first
    size marked dynamic (or, `dynamic` off, every size plain), eager(inputs, slot) recorded
    through te_triton's launcher."""
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True,
                             dynamic=None if dynamic else False)  # (None: the marked sizes dynamic, the rest plain)
    out = []
    for count in counts:
        inputs = inputs_at(count)
        for t in inputs if dynamic else []:
            torch._dynamo.mark_dynamic(t, 0)
        stand_in_gpu.clear()
        compiled(torch.full((4,), 2.0)[1:2], *inputs)  # a history's row as the slot
        got = _recorded(stand_in_gpu)
        want = _eager_launches(lambda: eager(inputs, torch.full((1,), 2.0)), monkeypatch)
        out.append((got, want))
    return out, counters["stats"]["unique_graphs"]


def _run_fused(cast, batch, stand_in_gpu, monkeypatch, tuning):
    """_launches_per_count of the fused forward at each of TOKENS, the token count dynamic."""
    return _launches_per_count(_fused_twin(cast), TOKENS, lambda tokens: [_fused_input(cast, tokens, batch)],
                               lambda inputs, slot: _fused_eager(cast, inputs[0], slot, tuning), stand_in_gpu,
                               monkeypatch)


@pytest.mark.parametrize("cast", FUSED)
def test_fused_forwards_over_a_changing_token_count_launch_what_the_eager_op_launches(stand_in_gpu, monkeypatch,
                                                                                     sm90, cast):
    """A (tokens, batch, hidden) input whose token count is symbolic: one graph, and at each
    token count the launches (grid, sizes, tiles, flags, warps, argument layouts) of te_triton's
    eager op, with the H100's table; the norm's unmasked variant too, as the row count
    (batch x tokens) is known to be a multiple of its rows per step."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", True)
    runs, graphs = _run_fused(cast, 4, stand_in_gpu, monkeypatch, sm90)
    assert graphs == 1, f"{graphs} graphs for {len(TOKENS)} token counts"
    unused = {"mean_ptr"} if cast == "rmsnorm" else set()  # (RMSNorm stores no mean: each side passes its own)
    for tokens, (got, want) in zip(TOKENS, runs):
        assert len(got) == len(want) == 1, (tokens, got, want)
        (name, grid, values), (eager_name, eager_grid, eager_values) = got[0], want[0]
        assert (name, grid) == (eager_name, eager_grid), tokens
        assert values.keys() == eager_values.keys(), tokens
        differ = _differing(values, eager_values, unused)
        assert not differ, (tokens, differ)
        if cast.endswith("norm"):
            assert values["EVEN"] is True, tokens


@pytest.mark.parametrize("cast", ["layernorm", "rmsnorm"])
def test_a_norm_over_rows_not_known_to_fill_its_steps_launches_the_masked_variant(stand_in_gpu, monkeypatch, sm90,
                                                                                   cast):
    """A 2-D input whose row count is symbolic: the compiler cannot know it a multiple of the
    kernel's rows per step, so the launch takes the masked variant (EVEN off, the same bytes);
    everything else as the eager launch."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", True)
    runs, graphs = _run_fused(cast, 0, stand_in_gpu, monkeypatch, sm90)
    assert graphs == 1
    for tokens, (got, want) in zip(TOKENS, runs):
        (name, grid, values), (_, eager_grid, eager_values) = got[0], want[0]
        assert grid == eager_grid and eager_values["EVEN"] is True and values["EVEN"] is False, tokens
        differ = _differing(values, eager_values, {"EVEN", "mean_ptr"})
        assert not differ, (tokens, differ)


@pytest.mark.parametrize("cast", FUSED)
def test_fused_forwards_keep_the_opaque_ops_while_symbolic_fused_is_off_or_the_hidden_size_is_symbolic(
        stand_in_gpu, monkeypatch, sm90, cast):
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", False)
    runs, _ = _run_fused(cast, 4, stand_in_gpu, monkeypatch, sm90)
    assert all(got == [] for got, _ in runs)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", True)
    torch._dynamo.reset()
    compiled = torch.compile(_fused_twin(cast), backend="aot_eager", fullgraph=True, dynamic=True)
    stand_in_gpu.clear()
    compiled(torch.full((4,), 2.0)[1:2], _fused_input(cast, TOKENS[0], 4))
    assert stand_in_gpu == []


# --- the FP8 transpose (traced.transpose_fp8): te_triton's from KERNEL_MIN_NUMEL elements, any sizes
@pytest.mark.parametrize("dynamic", [True, False], ids=["symbolic", "plain"])
def test_fp8_transposes_launch_what_the_eager_op_launches(stand_in_gpu, monkeypatch, sm90, dynamic):
    """At each shape, plain sizes or all symbolic (then one graph): te_triton's eager launch
    (grid, sizes, tiles, warps, argument layouts), the same for a transpose of a transpose."""
    from torch._dynamo.utils import counters

    from te_triton import cast as triton_cast

    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    counters.clear()
    compiled = torch.compile(traced.transpose_fp8, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    for shape in SHAPES:
        for data in (torch.randn(shape).to(E4M3), torch.randn(shape[::-1]).to(E4M3)):
            stand_in_gpu.clear()
            compiled(data)
            got = _recorded(stand_in_gpu)
            want = _eager_launches(lambda: triton_cast.transpose_fp8(data, sm90.transpose), monkeypatch)
            assert [(name, grid) for name, grid, _ in got] == [(name, grid) for name, grid, _ in want], shape
            assert len(got) == 1 and got[0][0] == "_transpose_kernel", got
            assert got[0][2].keys() == want[0][2].keys(), shape
            differ = _differing(got[0][2], want[0][2], set())
            assert not differ, (shape, differ)
    if dynamic:
        assert counters["stats"]["unique_graphs"] == 1


def test_small_fp8_transposes_and_symbolic_ones_with_symbolic_off_stay_the_compilers(stand_in_gpu, monkeypatch):
    """Below KERNEL_MIN_NUMEL elements, and at symbolic sizes with SYMBOLIC off, no launch: the
    compiler's transpose, bit for bit data.t()."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    small = torch.randn(96, 1000).to(E4M3)  # under 2^20 elements
    assert small.numel() < traced_kernels.KERNEL_MIN_NUMEL
    out = torch.compile(traced.transpose_fp8, backend="aot_eager", fullgraph=True, dynamic=True)(small)
    assert stand_in_gpu == []
    assert torch.equal(out.view(torch.uint8), small.t().contiguous().view(torch.uint8))
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", False)
    torch._dynamo.reset()
    large = torch.randn(SHAPES[0]).to(E4M3)
    out = torch.compile(traced.transpose_fp8, backend="aot_eager", fullgraph=True, dynamic=True)(large)
    assert stand_in_gpu == []
    assert torch.equal(out.view(torch.uint8), large.t().contiguous().view(torch.uint8))


# --- delayed scaling's bias-gradient casts into a history slot (traced_kernels.SYMBOLIC_FUSED)
EPILOGUES = ["dbias", "gelu-bwd", "swiglu-bwd", "parts", "current-dbias", "current-parts", "block-parts"]
GRAD_ROWS = [1040, 2600, 4200]  # token counts of one graph (hidden fixed); no two alike; row groups capped or not


def _epilogue_inputs(cast, rows):
    """The gradient (or its column blocks) and, for an activation's backward, its input."""
    g = torch.Generator().manual_seed(rows)
    dy = torch.randn((rows, HIDDEN), generator=g).to(torch.bfloat16)
    if cast.endswith("parts"):
        inputs = [torch.randn((rows, w), generator=g).to(torch.bfloat16) for w in (256, 512, 256)]
    elif cast.endswith("-bwd"):
        width = 2 * HIDDEN if cast.startswith("swiglu") else HIDDEN
        inputs = [dy, torch.randn((rows, width), generator=g).to(torch.bfloat16)]
    else:
        inputs = [dy]
    return inputs


def _epilogue_twin(cast):
    from te_backend_cuda import traced_fused

    twins = traced_fused.twins("cpu")
    scale = torch.full((1,), SCALE)
    if cast == "parts":
        return lambda slot, *parts: twins["dbias_cast_transpose_parts"](list(parts), scale, E4M3, amax_out=slot)
    if cast.endswith("-bwd"):
        kind = cast[:-len("-bwd")]
        return lambda slot, dy, x: twins["activation_bwd_dbias_cast_transpose"](dy, x, kind, scale, E4M3,
                                                                               amax_out=slot)
    if cast == "current-dbias":  # (current scaling: no history)
        return lambda slot, dy: traced.dbias_cast_transpose_current([dy], E4M3)
    if cast == "current-parts":
        return lambda slot, *parts: traced.dbias_cast_transpose_current(list(parts), E4M3)
    if cast == "block-parts":  # (block scaling: no history)
        return lambda slot, *parts: traced_block.dbias_cast_transpose_blockwise(list(parts), E4M3)
    return lambda slot, dy: traced.dbias_cast_transpose(dy, scale, E4M3, amax_out=slot)


def _epilogue_eager(cast, inputs, slot, tuning):
    """te_triton's eager op as the cuda op calls it below the descriptor kernels' size (column
    blocks of whole strips read in place, by the twin as well)."""
    from te_triton import blockwise, dbias

    scale = torch.full((1,), SCALE)
    if cast == "block-parts":
        return blockwise.dbias_cast_transpose_blockwise(inputs, E4M3, cfg=tuning.blockwise_1d_transpose)
    if cast.endswith("-bwd"):
        return dbias.activation_bwd_dbias_cast_transpose(*inputs, cast[:-len("-bwd")], scale, E4M3,
                                                         tuning.dbias_cast_transpose, tuning.elementwise,
                                                         amax_out=slot)
    if cast.startswith("current"):
        return dbias.dbias_cast_transpose_current(inputs, E4M3, tuning.dbias_cast_transpose, amax_cfg=tuning.quantize)
    if cast == "parts":
        return dbias.dbias_cast_transpose_parts(inputs, scale, E4M3, tuning.dbias_cast_transpose, amax_out=slot)
    return dbias.dbias_cast_transpose(inputs[0], scale, E4M3, tuning.dbias_cast_transpose, amax_out=slot)


def _run_epilogue(cast, rows, stand_in_gpu, monkeypatch, tuning, dynamic=True):
    """_launches_per_count of the bias-gradient cast at each row count."""
    return _launches_per_count(_epilogue_twin(cast), rows, lambda r: _epilogue_inputs(cast, r),
                               lambda inputs, slot: _epilogue_eager(cast, inputs, slot, tuning), stand_in_gpu,
                               monkeypatch, dynamic)


@pytest.mark.parametrize("dynamic", [True, False], ids=["symbolic", "plain"])
@pytest.mark.parametrize("cast", EPILOGUES)
def test_bias_gradient_casts_over_a_changing_token_count_launch_what_the_eager_op_launches(stand_in_gpu, monkeypatch,
                                                                                          sm90, cast, dynamic):
    """A gradient whose row count is symbolic (one graph) or plain (a graph per count): at each
    count the launches (grids, row groups, sizes, tiles, flags, warps, argument layouts) of
    te_triton's eager op, with the H100's table."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", True)
    runs, graphs = _run_epilogue(cast, GRAD_ROWS, stand_in_gpu, monkeypatch, sm90, dynamic)
    assert graphs == (1 if dynamic else len(GRAD_ROWS)), f"{graphs} graphs for {len(GRAD_ROWS)} token counts"
    # current scaling's amax passes (one per block) write no scales: each side passes tensors of its own there
    passes = {"current-dbias": 1, "current-parts": 3}.get(cast, 0)
    for rows, (got, want) in zip(GRAD_ROWS, runs):
        assert [(name, grid) for name, grid, _ in got] == [(name, grid) for name, grid, _ in want], rows
        unused = [{"scale_ptr", "scale_inv_ptr"}] * passes + [set()] * (len(got) - passes)
        assert ("_blockwise_kernel" if cast.startswith("block") else "_dbias_ct_kernel") in [n for n, _, _ in got], got
        for (name, _, values), (_, _, eager_values), skip in zip(got, want, unused):
            assert values.keys() == eager_values.keys(), (rows, name)
            differ = _differing(values, eager_values, skip)
            assert not differ, (rows, name, differ)


def test_a_bias_gradient_of_few_rows_is_a_graph_of_its_own(stand_in_gpu, monkeypatch, sm90):
    """Few enough rows that one group writes the bias gradient (no sum after the kernel): a second
    graph, whose launch is the eager op's at that count, and the first graph's again for many."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", True)
    runs, graphs = _run_epilogue("dbias", [1040, 200, 1536], stand_in_gpu, monkeypatch, sm90)
    assert graphs == 2
    for got, want in runs:
        assert [(name, grid) for name, grid, _ in got] == [(name, grid) for name, grid, _ in want]
        assert not _differing(got[0][2], want[0][2], set())
    assert runs[1][0][0][1][0] == 1024 // sm90.dbias_cast_transpose.block_n  # one group: a program per strip


@pytest.mark.parametrize("cast", EPILOGUES)
def test_bias_gradient_casts_keep_the_opaque_ops_or_plain_casts_while_symbolic_fused_is_off(stand_in_gpu, monkeypatch,
                                                                                            sm90, cast):
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", False)
    runs, _ = _run_epilogue(cast, GRAD_ROWS[:2], stand_in_gpu, monkeypatch, sm90)
    if cast.startswith("current"):  # te_triton's plain current-scaling casts (of the joined blocks), the compiler's sum
        assert all([name for name, _, _ in got] == ["_quantize_kernel", "_cast_transpose_kernel"] for got, _ in runs)
    elif cast == "block-parts":  # the block casts take symbolic sizes by SYMBOLIC_BLOCK, not SYMBOLIC_FUSED
        assert all([name for name, _, _ in got] == ["_blockwise_kernel"] * 3 for got, _ in runs)
    else:
        assert all(got == [] for got, _ in runs)


def test_block_scaled_gradient_blocks_keep_the_compilers_cast_while_symbolic_block_is_off(stand_in_gpu, monkeypatch,
                                                                                          sm90):
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_BLOCK", False)
    runs, _ = _run_epilogue("block-parts", GRAD_ROWS[:2], stand_in_gpu, monkeypatch, sm90)
    assert all(got == [] for got, _ in runs)


# --- norm backwards (traced_kernels.norm_bwd): te_triton's kernel, plain or symbolic row counts
NORM_BWD = ["layernorm", "layernorm-add", "rmsnorm", "rmsnorm-add"]


def _norm_bwd_inputs(cast, tokens):
    """(dy, x, statistics..., add or nothing) of a (tokens, 4, HIDDEN) norm backward."""
    g = torch.Generator().manual_seed(tokens)
    dy, x, add = [torch.randn((tokens, 4, HIDDEN), generator=g).to(torch.bfloat16) for _ in range(3)]
    stats = [torch.rand((tokens, 4), generator=g) + 0.5 for _ in range(1 if cast.startswith("rms") else 2)]
    return [dy, x, *stats] + ([add] if cast.endswith("-add") else [])


def _norm_bwd_twin(cast):
    from te_backend_cuda import traced_fused

    op = cast.replace("norm", "norm_bwd").replace("-add", "_add")
    twin, (w, _) = traced_fused.twins("cpu")[op], _fused_params()
    if cast.endswith("-add"):
        return lambda slot, dy, x, *stats_add: twin(dy, x, *stats_add[:-1], w, stats_add[-1])
    return lambda slot, dy, x, *stats: twin(dy, x, *stats, w)


def _norm_bwd_eager(cast, inputs, tuning):
    from te_triton import norm

    from te_backend_cuda.ops.norm import pointer_bwd_cfg

    rms, add = cast.startswith("rms"), cast.endswith("-add")
    dy, x, *stats = inputs[:-1] if add else inputs
    mean, rstd = (None, stats[0]) if rms else stats
    return norm.norm_bwd(dy, x, mean, rstd, _fused_params()[0], rms=rms, cfg=pointer_bwd_cfg(tuning, HIDDEN, rms),
                         add=inputs[-1] if add else None)


@pytest.mark.parametrize("dynamic", [True, False], ids=["symbolic", "plain"])
@pytest.mark.parametrize("cast", NORM_BWD)
def test_norm_backwards_launch_what_the_eager_op_launches(stand_in_gpu, monkeypatch, sm90, cast, dynamic):
    """A (tokens, batch, hidden) norm backward whose token count is symbolic (one graph) or plain
    (a graph per count): at each count the launch (grid, sizes, tile, flags, warps, argument
    layouts) of te_triton's eager op with the H100's table, but for RMSNorm's bias-gradient
    pointer, which that kernel never writes."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", True)
    runs, graphs = _launches_per_count(_norm_bwd_twin(cast), TOKENS, lambda tokens: _norm_bwd_inputs(cast, tokens),
                                       lambda inputs, slot: _norm_bwd_eager(cast, inputs, sm90), stand_in_gpu,
                                       monkeypatch, dynamic)
    assert graphs == (1 if dynamic else len(TOKENS)), f"{graphs} graphs for {len(TOKENS)} token counts"
    unused = {"db_part_ptr"} if cast.startswith("rms") else set()
    for tokens, (got, want) in zip(TOKENS, runs):
        assert len(got) == len(want) == 1 and got[0][:2] == want[0][:2], (tokens, got, want)
        assert got[0][2]["ADD"] is cast.endswith("-add") and got[0][2]["M"] == 4 * tokens
        assert got[0][2].keys() == want[0][2].keys(), tokens
        differ = _differing(got[0][2], want[0][2], unused)
        assert not differ, (tokens, differ)


def test_norm_backwards_over_a_symbolic_hidden_size_keep_the_traced_math(stand_in_gpu, monkeypatch):
    """With the hidden size symbolic too (dynamic=True) the launch's tile would depend on it: the
    traced math, no launch; the same with NORM_BWD off at plain sizes."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    monkeypatch.setattr(traced_kernels, "SYMBOLIC_FUSED", True)
    compiled = torch.compile(_norm_bwd_twin("rmsnorm"), backend="aot_eager", fullgraph=True, dynamic=True)
    stand_in_gpu.clear()
    compiled(torch.zeros(1), *_norm_bwd_inputs("rmsnorm", TOKENS[0]))
    assert stand_in_gpu == []
    monkeypatch.setattr(traced_kernels, "NORM_BWD", False)
    torch._dynamo.reset()
    compiled = torch.compile(_norm_bwd_twin("layernorm"), backend="aot_eager", fullgraph=True, dynamic=False)
    compiled(torch.zeros(1), *_norm_bwd_inputs("layernorm", TOKENS[0]))
    assert stand_in_gpu == []
