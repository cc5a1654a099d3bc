"""On the GPU: kernels launched through te_triton.launch's cache (the second call of a
specialization onwards) give the reference's bytes, and a call whose pointer alignment or sizes
differ gets its own compiled kernel instead of one specialized for the first call."""
import pytest
import torch
from te_core.reference import cast as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _check_quantize(x, scale):
    from te_triton import cast

    data, amax = cast.quantize_fp8(x, scale, torch.float8_e4m3fn)
    want, want_amax = ref.quantize_fp8(x.cpu(), scale.cpu(), torch.float8_e4m3fn)
    assert torch.equal(data.cpu().view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(amax.cpu(), want_amax)


def test_cached_launches_match_the_reference_across_alignments_and_sizes():
    from te_triton import cast, launch

    if not launch.ENABLED:
        pytest.skip("te_triton.launch is off with this triton (or TE_TRITON_FAST_LAUNCH=0)")
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(4096 + 8, device="cuda", generator=g, dtype=torch.bfloat16) * 30
    scale = torch.tensor([3.0], device="cuda")
    before = len(cast._quantize_kernel._compiled)
    for x in (base[:4096], base[8:4104], base[1:4097], base[1:4096], base[:4096], base[3:4000]):
        _check_quantize(x, scale)  # Triton's launch, or the cache's when an earlier view shared the key
        _check_quantize(x, scale)  # the cache's
    # aligned + divisible, misaligned + divisible, misaligned + odd length: one entry each
    assert len(cast._quantize_kernel._compiled) - before >= 3


def test_cached_cast_transpose_matches_the_reference():
    from te_triton import cast

    scale = torch.tensor([0.75], device="cuda")
    for shape in ((128, 256), (128, 256), (96, 40), (96, 40), (33, 70), (33, 70)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 100
        data, data_t, amax = cast.cast_transpose_fp8(x, scale, torch.float8_e5m2)
        want, want_t, want_amax = ref.cast_transpose_fp8(x.cpu(), scale.cpu(), torch.float8_e5m2)
        assert torch.equal(data.cpu().view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(data_t.cpu().view(torch.uint8), want_t.view(torch.uint8))
        assert torch.equal(amax.cpu(), want_amax)


def test_the_c_launch_runs_and_gives_the_bytes_of_pythons_launch():
    """Where te_triton's C extension is built, repeated launches go through it (counted here), and
    every kernel kind it launches (casts with amax slots, current scaling's two passes, the bias
    gradient's cast-transpose, the small FP8 GEMM, 1x128 blocks) gives the bytes that Python's
    launch gives the same call."""
    from te_triton import blockwise, cast, dbias, gemm, launch

    if launch.C_LAUNCH is None:
        pytest.skip("te_triton's C extension is not built here, or this Triton launches in another way")
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(96, 256, device="cuda", generator=g, dtype=torch.bfloat16) * 20
    w = torch.randn(128, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = torch.tensor([2.0], device="cuda")

    def run_all():  # (launches in this order; the block cast last)
        xq = cast.quantize_fp8_current(x, torch.float8_e4m3fn, with_transpose=True)
        wq = cast.cast_transpose_fp8(w, scale, torch.float8_e4m3fn)
        return [*xq, *wq, *cast.quantize_fp8(x.view(-1)[3:4099], scale, torch.float8_e5m2),  # a misaligned start
                *dbias.dbias_cast_transpose(x, scale, torch.float8_e5m2),
                gemm.gemm_fp8(xq[0], wq[0], xq[3], scale, out_dtype=torch.bfloat16),
                *blockwise.quantize_blockwise(x, torch.float8_e4m3fn, with_transpose=True)]

    def as_bytes(outs):
        return [None if t is None else t.view(torch.uint8) if t.element_size() == 1 else t.clone() for t in outs]

    run_all()  # every specialization compiled and registered
    real = launch._C_STATE[0]
    hits = []

    def counting(*args):
        done = real(*args)
        hits.append(done is not None)
        return done

    launch._C_STATE[0] = counting
    try:
        by_c = as_bytes(run_all())
        launch._C_STATE[0] = None
        by_python = as_bytes(run_all())
    finally:
        launch._C_STATE[0] = real
    # the per-tensor casts, current scaling's two passes, the dbias cast-transpose and the GEMM
    # (six launches) all go through C; the 1x128 block cast may (its plan is checked by bytes)
    assert len(hits) >= 6 and all(hits[:6]), f"repeated launches that missed the C launch: {hits}"
    for i, (a, b) in enumerate(zip(by_c, by_python)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"output {i} differs"


def test_a_c_launch_on_a_thread_without_a_cuda_context_makes_the_primary_one_current():
    """autograd runs a backward on a thread of its own, which has no current CUDA context until
    a CUDA call makes one; where a repeated launch is that thread's first CUDA work, the C launch
    makes the launch's GPU's primary context current, as Triton's launch does, and runs (here:
    an amax pass into a slot, on a thread whose context is cleared first)."""
    import ctypes
    import threading

    from te_triton import cast, launch

    if launch.C_LAUNCH is None:
        pytest.skip("te_triton's C extension is not built here, or this Triton launches in another way")
    libcuda = ctypes.CDLL("libcuda.so.1")
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(8192, device="cuda", generator=g, dtype=torch.bfloat16) * 7
    slot = torch.zeros(1, device="cuda")
    cast.amax(x, amax_out=slot)  # compiled, registered: the next launch goes through C
    slot.zero_()
    torch.cuda.synchronize()
    real = launch._C_STATE[0]
    hits, seen = [], {}

    def counting(*args):
        done = real(*args)
        hits.append(done is not None)
        return done

    def on_a_bare_thread():
        try:
            assert libcuda.cuCtxSetCurrent(ctypes.c_void_p(0)) == 0
            cast.amax(x, amax_out=slot)
            context = ctypes.c_void_p()
            assert libcuda.cuCtxGetCurrent(ctypes.byref(context)) == 0
            seen["context"] = context.value
        except Exception as exc:  # re-raised on the test's thread
            seen["error"] = exc

    launch._C_STATE[0] = counting
    try:
        worker = threading.Thread(target=on_a_bare_thread)
        worker.start()
        worker.join()
    finally:
        launch._C_STATE[0] = real
    if "error" in seen:
        raise seen["error"]
    torch.cuda.synchronize()
    assert hits == [True], f"the launch did not go through C: {hits}"
    assert seen["context"], "no context current on the thread after the launch"
    assert slot.item() == x.abs().max().float().item()
