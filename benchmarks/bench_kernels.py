"""Check every native kernel of te-backend-cuda against the reference on the GPU, then time it.

Correctness: fresh random inputs, the caching allocator's free memory poisoned (0xFF: NaN in
bf16/fp32/E4M3) before each native call so unwritten outputs show; FP8 outputs of casts at a
fixed scale must match bit for bit. Timing: triton.testing.do_bench medians; GB/s counts each
input read once and each output written once; peers (torch eager = the reference ops, and
torch.compile of them) are timed in the same process. GEMMs in TFLOP/s against bf16 torch.mm.

    python benchmarks/bench_kernels.py [--quick] [--no-compile] [--sweep]

Prints a table last; writes JSON to $OUT (if set) and benchmarks/results/kernels-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

from te_backend_cuda import attention as cuda_attention
from te_backend_cuda import configs, fused, scaled_mm
from te_backend_cuda.capabilities import capabilities_for
from te_core.reference.plugin import implementations
from te_triton import Config, activation, cast, norm

from report import KERNEL_TARGETS

REF = implementations()
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
DEV = torch.device("cuda")
RESULTS = {"checks": [], "timings": [], "sweeps": [], "gemm": []}


# ----------------------------------------------------------------------------- helpers
def poison():
    """Fill the allocator's cached free blocks with 0xFF so torch.empty returns NaN-filled memory."""
    free = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if free > 0:
        try:
            torch.empty(free - free % 512, dtype=torch.uint8, device=DEV).fill_(0xFF)
        except torch.OutOfMemoryError:
            pass


def rand(shape, dtype=BF16, scale=3.0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEV, dtype=torch.float32) * scale).to(dtype)


def record_check(name, ok, detail=""):
    RESULTS["checks"].append({"op": name, "ok": bool(ok), "detail": detail})
    print(f"[check] {name:48s} {'OK ' if ok else 'FAIL'} {detail}", flush=True)


def fp8_exact(got, want):
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    return int((g != w).sum().item())


def fp8_ulp_off(got, want):
    """Elements more than one FP8 step apart (for fused ops whose float32 math differs in order)."""
    g, w = got.float(), want.float()
    step = torch.ldexp(torch.ones_like(w), torch.frexp(w.abs().clamp_min(2.0**-6)).exponent - 1 - 3)
    return int(((g - w).abs() > step * (2 if got.dtype == E5M2 else 1) + 1e-12).sum().item()), int((g != w).sum().item())


def close(got, want, rtol, atol):
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        return True, ""
    except AssertionError as e:
        return False, str(e).splitlines()[-2][:120] if len(str(e).splitlines()) > 1 else str(e)[:120]


def rel_close(got, want, limit):
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
    return err <= limit, f"relative error {err:.1e} (limit {limit:.0e})"


def guarded(fn):
    def run(*a, **k):
        try:
            return fn(*a, **k)
        except Exception as exc:  # a broken check must not hide the others
            traceback.print_exc()
            record_check(fn.__name__, False, f"raised {type(exc).__name__}: {exc}"[:200])
    return run


