"""The correctness half of bench_kernels.py: every native kernel of te-backend-cuda against the
reference backend on the GPU, each check recorded in CHECKS (op, ok, detail) and printed.

Fresh random inputs; the caching allocator's free memory is poisoned (0xFF: NaN in bf16, fp32
and E4M3) before each native call so unwritten outputs show; FP8 outputs of casts at a fixed
scale must match bit for bit, fused ops within one FP8 step, the rest within Transformer
Engine's tolerances. A check that raises is recorded as failed; the others still run.
"""
from __future__ import annotations

import traceback

import torch

from te_backend_cuda import attention as cuda_attention
from te_backend_cuda import ops as cuda_ops
from te_backend_cuda import scaled_mm
from te_backend_cuda.capabilities import capabilities_for
from te_core.reference.plugin import implementations
from te_triton import activation

REF = implementations()
E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
DEV = torch.device("cuda")
CHECKS = []


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
    CHECKS.append({"op": name, "ok": bool(ok), "detail": detail})
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
            d, a = cuda_ops.quantize_fp8(x, s, fp8)
            wd, wa = REF["quantize_fp8"](x, s, fp8)
            n = fp8_exact(d, wd)
            record_check(f"quantize_fp8 {shape} {fp8}", n == 0 and torch.equal(a, wa), f"{n} bytes differ")
            poison()
            d, dt, a = cuda_ops.cast_transpose_fp8(x, s, fp8)
            wd, wdt, wa = REF["cast_transpose_fp8"](x, s, fp8)
            n = fp8_exact(d, wd) + fp8_exact(dt, wdt)
            record_check(f"cast_transpose_fp8 {shape} {fp8}", n == 0 and torch.equal(a, wa), f"{n} bytes differ")
        for wt in (False, True):
            for pow2 in (False, True):
                poison()
                got = cuda_ops.quantize_fp8_current(x, E4M3, with_transpose=wt, force_pow2_scales=pow2)
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
                got = cuda_ops.quantize_blockwise(x, E4M3, block_2d=block_2d, with_transpose=wt)
                want = REF["quantize_blockwise"](x, E4M3, block_2d=block_2d, with_transpose=wt)
                n = fp8_exact(got[0], want[0]) + (fp8_exact(got[2], want[2]) if wt else 0)
                same = torch.equal(got[1], want[1]) and (not wt or torch.equal(got[3], want[3]))
                record_check(f"quantize_blockwise {shape} 2d={block_2d} t={wt}", n == 0 and same,
                             f"{n} bytes differ, scales equal={same}")
    x = torch.tensor([1e6, -1e6, float("nan"), 3.0, float("inf"), -0.0] * 100, device=DEV)
    d, a = cuda_ops.quantize_fp8(x, torch.tensor([1.0], device=DEV), E4M3)
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
            y, mean, rstd, _ = cuda_ops.layernorm_fwd(x, w, b, 1e-5, zero_centered_gamma=zc)
            wy, wmean, wrstd, _ = REF["layernorm_fwd"](x, w, b, 1e-5, zero_centered_gamma=zc)
            ok1, d1 = close(y, wy, **tol)
            ok2, _ = close(rstd, wrstd, 1.3e-6, 1e-5)
            record_check(f"layernorm_fwd {shape} {dtype} zc={zc}", ok1 and ok2, d1)
            poison()
            dx, dw, db = cuda_ops.layernorm_bwd(dy, x, mean, rstd, w, zero_centered_gamma=zc)
            wdx, wdw, wdb = REF["layernorm_bwd"](dy, x, wmean, wrstd, w, zero_centered_gamma=zc)
            ok = [close(dx, wdx, **tol), close(dw.float(), wdw.float(), 1.6e-2, 1e-2), close(db.float(), wdb.float(), 1.6e-2, 1e-2)]
            record_check(f"layernorm_bwd {shape} {dtype} zc={zc}", all(o for o, _ in ok), "; ".join(d for _, d in ok))
            poison()
            y, rstd, _ = cuda_ops.rmsnorm_fwd(x, w, 1e-6, zero_centered_gamma=zc)
            wy, wrstd, _ = REF["rmsnorm_fwd"](x, w, 1e-6, zero_centered_gamma=zc)
            ok1, d1 = close(y, wy, **tol)
            record_check(f"rmsnorm_fwd {shape} {dtype} zc={zc}", ok1, d1)
            poison()
            dx, dw = cuda_ops.rmsnorm_bwd(dy, x, rstd, w, zero_centered_gamma=zc)
            wdx, wdw = REF["rmsnorm_bwd"](dy, x, wrstd, w, zero_centered_gamma=zc)
            ok = [close(dx, wdx, **tol), close(dw.float(), wdw.float(), 1.6e-2, 1e-2)]
            record_check(f"rmsnorm_bwd {shape} {dtype} zc={zc}", all(o for o, _ in ok), "; ".join(d for _, d in ok))
        s = torch.tensor([50.0], device=DEV)
        for fp8 in (E4M3, E5M2):
            poison()
            y, _, _, a = cuda_ops.layernorm_fwd(x, w, b, 1e-5, fp8_scale=s, fp8_dtype=fp8)
            wy, _, _, wa = REF["layernorm_fwd"](x, w, b, 1e-5, fp8_scale=s, fp8_dtype=fp8)
            far, diff = fp8_ulp_off(y, wy)
            oka, _ = close(a, wa, 1.3e-6, 1e-5)
            record_check(f"layernorm_fwd fp8 {shape} {fp8}", far == 0 and oka, f"{diff} differ by one step, {far} by more")
            poison()
            y, _, a = cuda_ops.rmsnorm_fwd(x, w, 1e-6, fp8_scale=s, fp8_dtype=fp8)
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
            y, _ = cuda_ops.activation_fwd(x, kind)
            wy, _ = REF["activation_fwd"](x, kind)
            ok1, d1 = close(y, wy, **tol)
            dy = rand(wy.shape, dtype, 1.0, 6)
            poison()
            dx = cuda_ops.activation_bwd(dy, x, kind)
            ok2, d2 = close(dx, REF["activation_bwd"](dy, x, kind), **tol)
            s = torch.tensor([20.0], device=DEV)
            poison()
            y8, a = cuda_ops.activation_fwd(x, kind, fp8_scale=s, fp8_dtype=E4M3)
            wy8, wa = REF["activation_fwd"](x, kind, fp8_scale=s, fp8_dtype=E4M3)
            far, diff = fp8_ulp_off(y8, wy8)
            oka, _ = close(a, wa, 1.3e-6, 1e-5)
            record_check(f"activation {kind} {shape} {dtype}", ok1 and ok2 and far == 0 and oka,
                         f"{d1} {d2} fp8: {diff} one step, {far} more")
    dy = rand((4096, 3072), BF16, 1.0, 7)
    s = torch.tensor([100.0], device=DEV)
    poison()
    got = cuda_ops.dbias_cast_transpose(dy, s, E5M2)
    want = REF["dbias_cast_transpose"](dy, s, E5M2)
    n = fp8_exact(got[0], want[0]) + fp8_exact(got[1], want[1])
    okb, db = close(got[2].float(), want[2].float(), 1.6e-2, 0.05)
    record_check("dbias_cast_transpose (4096, 3072)", n == 0 and okb and torch.equal(got[3], want[3]), f"{n} bytes; {db}")
    for shape in ((4096, 3072), (3, 1000, 96)):
        dyb = rand(shape, BF16, 1.0, 11)
        okb, db = close(cuda_ops.dbias(dyb).float(), REF["dbias"](dyb).float(), 1.6e-2, 0.05)
        record_check(f"dbias {shape}", okb, db)
    data = cuda_ops.quantize_fp8(rand((4096, 3072), BF16, 1.0, 12), s, E4M3)[0]
    sinv = torch.reciprocal(s)
    for out in (BF16, torch.float32):
        poison()
        got = cuda_ops.dequantize_fp8(data, sinv, out)
        record_check(f"dequantize_fp8 to {out}", torch.equal(got, REF["dequantize_fp8"](data, sinv, out)), "bit for bit")
    for block_2d in (False, True):
        bd, bs, _, _ = cuda_ops.quantize_blockwise(rand((1000, 3000), BF16, 1.0, 13), E4M3, block_2d=block_2d)
        poison()
        got = cuda_ops.dequantize_blockwise(bd, bs, block_2d, BF16)
        record_check(f"dequantize_blockwise 2d={block_2d}",
                     torch.equal(got, REF["dequantize_blockwise"](bd, bs, block_2d, BF16)), "bit for bit")
    for kind in ("gelu", "silu", "relu", "swiglu"):
        x = rand((4096, 3072), BF16, 2.0, 8)
        dyk = dy[:, :1536].contiguous() if kind == "swiglu" else dy
        poison()
        got = cuda_ops.activation_bwd_dbias_cast_transpose(dyk, x, kind, s, E4M3)
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
    cuda_ops.delayed_scaling_update(hists, scales, fmaxes, margin=1.0)
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
        sa, sb = gemm_scales(mode, M, N, K)
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


