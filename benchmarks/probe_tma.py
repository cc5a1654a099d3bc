"""Probe: row kernels whose loads go through TMA descriptors in a software-pipelined loop.

Triton pipelines only descriptor loads (and loads feeding a dot): compiled for sm_90, a plain
`tl.load` in a `tl.range(..., num_stages=3)` row loop stays a synchronous ld.global, while a
descriptor load becomes cp.async.bulk.tensor into shared memory, issued STAGES-1 rows ahead.
The rows in flight then sit in shared memory, not in registers, which is what limited the
norm forward (LayerNorm 2906 GB/s at 16384x8192 against a 3600 target) and its earlier
register-held prefetch. Variants here, each checked byte for byte against the production kernel:

  norm forward (LayerNorm / RMSNorm, FP8 out + amax): rows per step, warps, programs per SM,
  stages, output stored by pointer or through a descriptor (TMA store);
  quantize + amax, tiles (BM, BN) walked by persistent programs;
  norm backward: x and dy through descriptors.

    python benchmarks/probe_tma.py      # on the GPU
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from te_triton._common import abs_bits
from te_triton.activation import _dact
from te_triton.cast import _cast_transpose_tile


@triton.jit
def norm_fwd_tma(x_desc, y_desc, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, scale_ptr, amax_ptr, M, N, eps,
                 BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, STAGES: tl.constexpr,
                 CHUNK: tl.constexpr, TMA_STORE: tl.constexpr, HOIST: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HOIST:
        g0 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        b0 = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    acc = tl.zeros([ROWS * BLOCK_N // CHUNK], dtype=tl.int32)
    for first in tl.range(tl.program_id(0) * ROWS, M, tl.num_programs(0) * ROWS, num_stages=STAGES):
        x = x_desc.load([first, 0]).to(tl.float32)
        rows = first + tl.arange(0, ROWS)
        rmask = rows < M
        if RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            xc = tl.where(cmask[None, :], x - mean[:, None], 0.0)
            tl.store(mean_ptr + rows, mean, mask=rmask)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        if HOIST:
            g, bb = g0, b0
        else:
            g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            bb = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * g[None, :]
        if not RMS:
            y = y + bb[None, :]
        bits = tl.where(rmask[:, None] & cmask[None, :], abs_bits(y), 0)
        acc = tl.maximum(acc, tl.max(tl.reshape(bits, [ROWS * BLOCK_N // CHUNK, CHUNK], can_reorder=True), axis=1))
        out = (y * scale).to(y_ptr.dtype.element_ty)
        if TMA_STORE:
            y_desc.store([first, 0], out)
        else:
            tl.store(y_ptr + rows[:, None] * N + cols[None, :], out, mask=rmask[:, None] & cmask[None, :])
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def quantize_tma(x_desc, y_desc, scale_ptr, amax_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr,
                 STAGES: tl.constexpr, CHUNK: tl.constexpr):
    scale = tl.load(scale_ptr)
    tiles_n = tl.cdiv(N, BN)
    acc = tl.zeros([BM * BN // CHUNK], dtype=tl.int32)
    for t in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tiles_n, tl.num_programs(0), num_stages=STAGES):
        r = (t // tiles_n) * BM
        c = (t % tiles_n) * BN
        x = x_desc.load([r, c]).to(tl.float32)
        acc = tl.maximum(acc, tl.max(tl.reshape(abs_bits(x), [BM * BN // CHUNK, CHUNK], can_reorder=True), axis=1))
        y_desc.store([r, c], (x * scale).to(y_desc.dtype))
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _add_pair(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def norm_bwd_tma(dy_desc, x_desc, mean_ptr, rstd_ptr, w_ptr, dx_ptr, dw_part_ptr, db_part_ptr, M, N,
                 BLOCK_N: tl.constexpr, RMS: tl.constexpr, STAGES: tl.constexpr):
    """Rows kept as [1, BLOCK_N] tiles, as the descriptor loads them (a reshape to 1-D made
    the compiler shuffle them through shared memory and spill)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)[None, :]
    cmask = cols < N
    g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    db = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    for row in tl.range(pid, M, tl.num_programs(0), num_stages=STAGES):
        x = x_desc.load([row, 0]).to(tl.float32)
        dy = dy_desc.load([row, 0]).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(cmask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
        wdy = dy * g
        if RMS:
            c1 = tl.sum(xhat * wdy, axis=1)[:, None] / N
            dx = (wdy - xhat * c1) * rstd
        else:
            s1, s2 = tl.reduce((xhat * wdy, wdy), 1, _add_pair)
            dx = (wdy - (xhat * (s1[:, None] / N) + s2[:, None] / N)) * rstd
            db += dy
        dw += dy * xhat
        tl.store(dx_ptr + row * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cmask)
    if not RMS:
        tl.store(db_part_ptr + pid * N + cols, db, mask=cmask)


@triton.jit
def cast_transpose_tma(x_desc, y_desc, yt_desc, scale_ptr, amax_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr,
                       STAGES: tl.constexpr):
    scale = tl.load(scale_ptr)
    tiles_n = tl.cdiv(N, BN)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for t in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tiles_n, tl.num_programs(0), num_stages=STAGES):
        r = (t // tiles_n) * BM
        c = (t % tiles_n) * BN
        x = x_desc.load([r, c]).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(x))
        q = (x * scale).to(y_desc.dtype)
        y_desc.store([r, c], q)
        yt_desc.store([c, r], tl.trans(q))
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def cast_transpose_tma_load(x_desc, y_ptr, yt_ptr, scale_ptr, amax_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr,
                            STAGES: tl.constexpr):
    """Tiles in through a descriptor, out through pointers (the production kernel's stores)."""
    scale = tl.load(scale_ptr)
    tiles_n = tl.cdiv(N, BN)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for t in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tiles_n, tl.num_programs(0), num_stages=STAGES):
        tm = t // tiles_n
        tn = t % tiles_n
        x = x_desc.load([tm * BM, tn * BN]).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(x))
        _cast_transpose_tile(y_ptr, yt_ptr, x, tm, tn, M, N, scale, 448.0, BM, BN, False)
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


