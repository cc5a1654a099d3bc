"""torch.split / torch.chunk of an MXFP8Tensor along dim 0 at 32-row boundaries gives MXFP8
pieces (as Transformer Engine's): the FP8 bytes and E8M0 scales of those rows of both layouts,
so a piece is a GEMM operand without a requantization. They were DequantizedViews, which a GEMM
cannot read quantized. Other splits still give DequantizedViews, with the same values."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.dtype import DType
from te_core.quantization import MXFP8Tensor, quantized_gemm
from te_core.quantization.dequantized_view import DequantizedView

E4M3 = DType.kFloat8E4M3
ROWS, COLS = 192, 96

ALIGNED = {
    "split_32": lambda t: t.split(32),
    "split_64": lambda t: t.split(64),
    "split_sizes": lambda t: t.split([64, 32, 96]),
    "split_uneven_tail": lambda t: t.split(128),  # (128, 64): the last piece shorter, still whole runs
    "split_dim_minus_2": lambda t: t.split(96, dim=-2),
    "chunk_3": lambda t: t.chunk(3),
    "chunk_6": lambda t: t.chunk(6),
}
UNALIGNED = {
    "split_48": lambda t: t.split(48),
    "split_sizes_40": lambda t: t.split([40, 152]),
    "chunk_4": lambda t: t.chunk(4),  # 48 rows each
    "split_dim_1": lambda t: t.split(32, dim=1),
}


def _input(gen, rows=ROWS, cols=COLS, binades=6):
    """Random values whose rows span 2 * binades binades, so that neighbouring 1x32 runs have different scales."""
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float32)
    return x * torch.exp2(torch.randint(-binades, binades + 1, (rows, 1), generator=gen).float())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _bounds(pieces, dim=0):
    starts = [0]
    for p in pieces:
        starts.append(starts[-1] + p.shape[dim])
    return list(zip(starts, starts[1:]))


@pytest.mark.parametrize("how", list(ALIGNED))
def test_an_aligned_split_keeps_the_bytes_and_scales_of_both_layouts(how, gen):
    x = _input(gen)
    q = te.MXFP8Quantizer(E4M3)
    t = q(x)
    pieces = ALIGNED[how](t)
    assert sum(p.shape[0] for p in pieces) == ROWS
    for p, (a, b) in zip(pieces, _bounds(pieces)):
        assert type(p) is MXFP8Tensor, f"{how}: rows {a}:{b} became a {type(p).__name__}"
        assert p.shape == (b - a, COLS) and p.dtype == t.dtype
        rows, cols = p.rowwise(), p.columnwise()
        assert torch.equal(_bytes(rows.data), _bytes(t._data[a:b]))
        assert torch.equal(rows.scale_inv, t._scale_inv[a:b])
        assert torch.equal(_bytes(cols.data), _bytes(t._data_t[:, a:b]))
        assert torch.equal(cols.scale_inv, t._scale_inv_t[:, a // 32:b // 32])
        # ... which are what quantizing those rows alone gives: the piece is their MXFP8 value
        fresh = q(x[a:b])
        assert torch.equal(_bytes(cols.data), _bytes(fresh._data_t))
        assert torch.equal(cols.scale_inv, fresh._scale_inv_t)
        assert cols.data.is_contiguous() and cols.scale_inv.is_contiguous()  # (what kernels read)
        assert torch.equal(p.dequantize(), t.dequantize()[a:b])
        assert torch.equal(p.columnwise_only().dequantize(), t.columnwise_only().dequantize()[a:b])


@pytest.mark.parametrize("how", list(ALIGNED))
def test_a_rowwise_only_tensor_splits_into_rowwise_only_pieces(how, gen):
    t = te.MXFP8Quantizer(E4M3, columnwise=False)(_input(gen))
    pieces = ALIGNED[how](t)
    for p, (a, b) in zip(pieces, _bounds(pieces)):
        assert type(p) is MXFP8Tensor and not p.has_columnwise
        assert torch.equal(_bytes(p.rowwise().data), _bytes(t._data[a:b]))
        assert torch.equal(p.rowwise().scale_inv, t._scale_inv[a:b])
        assert torch.equal(p.dequantize(), t.dequantize()[a:b])
        with pytest.raises(RuntimeError, match="without its column-wise copy"):
            p.columnwise()


@pytest.mark.parametrize("how", list(UNALIGNED))
def test_an_unaligned_split_reads_the_dequantized_slices(how, gen):
    t = te.MXFP8Quantizer(E4M3)(_input(gen))
    whole = t.dequantize()
    pieces = UNALIGNED[how](t)
    dim = 1 if how == "split_dim_1" else 0
    assert sum(p.shape[dim] for p in pieces) == whole.shape[dim]
    for p, (a, b) in zip(pieces, _bounds(pieces, dim)):
        assert type(p) is DequantizedView, f"{how}: a cut inside a 1x32 run cannot stay MXFP8"
        assert torch.equal(p.dequantize(), whole.narrow(dim, a, b - a))


def test_gemms_read_a_piece_quantized(gen):
    """fprop (row-wise) and wgrad (column-wise) GEMMs of pieces equal the float64 products of the
    values the pieces' operands hold (values of one range, for which float32's tolerance holds)."""
    x = te.MXFP8Quantizer(E4M3)(_input(gen, binades=0))
    dy = te.MXFP8Quantizer(E4M3)(_input(gen, ROWS, 64, binades=0))
    w = te.MXFP8Quantizer(E4M3)(_input(gen, 64, COLS, binades=0))
    x_piece, dy_piece = x.split([64, 128])[1], dy.chunk(3)[2]  # rows 64:192, and 128:192
    x_rows = x.split(128)[1]  # rows 128:192, as dy_piece's
    y = quantized_gemm(x_piece, w, out_dtype=torch.float32)
    want = x.dequantize()[64:].double() @ w.dequantize().double().T
    torch.testing.assert_close(y.double(), want, rtol=1.3e-6, atol=1e-5)
    dw = quantized_gemm(dy_piece, x_rows, a_columnwise=True, b_columnwise=True, out_dtype=torch.float32)
    dy_t = dy.columnwise_only().dequantize()[128:].double()
    x_t = x.columnwise_only().dequantize()[128:].double()
    torch.testing.assert_close(dw.double(), dy_t.T @ x_t, rtol=1.3e-6, atol=1e-5)


def test_writes_reach_the_tensor_and_its_pieces(gen):
    """A piece is a view: a write into it requantizes its tensor, and a write into the tensor is
    read by the piece, in both layouts (its buffers are the tensor's)."""
    t = te.MXFP8Quantizer(E4M3)(_input(gen))
    want = t.dequantize().clone()
    want[64:128] *= -2.0
    piece = t.split(64)[1]
    with torch.no_grad():
        piece.mul_(-2.0)
    fresh = te.MXFP8Quantizer(E4M3)(want)  # (an in-place op requantizes the tensor's new value, whole)
    assert torch.equal(t.dequantize(), fresh.dequantize())
    assert torch.equal(t.columnwise_only().dequantize(), fresh.columnwise_only().dequantize())
    with torch.no_grad():
        t.copy_(_input(gen))
    assert torch.equal(piece.dequantize(), t.dequantize()[64:128])
    assert torch.equal(piece.columnwise_only().dequantize(), t.columnwise_only().dequantize()[64:128])


def test_a_split_under_torch_compile_equals_eager():
    """Traced, the pieces take the general path (compiling a split that returns MXFP8 pieces
    failed in torch's subclass tracing); the values are the eager split's."""
    import te_core as te
    from te_core import recipe

    torch.manual_seed(0)
    with te.quantized_model_init(recipe=recipe.MXFP8BlockScaling()):
        weight = te.Linear(64, 128).weight

    def f(w, x):
        a, _, _, d = w.split(32)
        return torch.cat([x @ a.dequantize().t(), x @ d.dequantize().t()], dim=1)

    x = torch.randn(8, 64)
    with torch.no_grad():
        eager = f(weight, x)
        compiled = torch.compile(f, backend="aot_eager")(weight, x)
        reference = torch.cat([x.double() @ weight.dequantize().double()[:32].t(),
                               x.double() @ weight.dequantize().double()[96:].t()], dim=1)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(compiled.double(), reference, rtol=1.3e-6, atol=1e-5)
