"""Diagnostics: (1) does cuBLASLt's bias epilogue run through torch._scaled_mm at the layer's
shapes, and what does it save against a separate add; (2) does an FP8 step synchronize with
the GPU (torch.cuda sync debug mode); (3) the tiny forward under torch.profiler;
(4) transpose_fp8 bandwidth against torch's t().contiguous().

    python benchmarks/probe_bias_sync.py
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from te_triton._common import abs_bits
from te_triton.activation import _act, _dact, _dbias_ct_load
from te_triton.cast import _cast_transpose_tile
from triton.testing import do_bench

import te_core as te
from te_core import ops, recipe

E4M3 = torch.float8_e4m3fn


def bias_probe():
    print("bias epilogue: M K N | epilogue ms | mm + add_ ms | ok")
    for M, K, N in [(16384, 4096, 12288), (16384, 4096, 4096), (16384, 4096, 16384), (16384, 16384, 4096),
                    (8192, 4096, 4096), (16, 64, 64)]:
        a = (torch.randn(M, K, device="cuda") * 4).to(E4M3)
        b = (torch.randn(N, K, device="cuda") * 4).to(E4M3)
        sa = torch.full((), 0.5, device="cuda")
        sb = torch.full((), 0.25, device="cuda")
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        plain = lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16).add_(bias)
        try:
            fused = lambda: torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=torch.bfloat16)
            want = plain().float()
            err = (fused().float() - want).abs().max().item() / want.abs().max().item()
            t_f = do_bench(fused, warmup=3, rep=20)
            status = f"ok (max rel err {err:.2e})"
        except RuntimeError as exc:
            t_f, status = float("nan"), f"FAILED: {str(exc)[:120]}"
        print(f"  {M} {K} {N} | {t_f:.3f} | {do_bench(plain, warmup=3, rep=20):.3f} | {status}", flush=True)


def sync_probe():
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    lin = te.Linear(64, 64, params_dtype=torch.bfloat16)
    big = te.Linear(4096, 4096, bias=True, params_dtype=torch.bfloat16)
    xb = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    rcp = recipe.DelayedScaling()

    def tiny():
        with torch.no_grad(), te.autocast(recipe=rcp):
            lin(x)

    def train():
        with te.autocast(recipe=rcp):
            y = big(xb)
        y.backward(dy)

    for fn in (tiny, train):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        torch.cuda.set_sync_debug_mode(0)
        print(f"sync points in {fn.__name__}: {len(caught)}")
        for w in caught[:5]:
            print("   ", str(w.message)[:200], w.filename, w.lineno)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            tiny()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def transpose_probe():
    for M, N in [(16384, 4096), (16384, 16384)]:
        d = (torch.randn(M, N, device="cuda") * 4).to(E4M3)
        ok = torch.equal(ops.transpose_fp8(d).view(torch.uint8), d.t().contiguous().view(torch.uint8))
        t_ours = do_bench(lambda: ops.transpose_fp8(d), warmup=3, rep=20)
        t_torch = do_bench(lambda: d.t().contiguous(), warmup=3, rep=20)
        gbs = lambda t: 2 * M * N / t / 1e6
        print(f"transpose_fp8 {M}x{N}: ours {gbs(t_ours):.0f} GB/s, torch {gbs(t_torch):.0f} GB/s, exact {ok}")
        from te_triton import Config, cast
        for bm, bn, w in [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8), (32, 256, 4),
                          (256, 32, 4), (64, 256, 8)]:
            cfg = Config(block_m=bm, block_n=bn, num_warps=w)
            t = do_bench(lambda: cast.transpose_fp8(d, cfg), warmup=3, rep=20)
            print(f"   cfg {bm}x{bn} w{w}: {gbs(t):.0f} GB/s")


def activation_sweep():
    """gelu forward with FP8 out and its fused backward at the layer's fc1 shape, per config:
    each program does one atomic max of the amax, so the program count matters."""
    from te_core.reference.plugin import implementations
    from te_triton import Config, activation

    ref = implementations()
    M, N = 16384, 16384
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 2
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    s = torch.full((1,), 8.0, device="cuda")
    want = ref["activation_fwd"](x, "gelu", fp8_scale=s, fp8_dtype=E4M3)[0].view(torch.uint8)
    for bm, bn, w, mp in [(8, 256, 4, 0), (8, 256, 4, 132 * 8), (8, 256, 4, 132 * 16), (16, 256, 8, 132 * 8),
                          (16, 512, 8, 132 * 4), (32, 256, 8, 132 * 4), (4, 1024, 8, 132 * 8), (8, 512, 8, 132 * 8)]:
        cfg = Config(block_m=bm, block_n=bn, num_warps=w, max_programs=mp, hw_saturate=True)
        fn = lambda: activation.activation_fwd(x, "gelu", fp8_scale=s, fp8_dtype=E4M3, cfg=cfg)
        ok = torch.equal(fn()[0].view(torch.uint8), want)
        t = do_bench(fn, warmup=3, rep=20)
        print(f"gelu fwd fp8 {bm}x{bn} w{w} mp{mp}: {3 * M * N / t / 1e6:.0f} GB/s {'ok' if ok else 'WRONG'}", flush=True)
    want = ref["activation_bwd_dbias_cast_transpose"](dy, x, "gelu", s, E4M3)
    for bm, bn, w, mp in [(64, 128, 4, 0), (64, 128, 4, 132 * 4), (64, 128, 4, 132 * 8), (32, 128, 4, 132 * 8),
                          (64, 64, 4, 132 * 8), (128, 64, 8, 132 * 4)]:
        cfg = Config(block_m=bm, block_n=bn, num_warps=w, max_programs=mp, hw_saturate=True)
        fn = lambda: activation.activation_bwd_dbias_cast_transpose(dy, x, "gelu", s, E4M3, cfg)
        got = fn()
        off = (got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum().item()
        # column sums of 16384 rows in bf16: an absolute tolerance relative to the largest sum
        dbias_ok = torch.allclose(got[2].float(), want[2].float(), rtol=1.6e-2, atol=1.6e-2 * want[2].float().abs().max().item())
        t = do_bench(fn, warmup=3, rep=20)
        print(f"gelu bwd dbias ct {bm}x{bn} w{w} mp{mp}: {6 * M * N / t / 1e6:.0f} GB/s ({off} bytes off, "
              f"dbias {'ok' if dbias_ok else 'WRONG'})", flush=True)


def norm_sweep():
    """LayerNorm forward with FP8 out + amax (and bf16 out, and backward) at the layer's shape, per config."""
    from te_core.reference.plugin import implementations
    from te_triton import Config, norm

    ref = implementations()
    for M, N in [(16384, 4096), (16384, 8192)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3 + 1
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        s = torch.full((1,), 16.0, device="cuda")
        want_y, _, _, want_amax = ref["layernorm_fwd"](x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3)
        for rows, warps, mp in [(1, 8, 528), (1, 8, 0), (2, 8, 528), (2, 8, 1056), (4, 8, 528), (2, 4, 1056),
                                (4, 16, 264), (2, 16, 528), (1, 4, 0), (4, 8, 0)]:
            cfg = Config(num_warps=warps, max_programs=mp, rows=rows)
            fn = lambda: norm.norm_fwd(x, w, b, 1e-5, rms=False, fp8_scale=s, fp8_dtype=E4M3, cfg=cfg)
            y, mean, rstd, amax = fn()
            off = (y.view(torch.uint8) != want_y.view(torch.uint8)).sum().item()
            amax_ok = torch.allclose(amax, want_amax, rtol=1e-6)
            t = do_bench(fn, warmup=3, rep=20)
            t16 = do_bench(lambda: norm.norm_fwd(x, w, b, 1e-5, rms=False, cfg=cfg), warmup=3, rep=20)
            print(f"layernorm fwd {M}x{N} rows{rows} w{warps} mp{mp}: fp8 {3 * M * N / t / 1e6:.0f} GB/s "
                  f"({off} bytes off, amax {'ok' if amax_ok else 'WRONG'}), bf16 {4 * M * N / t16 / 1e6:.0f} GB/s",
                  flush=True)
        _, mean, rstd, _ = norm.norm_fwd(x, w, b, 1e-5, rms=False)
        for warps, mp in [(16, 264), (8, 264), (8, 528), (16, 528), (4, 1056), (32, 132)]:
            cfg = Config(num_warps=warps, max_programs=mp)
            t = do_bench(lambda: norm.norm_bwd(dy, x, mean, rstd, w, rms=False, cfg=cfg), warmup=3, rep=20)
            print(f"layernorm bwd {M}x{N} w{warps} mp{mp}: {6 * M * N / t / 1e6:.0f} GB/s", flush=True)


def dbias_sweep():
    """dbias + cast-transpose and gelu backward + dbias + cast-transpose, per config, checked
    against the reference (FP8 bytes, dbias within one bf16 step per summed element)."""
    from te_core.reference.plugin import implementations
    from te_triton import Config, activation

    ref = implementations()
    for M, N in [(16384, 8192), (16384, 16384)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 2
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        s = torch.full((1,), 8.0, device="cuda")
        want_d = ref["dbias_cast_transpose"](dy, s, E4M3)
        for bm, bn, w, mp in [(32, 128, 4, 1056), (32, 128, 4, 528), (64, 128, 4, 1056), (32, 128, 8, 1056),
                              (16, 128, 4, 2112), (32, 64, 4, 2112), (64, 64, 4, 1056)]:
            cfg = Config(block_m=bm, block_n=bn, num_warps=w, max_programs=mp)
            fn = lambda: activation.dbias_cast_transpose(dy, s, E4M3, cfg)
            got = fn()
            off = (got[0].view(torch.uint8) != want_d[0].view(torch.uint8)).sum().item()
            off_t = (got[1].view(torch.uint8) != want_d[1].view(torch.uint8)).sum().item()
            derr = (got[2].float() - want_d[2].float()).abs().max().item()
            t = do_bench(fn, warmup=3, rep=20)
            tg = do_bench(lambda: activation.activation_bwd_dbias_cast_transpose(dy, x, "gelu", s, E4M3, cfg),
                          warmup=3, rep=20)
            print(f"{M}x{N} {bm}x{bn} w{w} mp{mp}: dbias_ct {4 * M * N / t / 1e6:.0f} GB/s ({off}/{off_t} bytes off, "
                  f"dbias max err {derr:.3g}), gelu bwd dbias ct {6 * M * N / tg / 1e6:.0f} GB/s", flush=True)


@triton.jit
def _gradient_tile(g_ptr, x_ptr, tm, cols, M, N, BM: tl.constexpr, ACT: tl.constexpr):
    """Row tile tm of the gradient as te_triton's dbias kernel forms it (ACT: g * gelu'(x),
    rounded to x's dtype), in float32."""
    g, x = _dbias_ct_load(g_ptr, x_ptr, tm, cols, M, N, BM, ACT)
    if ACT:
        return (g.to(tl.float32) * _dact(x.to(tl.float32), 0)).to(x.dtype).to(tl.float32)
    return g.to(tl.float32)


@triton.jit
def _dbias_tiles_kernel(g_ptr, x_ptr, y_ptr, yt_ptr, scale_ptr, amax_ptr, dbias_ptr, M, N, fmax, ACT: tl.constexpr,
           BM: tl.constexpr, BN: tl.constexpr, TPP: tl.constexpr):
    pid = tl.program_id(0)
    n_tn = tl.cdiv(N, BN)
    tg, tn = pid // n_tn, pid % n_tn
    cols = tn * BN + tl.arange(0, BN)
    scale = tl.load(scale_ptr)
    colsum = tl.zeros([BM, BN], dtype=tl.float32)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for i in tl.static_range(TPP):
        tm = tg * TPP + i
        v = _gradient_tile(g_ptr, x_ptr, tm, cols, M, N, BM, ACT)
        _cast_transpose_tile(y_ptr, yt_ptr, v, tm, tn, M, N, scale, fmax, BM, BN, True)
        colsum += v
        acc = tl.maximum(acc, abs_bits(v))
    tl.store(dbias_ptr + tg * N + cols, tl.sum(colsum, axis=0), mask=cols < N)
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))



