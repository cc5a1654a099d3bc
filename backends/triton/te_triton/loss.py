"""Cross-entropy over a vocabulary, chunked: a program walks its row of logits in BLOCK_V
chunks with an online log-sum-exp, so any vocabulary size fits. The backward recomputes the
softmax from the saved per-row log-sum-exp; no (N, V) float32 intermediate is kept.
A target outside the vocabulary gives NaN in its row (see cross_entropy)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import MAX_NUMEL, Config, check_device, next_power_of_2
from .launch import launcher

LOSS_DEFAULT = Config(block=4096, num_warps=8)


@launcher
@triton.jit
def _ce_fwd_kernel(x_ptr, t_ptr, loss_ptr, lse_ptr, V, ignore_index, smoothing, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * V
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    total = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(tl.where(m == float("-inf"), 0.0, m - m_new)) + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
        total += tl.where(cols < V, x, 0.0)
    row_max = tl.max(m, axis=0)
    lse = row_max + tl.log(tl.sum(s * tl.exp(tl.where(m == float("-inf"), float("-inf"), m - row_max)), axis=0))
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    in_range = (t >= 0) & (t < V)
    picked = tl.load(base + t, mask=valid & in_range, other=0.0).to(tl.float32)
    loss = (1.0 - smoothing) * (lse - picked) + smoothing * (lse - tl.sum(total, axis=0) / V)
    loss = tl.where(in_range, loss, float("nan"))  # a class outside the vocabulary: NaN, not a wrong loss
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    tl.store(lse_ptr + row, lse)


@launcher
@triton.jit
def _ce_bwd_kernel(x_ptr, t_ptr, lse_ptr, g_ptr, dx_ptr, V, ignore_index, smoothing, G_STRIDE,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = row.to(tl.int64) * V
    t = tl.load(t_ptr + row)
    g = tl.where((t >= 0) & (t < V), tl.load(g_ptr + row * G_STRIDE), float("nan"))
    g = tl.where(t != ignore_index, g, 0.0)
    lse = tl.load(lse_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + base + cols, mask=cols < V, other=0.0).to(tl.float32)
        target = tl.where(cols == t, 1.0 - smoothing, 0.0) + smoothing / V
        dx = (tl.exp(x - lse) - target) * g
        tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < V)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, smoothing, reduction, cfg):
        N, V = logits.shape
        loss = torch.empty(N, dtype=torch.float32, device=logits.device)
        lse = torch.empty(N, dtype=torch.float32, device=logits.device)
        if N:
            _ce_fwd_kernel[(N,)](logits, target, loss, lse, V, ignore_index, float(smoothing),
                                 BLOCK_V=min(cfg.block, next_power_of_2(V)), num_warps=cfg.num_warps)
        valid = (target != ignore_index).sum()
        ctx.save_for_backward(logits, target, lse, valid)
        ctx.args = (ignore_index, float(smoothing), reduction, cfg)
        if reduction == "none":
            return loss
        total = loss.sum()
        return total if reduction == "sum" else total / valid.float()

    @staticmethod
    def backward(ctx, grad_out):
        logits, target, lse, valid = ctx.saved_tensors
        ignore_index, smoothing, reduction, cfg = ctx.args
        N, V = logits.shape
        g = grad_out.float()
        if reduction == "mean":
            g = g / valid.float()
        g = g.reshape(-1).contiguous()
        dx = torch.empty_like(logits)
        if N:
            _ce_bwd_kernel[(N,)](logits, target, lse, g, dx, V, ignore_index, smoothing, 0 if g.numel() == 1 else 1,
                                 BLOCK_V=min(cfg.block, next_power_of_2(V)), num_warps=cfg.num_warps)
        return dx, None, None, None, None, None


def cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                  cfg: Config = LOSS_DEFAULT):
    """Loss as te_core.ops.cross_entropy, differentiable w.r.t. logits. A target outside
    [0, V) that is not ignore_index makes its row's loss and gradient NaN: checking on the
    host would synchronize with the device on every call."""
    if logits.dim() != 2 or not logits.is_contiguous() or logits.numel() > MAX_NUMEL * 8:
        raise ValueError(f"logits must be a contiguous 2-D (N, V) tensor, got shape {tuple(logits.shape)}")
    if target.shape != (logits.shape[0],) or target.dtype.is_floating_point:
        raise ValueError(f"target must be an integer tensor of shape ({logits.shape[0]},), got {target.dtype} "
                         f"{tuple(target.shape)}")
    check_device(target, logits, "target", "logits")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return _CrossEntropy.apply(logits, target.contiguous(), int(ignore_index), float(label_smoothing), reduction, cfg)