def gemm_scales(mode, M, N, K):
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
            y = cuda_ops.softmax_fwd(x, 0.5, mask=mask, causal=causal)
            ok1, d1 = close(y, REF["softmax_fwd"](x, 0.5, mask=mask, causal=causal), **tol)
            dy = rand(x.shape, dtype, 1.0, 81)
            poison()
            ok2, d2 = close(cuda_ops.softmax_bwd(dy, y, 0.5), REF["softmax_bwd"](dy, y, 0.5), **tol)
            record_check(f"softmax {dtype} mask={mask_shape} causal={causal}", ok1 and ok2, d1 + d2)
        for fmt in ("sbhd", "bshd"):
            for interleaved in (False, True):
                x = rand((64, 3, 8, 128), dtype, 1.0, 82)
                half = torch.rand((70, 1, 1, 48), device=DEV) * 6
                freqs = half.repeat_interleave(2, -1) if interleaved else torch.cat([half, half], -1)
                poison()
                y = cuda_ops.rope_fwd(x, freqs, tensor_format=fmt, interleaved=interleaved)
                ok1, d1 = close(y, REF["rope_fwd"](x, freqs, tensor_format=fmt, interleaved=interleaved), **tol)
                poison()
                dx = cuda_ops.rope_bwd(y, freqs, tensor_format=fmt, interleaved=interleaved)
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
            got = cuda_ops.cross_entropy(a, target, label_smoothing=smoothing, reduction=reduction)
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


