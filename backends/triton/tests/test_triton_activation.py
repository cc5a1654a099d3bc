"""te_triton.activation under the Triton interpreter against te_core.reference.activation."""
import pytest
import torch
from triton_fp8_compare import assert_fp8_matches
from te_core.reference import activation as ref
from te_triton import Config, activation, dbias

KINDS = ("gelu", "relu", "silu", "qgelu", "srelu", "swiglu", "geglu", "reglu")
SMALL = Config(block_m=4, block_n=32, num_warps=4, max_programs=5)
TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def _x(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward(kind, dtype):
    x = _x((3, 5, 42), dtype, 1)
    y, amax = activation.activation_fwd(x, kind, cfg=SMALL)
    wy, _ = ref.activation_fwd(x, kind)
    assert amax is None
    torch.testing.assert_close(y, wy, **TOL[dtype])
    dy = _x(wy.shape, dtype, 2)
    torch.testing.assert_close(activation.activation_bwd(dy, x, kind, SMALL), ref.activation_bwd(dy, x, kind),
                               **TOL[dtype])


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_fp8_output(kind):
    x = _x((7, 66), torch.float32, 3)
    scale = torch.tensor([30.0])
    y, amax = activation.activation_fwd(x, kind, fp8_scale=scale, fp8_dtype=torch.float8_e4m3fn, cfg=SMALL)
    wy, wamax = ref.activation_fwd(x, kind, fp8_scale=scale, fp8_dtype=torch.float8_e4m3fn)
    torch.testing.assert_close(amax, wamax, rtol=1.3e-6, atol=1e-5)
    assert_fp8_matches(y, wy)


@pytest.mark.parametrize("prefetch", [False, True])
def test_dbias_cast_transpose(prefetch):
    dy = _x((37, 50), torch.bfloat16, 4)
    scale = torch.tensor([10.0])
    got = dbias.dbias_cast_transpose(dy, scale, torch.float8_e5m2,
                                          Config(block_m=16, block_n=16, max_programs=4, prefetch=prefetch))
    want = ref.dbias_cast_transpose(dy, scale, torch.float8_e5m2)
    assert_fp8_matches(got[0], want[0])
    assert torch.equal(got[1].float(), got[0].float().t())
    torch.testing.assert_close(got[2], want[2], **TOL[torch.bfloat16])
    assert torch.equal(got[3], want[3])


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("widths", [(32, 16, 16), (16, 48), (16, 0, 32), (20, 12), (16, 16, 16, 16), (48,)])
def test_dbias_cast_transpose_parts(widths, prefetch):
    """In place when every part is a whole number of 16-wide strips (the first three), else
    concatenated first; either way equal to the reference on the concatenation."""
    parts = [_x((37, w), torch.bfloat16, 10 + i) for i, w in enumerate(widths)]
    dy = torch.cat(parts, dim=1)
    scale = torch.tensor([10.0])
    cfg = Config(block_m=16, block_n=16, max_programs=4, prefetch=prefetch)
    amax_slot = torch.tensor([0.5])
    got = dbias.dbias_cast_transpose_parts(parts, scale, torch.float8_e5m2, cfg, amax_out=amax_slot)
    want = ref.dbias_cast_transpose(dy, scale, torch.float8_e5m2, amax_out=torch.tensor([0.5]))
    assert_fp8_matches(got[0], want[0])
    assert torch.equal(got[1].float(), got[0].float().t())
    torch.testing.assert_close(got[2], want[2], **TOL[torch.bfloat16])
    assert got[3] is amax_slot and torch.equal(got[3], want[3])


@pytest.mark.parametrize("groups", [1, 3], ids=["one-group", "row-groups"])
@pytest.mark.parametrize("widths", [(32, 16, 16), (16, 48)])
def test_parts_read_in_place_give_the_joined_gradients_bytes(monkeypatch, widths, groups):
    """The parts read in place (the kernel's PARTS) and their concatenation cast as one gradient
    give the same bytes, bias gradient included (one row group, or partial sums of several):
    the compiled code's twin joins them first."""
    if groups > 1:
        monkeypatch.setattr(dbias, "ONE_GROUP_NUMEL", 0)
    parts = [_x((70, w), torch.bfloat16, 40 + i) * 10 ** i for i, w in enumerate(widths)]
    scale = torch.tensor([10.0])
    cfg = Config(block_m=16, block_n=16, max_programs=12)
    assert dbias._groups(70, 4, cfg) == groups
    got = dbias.dbias_cast_transpose_parts(parts, scale, torch.float8_e4m3fn, cfg, amax_out=torch.tensor([0.5]))
    want = dbias.dbias_cast_transpose(torch.cat(parts, dim=1), scale, torch.float8_e4m3fn, cfg,
                                      amax_out=torch.tensor([0.5]))
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8) if g.element_size() == 1 else g, w.view(torch.uint8)
                           if w.element_size() == 1 else w)


