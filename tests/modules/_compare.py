"""Run a te-core module and its plain-PyTorch twin on the same input and compare the output
and every gradient (input and parameters by name)."""

from __future__ import annotations

from typing import Dict, Optional

import torch

TOL = {torch.float32: dict(rtol=1.3e-6, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def seeded(seed: int) -> torch.Generator:
    """A seeded generator on the device under test (torch's default device, which the conftest
    sets), so that `torch.randn(..., generator=seeded(n))` draws its numbers there."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def grads_of(module: torch.nn.Module, names: Dict[str, str]) -> Dict[str, torch.Tensor]:
    params = dict(module.named_parameters())
    return {k: params[v].grad for k, v in names.items()}


def run_pair(
    te_mod,
    ref_mod,
    x: torch.Tensor,
    param_map: Dict[str, str],
    *,
    seed: int = 0,
    tol: Optional[dict] = None,
    forward=None,
):
    """param_map: te parameter name -> reference parameter name. Compares output, dx and each dparam."""
    forward = forward or (lambda m, inp: m(inp))
    x_te = x.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    y_te, y_ref = forward(te_mod, x_te), forward(ref_mod, x_ref)
    tol = tol or TOL[x.dtype]
    torch.testing.assert_close(y_te, y_ref, **tol, msg=lambda m: f"forward: {m}")
    dy = torch.randn(y_ref.shape, generator=seeded(seed + 1)).to(y_ref.dtype)
    y_te.backward(dy)
    y_ref.backward(dy)
    torch.testing.assert_close(x_te.grad, x_ref.grad, **tol, msg=lambda m: f"dx: {m}")
    te_params, ref_params = dict(te_mod.named_parameters()), dict(ref_mod.named_parameters())
    for te_name, ref_name in param_map.items():
        torch.testing.assert_close(
            te_params[te_name].grad, ref_params[ref_name].grad, **tol, msg=lambda m: f"d{te_name}: {m}"
        )
    return y_te


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.5) -> None:
    g = seeded(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 and std < 1 else 0.0))