@guarded
def check_mxfp8():
    """The MXFP8 casts (te_triton's kernels at the backend's config): bit for bit against the
    reference, both formats and layouts, zero / subnormal / inf / NaN blocks."""
    for shape in [(4096, 4096), (96, 160)]:
        x = rand(shape, BF16, 1.0, 14) * torch.logspace(-30, 12, shape[0], device=DEV)[:, None].to(BF16)
        x[0] = 0.0
        x[1, 3], x[2, 40], x[3, 70] = float("nan"), float("inf"), float("-inf")
        x[4, :32] = 1e-40
        for fp8 in (E4M3, E5M2):
            for wt in (False, True):
                poison()
                got = cuda_ops.quantize_mxfp8(x, fp8, with_transpose=wt)
                want = REF["quantize_mxfp8"](x, fp8, with_transpose=wt)
                n = fp8_exact(got[0], want[0]) + (fp8_exact(got[2], want[2]) if wt else 0)
                same = torch.equal(got[1], want[1]) and (not wt or torch.equal(got[3], want[3]))
                record_check(f"quantize_mxfp8 {shape} {fp8} t={wt}", n == 0 and same,
                             f"{n} bytes differ, scales equal={same}")
                poison()
                back = cuda_ops.dequantize_mxfp8(got[0], got[1], torch.float32)
                record_check(f"dequantize_mxfp8 {shape} {fp8}",
                             torch.equal(back.nan_to_num(), REF["dequantize_mxfp8"](got[0], got[1], torch.float32)
                                         .nan_to_num()), "bit for bit")


def run_checks():
    for check in (check_casts, check_norms, check_activations, check_scaling, check_gemms, check_attention,
                  check_softmax_rope, check_cross_entropy_adam, check_mxfp8):
        check()