@triton.jit
def dbias_ct_tma(g_desc, x_desc, y_desc, yt_desc, scale_ptr, amax_ptr, dbias_ptr, M, N, groups,
                 BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, ACT: tl.constexpr):
    """The production dbias cast-transpose's walk (a column strip per program, every groups-th
    row tile of it), its loads and stores through descriptors. ACT: gelu backward first."""
    pid = tl.program_id(0)
    c = (pid // groups) * BN
    scale = tl.load(scale_ptr)
    colsum = tl.zeros([BM, BN], dtype=tl.float32)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for tm in tl.range(pid % groups, tl.cdiv(M, BM), groups, num_stages=STAGES):
        g = g_desc.load([tm * BM, c])
        if ACT:
            x = x_desc.load([tm * BM, c])
            v = (g.to(tl.float32) * _dact(x.to(tl.float32), 0)).to(x.dtype).to(tl.float32)
        else:
            v = g.to(tl.float32)
        q = (v * scale).to(y_desc.dtype)
        y_desc.store([tm * BM, c], q)
        yt_desc.store([c, tm * BM], tl.trans(q))
        colsum += v
        acc = tl.maximum(acc, abs_bits(v))
    cols = c + tl.arange(0, BN)
    tl.store(dbias_ptr + (pid % groups) * N + cols, tl.sum(colsum, axis=0), mask=cols < N)
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def gbps(nbytes, ms):
    return nbytes / ms / 1e6


class Probe:
    """Times variants against the production kernel and keeps the best per group."""

    def __init__(self):
        self.best = {}

    def production(self, group, nbytes, fn):
        self.best.setdefault(group, [0.0, "", 0.0])[2] = v = gbps(nbytes, do_bench(fn, warmup=5, rep=40))
        print(f"{group} production: {v:.0f} GB/s", flush=True)

    def variant(self, group, label, nbytes, run, check):
        try:
            run()
            verdict = check()
            v = gbps(nbytes, do_bench(run, warmup=5, rep=40))
        except Exception as exc:  # a variant that does not compile is a finding, not a stop
            print(f"{group} {label}: FAILED {str(exc)[:200]}", flush=True)
            return
        print(f"{group} {label}: {v:.0f} GB/s ({verdict})", flush=True)
        entry = self.best.setdefault(group, [0.0, "", 0.0])
        if v > entry[0]:
            entry[:2] = [v, label]

    def summary(self):
        print("\nbest per group:")
        for group, (v, label, prod) in self.best.items():
            print(f"{group}: production {prod:.0f}, best tma {v:.0f} GB/s ({v / max(prod, 1):.3f}x)  [{label}]")


def _bytes_off(got, want):
    return (got.view(torch.uint8) != want.view(torch.uint8)).sum().item()


def _amax_verdict(buf, want):
    got = buf.view(torch.float32).item()
    return "amax ok" if got == want.item() else f"amax {got} vs {want.item()}"


def layernorm_forward_wide(pr, sms):
    """LayerNorm only (RMSNorm meets its target): more warps / rows / programs per SM."""
    norm_forward(pr, sms, norms=(False,), variants=[
        (rows, warps, stages, hoist, per_sm)
        for rows, warps in ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 8), (4, 16))
        for stages in (3, 4) for hoist in (True, False) for per_sm in (1, 2, 3, 4, 8)
        if warps * per_sm <= 64])


