"""Check every native kernel of te-backend-cuda against the reference on the GPU, then time it.

Correctness: _kernel_checks.py (fresh random inputs, poisoned free memory, FP8 casts bit for
bit against the reference). Timing: triton.testing.do_bench medians; GB/s counts each
input read once and each output written once; peers (torch eager = the reference ops, and
torch.compile of them) are timed in the same process. GEMMs in TFLOP/s against bf16 torch.mm.

    python benchmarks/bench_kernels.py [--quick] [--no-compile] [--sweep [FAMILY ...]] [--results DIR]

--sweep also tries tuning configs per kernel family (all, or the families named: quantize,
cast_transpose, norm_fwd, norm_bwd, elementwise, mxfp8), each checked against the reference; the
best correct one is what te_backend_cuda/configs.py should hold. Prints a table last; writes
RESULTS/<gpu>/kernels.json (see _results.py) after each stage, so a run stopped at its time
limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import sys
import traceback

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from te_backend_cuda import attention as cuda_attention
from te_backend_cuda import ops as cuda_ops
from te_backend_cuda import scaled_mm
from te_backend_cuda.capabilities import capabilities_for
from te_triton import Config, activation, cast, norm
from te_triton import mxfp8 as te_mxfp8

from _kernel_checks import (BF16, CHECKS, DEV, E4M3, E5M2, REF, close, fp8_exact, fp8_ulp_off, gemm_scales,
                            poison, rand, run_checks)
from _results import add_results_argument, meta, write_json
from report import KERNEL_TARGETS

RESULTS = {"checks": CHECKS, "timings": [], "sweeps": [], "gemm": []}
RESULTS_ROOT = [None]  # --results


# ----------------------------------------------------------------------------- timing
def bench(fn):
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


# The targets' kernels are timed a second time as a CUDA graph replay: GPU time alone. Eager
# calls of a ~100 us kernel are host-bound on a slow host (descriptor kernels most of all).
GRAPHED_OPS = {op for _, _, ops, _ in KERNEL_TARGETS for op in ops}


def timed(name, nbytes, ours, peers, **extra):
    ms = bench(ours)
    row = {"op": name, "ms": ms, "GBps": nbytes / ms / 1e6, **extra}
    if name in GRAPHED_OPS:
        try:
            row["graphed_GBps"] = nbytes / do_bench_cudagraph(ours, rep=40, return_mode="median") / 1e6
        except Exception as exc:  # report, keep timing the rest
            print(f"graphed timing of {name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    for peer, fn in peers.items():
        try:
            pms = bench(fn)
            row[f"{peer}_GBps"] = nbytes / pms / 1e6
        except Exception as exc:
            row[f"{peer}_GBps"] = None
            print(f"peer {peer} of {name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    RESULTS["timings"].append(row)
    print(f"[time] {name:40s} {row['GBps']:8.0f} GB/s  " + "  ".join(
        f"{k}={v:.0f}" for k, v in row.items() if k.endswith("_GBps") and v), flush=True)


def compiled(fn, use_compile):
    if not use_compile:
        return None
    c = torch.compile(fn)
    return c


def time_memory_bound(use_compile):
    M, N = 16384, 8192
    x = rand((M, N), BF16, 3.0, 40)
    dy = rand((M, N), BF16, 1.0, 41)
    s = torch.tensor([40.0], device=DEV)
    w, b = rand((N,), BF16, 0.5, 42) + 1, rand((N,), BF16, 1.0, 43)
    n = M * N

    def peers(ref_fn, *args, with_compile=False, **kw):
        p = {"eager": lambda: ref_fn(*args, **kw)}
        c = compiled(ref_fn, use_compile and with_compile)
        if c is not None:
            p["compile"] = lambda: c(*args, **kw)
        return p

    timed("quantize_fp8 (amax+cast)", 3 * n, lambda: cuda_ops.quantize_fp8(x, s, E4M3), peers(REF["quantize_fp8"], x, s, E4M3, with_compile=True))
    # as the modules call it: the amax maxed into the history slot, no buffer to zero first
    slot = torch.zeros(1, device=DEV)
    timed("quantize_fp8 into history slot", 3 * n, lambda: cuda_ops.quantize_fp8(x, s, E4M3, amax_out=slot), {})
    timed("x.to(float8_e4m3fn) alone", 3 * n, lambda: x.to(E4M3), {})
    timed("cast_transpose_fp8", 4 * n, lambda: cuda_ops.cast_transpose_fp8(x, s, E4M3), peers(REF["cast_transpose_fp8"], x, s, E4M3, with_compile=True))
    timed("cast_transpose_fp8 into history slot", 4 * n, lambda: cuda_ops.cast_transpose_fp8(x, s, E4M3, amax_out=slot), {})
    timed("quantize_fp8_current", 3 * n, lambda: cuda_ops.quantize_fp8_current(x, E4M3),
          peers(REF["quantize_fp8_current"], x, E4M3))
    timed("quantize_fp8_current +transpose", 4 * n, lambda: cuda_ops.quantize_fp8_current(x, E4M3, with_transpose=True), {})
    for block_2d in (False, True):
        timed(f"quantize_blockwise 2d={block_2d} +transpose", 4 * n,
              lambda: cuda_ops.quantize_blockwise(x, E4M3, block_2d=block_2d, with_transpose=True),
              {"eager": lambda: REF["quantize_blockwise"](x, E4M3, block_2d=block_2d, with_transpose=True)})
    timed("quantize_blockwise 1x128", 3 * n, lambda: cuda_ops.quantize_blockwise(x, E4M3),
          {"eager": lambda: REF["quantize_blockwise"](x, E4M3)})
    timed("quantize_mxfp8 +transpose", 4 * n, lambda: cuda_ops.quantize_mxfp8(x, E4M3, with_transpose=True),
          {"eager": lambda: REF["quantize_mxfp8"](x, E4M3, with_transpose=True)})
    timed("quantize_mxfp8", 3 * n, lambda: cuda_ops.quantize_mxfp8(x, E4M3),
          {"eager": lambda: REF["quantize_mxfp8"](x, E4M3)})
    timed("layernorm_fwd bf16", 4 * n, lambda: cuda_ops.layernorm_fwd(x, w, b, 1e-5),
          {"torch_F.layer_norm": lambda: torch.nn.functional.layer_norm(x, (N,), w, b, 1e-5)})
    timed("layernorm_fwd fp8 out", 3 * n, lambda: cuda_ops.layernorm_fwd(x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3),
          peers(REF["layernorm_fwd"], x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3))
    timed("rmsnorm_fwd fp8 out", 3 * n, lambda: cuda_ops.rmsnorm_fwd(x, w, 1e-5, fp8_scale=s, fp8_dtype=E4M3),
          peers(REF["rmsnorm_fwd"], x, w, 1e-5, fp8_scale=s, fp8_dtype=E4M3, with_compile=True))
    _, mean, rstd, _ = cuda_ops.layernorm_fwd(x, w, b, 1e-5)
    timed("layernorm_bwd", 6 * n, lambda: cuda_ops.layernorm_bwd(dy, x, mean, rstd, w),
          {"eager": lambda: REF["layernorm_bwd"](dy, x, mean, rstd, w)})
    timed("rmsnorm_bwd", 6 * n, lambda: cuda_ops.rmsnorm_bwd(dy, x, rstd, w),
          {"eager": lambda: REF["rmsnorm_bwd"](dy, x, rstd, w)})
    timed("gelu fwd fp8 out", 3 * n, lambda: cuda_ops.activation_fwd(x, "gelu", fp8_scale=s, fp8_dtype=E4M3),
          peers(REF["activation_fwd"], x, "gelu", fp8_scale=s, fp8_dtype=E4M3, with_compile=True))
    timed("swiglu fwd fp8 out", 2 * n + n // 2, lambda: cuda_ops.activation_fwd(x, "swiglu", fp8_scale=s, fp8_dtype=E4M3),
          peers(REF["activation_fwd"], x, "swiglu", fp8_scale=s, fp8_dtype=E4M3))
    timed("gelu bwd", 6 * n, lambda: cuda_ops.activation_bwd(dy, x, "gelu"),
          {"eager": lambda: REF["activation_bwd"](dy, x, "gelu")})
    dyh = dy[:, : N // 2].contiguous()
    timed("swiglu bwd", 5 * n, lambda: cuda_ops.activation_bwd(dyh, x, "swiglu"),
          {"eager": lambda: REF["activation_bwd"](dyh, x, "swiglu")})
    timed("dbias_cast_transpose", 4 * n, lambda: cuda_ops.dbias_cast_transpose(dy, s, E5M2),
          {"eager": lambda: REF["dbias_cast_transpose"](dy, s, E5M2)})
    timed("gelu bwd+dbias+cast_transpose", 6 * n, lambda: cuda_ops.activation_bwd_dbias_cast_transpose(dy, x, "gelu", s, E5M2),
          {"eager": lambda: REF["activation_bwd_dbias_cast_transpose"](dy, x, "gelu", s, E5M2)})
    timed("dbias", 2 * n, lambda: cuda_ops.dbias(dy), {"eager": lambda: REF["dbias"](dy)})
    xq = cuda_ops.quantize_fp8(x, s, E4M3)[0]
    timed("dequantize_fp8 to bf16", 3 * n, lambda: cuda_ops.dequantize_fp8(xq, s, BF16),
          {"eager": lambda: REF["dequantize_fp8"](xq, s, BF16)})
    bq, bs, _, _ = cuda_ops.quantize_blockwise(x, E4M3)
    timed("dequantize_blockwise 1x128 to bf16", 3 * n, lambda: cuda_ops.dequantize_blockwise(bq, bs, False, BF16),
          {"eager": lambda: REF["dequantize_blockwise"](bq, bs, False, BF16)})
    mq, ms, _, _ = cuda_ops.quantize_mxfp8(x, E4M3)
    timed("dequantize_mxfp8 to bf16", 3 * n, lambda: cuda_ops.dequantize_mxfp8(mq, ms, BF16),
          {"eager": lambda: REF["dequantize_mxfp8"](mq, ms, BF16)})
    copy_dst = torch.empty_like(x)
    timed("device copy (ceiling)", 4 * n, lambda: copy_dst.copy_(x), {})
    return x, dy, s, w, b


def time_softmax_rope_adam():
    x = rand((4, 16, 2048, 2048), BF16, 2.0, 100)
    n = x.numel()
    timed("softmax_fwd causal (4,16,2048,2048)", 4 * n, lambda: cuda_ops.softmax_fwd(x, 0.1, causal=True),
          {"eager": lambda: REF["softmax_fwd"](x, 0.1, causal=True),
           "torch.softmax": lambda: torch.softmax(x, -1)})
    y = cuda_ops.softmax_fwd(x, 0.1, causal=True)
    timed("softmax_bwd", 6 * n, lambda: cuda_ops.softmax_bwd(x, y, 0.1), {"eager": lambda: REF["softmax_bwd"](x, y, 0.1)})
    del x, y
    x = rand((2048, 8, 32, 128), BF16, 1.0, 101)
    freqs = torch.rand((2048, 1, 1, 128), device=DEV)
    timed("rope_fwd sbhd (2048,8,32,128)", 4 * x.numel(), lambda: cuda_ops.rope_fwd(x, freqs),
          {"eager": lambda: REF["rope_fwd"](x, freqs)})
    del x
    logits = rand((8192, 50304), BF16, 3.0, 103).requires_grad_()
    target = torch.randint(0, 50304, (8192,), device=DEV)
    ce_bytes = 2 * logits.numel() * 3  # forward reads logits; backward reads them and writes the gradient

    def ce_step(fn):
        fn(logits, target).backward()

    timed("cross_entropy fwd+bwd (8192,50304)", ce_bytes, lambda: ce_step(cuda_ops.cross_entropy),
          {"eager": lambda: ce_step(REF["cross_entropy"]),
           "F.cross_entropy": lambda: ce_step(torch.nn.functional.cross_entropy)})
    del logits
    from te_backend_cuda import optimizer
    state = [[rand((4096, 4096), torch.float32, 1.0, 102 + i) for _ in range(16)] for i in range(4)]
    state[3] = [t.abs() for t in state[3]]
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=5)
    nbytes = 16 * 4096 * 4096 * 4 * 7  # read p, g, m, v; write p, m, v
    timed("multi_tensor_adam 16x(4096,4096) fp32", nbytes, lambda: optimizer.multi_tensor_adam(*state, **hyper),
          {"eager": lambda: REF["multi_tensor_adam"](*state, **hyper)})


def time_scaling():
    g = torch.Generator(device=DEV).manual_seed(50)
    hists = [torch.rand(1024, 3, generator=g, device=DEV) for _ in range(200)]
    scales = [torch.ones(3, device=DEV) for _ in hists]
    fm = [448.0] * 200
    ms = bench(lambda: cuda_ops.delayed_scaling_update(hists, scales, fm))
    rms = bench(lambda: REF["delayed_scaling_update"](hists, scales, fm))
    RESULTS["timings"].append({"op": "delayed_scaling_update 200x(1024,3)", "ms": ms, "eager_ms": rms})
    print(f"[time] delayed_scaling_update 200 histories: {ms * 1e3:.0f} us vs eager {rms * 1e3:.0f} us", flush=True)


SWEEP_FAMILIES = ("quantize", "cast_transpose", "norm_fwd", "norm_bwd", "elementwise", "mxfp8")


def sweep(x, dy, s, w, b, families=()):
    """Try tuning configs per kernel family, each checked against the reference output; the
    best correct one goes into te_backend_cuda.configs."""
    n = x.numel()
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count  # program caps scale with the SM count
    cands = {
        "quantize": [Config(block=bk, num_warps=nw, max_programs=mp) for bk, nw, mp in
                     [(2048, 4, 0), (4096, 4, 0), (4096, 8, 0), (8192, 8, 0), (8192, 16, 0), (16384, 16, 0),
                      (4096, 8, sms * 8), (8192, 8, sms * 4), (2048, 8, 0)]],
        "cast_transpose": [Config(block_m=bm, block_n=bn, num_warps=nw) for bm, bn, nw in
                           [(64, 64, 4), (64, 64, 8), (64, 128, 8), (128, 64, 8), (128, 128, 8), (32, 128, 4),
                            (64, 128, 4), (128, 128, 16), (64, 256, 8), (128, 256, 8), (256, 128, 8), (32, 64, 4)]],
        "norm_fwd": [Config(num_warps=nw, max_programs=mp) for nw, mp in
                     [(4, 0), (8, 0), (16, 0), (32, 0), (8, sms * 4), (8, sms * 8), (16, sms * 4), (16, sms * 8),
                      (32, sms * 2)]],
        "norm_bwd": [Config(num_warps=nw, max_programs=mp) for nw, mp in
                     [(8, sms * 2), (8, sms * 4), (16, sms * 2), (16, sms * 4), (32, sms * 2), (8, sms * 8),
                      (16, sms * 8)]],
        "elementwise": [Config(block_m=bm, block_n=bn, num_warps=nw) for bm, bn, nw in
                        [(16, 256, 8), (8, 512, 8), (32, 256, 8), (4, 1024, 8), (16, 512, 16), (8, 256, 4),
                         (2, 2048, 8), (32, 512, 16)]],
        "mxfp8": [Config(block_m=bm, block_n=bn, num_warps=nw, hw_saturate=True) for bm, bn, nw in
                  [(64, 64, 4), (32, 64, 4), (64, 32, 4), (32, 128, 4), (64, 128, 4), (128, 64, 4), (64, 64, 8),
                   (128, 128, 8), (32, 256, 4), (64, 128, 8)]],
    }
    _, mean, rstd, _ = norm.norm_fwd(x, w, b, 1e-5, rms=False)
    want = {
        "quantize": REF["quantize_fp8"](x, s, E4M3)[0],
        "cast_transpose": REF["cast_transpose_fp8"](x, s, E4M3)[:2],
        "norm_fwd": REF["layernorm_fwd"](x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3)[0],
        "norm_bwd": REF["layernorm_bwd"](dy, x, mean, rstd, w)[0],
        "elementwise": REF["activation_fwd"](x, "gelu", fp8_scale=s, fp8_dtype=E4M3)[0],
        "mxfp8": REF["quantize_mxfp8"](x, E4M3, with_transpose=True),
    }
    checks = {
        "quantize": lambda out, w_: fp8_exact(out[0], w_) == 0,
        "cast_transpose": lambda out, w_: fp8_exact(out[0], w_[0]) + fp8_exact(out[1], w_[1]) == 0,
        "norm_fwd": lambda out, w_: fp8_ulp_off(out[0], w_)[0] == 0,
        "norm_bwd": lambda out, w_: close(out[0], w_, 1.6e-2, 1e-5)[0],
        "elementwise": lambda out, w_: fp8_ulp_off(out[0], w_)[0] == 0,
        "mxfp8": lambda out, w_: (fp8_exact(out[0], w_[0]) + fp8_exact(out[2], w_[2]) == 0
                                  and torch.equal(out[1], w_[1]) and torch.equal(out[3], w_[3])),
    }
    runs = {
        "quantize": (3 * n, lambda c: cast.quantize_fp8(x, s, E4M3, c)),
        "cast_transpose": (4 * n, lambda c: cast.cast_transpose_fp8(x, s, E4M3, c)),
        "norm_fwd": (3 * n, lambda c: norm.norm_fwd(x, w, b, 1e-5, rms=False, fp8_scale=s, fp8_dtype=E4M3, cfg=c)),
        "norm_bwd": (6 * n, lambda c: norm.norm_bwd(dy, x, mean, rstd, w, rms=False, cfg=c)),
        "elementwise": (3 * n, lambda c: activation.activation_fwd(x, "gelu", fp8_scale=s, fp8_dtype=E4M3, cfg=c)),
        "mxfp8": (4 * n, lambda c: te_mxfp8.quantize_mxfp8(x, E4M3, with_transpose=True, cfg=c)),
    }
    for fam, configs_ in cands.items():
        if families and fam not in families:
            continue
        nbytes, fn = runs[fam]
        for c in configs_:
            try:
                poison()
                ok = bool(checks[fam](fn(c), want[fam]))
                ms = bench(lambda: fn(c))
                RESULTS["sweeps"].append({"family": fam, "config": c.__dict__, "GBps": nbytes / ms / 1e6, "ok": ok})
                print(f"[sweep] {fam:15s} {c} {nbytes / ms / 1e6:8.0f} GB/s {'ok' if ok else 'WRONG'}", flush=True)
            except Exception as exc:
                print(f"[sweep] {fam} {c} failed: {type(exc).__name__}: {str(exc)[:150]}", flush=True)
    dump()


def time_gemms(quick):
    caps = capabilities_for(torch.cuda.current_device())
    shapes = [(8192, 8192, 8192), (16384, 8192, 8192), (8192, 4096, 4096)] + ([] if quick else [(16384, 8192, 28672)])
    for M, K, N in shapes:
        a16, b16 = rand((M, K), BF16, 1.0, 60), rand((N, K), BF16, 1.0, 61)
        flops = 2 * M * N * K
        row = {"M": M, "K": K, "N": N, "bf16_TFLOPs": flops / bench(lambda: torch.mm(a16, b16.t())) / 1e9}
        a8, b8 = a16.to(E4M3), b16.to(E4M3)
        for mode in sorted(caps.scaling_modes - {"mxfp8"}):
            sa, sb = gemm_scales(mode, M, N, K)
            ok, why = scaled_mm.supports_gemm_fp8(a8, b8, sa, sb, out_dtype=BF16, scaling=mode)
            if ok:
                ms = bench(lambda: scaled_mm.gemm_fp8(a8, b8, sa, sb, out_dtype=BF16, scaling=mode))
                row[f"{mode}_TFLOPs"] = flops / ms / 1e9
        RESULTS["gemm"].append(row)
        print("[gemm] " + "  ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del a16, b16, a8, b8


def time_attention():
    q, k, v = (rand((8, 32, 2048, 128), BF16, 1.0, 70 + i).requires_grad_() for i in range(3))
    dout = rand((8, 32, 2048, 128), BF16, 1.0, 73)

    def step(fn):
        out = fn()
        out.backward(dout)

    ours = bench(lambda: step(lambda: cuda_attention.attention(q, k, v, attn_mask_type="causal")))
    plain = bench(lambda: step(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)))
    RESULTS["timings"].append({"op": "attention causal b8 h32 s2048 d128 fwd+bwd", "ms": ours, "sdpa_default_ms": plain})
    print(f"[time] attention causal fwd+bwd: {ours:.2f} ms (torch SDPA default {plain:.2f} ms)", flush=True)


# ----------------------------------------------------------------------------- main
def summary():
    print("\n==== te-backend-cuda kernels on", torch.cuda.get_device_name(), "torch", torch.__version__, "triton",
          triton.__version__, "====")
    bad = [c for c in RESULTS["checks"] if not c["ok"]]
    print(f"checks: {len(RESULTS['checks']) - len(bad)}/{len(RESULTS['checks'])} OK" + (
        "; FAILED: " + ", ".join(c["op"] for c in bad) if bad else ""))
    print(f"{'op (16384x8192 bf16)':36s} {'ours GB/s':>9s} {'eager':>7s} {'compile':>8s}")
    for r in RESULTS["timings"]:
        if "GBps" in r:
            peer = r.get("eager_GBps") or r.get("torch_F.layer_norm_GBps")
            comp = r.get("compile_GBps")
            print(f"{r['op'][:36]:36s} {r['GBps']:9.0f} {peer or 0:7.0f} {comp or 0:8.0f}")
        else:
            print(f"{r['op'][:36]:36s} {r['ms'] * 1e3:7.0f} us  " + "  ".join(f"{k}={v:.3f}" for k, v in r.items() if k.endswith("_ms")))
    for fam in sorted({s["family"] for s in RESULTS["sweeps"]}):
        best = max((s for s in RESULTS["sweeps"] if s["family"] == fam and s["ok"]), key=lambda s: s["GBps"])
        print(f"best {fam:15s} {best['GBps']:6.0f} GB/s {best['config']}")
    for g in RESULTS["gemm"]:
        print("gemm " + " ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in g.items()))


def dump():
    """Write the results so far (a run stopped at its time limit still leaves them)."""
    write_json("kernels", RESULTS, RESULTS_ROOT[0])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--sweep", nargs="*", default=None, metavar="FAMILY",
                    help="try tuning configs: of every family, or of those named")
    add_results_argument(ap)
    args = ap.parse_args()
    unknown = sorted(set(args.sweep or ()) - set(SWEEP_FAMILIES))
    if unknown:
        ap.error(f"--sweep: unknown families {unknown}; choose from {', '.join(SWEEP_FAMILIES)}")
    RESULTS_ROOT[0] = args.results
    RESULTS["meta"] = meta("cuda")
    run_checks()
    dump()
    torch.cuda.empty_cache()
    for step in (lambda: time_memory_bound(not args.no_compile), time_scaling, time_softmax_rope_adam,
                 lambda: time_gemms(args.quick), time_attention):
        try:
            tensors = step()
            if args.sweep is not None and isinstance(tensors, tuple):
                sweep(*tensors, families=tuple(args.sweep))
            del tensors
        except Exception:
            traceback.print_exc()
        torch.cuda.empty_cache()
        dump()
    summary()
    return 0 if all(c["ok"] for c in RESULTS["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