# ----------------------------------------------------------------------------- checks
@guarded
def check_casts():
    for shape in [(4096, 4096), (333, 1000), (8192, 1536)]:
        x = rand(shape, seed=shape[0])
        for fp8 in (E4M3, E5M2):
            s = torch.tensor([fp8 == E4M3 and 37.0 or 900.0], device=DEV)
            poison()
            d, a = fused.quantize_fp8(x, s, fp8)
            wd, wa = REF["quantize_fp8"](x, s, fp8)
            n = fp8_exact(d, wd)
            record_check(f"quantize_fp8 {shape} {fp8}", n == 0 and torch.equal(a, wa), f"{n} bytes differ")
            poison()
            d, dt, a = fused.cast_transpose_fp8(x, s, fp8)
            wd, wdt, wa = REF["cast_transpose_fp8"](x, s, fp8)
            n = fp8_exact(d, wd) + fp8_exact(dt, wdt)
            record_check(f"cast_transpose_fp8 {shape} {fp8}", n == 0 and torch.equal(a, wa), f"{n} bytes differ")
        for wt in (False, True):
            for pow2 in (False, True):
                poison()
                got = fused.quantize_fp8_current(x, E4M3, with_transpose=wt, force_pow2_scales=pow2)
                want = REF["quantize_fp8_current"](x, E4M3, with_transpose=wt, force_pow2_scales=pow2)
                n = fp8_exact(got[0], want[0]) + (fp8_exact(got[1], want[1]) if wt else 0)
                same = all(torch.equal(got[i], want[i]) for i in (2, 3, 4))
                record_check(f"quantize_fp8_current {shape} t={wt} pow2={pow2}", n == 0 and same,
                             f"{n} bytes differ, scales/amax equal={same}")
    for shape in [(4096, 4096), (333, 1000)]:
        x = rand(shape, seed=7) * torch.logspace(-3, 3, shape[0], device=DEV)[:, None].to(BF16)
        for block_2d in (False, True):
            for wt in (False, True):
                poison()
                got = fused.quantize_blockwise(x, E4M3, block_2d=block_2d, with_transpose=wt)
                want = REF["quantize_blockwise"](x, E4M3, block_2d=block_2d, with_transpose=wt)
                n = fp8_exact(got[0], want[0]) + (fp8_exact(got[2], want[2]) if wt else 0)
                same = torch.equal(got[1], want[1]) and (not wt or torch.equal(got[3], want[3]))
                record_check(f"quantize_blockwise {shape} 2d={block_2d} t={wt}", n == 0 and same,
                             f"{n} bytes differ, scales equal={same}")
    x = torch.tensor([1e6, -1e6, float("nan"), 3.0, float("inf"), -0.0] * 100, device=DEV)
    d, a = fused.quantize_fp8(x, torch.tensor([1.0], device=DEV), E4M3)
    wd, wa = REF["quantize_fp8"](x, torch.tensor([1.0], device=DEV), E4M3)
    record_check("quantize_fp8 saturation/NaN", fp8_exact(d, wd) == 0 and a.isnan().item(), "")


@guarded
def check_norms():
    for shape, dtype in [((4096, 8192), BF16), ((1000, 1000), torch.float32), ((3, 7, 2304), BF16)]:
        x = rand(shape, dtype, seed=1)
        n = shape[-1]
        w, b = rand((n,), dtype, 0.5, 2) + 1, rand((n,), dtype, 1.0, 3)
        dy = rand(shape, dtype, 1.0, 4)
        tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == BF16 else dict(rtol=1.3e-6, atol=1e-5)
        for zc in (False, True):
            poison()
            y, mean, rstd, _ = fused.layernorm_fwd(x, w, b, 1e-5, zero_centered_gamma=zc)
            wy, wmean, wrstd, _ = REF["layernorm_fwd"](x, w, b, 1e-5, zero_centered_gamma=zc)
            ok1, d1 = close(y, wy, **tol)
            ok2, _ = close(rstd, wrstd, 1.3e-6, 1e-5)
            record_check(f"layernorm_fwd {shape} {dtype} zc={zc}", ok1 and ok2, d1)
            poison()
            dx, dw, db = fused.layernorm_bwd(dy, x, mean, rstd, w, zero_centered_gamma=zc)
            wdx, wdw, wdb = REF["layernorm_bwd"](dy, x, wmean, wrstd, w, zero_centered_gamma=zc)
            ok = [close(dx, wdx, **tol), close(dw.float(), wdw.float(), 1.6e-2, 1e-2), close(db.float(), wdb.float(), 1.6e-2, 1e-2)]
            record_check(f"layernorm_bwd {shape} {dtype} zc={zc}", all(o for o, _ in ok), "; ".join(d for _, d in ok))
            poison()
            y, rstd, _ = fused.rmsnorm_fwd(x, w, 1e-6, zero_centered_gamma=zc)
            wy, wrstd, _ = REF["rmsnorm_fwd"](x, w, 1e-6, zero_centered_gamma=zc)
            ok1, d1 = close(y, wy, **tol)
            record_check(f"rmsnorm_fwd {shape} {dtype} zc={zc}", ok1, d1)
            poison()
            dx, dw = fused.rmsnorm_bwd(dy, x, rstd, w, zero_centered_gamma=zc)
            wdx, wdw = REF["rmsnorm_bwd"](dy, x, wrstd, w, zero_centered_gamma=zc)
            ok = [close(dx, wdx, **tol), close(dw.float(), wdw.float(), 1.6e-2, 1e-2)]
            record_check(f"rmsnorm_bwd {shape} {dtype} zc={zc}", all(o for o, _ in ok), "; ".join(d for _, d in ok))
        s = torch.tensor([50.0], device=DEV)
        for fp8 in (E4M3, E5M2):
            poison()
            y, _, _, a = fused.layernorm_fwd(x, w, b, 1e-5, fp8_scale=s, fp8_dtype=fp8)
            wy, _, _, wa = REF["layernorm_fwd"](x, w, b, 1e-5, fp8_scale=s, fp8_dtype=fp8)
            far, diff = fp8_ulp_off(y, wy)
            oka, _ = close(a, wa, 1.3e-6, 1e-5)
            record_check(f"layernorm_fwd fp8 {shape} {fp8}", far == 0 and oka, f"{diff} differ by one step, {far} by more")
            poison()
            y, _, a = fused.rmsnorm_fwd(x, w, 1e-6, fp8_scale=s, fp8_dtype=fp8)
            wy, _, wa = REF["rmsnorm_fwd"](x, w, 1e-6, fp8_scale=s, fp8_dtype=fp8)
            far, diff = fp8_ulp_off(y, wy)
            oka, _ = close(a, wa, 1.3e-6, 1e-5)
            record_check(f"rmsnorm_fwd fp8 {shape} {fp8}", far == 0 and oka, f"{diff} differ by one step, {far} by more")


