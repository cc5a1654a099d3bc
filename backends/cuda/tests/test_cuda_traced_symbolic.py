"""The plain casts' twins traced by torch.compile with every size symbolic, on any machine: Triton
compiles a kernel to its IR (which dynamo reads to learn what a launch writes) for a stand-in
CUDA target without a GPU, and the launches run as nothing, so the trace and its guards are the
ones a GPU gets, while their bytes are checked on a GPU (test_cuda_traced_kernels.py). With
traced_kernels.SYMBOLIC on, one graph serves every shape and launches te_triton's kernels with
grids worked out from the sizes; off, such sizes keep the compiler's casts or the opaque ops."""
import pytest
import torch

from te_backend_cuda import traced, traced_kernels

triton = pytest.importorskip("triton")
E4M3 = torch.float8_e4m3fn
# No two sizes alike (dynamo gives equal sizes one symbol, and a shape without that equality
# is a graph of its own), every one at least traced_kernels.KERNEL_MIN_NUMEL elements.
SHAPES = [(1040, 1100), (640, 2048), (1536, 1024)]
CASTS = ["current", "current-transpose", "delayed", "delayed-transpose"]


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
    monkeypatch.setitem(launch_op.py_kernels, DispatchKey.CompositeExplicitAutograd, lambda *args, **kwargs: None)
    launch_op._dispatch_cache.clear()
    for module in (traced, traced_kernels):
        monkeypatch.setattr(module, "DEVICE_TYPE", "cpu")
    monkeypatch.setattr(traced_kernels, "_kernels_run_on", lambda index: True)
    monkeypatch.setattr(driver, "_active", _StandInDriver())  # (restored as it was: None where no GPU)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    launch_op._dispatch_cache.clear()


def _twin(cast):
    transpose = cast.endswith("transpose")
    if cast.startswith("current"):
        return lambda x, slot: traced.quantize_fp8_current(x, E4M3, with_transpose=transpose)
    scale = torch.full((1,), 0.5)
    fn = traced.cast_transpose_fp8 if transpose else traced.quantize_fp8
    return lambda x, slot: fn(x, scale, E4M3, amax_out=slot)


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


@pytest.mark.parametrize("cast", CASTS)
def test_one_graph_launches_the_kernels_for_every_shape(stand_in_gpu, monkeypatch, cast):
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    graphs, launches = _traced(cast, SHAPES, dynamic=True)
    assert graphs == 1, f"{graphs} graphs for {len(SHAPES)} shapes"
    want = ["_quantize_kernel"] if cast.startswith("current") else []  # current scaling's amax pass
    want.append("_cast_transpose_kernel" if cast.endswith("transpose") else "_quantize_kernel")
    assert [name for name, _ in launches] == want
    for name, grid in launches:  # each grid an expression of the sizes, not a number of one shape
        assert isinstance(grid[0][0], torch.fx.Node), (name, grid)


@pytest.mark.parametrize("cast", CASTS)
def test_symbolic_sizes_keep_the_compilers_casts_while_symbolic_is_off(stand_in_gpu, monkeypatch, cast):
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", False)
    _, launches = _traced(cast, SHAPES[:1], dynamic=True)
    assert launches == []
    _, launches = _traced(cast, SHAPES[:1], dynamic=False)  # plain sizes: the kernels, whatever SYMBOLIC says
    assert launches and all(isinstance(grid[0][0], int) for _, grid in launches), launches


def test_a_shape_with_equal_sizes_is_a_graph_of_its_own(stand_in_gpu, monkeypatch):
    """Why SHAPES has no two sizes alike: a square first shape gives both sizes one symbol."""
    monkeypatch.setattr(traced_kernels, "SYMBOLIC", True)
    graphs, _ = _traced("delayed", [(1024, 1024)] + SHAPES[:2], dynamic=True)
    assert graphs == 2