@triton.jit
def _act_ct_kernel(x_ptr, y_ptr, yt_ptr, scale_ptr, amax_ptr, M, N, fmax, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    n_tn = tl.cdiv(N, BN)
    tm, tn = pid // n_tn, pid % n_tn
    rows = tm * BM + tl.arange(0, BM)
    cols = tn * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    v = _act(tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32), 0)
    _cast_transpose_tile(y_ptr, yt_ptr, v, tm, tn, M, N, tl.load(scale_ptr), fmax, BM, BN, True)
    tl.atomic_max(amax_ptr, tl.max(tl.max(abs_bits(v), axis=1), axis=0))


def act_ct_probe():
    """gelu forward with FP8 output and its column-wise copy: today's two kernels (activation
    forward, then transpose_fp8) against one kernel that stores both."""
    from te_backend_cuda import configs
    from te_triton import activation, cast

    for M, N in [(16384, 16384)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 2
        s = torch.full((1,), 8.0, device="cuda")

        def today():
            y, _ = activation.activation_fwd(x, "gelu", fp8_scale=s, fp8_dtype=E4M3, cfg=configs.ACTIVATION_FWD)
            return y, cast.transpose_fp8(y, configs.TRANSPOSE)

        want = today()
        t = do_bench(today, warmup=3, rep=30)
        print(f"{M}x{N} gelu fwd + transpose_fp8: {t * 1e3:.0f} us ({4 * M * N / t / 1e6:.0f} GB/s "
              f"of the fused kernel's bytes)")
        for bm, bn, w in [(64, 128, 4), (64, 128, 8), (128, 64, 8), (32, 128, 4), (128, 128, 8)]:
            def fused():
                y = torch.empty((M, N), dtype=E4M3, device="cuda")
                yt = torch.empty((N, M), dtype=E4M3, device="cuda")
                amax = torch.zeros(1, dtype=torch.int32, device="cuda")
                _act_ct_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](x, y, yt, s, amax, M, N, 448.0, BM=bm, BN=bn,
                                                                            num_warps=w)
                return y, yt

            got = fused()
            off = [int((a.view(torch.uint8) != b.view(torch.uint8)).sum().item()) for a, b in zip(got, want)]
            t = do_bench(fused, warmup=3, rep=30)
            print(f"{M}x{N} fused {bm}x{bn} w{w}: {t * 1e3:.0f} us, {4 * M * N / t / 1e6:.0f} GB/s (bytes off {off})",
                  flush=True)