@guarded
def check_activations():
    for kind in activation.KIND_IDS:
        for shape, dtype in [((2048, 4096), BF16), ((7, 33, 130), torch.float32)]:
            x = rand(shape, dtype, 2.0, 5)
            tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == BF16 else dict(rtol=1.3e-6, atol=1e-5)
            poison()
            y, _ = fused.activation_fwd(x, kind)
            wy, _ = REF["activation_fwd"](x, kind)
            ok1, d1 = close(y, wy, **tol)
            dy = rand(wy.shape, dtype, 1.0, 6)
            poison()
            dx = fused.activation_bwd(dy, x, kind)
            ok2, d2 = close(dx, REF["activation_bwd"](dy, x, kind), **tol)
            s = torch.tensor([20.0], device=DEV)
            poison()
            y8, a = fused.activation_fwd(x, kind, fp8_scale=s, fp8_dtype=E4M3)
            wy8, wa = REF["activation_fwd"](x, kind, fp8_scale=s, fp8_dtype=E4M3)
            far, diff = fp8_ulp_off(y8, wy8)
            oka, _ = close(a, wa, 1.3e-6, 1e-5)
            record_check(f"activation {kind} {shape} {dtype}", ok1 and ok2 and far == 0 and oka,
                         f"{d1} {d2} fp8: {diff} one step, {far} more")
    dy = rand((4096, 3072), BF16, 1.0, 7)
    s = torch.tensor([100.0], device=DEV)
    poison()
    got = fused.dbias_cast_transpose(dy, s, E5M2)
    want = REF["dbias_cast_transpose"](dy, s, E5M2)
    n = fp8_exact(got[0], want[0]) + fp8_exact(got[1], want[1])
    okb, db = close(got[2].float(), want[2].float(), 1.6e-2, 0.05)
    record_check("dbias_cast_transpose (4096, 3072)", n == 0 and okb and torch.equal(got[3], want[3]), f"{n} bytes; {db}")
    for shape in ((4096, 3072), (3, 1000, 96)):
        dyb = rand(shape, BF16, 1.0, 11)
        okb, db = close(fused.dbias(dyb).float(), REF["dbias"](dyb).float(), 1.6e-2, 0.05)
        record_check(f"dbias {shape}", okb, db)
    data = fused.quantize_fp8(rand((4096, 3072), BF16, 1.0, 12), s, E4M3)[0]
    sinv = torch.reciprocal(s)
    for out in (BF16, torch.float32):
        poison()
        got = fused.dequantize_fp8(data, sinv, out)
        record_check(f"dequantize_fp8 to {out}", torch.equal(got, REF["dequantize_fp8"](data, sinv, out)), "bit for bit")
    for block_2d in (False, True):
        bd, bs, _, _ = fused.quantize_blockwise(rand((1000, 3000), BF16, 1.0, 13), E4M3, block_2d=block_2d)
        poison()
        got = fused.dequantize_blockwise(bd, bs, block_2d, BF16)
        record_check(f"dequantize_blockwise 2d={block_2d}",
                     torch.equal(got, REF["dequantize_blockwise"](bd, bs, block_2d, BF16)), "bit for bit")
    for kind in ("gelu", "silu", "relu", "swiglu"):
        x = rand((4096, 3072), BF16, 2.0, 8)
        dyk = dy[:, :1536].contiguous() if kind == "swiglu" else dy
        poison()
        got = fused.activation_bwd_dbias_cast_transpose(dyk, x, kind, s, E4M3)
        want = REF["activation_bwd_dbias_cast_transpose"](dyk, x, kind, s, E4M3)
        far, diff = fp8_ulp_off(got[0], want[0])
        okt = torch.equal(got[1].float().t(), got[0].float())
        okb, db = close(got[2].float(), want[2].float(), 1.6e-2, 0.5)
        oka, _ = close(got[3], want[3], 1.6e-2, 1e-5)
        record_check(f"activation_bwd_dbias_cast_transpose {kind}", far == 0 and okt and okb and oka,
                     f"{diff} one step, {far} more; {db}")