def norm_forward(pr, sms, norms=(False, True), variants=None):
    from te_triton import norm

    from te_backend_cuda import configs
    e4m3 = torch.float8_e4m3fn
    for M, N in [(16384, 4096), (16384, 8192)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3 + 1
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        s = torch.full((1,), 16.0, device="cuda")
        for rms in norms:
            group = f"{'rmsnorm' if rms else 'layernorm'} fwd {M}x{N}"
            cfg = configs.NORM_LAYERNORM_LONG_ROWS if (not rms and N > 4096) else configs.NORM

            def prod():
                return norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms, fp8_scale=s, fp8_dtype=e4m3, cfg=cfg)

            want = prod()
            pr.production(group, 3 * M * N, prod)
            default = [c for c in itertools.product((1, 2), (8, 16), (3, 4, 5), (True, False), (1, 2, 4))
                       if (c[1] == 16) != (c[4] == 4)]  # 8 warps: 2 or 4 programs per SM; 16 warps: 1 or 2
            for rows, warps, stages, hoist, per_sm in variants or default:
                if rows * N > 16384:
                    continue
                y = torch.empty(M, N, device="cuda", dtype=e4m3)
                mean, rstd = torch.empty(M, device="cuda"), torch.empty(M, device="cuda")
                amax = torch.zeros(1, device="cuda", dtype=torch.int32)
                xd, yd = TensorDescriptor.from_tensor(x, [rows, N]), TensorDescriptor.from_tensor(y, [rows, N])
                grid = (min(triton.cdiv(M, rows), sms * per_sm),)

                def run():
                    amax.zero_()
                    norm_fwd_tma[grid](xd, yd, w, b, y, mean, rstd, s, amax, M, N, 1e-5, BLOCK_N=N, ROWS=rows,
                                       RMS=rms, STAGES=stages, CHUNK=8, TMA_STORE=True, HOIST=hoist, num_warps=warps)

                pr.variant(group, f"rows{rows} w{warps} x{per_sm}/SM st{stages} hoist={int(hoist)}", 3 * M * N, run,
                           lambda: f"{_bytes_off(y, want[0])} bytes off, rstd max diff "
                                   f"{(rstd - want[2]).abs().max().item():.2g}, {_amax_verdict(amax, want[3])}")


def norm_backward(pr, sms):
    from te_triton import norm

    from te_backend_cuda import configs
    for M, N in [(16384, 4096), (16384, 8192)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3 + 1
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for rms in (False, True):
            group = f"{'rmsnorm' if rms else 'layernorm'} bwd {M}x{N}"
            _, mean, rstd, _ = norm.norm_fwd(x, w, None if rms else w, 1e-5, rms=rms)
            cfg = configs.RMSNORM_BWD_LONG_ROWS if rms and N > 4096 else configs.NORM_BWD
            want = norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=cfg)
            pr.production(group, 6 * M * N, lambda: norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=cfg))
            for warps, per_sm, stages in itertools.product((8, 16), (1, 2), (3, 4, 5)):
                dx = torch.empty_like(x)
                grid = (min(M, sms * per_sm),)
                dwp, dbp = torch.empty(grid[0], N, device="cuda"), torch.empty(grid[0], N, device="cuda")
                xd, dyd = TensorDescriptor.from_tensor(x, [1, N]), TensorDescriptor.from_tensor(dy, [1, N])

                def run():
                    norm_bwd_tma[grid](dyd, xd, rstd if mean is None else mean, rstd, w, dx, dwp, dbp, M, N,
                                       BLOCK_N=N, RMS=rms, STAGES=stages, num_warps=warps)
                    return dwp.sum(0)

                pr.variant(group, f"w{warps} x{per_sm}/SM st{stages}", 6 * M * N, run,
                           lambda: f"max |dx diff| {(dx.float() - want[0].float()).abs().max().item():.3g}, max |dw diff| "
                                   f"{(dwp.sum(0) - want[1].float()).abs().max().item():.3g}")