def test_dbias_cast_transpose_parts_strided_part_is_copied():
    base = _x((24, 64), torch.bfloat16, 20)
    parts = [base[:, :32], base[:, 32:]]  # column slices: not contiguous
    got = dbias.dbias_cast_transpose_parts(parts, torch.tensor([4.0]), torch.float8_e4m3fn,
                                                Config(block_m=16, block_n=16, max_programs=4))
    want = ref.dbias_cast_transpose(base, torch.tensor([4.0]), torch.float8_e4m3fn)
    assert_fp8_matches(got[0], want[0])
    torch.testing.assert_close(got[2], want[2], **TOL[torch.bfloat16])


def test_dbias_cast_transpose_parts_bad_inputs():
    scale = torch.tensor([1.0])
    with pytest.raises(ValueError, match=r"parts\[1\].*not a column block"):
        dbias.dbias_cast_transpose_parts([torch.randn(4, 16), torch.randn(5, 16)], scale, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"parts\[1\]"):
        dbias.dbias_cast_transpose_parts([torch.randn(4, 16), torch.randn(4, 16).half()], scale,
                                              torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="non-empty list or tuple"):
        dbias.dbias_cast_transpose_parts([], scale, torch.float8_e4m3fn)


@pytest.mark.parametrize("pow2,eps", [(False, 0.0), (True, 0.0), (False, 50.0)])
@pytest.mark.parametrize("widths", [(32, 16, 16), (16, 48), (20, 12), (48,)])
def test_dbias_cast_transpose_current(widths, pow2, eps):
    """Current scaling's epilogue equals the reference's quantize_fp8_current + dbias of the
    concatenation: in place for whole strips (the first two), concatenated otherwise."""
    parts = [_x((37, w), torch.bfloat16, 30 + i) * (i + 1) for i, w in enumerate(widths)]
    dy = torch.cat(parts, dim=1)
    e5m2 = torch.float8_e5m2
    got = dbias.dbias_cast_transpose_current(parts, e5m2, Config(block_m=16, block_n=16, max_programs=4),
                                             force_pow2_scales=pow2, amax_epsilon=eps)
    data, data_t, scale, scale_inv, amax = ref.quantize_fp8_current(dy, e5m2, with_transpose=True,
                                                                    force_pow2_scales=pow2, amax_epsilon=eps)
    assert_fp8_matches(got[0], data)
    assert torch.equal(got[1].float(), got[0].float().t())
    torch.testing.assert_close(got[2], ref.dbias(dy), **TOL[torch.bfloat16])
    assert torch.equal(got[3], scale) and torch.equal(got[4], scale_inv) and torch.equal(got[5], amax)
    assert got[3].shape == (1,) and got[5].shape == ()


