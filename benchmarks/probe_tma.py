"""Probe: kernels whose loads go through TMA descriptors in a software-pipelined loop.

Triton pipelines only descriptor loads (and loads feeding a dot): compiled for sm_90, a plain
`tl.load` in a `tl.range(..., num_stages=3)` loop stays a synchronous ld.global, while a
descriptor load becomes cp.async.bulk.tensor into shared memory, issued STAGES-1 steps ahead.
The rows in flight then sit in shared memory, not in registers, which is what limited the
norm kernels and their earlier register-held prefetch.

Sections, each variant checked against the production kernel and timed beside it:

  norm_fwd, layernorm_fwd_wide, norm_bwd, dbias_ct: te_triton's descriptor kernels (norm_tma,
    dbias) through their launchers, over configs (rows per step, warps, programs per SM,
    stages); the pointer kernels are replaced by failing stand-ins meanwhile, so a variant that
    would fall back fails instead of timing the pointer kernel;
  quantize, cast_transpose: descriptor prototypes kept here (not adopted).

Session 12's first two logs (probe-tma-2026-11-30-session12{,-b}.log) were taken with this
file's prototypes of the norm and dbias kernels, before they moved into te_triton, with
outputs allocated once outside the timed call (commit 379f789).

    python benchmarks/probe_tma.py [sections]      # on the GPU
"""
from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from te_triton import Config
from te_triton._common import abs_bits
from te_triton.cast import _cast_transpose_tile


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


class _Fails:
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("fell back to the pointer kernel")
        return launch


class _PointerKernelsFail:
    """Within: te_triton's pointer kernels named here fail when launched."""

    def __init__(self, *where):
        self.where = where

    def __enter__(self):
        self.saved = [(mod, name, getattr(mod, name)) for mod, name in self.where]
        for mod, name in self.where:
            setattr(mod, name, _Fails())

    def __exit__(self, *exc):
        for mod, name, kernel in self.saved:
            setattr(mod, name, kernel)


