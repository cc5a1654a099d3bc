"""Plain-PyTorch twins of the te-core modules (same parameter names), for comparisons."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def plain_norm(x, weight, bias, eps, normalization, zero_centered=False):
    w = weight + 1 if zero_centered else weight
    xf = x.float()
    if normalization == "LayerNorm":
        y = F.layer_norm(xf, x.shape[-1:], w.float(), bias.float(), eps)
    else:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return y.to(x.dtype)


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


ACTS = {
    "gelu": gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "srelu": lambda x: F.relu(x) ** 2,
    "sigmoid": torch.sigmoid,  # glu's gate (no activation kind of its own)
}
GATED = {"glu": "sigmoid", "swiglu": "silu", "geglu": "gelu", "reglu": "relu", "qgeglu": "qgelu", "sreglu": "srelu",
         "clamped_swiglu": None}


def clamped_swiglu(a, b, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
    """GPT-OSS's SwiGLU on Transformer Engine's [gate | linear] halves."""
    a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
    return a * torch.sigmoid(alpha * a) * (b + glu_linear_offset)


def plain_activation(x, kind, params=None):
    """In float32, rounded once to x's dtype (as Transformer Engine's kernels do)."""
    xf = x.float()
    if kind == "clamped_swiglu":
        return clamped_swiglu(*xf.chunk(2, dim=-1), **(params or {})).to(x.dtype)
    if kind in GATED:
        a, b = xf.chunk(2, dim=-1)
        return (ACTS[GATED[kind]](a) * b).to(x.dtype)
    return ACTS[kind](xf).to(x.dtype)


class PlainNormLinear(nn.Module):
    def __init__(self, n_in, n_out, normalization, eps=1e-5, bias=True, zero_centered=False):
        super().__init__()
        self.layer_norm_weight = nn.Parameter(torch.ones(n_in))
        self.layer_norm_bias = nn.Parameter(torch.zeros(n_in)) if normalization == "LayerNorm" else None
        self.weight = nn.Parameter(torch.zeros(n_out, n_in))
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None
        self.normalization, self.eps, self.zero_centered = normalization, eps, zero_centered

    def forward(self, x):
        ln = plain_norm(
            x, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization, self.zero_centered
        )
        return F.linear(ln, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class PlainNormMLP(nn.Module):
    def __init__(self, hidden, ffn, activation, normalization, eps=1e-5, bias=True, activation_params=None):
        super().__init__()
        fc1_out = 2 * ffn if activation in GATED else ffn
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden))
        self.layer_norm_bias = nn.Parameter(torch.zeros(hidden)) if normalization == "LayerNorm" else None
        self.fc1_weight = nn.Parameter(torch.zeros(fc1_out, hidden))
        self.fc1_bias = nn.Parameter(torch.zeros(fc1_out)) if bias else None
        self.fc2_weight = nn.Parameter(torch.zeros(hidden, ffn))
        self.fc2_bias = nn.Parameter(torch.zeros(hidden)) if bias else None
        self.activation, self.normalization, self.eps = activation, normalization, eps
        self.activation_params = activation_params

    def forward(self, x):
        ln = plain_norm(x, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization)
        cast = lambda t: None if t is None else t.to(x.dtype)  # noqa: E731
        h = F.linear(ln, cast(self.fc1_weight), cast(self.fc1_bias))
        return F.linear(plain_activation(h, self.activation, self.activation_params), cast(self.fc2_weight), cast(self.fc2_bias))