@triton.jit
def _dbias_chunks_kernel(g_ptr, x_ptr, y_ptr, yt_ptr, scale_ptr, amax_ptr, dbias_ptr, M, N, fmax, groups,
                         ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """As te_triton's _dbias_ct_kernel, but each program walks a contiguous run of row tiles."""
    pid = tl.program_id(0)
    tn, g = pid // groups, pid % groups
    n_tm = tl.cdiv(M, BM)
    per = tl.cdiv(n_tm, groups)
    cols = tn * BN + tl.arange(0, BN)
    scale = tl.load(scale_ptr)
    colsum = tl.zeros([BM, BN], dtype=tl.float32)
    acc = tl.zeros([BM, BN], dtype=tl.int32)
    for tm in range(g * per, tl.minimum(g * per + per, n_tm)):
        v = _gradient_tile(g_ptr, x_ptr, tm, cols, M, N, BM, ACT)
        colsum += v
        _cast_transpose_tile(y_ptr, yt_ptr, v, tm, tn, M, N, scale, fmax, BM, BN, True)
        acc = tl.maximum(acc, abs_bits(v))
    tl.store(dbias_ptr + g * N + cols, tl.sum(colsum, axis=0), mask=cols < N)
    tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))


def dbias_layout_sweep():
    """The fused dbias kernels: software pipelining depth (num_stages) of today's strided walk,
    and a contiguous walk of row tiles per program, against the reference."""
    from te_core.reference.plugin import implementations
    from te_triton.activation import _dbias_ct_kernel

    ref = implementations()
    for M, N in [(16384, 4096), (16384, 16384)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 2
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        s = torch.full((1,), 8.0, device="cuda")
        want_d = ref["dbias_cast_transpose"](dy, s, E4M3)
        for bm, bn, w, mp, stages, walk in [(32, 64, 4, 2112, None, "strided"), (32, 64, 4, 2112, 1, "strided"),
                                            (32, 64, 4, 2112, 2, "strided"), (32, 64, 4, 2112, 4, "strided"),
                                            (32, 64, 4, 2112, None, "contiguous"), (32, 64, 4, 1056, None, "contiguous"),
                                            (32, 128, 8, 1056, None, "contiguous"), (64, 64, 4, 2112, 1, "strided"),
                                            (32, 128, 8, 1056, 1, "strided"), (32, 64, 4, 4224, None, "strided")]:
            n_tm, n_tn = triton.cdiv(M, bm), triton.cdiv(N, bn)
            groups = max(1, min(n_tm, mp // n_tn))
            extra = {} if stages is None else {"num_stages": stages}

            def run(xx):
                y = torch.empty((M, N), dtype=E4M3, device="cuda")
                yt = torch.empty((N, M), dtype=E4M3, device="cuda")
                amax = torch.zeros(1, dtype=torch.int32, device="cuda")
                part = torch.empty((groups, N), dtype=torch.float32, device="cuda")
                if walk == "strided":
                    _dbias_ct_kernel[(groups * n_tn,)](dy, dy if xx is None else xx, y, yt, s, amax, part, M, N, 448.0,
                                                       groups, dy, dy, N, N, ACT=xx is not None, KIND=0, BM=bm,
                                                       BN=bn, CLAMP=True, PREFETCH=False, PARTS=1, num_warps=w,
                                                       **extra)
                else:
                    _dbias_chunks_kernel[(groups * n_tn,)](dy, dy if xx is None else xx, y, yt, s, amax, part, M, N,
                                                           448.0, groups, ACT=xx is not None, BM=bm, BN=bn,
                                                           num_warps=w, **extra)
                return y, yt, part.sum(0).to(dy.dtype)

            got = run(None)
            bad = [int((a.view(torch.uint8) != b_.view(torch.uint8)).sum().item()) for a, b_ in zip(got[:2], want_d[:2])]
            bad.append(round((got[2].float() - want_d[2].float()).abs().max().item(), 4))
            t = do_bench(lambda: run(None), warmup=3, rep=30)
            tg = do_bench(lambda: run(x), warmup=3, rep=30)
            print(f"{M}x{N} {walk} {bm}x{bn} w{w} mp{mp} stages{stages}: dbias_ct {4 * M * N / t / 1e6:.0f} GB/s, "
                  f"gelu {6 * M * N / tg / 1e6:.0f} GB/s (bytes off / dbias err: {bad})", flush=True)


def fast_accum_probe():
    """cuBLASLt FP8 fast accumulation (torch._scaled_mm use_fast_accum=True, what Transformer
    Engine and torchao use for forward GEMMs) against float32 accumulation at the layer's
    forward shapes, tensor-wise scales, bf16 out with the bias epilogue."""
    for M, K, N in [(16384, 4096, 12288), (16384, 4096, 4096), (16384, 4096, 16384), (16384, 16384, 4096),
                    (16384, 8192, 8192), (8192, 4096, 4096)]:
        a = (torch.randn(M, K, device="cuda") * 2).to(E4M3)
        b = (torch.randn(N, K, device="cuda") * 2).to(E4M3)
        s = torch.ones((), device="cuda")
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        exact = torch._scaled_mm(a, b.t(), s, s, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=False)
        fast = torch._scaled_mm(a, b.t(), s, s, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True)
        err = ((fast.float() - exact.float()).abs().max() / exact.float().abs().max()).item()
        t0 = do_bench(lambda: torch._scaled_mm(a, b.t(), s, s, bias=bias, out_dtype=torch.bfloat16,
                                               use_fast_accum=False), warmup=5, rep=50)
        t1 = do_bench(lambda: torch._scaled_mm(a, b.t(), s, s, bias=bias, out_dtype=torch.bfloat16,
                                               use_fast_accum=True), warmup=5, rep=50)
        print(f"M{M} K{K} N{N}: float32 accumulation {t0 * 1e3:.0f} us ({2 * M * N * K / t0 / 1e9:.0f} TFLOP/s), "
              f"fast {t1 * 1e3:.0f} us ({2 * M * N * K / t1 / 1e9:.0f} TFLOP/s); max difference {err:.2e} of max|y|",
              flush=True)


def blockwise_sweep():
    """1x128 block quantization with its transpose (row- and column-wise 1x128 scales from one
    128x128 tile, in block_m-row / block_m-column slices) per slice height and warp count, and
    128x128 blocks per warp count, against the reference bytes and scales; then fp16 and fp32
    input at a ragged shape."""
    from te_core.reference.plugin import implementations
    from te_triton import Config, blockwise

    ref = implementations()
    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
    for block_2d in (False, True):
        want = ref["quantize_blockwise"](x, E4M3, block_2d=block_2d, with_transpose=True)
        sweep = [(64, w) for w in (4, 8)] if block_2d else [(bm, w) for bm in (32, 64, 128) for w in (2, 4, 8)]
        for bm, w in sweep:
            cfg = Config(block_m=bm, num_warps=w)
            got = blockwise.quantize_blockwise(x, E4M3, block_2d=block_2d, with_transpose=True, cfg=cfg)
            bad = [int((got[i].view(torch.uint8) != want[i].view(torch.uint8)).sum().item()) for i in (0, 2)]
            same = all(torch.equal(got[i], want[i]) for i in (1, 3))
            t = do_bench(lambda: blockwise.quantize_blockwise(x, E4M3, block_2d=block_2d, with_transpose=True,
                                                              cfg=cfg), warmup=3, rep=30)
            print(f"blockwise 2d={block_2d} +transpose block_m{bm} w{w}: {4 * x.numel() / t / 1e6:.0f} GB/s "
                  f"(bytes off {bad}, scales equal {same})", flush=True)
    for dtype in (torch.float16, torch.float32):
        xs = (torch.randn(333, 1000, device="cuda") * 50).to(dtype)
        xs[7, 9] = float("nan")
        for cfg in (Config(block_m=32, num_warps=8), Config(block_m=64, num_warps=8)):
            got = blockwise.quantize_blockwise(xs, E4M3, with_transpose=True, cfg=cfg)
            want = ref["quantize_blockwise"](xs, E4M3, with_transpose=True)
            bad = [int((got[i].view(torch.uint8) != want[i].view(torch.uint8)).sum().item()) for i in (0, 2)]
            same = all(torch.equal(got[i], want[i]) for i in (1, 3))
            print(f"blockwise 1x128 +transpose {dtype} (333, 1000) block_m{cfg.block_m}: bytes off {bad}, "
                  f"scales equal {same}", flush=True)


def quantize_sweep():
    """quantize_fp8 (delayed: cast with a given scale + amax) and cast_transpose_fp8 per config at
    16384x8192 bf16, checked against the reference bytes and amax."""
    from te_core.reference.plugin import implementations
    from te_triton import Config, cast

    ref = implementations()
    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16) * 3
    s = torch.full((1,), 16.0, device="cuda")
    want, want_amax = ref["quantize_fp8"](x, s, E4M3)
    for block, w, mp in [(8192, 8, 528), (1024, 4, 0), (2048, 4, 0), (4096, 4, 0), (4096, 8, 0), (2048, 8, 0),
                         (1024, 2, 0), (2048, 4, 1056), (4096, 4, 1056), (4096, 8, 528), (8192, 8, 1056),
                         (16384, 16, 264)]:
        cfg = Config(block=block, num_warps=w, max_programs=mp, hw_saturate=True)
        y, amax = cast.quantize_fp8(x, s, E4M3, cfg)
        ok = torch.equal(y.view(torch.uint8), want.view(torch.uint8)) and torch.equal(amax, want_amax)
        t = do_bench(lambda: cast.quantize_fp8(x, s, E4M3, cfg), warmup=5, rep=40)
        print(f"quantize block{block} w{w} mp{mp}: {3 * x.numel() / t / 1e6:.0f} GB/s ({'ok' if ok else 'WRONG'})",
              flush=True)
    want_ct = ref["cast_transpose_fp8"](x, s, E4M3)
    for bm, bn, w, mp in [(64, 128, 4, 0), (128, 64, 4, 0), (64, 64, 4, 0), (128, 128, 8, 0), (32, 128, 4, 0),
                          (64, 256, 8, 0), (64, 128, 4, 2112), (128, 128, 4, 0)]:
        cfg = Config(block_m=bm, block_n=bn, num_warps=w, max_programs=mp, hw_saturate=True)
        y, yt, amax = cast.cast_transpose_fp8(x, s, E4M3, cfg)
        ok = (torch.equal(y.view(torch.uint8), want_ct[0].view(torch.uint8))
              and torch.equal(yt.view(torch.uint8), want_ct[1].view(torch.uint8)))
        t = do_bench(lambda: cast.cast_transpose_fp8(x, s, E4M3, cfg), warmup=5, rep=40)
        print(f"cast_transpose {bm}x{bn} w{w} mp{mp}: {4 * x.numel() / t / 1e6:.0f} GB/s ({'ok' if ok else 'WRONG'})",
              flush=True)


@triton.jit
def _quantize_hint_kernel(x_ptr, y_ptr, scale_ptr, amax_ptr, n, BLOCK: tl.constexpr, HINT: tl.constexpr):
    """te_triton's delayed-scaling quantize (hardware saturation) with cache hints on the stream."""
    scale = tl.load(scale_ptr)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        if HINT == 1:
            v = tl.load(x_ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        elif HINT == 2:
            v = tl.load(x_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(v))
        q = (v * scale).to(y_ptr.dtype.element_ty)
        if HINT == 3:
            tl.store(y_ptr + offs, q, mask=mask, cache_modifier=".cs")
        elif HINT == 1:
            tl.store(y_ptr + offs, q, mask=mask, eviction_policy="evict_first")
        else:
            tl.store(y_ptr + offs, q, mask=mask)
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


def hints_probe():
    """Cache hints on quantize's streaming loads and stores (16384x8192 bf16, 8192-element blocks,
    8 warps, 4 programs per SM as configs.QUANTIZE): 0 none, 1 evict_first, 2 .cg loads, 3 .cs stores."""
    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16) * 3
    s = torch.full((1,), 16.0, device="cuda")
    want = (x.float() * 16.0).clamp(-448, 448).to(E4M3).view(torch.uint8)
    for hint in (0, 1, 2, 3, 0):
        y = torch.empty(x.shape, dtype=E4M3, device="cuda")
        amax = torch.zeros(1, dtype=torch.int32, device="cuda")
        fn = lambda: _quantize_hint_kernel[(528,)](x, y, s, amax, x.numel(), BLOCK=8192, HINT=hint, num_warps=8)
        fn()
        ok = torch.equal(y.view(torch.uint8), want)
        t = do_bench(fn, warmup=5, rep=40)
        print(f"quantize hint {hint}: {3 * x.numel() / t / 1e6:.0f} GB/s ({'ok' if ok else 'WRONG'})", flush=True)


def gated_sweep():
    """swiglu forward with FP8 out (hardware saturation) at the layer's fc1 output shape, per
    config: it reads two halves of each row, gelu reads one."""
    from te_core.reference.plugin import implementations
    from te_triton import Config, activation

    ref = implementations()
    M, H = 16384, 8192
    x = torch.randn(M, 2 * H, device="cuda", dtype=torch.bfloat16) * 2
    s = torch.full((1,), 8.0, device="cuda")
    want = ref["activation_fwd"](x, "swiglu", fp8_scale=s, fp8_dtype=E4M3)[0].view(torch.uint8)
    for bm, bn, w, mp in [(8, 512, 8, 132 * 8), (8, 256, 4, 132 * 8), (8, 256, 4, 0), (16, 256, 8, 132 * 8),
                          (4, 1024, 8, 132 * 8), (16, 512, 8, 132 * 4), (8, 1024, 8, 132 * 4), (4, 512, 4, 132 * 16),
                          (32, 128, 4, 132 * 8), (8, 512, 8, 0)]:
        cfg = Config(block_m=bm, block_n=bn, num_warps=w, max_programs=mp, hw_saturate=True)
        fn = lambda: activation.activation_fwd(x, "swiglu", fp8_scale=s, fp8_dtype=E4M3, cfg=cfg)
        off = (fn()[0].view(torch.uint8) != want).sum().item()
        t = do_bench(fn, warmup=3, rep=30)
        print(f"swiglu fwd fp8 {bm}x{bn} w{w} mp{mp}: {5 * M * H / t / 1e6:.0f} GB/s ({off} bytes off)", flush=True)


def dbias_tiles_sweep():
    """A candidate layout for the fused dbias kernels: each program takes TPP consecutive row
    tiles of one column strip (tiles in cast-transpose's row-major order), sums them
    element-wise and writes one row of partial column sums; against the current kernel."""
    from te_core.reference.plugin import implementations
    from te_triton import Config, activation

    def run(g, x, s, bm, bn, w, tpp):
        M, N = g.shape
        y = torch.empty((M, N), dtype=E4M3, device=g.device)
        yt = torch.empty((N, M), dtype=E4M3, device=g.device)
        amax = torch.zeros(1, dtype=torch.int32, device=g.device)
        n_tg, n_tn = triton.cdiv(triton.cdiv(M, bm), tpp), triton.cdiv(N, bn)
        part = torch.empty((n_tg, N), dtype=torch.float32, device=g.device)
        _dbias_tiles_kernel[(n_tg * n_tn,)](g, g if x is None else x, y, yt, s, amax, part, M, N, 448.0, ACT=x is not None,
                                BM=bm, BN=bn, TPP=tpp, num_warps=w)
        return y, yt, part.sum(0).to(g.dtype)

    ref = implementations()
    for M, N in [(16384, 4096), (16384, 12288), (16384, 16384)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 2
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        s = torch.full((1,), 8.0, device="cuda")
        want_d = ref["dbias_cast_transpose"](dy, s, E4M3)
        want_g = ref["activation_bwd_dbias_cast_transpose"](dy, x, "gelu", s, E4M3)
        cur = Config(block_m=32, block_n=64, num_warps=4, max_programs=132 * 16)
        t = do_bench(lambda: activation.dbias_cast_transpose(dy, s, E4M3, cur), warmup=3, rep=30)
        tg = do_bench(lambda: activation.activation_bwd_dbias_cast_transpose(dy, x, "gelu", s, E4M3, cur),
                      warmup=3, rep=30)
        print(f"{M}x{N} current strips: dbias_ct {4 * M * N / t / 1e6:.0f} GB/s, gelu {6 * M * N / tg / 1e6:.0f} GB/s")
        for bm, bn, w, tpp in [(64, 128, 4, 1), (64, 128, 4, 2), (64, 128, 4, 4), (64, 128, 8, 4), (32, 128, 4, 4),
                               (32, 128, 4, 8), (64, 64, 4, 4), (128, 64, 8, 2), (128, 128, 8, 1), (64, 128, 4, 8)]:
            bad = []
            for xx, want in ((None, want_d), (x, want_g)):
                got = run(dy, xx, s, bm, bn, w, tpp)
                for a, b_ in zip(got[:2], want[:2]):
                    bad.append(int((a.view(torch.uint8) != b_.view(torch.uint8)).sum().item()))
                bad.append(round((got[2].float() - want[2].float()).abs().max().item(), 4))
            t = do_bench(lambda: run(dy, None, s, bm, bn, w, tpp), warmup=3, rep=30)
            tg = do_bench(lambda: run(dy, x, s, bm, bn, w, tpp), warmup=3, rep=30)
            print(f"{M}x{N} {bm}x{bn} w{w} tpp{tpp}: dbias_ct {4 * M * N / t / 1e6:.0f} GB/s, "
                  f"gelu {6 * M * N / tg / 1e6:.0f} GB/s (bytes off / dbias err: {bad})", flush=True)


if __name__ == "__main__":
    import sys

    probes = {"activation": activation_sweep, "transpose": transpose_probe, "bias": bias_probe, "sync": sync_probe,
              "norm": norm_sweep, "dbias": dbias_sweep,
              "dbias_tiles": dbias_tiles_sweep, "act_ct": act_ct_probe,
              "dbias_layout": dbias_layout_sweep, "fast_accum": fast_accum_probe,
              "blockwise": blockwise_sweep, "quantize": quantize_sweep, "gated": gated_sweep,
              "hints": hints_probe}
    for name in sys.argv[1:] or probes:
        probes[name]()