def _keeping(fn):
    """fn wrapped to keep its last result in .last, for the check after the first call."""
    def run():
        run.last = fn()
    return run


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

            def run(cfg):
                return norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms, fp8_scale=s, fp8_dtype=e4m3, cfg=cfg)

            pointer = configs.NORM_LAYERNORM_LONG_ROWS if (not rms and N > 4096) else configs.NORM
            want = run(pointer)
            pr.production(group, 3 * M * N, lambda: run(pointer))
            default = [c for c in itertools.product((1, 2), (8, 16), (3, 4, 5), (True, False), (1, 2, 4))
                       if (c[1] == 16) != (c[4] == 4)]  # 8 warps: 2 or 4 programs per SM; 16 warps: 1 or 2
            with _PointerKernelsFail((norm, "_norm_fwd_kernel")):
                for rows, warps, stages, hoist, per_sm in variants or default:
                    if rows * N > 16384:
                        continue
                    cfg = Config(num_warps=warps, max_programs=sms * per_sm, rows=rows, hoist_params=hoist,
                                 hw_saturate=True, tma_stages=stages)
                    got = _keeping(lambda cfg=cfg: run(cfg))
                    pr.variant(group, f"rows{rows} w{warps} x{per_sm}/SM st{stages} hoist={int(hoist)}", 3 * M * N,
                               got, lambda: f"{_bytes_off(got.last[0], want[0])} bytes off, rstd max diff "
                                            f"{(got.last[2] - want[2]).abs().max().item():.2g}, "
                                            f"amax {'ok' if got.last[3].item() == want[3].item() else 'WRONG'}")


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

            def run(cfg):
                return norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=cfg)

            pointer = configs.RMSNORM_BWD_LONG_ROWS if rms and N > 4096 else configs.NORM_BWD
            want = run(pointer)
            pr.production(group, 6 * M * N, lambda: run(pointer))
            with _PointerKernelsFail((norm, "_norm_bwd_kernel")):
                for warps, per_sm, stages in itertools.product((8, 16), (1, 2), (3, 4, 5)):
                    cfg = Config(num_warps=warps, max_programs=sms * per_sm, tma_stages=stages)
                    got = _keeping(lambda cfg=cfg: run(cfg))
                    pr.variant(group, f"w{warps} x{per_sm}/SM st{stages}", 6 * M * N, got,
                               lambda: f"max |dx diff| {(got.last[0].float() - want[0].float()).abs().max().item():.3g}, "
                                       f"max |dw diff| {(got.last[1].float() - want[1].float()).abs().max().item():.3g}")


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

    def variant(label, rows, cols, bm, bn, warps, per_sm, stages):
        """x and y seen as (rows, cols), walked in (bm, bn) tiles."""
        y = torch.empty(M, N, device="cuda", dtype=e4m3)
        amax = torch.zeros(1, device="cuda", dtype=torch.int32)
        xd = TensorDescriptor.from_tensor(x.view(rows, cols), [bm, bn])
        yd = TensorDescriptor.from_tensor(y.view(rows, cols), [bm, bn])
        grid = (min(triton.cdiv(rows, bm) * triton.cdiv(cols, bn), sms * per_sm),)

        def run():
            amax.zero_()
            quantize_tma[grid](xd, yd, s, amax, rows, cols, BM=bm, BN=bn, STAGES=stages, CHUNK=8, num_warps=warps)

        pr.variant(group, f"{label}{bm}x{bn} w{warps} x{per_sm}/SM st{stages}", 3 * M * N, run,
                   lambda: f"{_bytes_off(y, want[0])} bytes off, {_amax_verdict(amax, want[1])}")

    for (bm, bn), warps, per_sm, stages in itertools.product(((4, 1024), (8, 512)), (4,), (4, 8), (3, 4)):
        variant("", M, N, bm, bn, warps, per_sm, stages)
    # the same data seen flat, as (numel / C, C) rows: a quantize does not care about the shape
    for (bm, c), warps, per_sm, stages in itertools.product(((4, 1024), (8, 1024), (2, 2048), (8, 512)), (4, 8),
                                                           (4, 8), (3, 4)):
        variant("flat ", M * N // c, c, bm, c, warps, per_sm, stages)


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
    from te_triton import dbias

    from te_backend_cuda import configs
    e4m3 = torch.float8_e4m3fn
    s = torch.full((1,), 16.0, device="cuda")
    for M, N, act in ((16384, 4096, False), (16384, 12288, False), (16384, 16384, True)):
        g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if act else g
        nbytes = (6 if act else 4) * M * N
        group = f"{'gelu bwd + ' if act else ''}dbias cast-transpose {M}x{N}"

        def run(cfg):
            if act:
                return dbias.activation_bwd_dbias_cast_transpose(g, x, "gelu", s, e4m3, cfg)
            return dbias.dbias_cast_transpose(g, s, e4m3, cfg)

        want = run(configs.DBIAS_CAST_TRANSPOSE)
        pr.production(group, nbytes, lambda: run(configs.DBIAS_CAST_TRANSPOSE))
        with _PointerKernelsFail((dbias, "_dbias_ct_kernel")):
            for (bm, bn), warps, per_sm, stages in itertools.product(((32, 64), (64, 64), (32, 128), (64, 128)),
                                                                    (4, 8), (4, 8), (3, 4)):
                cfg = Config(block_m=bm, block_n=bn, num_warps=warps, max_programs=sms * per_sm, hw_saturate=True,
                             tma_stages=stages)
                got = _keeping(lambda cfg=cfg: run(cfg))
                pr.variant(group, f"{bm}x{bn} w{warps} x{per_sm}/SM st{stages}", nbytes, got,
                           lambda: f"{_bytes_off(got.last[0], want[0]) + _bytes_off(got.last[1], want[1])} bytes off, "
                                   f"dbias max diff {(got.last[2].float() - want[2].float()).abs().max().item():.3g}, "
                                   f"amax {'ok' if got.last[3].item() == want[3].item() else 'WRONG'}")


SECTIONS = {"dbias_ct": dbias_cast_transpose, "norm_fwd": norm_forward, "layernorm_fwd_wide": layernorm_forward_wide,
            "cast_transpose": cast_transpose, "norm_bwd": norm_backward, "quantize": quantize}


def main():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("sections", nargs="*", default=[s for s in SECTIONS if s != "layernorm_fwd_wide"],
                        help=f"any of {list(SECTIONS)}")
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pr = Probe()
    try:
        for name in args.sections:
            SECTIONS[name](pr, sms)
    finally:
        pr.summary()


if __name__ == "__main__":
    main()