@guarded
def check_scaling():
    g = torch.Generator(device=DEV).manual_seed(9)
    hists = [torch.rand(L, n, generator=g, device=DEV) * 10 for L, n in [(1024, 3), (16, 1), (1, 300), (1024, 3)] * 25]
    hists[0][:, 1] = 0
    hists[1][5, 0] = float("nan")
    hists[2][0, 7] = float("inf")
    scales = [torch.rand(h.shape[1], generator=g, device=DEV) + 0.5 for h in hists]
    fmaxes = [448.0, 57344.0] * 50
    wh, ws = [h.clone() for h in hists], [s.clone() for s in scales]
    fused.delayed_scaling_update(hists, scales, fmaxes, margin=1.0)
    REF["delayed_scaling_update"](wh, ws, fmaxes, margin=1.0)
    ok = all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(hists + scales, wh + ws))
    record_check("delayed_scaling_update (100 histories)", ok, "bit-exact" if ok else "differs")
    return hists, scales, fmaxes


@guarded
def check_gemms():
    caps = capabilities_for(torch.cuda.current_device())
    print("capabilities:", sorted(caps.scaling_modes), caps.notes, flush=True)
    M, N, K = 256, 384, 1024
    for mode in sorted(caps.scaling_modes):
        if mode == "mxfp8":
            continue
        a, b = rand((M, K), E4M3, 1.0, 10), rand((N, K), E4M3, 1.0, 11)
        sa, sb = _scales(mode, M, N, K)
        for out_dtype in (BF16, torch.float32):
            bias = rand((N,), out_dtype, 1.0, 12)
            poison()
            got = scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=out_dtype, scaling=mode, bias=bias)
            want = REF["gemm_fp8"](a, b, sa, sb, out_dtype=out_dtype, scaling=mode, bias=bias)
            ok, d = rel_close(got, want, 4e-3 if out_dtype == BF16 else 1e-3)
            record_check(f"gemm_fp8 {mode} out={out_dtype}", ok and not got.isnan().any(), d)
        out = rand((M, N), torch.float32, 1.0, 13)
        want_out = out.clone()
        scaled_mm.gemm_fp8(a, b, sa, sb, out_dtype=torch.float32, scaling=mode, out=out, accumulate=True)
        REF["gemm_fp8"](a, b, sa, sb, out_dtype=torch.float32, scaling=mode, out=want_out, accumulate=True)
        ok, d = rel_close(out, want_out, 1e-3)
        record_check(f"gemm_fp8 {mode} accumulate", ok, d)
    a, b = rand((M, K), BF16, 1.0, 14), rand((N, K), BF16, 1.0, 15)
    out = rand((M, N), torch.float32, 1.0, 16)
    want_out = out.clone()
    scaled_mm.gemm(a, b, out=out, accumulate=True)
    REF["gemm"](a, b, out=want_out, accumulate=True)
    ok, d = rel_close(out, want_out, 1e-4)
    record_check("gemm bf16 accumulate fp32", ok, d)


