"""Probe: LayerNorm / RMSNorm forward with FP8 out + amax, per configuration of the production
kernel (te_triton.norm) and against a variant that prefetches the next rows.

Before session 9 the FP8 forward ran 1.9 TB/s at 16384x8192 against 3.2 TB/s with bf16 out.
Compiled for sm_90 its FP8 variant needed 150-255 registers per thread (one program per SM),
so few loads were in flight. The production kernel's options, swept here:

  rows, num_warps, programs per SM
  hoist_params  gamma/beta held in registers for the whole program, or reloaded each step
  amax_chunk    0: per-element running amax when it fits, else a block reduction per step;
                c > 0: a running max per c-element chunk (a thread-local reduction)
  hw_saturate   the hardware convert saturates (no clamp)

The prefetching variant issues the next rows' loads (in x's dtype) before reducing the
current rows, as the backward kernel does since session 10. Session 9's pipelined LayerNorm,
which also merged the two reductions across rows, was slower
(probe-norm-fwd-2026-11-30-session9.log).

    python benchmarks/probe_norm_fwd.py          # on the GPU: time each variant, check bytes
"""
from __future__ import annotations

import triton
import triton.language as tl
from te_triton._common import abs_bits, saturating_cast


@triton.jit
def norm_fwd_prefetch(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, scale_ptr, amax_ptr, M, N, eps,
                      BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, CHUNK: tl.constexpr):
    """The production kernel's two-pass statistics, FP8 out without a clamp, with the next
    rows' loads (kept in x's dtype) issued before the current rows' reductions."""
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    scale = tl.load(scale_ptr)
    if CHUNK:
        acc = tl.zeros([ROWS * BLOCK_N // CHUNK], dtype=tl.int32)
    else:
        acc = tl.zeros([], dtype=tl.int32)
    step = tl.num_programs(0) * ROWS
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    x_next = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=(rows < M)[:, None] & cmask[None, :], other=0.0)
    for first in range(tl.program_id(0) * ROWS, M, step):
        rows = first + tl.arange(0, ROWS)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        x = x_next.to(tl.float32)
        nrows = rows + step
        x_next = tl.load(x_ptr + nrows[:, None] * N + cols[None, :], mask=(nrows < M)[:, None] & cmask[None, :],
                         other=0.0)
        if RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            xc = tl.where(mask, x - mean[:, None], 0.0)
            tl.store(mean_ptr + rows, mean, mask=rmask)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * g[None, :]
        if not RMS:
            y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        bits = tl.where(mask, abs_bits(y), 0)
        if CHUNK:
            acc = tl.maximum(acc, tl.max(tl.reshape(bits, [ROWS * BLOCK_N // CHUNK, CHUNK], can_reorder=True), axis=1))
        else:
            acc = tl.maximum(acc, tl.max(tl.max(bits, axis=1), axis=0))
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], saturating_cast(y * scale, 448.0, y_ptr.dtype.element_ty,
                                                                            False), mask=mask)
    if CHUNK:
        tl.atomic_max(amax_ptr, tl.max(acc, axis=0))
    else:
        tl.atomic_max(amax_ptr, acc)


# (rows, warps, programs per SM, hoist_params, amax_chunk); all with hw_saturate. Production at
# session 9's end: (4, 8, 4, True, 0) at 4096 wide, LayerNorm wider than 4096 (2, 4, 8, False, 8)
CONFIGS = [(4, 8, 4, True, 0), (4, 8, 4, True, 8), (2, 8, 4, True, 0), (2, 8, 4, True, 8), (2, 4, 8, False, 8),
           (2, 4, 8, True, 8), (4, 8, 4, False, 8), (4, 4, 8, True, 8), (2, 4, 8, True, 0)]
# (rows, warps, programs per SM, amax chunk) of the prefetching variant
PREFETCH = [(1, 8, 2, 0), (1, 8, 2, 8), (1, 8, 4, 8), (2, 8, 2, 8), (1, 4, 4, 8), (1, 16, 1, 0), (1, 16, 1, 8),
            (2, 4, 4, 8), (1, 4, 8, 8), (2, 8, 4, 0), (4, 8, 2, 0), (2, 16, 1, 0)]


def main():
    import torch
    from te_triton import Config, norm
    from triton.testing import do_bench

    from te_core.reference.plugin import implementations

    ref = implementations()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    e4m3 = torch.float8_e4m3fn

    def report(label, M, N, run, want_y, want_amax):
        try:
            y, amax = run()
            off = (y.view(torch.uint8) != want_y.view(torch.uint8)).sum().item()
            amax_ok = torch.allclose(amax.reshape(1), want_amax.float().reshape(1), rtol=1e-6)
            t = do_bench(run, warmup=5, rep=30)
            print(f"{label} {M}x{N}: {3 * M * N / t / 1e6:.0f} GB/s ({off} bytes off, amax {'ok' if amax_ok else 'WRONG'})",
                  flush=True)
        except Exception as exc:  # a variant that does not compile is a finding, not a stop
            print(f"{label} {M}x{N}: FAILED {str(exc)[:160]}", flush=True)

    for M, N in [(16384, 4096), (16384, 8192)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3 + 1
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        s = torch.full((1,), 16.0, device="cuda")
        for rms in (False, True):
            name = "rmsnorm" if rms else "layernorm"
            want = ref[f"{name}_fwd"](x, w, *(() if rms else (b,)), 1e-5, fp8_scale=s, fp8_dtype=e4m3)
            for rows, warps, per_sm, hoist, chunk in CONFIGS:
                cfg = Config(num_warps=warps, max_programs=sms * per_sm, rows=rows, hoist_params=hoist,
                             amax_chunk=chunk, hw_saturate=True)

                def run():
                    y, _, _, amax = norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms, fp8_scale=s,
                                                  fp8_dtype=e4m3, cfg=cfg)
                    return y, amax

                report(f"{name} fwd fp8 rows{rows} w{warps} x{per_sm}/SM hoist={int(hoist)} chunk={chunk}", M, N, run,
                       want[0], want[-1])
            y = torch.empty((M, N), dtype=e4m3, device="cuda")
            mean, rstd = torch.empty(M, device="cuda"), torch.empty(M, device="cuda")
            amax = torch.zeros(1, dtype=torch.int32, device="cuda")
            for rows, warps, per_sm, chunk in PREFETCH:
                if rows * triton.next_power_of_2(N) > norm.MAX_TILE:
                    continue
                grid = (min(sms * per_sm, triton.cdiv(M, rows)),)

                def run():
                    amax.zero_()
                    norm_fwd_prefetch[grid](x, w, b, y, mean, rstd, s, amax, M, N, 1e-5,
                                            BLOCK_N=triton.next_power_of_2(N), ROWS=rows, RMS=rms, CHUNK=chunk,
                                            num_warps=warps)
                    return y, amax.view(torch.float32)

                report(f"{name} PREFETCH fp8 rows{rows} w{warps} x{per_sm}/SM chunk={chunk}", M, N, run, want[0],
                       want[-1])


if __name__ == "__main__":
    main()
