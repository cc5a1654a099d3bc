"""CPU stand-ins for the torch_musa kernels the ops call, written from torch_musa's sources and
tests (RMSNorm.cpp, SwiGlu.cpp, RoPE.cpp, tests/unittest/operator/test_rope.py): same argument
order, same dtype checks, same results. They test the Python around the kernels, not muDNN."""
from __future__ import annotations

import torch
import torch.nn.functional as F

ALLOWED = (torch.float32, torch.float16, torch.bfloat16)


def rmsnorm_forward(input, normalized_shape, eps, weight):
    assert input.dtype in ALLOWED, "Dtype of input tensor of RMSNorm only supports Float32, Half and BFloat16"
    assert weight.dtype == input.dtype, "DTypes of input/weight tensors of FusedRMSNormForwardOut must be the same"
    assert list(normalized_shape) == [input.shape[-1]]
    xf = input.float()
    invvar = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * invvar[..., None] * weight.float()).to(input.dtype), invvar


def rmsnorm_backward(grad_out, invvar, input, normalized_shape, eps, weight):
    assert list(normalized_shape) == [input.shape[-1]]
    xhat = input.float() * invvar[..., None]
    dxhat = grad_out.float() * weight.float()
    dx = invvar[..., None] * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dw = (grad_out.float() * xhat).reshape(-1, input.shape[-1]).sum(0)
    return dx.to(input.dtype), dw.to(weight.dtype)


def swish_glu(x):
    assert x.dtype in ALLOWED, "SwiGLu only supports for float32/float16/bfloat16"
    a, b = torch.chunk(x.float(), 2, dim=-1)
    return (F.silu(a) * b).to(x.dtype)


def rope(*, input, freq_cis, rotary_interleaved, batch_first):
    # Only the mode torch_musa's test checks; the backend must never ask for another.
    assert not rotary_interleaved and not batch_first, "untested F.rope mode requested"
    assert freq_cis.dim() == 2 and freq_cis.shape[-1] == input.shape[-1]
    assert input.is_contiguous() and freq_cis.is_contiguous()
    f = freq_cis.reshape(freq_cis.shape[0], 1, 1, freq_cis.shape[-1])
    t1, t2 = torch.chunk(input, 2, dim=-1)
    return input * torch.cos(f).to(input.dtype) + torch.cat((-t2, t1), dim=-1) * torch.sin(f).to(input.dtype)