@pytest.mark.parametrize("op", ["parts", "current"])
def test_dbias_cast_transpose_one_strided_part_is_copied(op):
    """A lone part that is not contiguous (the gradient of a transposed output) is made so."""
    dy = _x((48, 24), torch.bfloat16, 40).t()
    cfg = Config(block_m=16, block_n=16, max_programs=4)
    if op == "parts":
        got = dbias.dbias_cast_transpose_parts([dy], torch.tensor([4.0]), torch.float8_e4m3fn, cfg)
        want = ref.dbias_cast_transpose(dy, torch.tensor([4.0]), torch.float8_e4m3fn)
    else:
        got = dbias.dbias_cast_transpose_current([dy], torch.float8_e4m3fn, cfg)
        want = ref.dbias_cast_transpose_current([dy], torch.float8_e4m3fn)
    assert_fp8_matches(got[0], want[0])
    torch.testing.assert_close(got[2], want[2], **TOL[torch.bfloat16])


def test_dbias_cast_transpose_current_empty_gets_its_scale():
    got = dbias.dbias_cast_transpose_current([torch.empty(0, 32)], torch.float8_e4m3fn, amax_epsilon=2.0)
    want = ref.quantize_fp8_current(torch.empty(0, 32), torch.float8_e4m3fn, with_transpose=True, amax_epsilon=2.0)
    assert got[0].shape == (0, 32) and got[1].shape == (32, 0)
    assert torch.equal(got[2], torch.zeros(32)) and torch.equal(got[3], want[2]) and torch.equal(got[4], want[3])


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("max_programs", [3, 12])  # one row group per column strip, or one per row tile
@pytest.mark.parametrize("kind", ["gelu", "srelu", "swiglu"])
def test_activation_bwd_dbias_cast_transpose(kind, max_programs, prefetch):
    x = _x((33, 48), torch.bfloat16, 5)
    dy = _x((33, 24 if kind == "swiglu" else 48), torch.bfloat16, 6)
    scale = torch.tensor([8.0])
    got = dbias.activation_bwd_dbias_cast_transpose(dy, x, kind, scale, torch.float8_e4m3fn,
                                                         Config(block_m=16, block_n=16, max_programs=max_programs,
                                                                prefetch=prefetch), SMALL)
    want = ref.activation_bwd_dbias_cast_transpose(dy, x, kind, scale, torch.float8_e4m3fn)
    assert_fp8_matches(got[0], want[0])
    assert torch.equal(got[1].float(), got[0].float().t())
    # dx is rounded to bf16 before the sum: one element one bf16 ulp off (fp32 formula
    # differences) moves a column sum by that ulp, however small the sum is
    ulp = 2.0**-7 * ref.activation_bwd(dy, x, kind).abs().max().item()
    torch.testing.assert_close(got[2], want[2], rtol=1.6e-2, atol=ulp)
    torch.testing.assert_close(got[3], want[3], **TOL[torch.bfloat16])


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="unknown activation kind 'tanh'"):
        activation.activation_fwd(torch.randn(4, 4), "tanh", cfg=SMALL)
    with pytest.raises(ValueError, match="even last dimension"):
        activation.activation_fwd(torch.randn(4, 5), "swiglu", cfg=SMALL)
    with pytest.raises(ValueError, match=r"dy must be contiguous with shape \(4, 2\)"):
        activation.activation_bwd(torch.randn(4, 4), torch.randn(4, 4), "geglu", SMALL)
    with pytest.raises(ValueError, match="must be 2-D"):
        dbias.activation_bwd_dbias_cast_transpose(torch.randn(2, 2, 2), torch.randn(2, 2, 2), "gelu",
                                                       torch.tensor([1.0]), torch.float8_e4m3fn)