def _scales(mode, M, N, K):
    g = torch.Generator(device=DEV).manual_seed(17)
    kb, nb = -(-K // 128), -(-N // 128)
    shapes = {"tensorwise": ((1,), (1,)), "rowwise": ((M, 1), (N, 1)), "block_1x128_128x128": ((M, kb), (nb, kb)),
              "block_1x128_1x128": ((M, kb), (N, kb))}[mode]
    return tuple(torch.rand(s, generator=g, device=DEV) + 0.5 for s in shapes)


@guarded
def check_attention():
    for kind in ("no_mask", "causal", "causal_bottom_right", "padding_causal", "arbitrary"):
        for hkv in (8, 2):
            q, k, v = (rand((2, 8 if i == 0 else hkv, 256, 64), BF16, 1.0, 20 + i) for i in range(3))
            mask = None
            if kind == "padding_causal":
                mask = torch.zeros(2, 1, 1, 256, dtype=torch.bool, device=DEV)
                mask[1, ..., 200:] = True
            if kind == "arbitrary":
                mask = torch.rand(2, 8, 256, 256, device=DEV) > 0.7
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            wins = [t.float().clone().requires_grad_() for t in (q, k, v)]
            out = cuda_attention.attention(*ins, attn_mask_type=kind, attention_mask=mask)
            wout = REF["attention"](*wins, attn_mask_type=kind, attention_mask=mask)
            dout = rand(out.shape, BF16, 1.0, 30)
            out.backward(dout)
            wout.backward(dout.float())
            oks = [close(out.float(), wout, 2e-2, 2e-2)] + [close(i.grad.float(), w.grad, 3e-2, 3e-2) for i, w in zip(ins, wins)]
            record_check(f"attention {kind} hkv={hkv}", all(o for o, _ in oks), "; ".join(d for _, d in oks if d))


@guarded
def check_softmax_rope():
    for dtype in (BF16, torch.float32):
        tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == BF16 else dict(rtol=1.3e-6, atol=1e-5)
        x = rand((2, 4, 100, 300), dtype, 2.0, 80)
        for mask_shape, causal in [(None, False), (None, True), ((2, 1, 1, 300), False), ((2, 4, 100, 300), True)]:
            mask = None if mask_shape is None else torch.rand(mask_shape, device=DEV) > 0.5
            if mask is not None:
                mask[..., 0, :] = True
            poison()
            y = fused.softmax_fwd(x, 0.5, mask=mask, causal=causal)
            ok1, d1 = close(y, REF["softmax_fwd"](x, 0.5, mask=mask, causal=causal), **tol)
            dy = rand(x.shape, dtype, 1.0, 81)
            poison()
            ok2, d2 = close(fused.softmax_bwd(dy, y, 0.5), REF["softmax_bwd"](dy, y, 0.5), **tol)
            record_check(f"softmax {dtype} mask={mask_shape} causal={causal}", ok1 and ok2, d1 + d2)
        for fmt in ("sbhd", "bshd"):
            for interleaved in (False, True):
                x = rand((64, 3, 8, 128), dtype, 1.0, 82)
                half = torch.rand((70, 1, 1, 48), device=DEV) * 6
                freqs = half.repeat_interleave(2, -1) if interleaved else torch.cat([half, half], -1)
                poison()
                y = fused.rope_fwd(x, freqs, tensor_format=fmt, interleaved=interleaved)
                ok1, d1 = close(y, REF["rope_fwd"](x, freqs, tensor_format=fmt, interleaved=interleaved), **tol)
                poison()
                dx = fused.rope_bwd(y, freqs, tensor_format=fmt, interleaved=interleaved)
                ok2, d2 = close(dx, REF["rope_bwd"](y, freqs, tensor_format=fmt, interleaved=interleaved), **tol)
                record_check(f"rope {dtype} {fmt} interleaved={interleaved}", ok1 and ok2, d1 + d2)


@guarded
def check_cross_entropy_adam():
    for dtype in (torch.float32, BF16):
        logits = rand((300, 50257), dtype, 3.0, 85)
        target = torch.randint(0, 50257, (300,), device=DEV)
        target[::7] = -100
        for reduction, smoothing in [("mean", 0.0), ("sum", 0.1), ("none", 0.0)]:
            a, b = logits.clone().requires_grad_(), logits.float().clone().requires_grad_()
            got = fused.cross_entropy(a, target, label_smoothing=smoothing, reduction=reduction)
            want = REF["cross_entropy"](b, target, label_smoothing=smoothing, reduction=reduction)
            dout = torch.rand(want.shape, device=DEV) + 0.5
            got.backward(dout)
            want.backward(dout)
            ok1, d1 = close(got, want, 1e-5, 1e-4)
            ok2, d2 = close(a.grad.float(), b.grad, 1.6e-2, 1e-5)
            record_check(f"cross_entropy {dtype} {reduction} smoothing={smoothing}", ok1 and ok2, d1 + d2)
    from te_backend_cuda import optimizer
    for dtype in (torch.float32, BF16):
        for adam_w in (True, False):
            state = [[rand(shape, dtype, 1.0, 90 + i) for shape in [(1000, 37), (4096,), (3, 5)]] for i in range(3)]
            state.append([t.abs() for t in state[2]])
            want = [[t.clone() for t in lst] for lst in state]
            hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=5, adam_w_mode=adam_w)
            optimizer.multi_tensor_adam(*state, **hyper)
            REF["multi_tensor_adam"](*want, **hyper)
            tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == BF16 else dict(rtol=1.3e-6, atol=1e-5)
            oks = [close(a, b, **tol) for la, lb in zip(state, want) for a, b in zip(la, lb)]
            record_check(f"multi_tensor_adam {dtype} adamw={adam_w}", all(o for o, _ in oks),
                         "; ".join(d for _, d in oks if d)[:200])


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

    timed("quantize_fp8 (amax+cast)", 3 * n, lambda: fused.quantize_fp8(x, s, E4M3), peers(REF["quantize_fp8"], x, s, E4M3, with_compile=True))
    # as the modules call it: the amax maxed into the history slot, no buffer to zero first
    slot = torch.zeros(1, device=DEV)
    timed("quantize_fp8 into history slot", 3 * n, lambda: fused.quantize_fp8(x, s, E4M3, amax_out=slot), {})
    timed("x.to(float8_e4m3fn) alone", 3 * n, lambda: x.to(E4M3), {})
    timed("cast_transpose_fp8", 4 * n, lambda: fused.cast_transpose_fp8(x, s, E4M3), peers(REF["cast_transpose_fp8"], x, s, E4M3, with_compile=True))
    timed("cast_transpose_fp8 into history slot", 4 * n, lambda: fused.cast_transpose_fp8(x, s, E4M3, amax_out=slot), {})
    timed("quantize_fp8_current", 3 * n, lambda: fused.quantize_fp8_current(x, E4M3),
          peers(REF["quantize_fp8_current"], x, E4M3))
    timed("quantize_fp8_current +transpose", 4 * n, lambda: fused.quantize_fp8_current(x, E4M3, with_transpose=True), {})
    for block_2d in (False, True):
        timed(f"quantize_blockwise 2d={block_2d} +transpose", 4 * n,
              lambda: fused.quantize_blockwise(x, E4M3, block_2d=block_2d, with_transpose=True),
              {"eager": lambda: REF["quantize_blockwise"](x, E4M3, block_2d=block_2d, with_transpose=True)})
    timed("quantize_blockwise 1x128", 3 * n, lambda: fused.quantize_blockwise(x, E4M3),
          {"eager": lambda: REF["quantize_blockwise"](x, E4M3)})
    timed("layernorm_fwd bf16", 4 * n, lambda: fused.layernorm_fwd(x, w, b, 1e-5),
          {"torch_F.layer_norm": lambda: torch.nn.functional.layer_norm(x, (N,), w, b, 1e-5)})
    timed("layernorm_fwd fp8 out", 3 * n, lambda: fused.layernorm_fwd(x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3),
          peers(REF["layernorm_fwd"], x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3))
    timed("rmsnorm_fwd fp8 out", 3 * n, lambda: fused.rmsnorm_fwd(x, w, 1e-5, fp8_scale=s, fp8_dtype=E4M3),
          peers(REF["rmsnorm_fwd"], x, w, 1e-5, fp8_scale=s, fp8_dtype=E4M3, with_compile=True))
    _, mean, rstd, _ = fused.layernorm_fwd(x, w, b, 1e-5)
    timed("layernorm_bwd", 6 * n, lambda: fused.layernorm_bwd(dy, x, mean, rstd, w),
          {"eager": lambda: REF["layernorm_bwd"](dy, x, mean, rstd, w)})
    timed("rmsnorm_bwd", 6 * n, lambda: fused.rmsnorm_bwd(dy, x, rstd, w),
          {"eager": lambda: REF["rmsnorm_bwd"](dy, x, rstd, w)})
    timed("gelu fwd fp8 out", 3 * n, lambda: fused.activation_fwd(x, "gelu", fp8_scale=s, fp8_dtype=E4M3),
          peers(REF["activation_fwd"], x, "gelu", fp8_scale=s, fp8_dtype=E4M3, with_compile=True))
    timed("swiglu fwd fp8 out", 2 * n + n // 2, lambda: fused.activation_fwd(x, "swiglu", fp8_scale=s, fp8_dtype=E4M3),
          peers(REF["activation_fwd"], x, "swiglu", fp8_scale=s, fp8_dtype=E4M3))
    timed("gelu bwd", 6 * n, lambda: fused.activation_bwd(dy, x, "gelu"),
          {"eager": lambda: REF["activation_bwd"](dy, x, "gelu")})
    dyh = dy[:, : N // 2].contiguous()
    timed("swiglu bwd", 5 * n, lambda: fused.activation_bwd(dyh, x, "swiglu"),
          {"eager": lambda: REF["activation_bwd"](dyh, x, "swiglu")})
    timed("dbias_cast_transpose", 4 * n, lambda: fused.dbias_cast_transpose(dy, s, E5M2),
          {"eager": lambda: REF["dbias_cast_transpose"](dy, s, E5M2)})
    timed("gelu bwd+dbias+cast_transpose", 6 * n, lambda: fused.activation_bwd_dbias_cast_transpose(dy, x, "gelu", s, E5M2),
          {"eager": lambda: REF["activation_bwd_dbias_cast_transpose"](dy, x, "gelu", s, E5M2)})
    timed("dbias", 2 * n, lambda: fused.dbias(dy), {"eager": lambda: REF["dbias"](dy)})
    xq = fused.quantize_fp8(x, s, E4M3)[0]
    timed("dequantize_fp8 to bf16", 3 * n, lambda: fused.dequantize_fp8(xq, s, BF16),
          {"eager": lambda: REF["dequantize_fp8"](xq, s, BF16)})
    bq, bs, _, _ = fused.quantize_blockwise(x, E4M3)
    timed("dequantize_blockwise 1x128 to bf16", 3 * n, lambda: fused.dequantize_blockwise(bq, bs, False, BF16),
          {"eager": lambda: REF["dequantize_blockwise"](bq, bs, False, BF16)})
    copy_dst = torch.empty_like(x)
    timed("device copy (ceiling)", 4 * n, lambda: copy_dst.copy_(x), {})
    return x, dy, s, w, b


def time_softmax_rope_adam():
    x = rand((4, 16, 2048, 2048), BF16, 2.0, 100)
    n = x.numel()
    timed("softmax_fwd causal (4,16,2048,2048)", 4 * n, lambda: fused.softmax_fwd(x, 0.1, causal=True),
          {"eager": lambda: REF["softmax_fwd"](x, 0.1, causal=True),
           "torch.softmax": lambda: torch.softmax(x, -1)})
    y = fused.softmax_fwd(x, 0.1, causal=True)
    timed("softmax_bwd", 6 * n, lambda: fused.softmax_bwd(x, y, 0.1), {"eager": lambda: REF["softmax_bwd"](x, y, 0.1)})
    del x, y
    x = rand((2048, 8, 32, 128), BF16, 1.0, 101)
    freqs = torch.rand((2048, 1, 1, 128), device=DEV)
    timed("rope_fwd sbhd (2048,8,32,128)", 4 * x.numel(), lambda: fused.rope_fwd(x, freqs),
          {"eager": lambda: REF["rope_fwd"](x, freqs)})
    del x
    logits = rand((8192, 50304), BF16, 3.0, 103).requires_grad_()
    target = torch.randint(0, 50304, (8192,), device=DEV)
    ce_bytes = 2 * logits.numel() * 3  # forward reads logits; backward reads them and writes the gradient

    def ce_step(fn):
        fn(logits, target).backward()

    timed("cross_entropy fwd+bwd (8192,50304)", ce_bytes, lambda: ce_step(fused.cross_entropy),
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
    ms = bench(lambda: fused.delayed_scaling_update(hists, scales, fm))
    rms = bench(lambda: REF["delayed_scaling_update"](hists, scales, fm))
    RESULTS["timings"].append({"op": "delayed_scaling_update 200x(1024,3)", "ms": ms, "eager_ms": rms})
    print(f"[time] delayed_scaling_update 200 histories: {ms * 1e3:.0f} us vs eager {rms * 1e3:.0f} us", flush=True)


def sweep(x, dy, s, w, b):
    """Try tuning configs per kernel family, each checked against the reference output; the
    best correct one goes into te_backend_cuda.configs."""
    n = x.numel()
    cands = {
        "quantize": [Config(block=bk, num_warps=nw, max_programs=mp) for bk, nw, mp in
                     [(2048, 4, 0), (4096, 4, 0), (4096, 8, 0), (8192, 8, 0), (8192, 16, 0), (16384, 16, 0),
                      (4096, 8, 132 * 8), (8192, 8, 132 * 4), (2048, 8, 0)]],
        "cast_transpose": [Config(block_m=bm, block_n=bn, num_warps=nw) for bm, bn, nw in
                           [(64, 64, 4), (64, 64, 8), (64, 128, 8), (128, 64, 8), (128, 128, 8), (32, 128, 4),
                            (64, 128, 4), (128, 128, 16), (64, 256, 8), (128, 256, 8), (256, 128, 8), (32, 64, 4)]],
        "norm_fwd": [Config(num_warps=nw, max_programs=mp) for nw, mp in
                     [(4, 0), (8, 0), (16, 0), (32, 0), (8, 132 * 4), (8, 132 * 8), (16, 132 * 4), (16, 132 * 8),
                      (32, 132 * 2)]],
        "norm_bwd": [Config(num_warps=nw, max_programs=mp) for nw, mp in
                     [(8, 132 * 2), (8, 132 * 4), (16, 132 * 2), (16, 132 * 4), (32, 132 * 2), (8, 132 * 8),
                      (16, 132 * 8)]],
        "elementwise": [Config(block_m=bm, block_n=bn, num_warps=nw) for bm, bn, nw in
                        [(16, 256, 8), (8, 512, 8), (32, 256, 8), (4, 1024, 8), (16, 512, 16), (8, 256, 4),
                         (2, 2048, 8), (32, 512, 16)]],
    }
    _, mean, rstd, _ = norm.norm_fwd(x, w, b, 1e-5, rms=False)
    want = {
        "quantize": REF["quantize_fp8"](x, s, E4M3)[0],
        "cast_transpose": REF["cast_transpose_fp8"](x, s, E4M3)[:2],
        "norm_fwd": REF["layernorm_fwd"](x, w, b, 1e-5, fp8_scale=s, fp8_dtype=E4M3)[0],
        "norm_bwd": REF["layernorm_bwd"](dy, x, mean, rstd, w)[0],
        "elementwise": REF["activation_fwd"](x, "gelu", fp8_scale=s, fp8_dtype=E4M3)[0],
    }
    checks = {
        "quantize": lambda out, w_: fp8_exact(out[0], w_) == 0,
        "cast_transpose": lambda out, w_: fp8_exact(out[0], w_[0]) + fp8_exact(out[1], w_[1]) == 0,
        "norm_fwd": lambda out, w_: fp8_ulp_off(out[0], w_)[0] == 0,
        "norm_bwd": lambda out, w_: close(out[0], w_, 1.6e-2, 1e-5)[0],
        "elementwise": lambda out, w_: fp8_ulp_off(out[0], w_)[0] == 0,
    }
    runs = {
        "quantize": (3 * n, lambda c: cast.quantize_fp8(x, s, E4M3, c)),
        "cast_transpose": (4 * n, lambda c: cast.cast_transpose_fp8(x, s, E4M3, c)),
        "norm_fwd": (3 * n, lambda c: norm.norm_fwd(x, w, b, 1e-5, rms=False, fp8_scale=s, fp8_dtype=E4M3, cfg=c)),
        "norm_bwd": (6 * n, lambda c: norm.norm_bwd(dy, x, mean, rstd, w, rms=False, cfg=c)),
        "elementwise": (3 * n, lambda c: activation.activation_fwd(x, "gelu", fp8_scale=s, fp8_dtype=E4M3, cfg=c)),
    }
    for fam, configs_ in cands.items():
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
            sa, sb = _scales(mode, M, N, K)
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
    text = json.dumps(RESULTS, indent=1, default=str)
    day = datetime.date.today().isoformat()
    Path(__file__).with_name("results").mkdir(exist_ok=True)
    Path(__file__).with_name("results").joinpath(f"kernels-{day}.json").write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"kernels-{day}.json").write_text(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    RESULTS["meta"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "cuda": torch.version.cuda, "date": datetime.datetime.utcnow().isoformat(timespec="seconds")}
    check_casts()
    check_norms()
    check_activations()
    check_scaling()
    check_gemms()
    check_attention()
    check_softmax_rope()
    check_cross_entropy_adam()
    dump()
    torch.cuda.empty_cache()
    for step in (lambda: time_memory_bound(not args.no_compile), time_scaling, time_softmax_rope_adam,
                 lambda: time_gemms(args.quick), time_attention):
        try:
            tensors = step()
            if args.sweep and isinstance(tensors, tuple):
                sweep(*tensors)
            del tensors
        except Exception:
            traceback.print_exc()
        torch.cuda.empty_cache()
        dump()
    summary()
    return 0 if all(c["ok"] for c in RESULTS["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
