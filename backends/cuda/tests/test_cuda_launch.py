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