def test_fp8_output_arguments_are_checked():
    """fp8_dtype without a scale reached the kernel as a None pointer; an empty scale was read
    through a null pointer; a scale without fp8_dtype was ignored; a 16-bit amax_out took the
    kernel's 4-byte atomic (and its neighbour's bytes)."""
    x, e4m3 = torch.randn(4, 32), torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8_dtype needs fp8_scale, a 1-element"):
        activation.activation_fwd(x, "gelu", fp8_dtype=e4m3, cfg=SMALL)
    with pytest.raises(ValueError, match="fp8_dtype needs fp8_scale, a 1-element"):
        activation.activation_fwd(x, "gelu", fp8_scale=torch.ones(0), fp8_dtype=e4m3, cfg=SMALL)
    with pytest.raises(ValueError, match="fp8_scale and fp8_dtype go together"):
        activation.activation_fwd(x, "gelu", fp8_scale=torch.ones(1), cfg=SMALL)
    with pytest.raises(ValueError, match="fp8_scale is on meta but x is on cpu"):
        activation.activation_fwd(x, "gelu", fp8_scale=torch.ones(1, device="meta"), fp8_dtype=e4m3, cfg=SMALL)
    with pytest.raises(ValueError, match="amax_out must be a 1-element float32 tensor, got torch.float16"):
        activation.activation_fwd(x, "relu", fp8_scale=torch.ones(1), fp8_dtype=e4m3, cfg=SMALL,
                                  amax_out=torch.zeros(1, dtype=torch.float16))


def test_integer_input_and_a_gradient_on_another_device_are_refused():
    """An integer x was computed on and written back truncated (gelu of ints gave 0s and 1s)."""
    xi, x = torch.randint(-3, 3, (4, 16)), torch.randn(4, 16)
    with pytest.raises(TypeError, match="x must be float32, bfloat16, float16 or float64, got torch.int64"):
        activation.activation_fwd(xi, "gelu", cfg=SMALL)
    with pytest.raises(TypeError, match="x must be float32, bfloat16, float16 or float64"):
        activation.activation_bwd(torch.randn(4, 16), xi, "gelu", SMALL)
    with pytest.raises(TypeError, match="x must be float32, bfloat16, float16 or float64"):
        dbias.activation_bwd_dbias_cast_transpose(torch.randn(4, 16), xi, "gelu", torch.ones(1), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="dy is on meta but x is on cpu"):
        activation.activation_bwd(torch.randn(4, 16, device="meta"), x, "gelu", SMALL)
    meta_scale = torch.ones(1, device="meta")
    with pytest.raises(ValueError, match="dy is on meta but x is on cpu"):
        dbias.activation_bwd_dbias_cast_transpose(torch.randn(4, 16, device="meta"), x, "gelu", meta_scale,
                                                  torch.float8_e4m3fn)
    ok, why = dbias.activation_bwd_dbias_cast_transpose_supports(torch.randn(4, 16, device="meta"), x, "gelu",
                                                                  meta_scale, torch.float8_e4m3fn)
    assert not ok and "dy is on meta" in why


def test_dbias_epilogues_refuse_a_missing_scale_and_bad_amax_out():
    """A None scale reached the kernel as a None pointer; an empty amax_out was a null pointer."""
    x, e4m3 = torch.randn(4, 32), torch.float8_e4m3fn
    with pytest.raises(ValueError, match="scale must be a 1-element float32 tensor, got NoneType"):
        dbias.activation_bwd_dbias_cast_transpose(torch.randn(4, 32), x, "gelu", None, e4m3)
    with pytest.raises(ValueError, match="scale must be a 1-element float32 tensor, got NoneType"):
        dbias.dbias_cast_transpose(x, None, e4m3)
    parts = [torch.randn(4, 128), torch.randn(4, 128)]
    with pytest.raises(ValueError, match="scale must be a 1-element float32 tensor, got NoneType"):
        dbias.dbias_cast_transpose_parts(parts, None, e4m3)
    with pytest.raises(ValueError, match=r"amax_out must be a 1-element float32 tensor, got torch.float32 \(0,\)"):
        dbias.dbias_cast_transpose_parts(parts, torch.ones(1), e4m3, amax_out=torch.zeros(0))
    with pytest.raises(ValueError, match="amax_out must be a 1-element float32 tensor, got torch.float16"):
        dbias.activation_bwd_dbias_cast_transpose(torch.randn(4, 16), torch.randn(4, 32), "swiglu", torch.ones(1),
                                                  e4m3, amax_out=torch.zeros(1, dtype=torch.float16))