def quantize(pr, sms):
    from te_triton.cast import quantize_fp8

    from te_backend_cuda import configs
    e4m3 = torch.float8_e4m3fn
    M, N = 16384, 8192
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    s = torch.full((1,), 16.0, device="cuda")
    group = f"quantize {M}x{N}"
    want = quantize_fp8(x, s, e4m3, cfg=configs.QUANTIZE)
    pr.production(group, 3 * M * N, lambda: quantize_fp8(x, s, e4m3, cfg=configs.QUANTIZE))
    for (bm, bn), warps, per_sm, stages in itertools.product(((4, 1024), (8, 512)), (4,), (4, 8), (3, 4)):
        y = torch.empty(M, N, device="cuda", dtype=e4m3)
        amax = torch.zeros(1, device="cuda", dtype=torch.int32)
        xd, yd = TensorDescriptor.from_tensor(x, [bm, bn]), TensorDescriptor.from_tensor(y, [bm, bn])
        grid = (min(triton.cdiv(M, bm) * triton.cdiv(N, bn), sms * per_sm),)

        def run():
            amax.zero_()
            quantize_tma[grid](xd, yd, s, amax, M, N, BM=bm, BN=bn, STAGES=stages, CHUNK=8, num_warps=warps)

        pr.variant(group, f"{bm}x{bn} w{warps} x{per_sm}/SM st{stages}", 3 * M * N, run,
                   lambda: f"{_bytes_off(y, want[0])} bytes off, {_amax_verdict(amax, want[1])}")
    # the same data seen flat, as (numel / C, C) rows: a quantize does not care about the shape
    for (bm, c), warps, per_sm, stages in itertools.product(((4, 1024), (8, 1024), (2, 2048), (8, 512)), (4, 8),
                                                           (4, 8), (3, 4)):
        y = torch.empty(M, N, device="cuda", dtype=e4m3)
        amax = torch.zeros(1, device="cuda", dtype=torch.int32)
        rows = M * N // c
        xd = TensorDescriptor.from_tensor(x.view(rows, c), [bm, c])
        yd = TensorDescriptor.from_tensor(y.view(rows, c), [bm, c])
        grid = (min(triton.cdiv(rows, bm), sms * per_sm),)

        def run_flat():
            amax.zero_()
            quantize_tma[grid](xd, yd, s, amax, rows, c, BM=bm, BN=c, STAGES=stages, CHUNK=8, num_warps=warps)

        pr.variant(group, f"flat {bm}x{c} w{warps} x{per_sm}/SM st{stages}", 3 * M * N, run_flat,
                   lambda: f"{_bytes_off(y, want[0])} bytes off, {_amax_verdict(amax, want[1])}")


def cast_transpose(pr, sms):
    from te_triton.cast import cast_transpose_fp8

    from te_backend_cuda import configs
    e4m3 = torch.float8_e4m3fn
    M, N = 16384, 8192
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    s = torch.full((1,), 16.0, device="cuda")
    group = f"cast-transpose {M}x{N}"
    want = cast_transpose_fp8(x, s, e4m3, cfg=configs.CAST_TRANSPOSE)
    pr.production(group, 4 * M * N, lambda: cast_transpose_fp8(x, s, e4m3, cfg=configs.CAST_TRANSPOSE))
    for (bm, bn), warps, per_sm, stages in itertools.product(((64, 64), (64, 128), (32, 128)), (4, 8), (4, 8),
                                                            (3, 4)):
        y = torch.empty(M, N, device="cuda", dtype=e4m3)
        yt = torch.empty(N, M, device="cuda", dtype=e4m3)
        amax = torch.zeros(1, device="cuda", dtype=torch.int32)
        xd, yd = TensorDescriptor.from_tensor(x, [bm, bn]), TensorDescriptor.from_tensor(y, [bm, bn])
        ytd = TensorDescriptor.from_tensor(yt, [bn, bm])
        grid = (min(triton.cdiv(M, bm) * triton.cdiv(N, bn), sms * per_sm),)

        def run():
            amax.zero_()
            cast_transpose_tma[grid](xd, yd, ytd, s, amax, M, N, BM=bm, BN=bn, STAGES=stages, num_warps=warps)

        pr.variant(group, f"{bm}x{bn} w{warps} x{per_sm}/SM st{stages}", 4 * M * N, run,
                   lambda: f"{_bytes_off(y, want[0]) + _bytes_off(yt, want[1])} bytes off, {_amax_verdict(amax, want[2])}")

        def run_load_only():
            amax.zero_()
            cast_transpose_tma_load[grid](xd, y, yt, s, amax, M, N, BM=bm, BN=bn, STAGES=stages, num_warps=warps)

        pr.variant(group, f"{bm}x{bn} w{warps} x{per_sm}/SM st{stages} pointer stores", 4 * M * N, run_load_only,
                   lambda: f"{_bytes_off(y, want[0]) + _bytes_off(yt, want[1])} bytes off, {_amax_verdict(amax, want[2])}")


