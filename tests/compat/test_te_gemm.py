"""transformer_engine.pytorch.cpp_extensions.general_gemm under the stand-in: Megatron-LM's GEMMs
whose output dtype differs from the inputs' (a float32 logit layer over bfloat16 activations, a
weight gradient into a float32 buffer), against float64 products on fresh random inputs."""
from __future__ import annotations

import pytest
import torch


def _operands(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return (torch.randn(24, 32, dtype=dtype), torch.randn(16, 32, dtype=dtype), torch.randn(16, 24, dtype=dtype),
            torch.randn(24, dtype=dtype))


def test_layouts_and_output_dtypes_match_float64(stand_in):
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    weight, x, grad, bias = _operands()
    w64, x64, g64, b64 = (t.double() for t in (weight, x, grad, bias))
    # forward (TN), in float32 from bfloat16 operands, with the bias
    y, bias_grad, gelu_in, extra = general_gemm(weight, x, out_dtype=torch.float32, layout="TN", bias=bias)
    assert y.dtype == torch.float32 and bias_grad is gelu_in is extra is None
    torch.testing.assert_close(y.double(), x64 @ w64.T + b64, rtol=1.3e-6, atol=1e-5)
    # dgrad (NN), in the operands' dtype by default
    dx = general_gemm(weight, grad, layout="NN")[0]
    assert dx.dtype == torch.bfloat16
    torch.testing.assert_close(dx.double(), g64 @ w64, rtol=1.6e-2, atol=1e-5)
    # wgrad (NT) into a float32 buffer, written, then accumulated
    out = torch.full((24, 32), float("nan"))
    assert general_gemm(x, grad, out_dtype=torch.float32, layout="NT", out=out, grad=True)[0] is out
    torch.testing.assert_close(out.double(), g64.T @ x64, rtol=1.3e-6, atol=1e-5)
    general_gemm(x, grad, out_dtype=torch.float32, layout="NT", out=out, accumulate=True, grad=True)
    torch.testing.assert_close(out.double(), 2 * (g64.T @ x64), rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(layout="TT"), "layout must be one of TN, NN, NT"),
    (dict(gelu=True), "without gelu"),
    (dict(grad=True, bias=torch.zeros(24)), "bias with grad=True"),
])
def test_what_it_does_not_run_is_a_clear_error(stand_in, kwargs, match):
    from transformer_engine.pytorch.cpp_extensions import general_gemm

    weight, x, _, _ = _operands(torch.float32)
    error = ValueError if "layout" in kwargs else NotImplementedError
    with pytest.raises(error, match=match):
        general_gemm(weight, x, **kwargs)
