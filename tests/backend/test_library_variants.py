"""The torch.library custom ops behind the contract ops (te_core.ops._library), called as a
compiled graph calls them: their schemas, and the contract's results rebuilt from theirs."""
import torch

import te_core  # noqa: F401  (registers the custom ops)
from te_core import ops
from te_core.ops import _library
from te_core.ops._spec import CONTRACT

E4M3 = torch.float8_e4m3fn


def _returns(name):
    return [str(r.type) for r in getattr(torch.ops.te_core, name).default._schema.returns]


def test_writing_variants_leave_the_written_output_out_of_their_schema():
    """The argument an `_into` variant writes (amax_out, out) is handed back by the caller, so the
    custom op makes no tensor for it on each call."""
    assert _returns("cast_transpose_fp8") == ["Tensor"] * 3 and _returns("cast_transpose_fp8_into") == ["Tensor"] * 2
    assert _returns("quantize_fp8_into") == ["Tensor"]
    assert _returns("gemm") == ["Tensor"] and _returns("gemm_into") == []
    assert _returns("layernorm_fwd_into") == ["Tensor"] * 3


def _call(name, *args, **kwargs):
    """A contract op through its custom op, as traced_call records it, decoded as traced_call does."""
    op = CONTRACT[name]
    writes = any(kwargs.get(n) is not None for n in _library.MUTATED_BY_NAME)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in _library.MUTATED_BY_NAME}
    raw = getattr(torch.ops.te_core, _library.writing_variant(op) if writes else name)(*args, **kwargs)
    return _library._decode(op, raw, kwargs)


def test_results_through_the_custom_ops_equal_the_direct_calls():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 48, generator=g) * 5
    scale = torch.tensor([2.0])
    slot, want_slot = torch.tensor(3.0).reshape(1), torch.tensor(3.0).reshape(1)
    got = _call("cast_transpose_fp8", x, scale, E4M3, amax_out=slot)
    want = ops.cast_transpose_fp8(x, scale, E4M3, amax_out=want_slot)
    assert got[2] is slot and torch.equal(slot, want_slot) and slot.item() == max(3.0, x.abs().max().item())
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    data, amax = _call("quantize_fp8", x, scale, E4M3, amax_out=slot)
    assert amax is slot and torch.equal(data.view(torch.uint8), want[0].view(torch.uint8))
    data, amax = _call("quantize_fp8", x, scale, E4M3)  # the pure variant: a fresh amax
    assert amax is not slot and amax.item() == x.abs().max().item()
    # an optional copy not asked for comes back as None (a placeholder in between)
    current = _call("quantize_fp8_current", x, E4M3, with_transpose=False)
    assert current[1] is None and torch.equal(current[4], x.abs().max())
    a, b = x.to(torch.bfloat16), torch.randn(16, 48, generator=g).to(torch.bfloat16)
    out = torch.full((32, 16), float("nan"), dtype=torch.bfloat16)
    result = _call("gemm", a, b, out=out)
    assert result is out and torch.equal(out, ops.gemm(a, b))