def dbias_cast_transpose(pr, sms):
    from te_triton.activation import activation_bwd_dbias_cast_transpose, dbias_cast_transpose as prod_dbias_ct

    from te_backend_cuda import configs
    e4m3 = torch.float8_e4m3fn
    s = torch.full((1,), 16.0, device="cuda")
    cfg = configs.DBIAS_CAST_TRANSPOSE
    for M, N, act in ((16384, 4096, False), (16384, 12288, False), (16384, 16384, True)):
        g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if act else g
        nbytes = (6 if act else 4) * M * N
        group = f"{'gelu bwd + ' if act else ''}dbias cast-transpose {M}x{N}"
        if act:
            prod = lambda: activation_bwd_dbias_cast_transpose(g, x, "gelu", s, e4m3, cfg=cfg)  # noqa: E731
        else:
            prod = lambda: prod_dbias_ct(g, s, e4m3, cfg=cfg)  # noqa: E731
        want = prod()
        pr.production(group, nbytes, prod)
        for (bm, bn), warps, per_sm, stages in itertools.product(((32, 64), (64, 64), (32, 128), (64, 128)), (4, 8),
                                                                (4, 8), (3, 4)):
            y = torch.empty(M, N, device="cuda", dtype=e4m3)
            yt = torch.empty(N, M, device="cuda", dtype=e4m3)
            amax = torch.zeros(1, device="cuda", dtype=torch.int32)
            n_tm, n_tn = triton.cdiv(M, bm), triton.cdiv(N, bn)
            groups = max(1, min(n_tm, sms * per_sm // n_tn))
            part = torch.empty(groups, N, device="cuda")
            gd, xd = TensorDescriptor.from_tensor(g, [bm, bn]), TensorDescriptor.from_tensor(x, [bm, bn])
            yd, ytd = TensorDescriptor.from_tensor(y, [bm, bn]), TensorDescriptor.from_tensor(yt, [bn, bm])

            def run():
                amax.zero_()
                dbias_ct_tma[(groups * n_tn,)](gd, xd, yd, ytd, s, amax, part, M, N, groups, BM=bm, BN=bn,
                                               STAGES=stages, ACT=act, num_warps=warps)
                return part.sum(0)

            pr.variant(group, f"{bm}x{bn} w{warps} x{per_sm}/SM st{stages}", nbytes, run,
                       lambda: f"{_bytes_off(y, want[0]) + _bytes_off(yt, want[1])} bytes off, dbias max diff "
                               f"{(part.sum(0) - want[2].float()).abs().max().item():.3g}, {_amax_verdict(amax, want[3])}")


SECTIONS = {"dbias_ct": dbias_cast_transpose, "norm_fwd": norm_forward, "layernorm_fwd_wide": layernorm_forward_wide, "cast_transpose": cast_transpose,
            "norm_bwd": norm_backward, "quantize": quantize}


def main():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("sections", nargs="*", default=[s for s in SECTIONS if s != "layernorm_fwd_wide"],
                        help=f"any of {list(SECTIONS)}")
    args = parser.parse_args()
    triton.set_allocator(_alloc)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pr = Probe()
    try:
        for name in args.sections:
            SECTIONS[name](pr, sms)
    finally:
        pr.summary()


if __name__ == "__main__":
    main()
