"""Probe: LayerNorm / RMSNorm forward with FP8 out + amax, structural variants of the kernel.

The production kernel (te_triton.norm._norm_fwd_kernel) runs 1.9 TB/s with FP8 out at
16384x8192 against 3.2 TB/s with bf16 out. Compiled for sm_90, its FP8 variant needs 150-255
registers per thread (one program per SM), so few loads are in flight. The variants:

  HOIST   gamma/beta loaded once per program (registers) or per step (L1/L2 hits)
  AMAX    0: a block reduction per step; 1: per-element running max (a tile of registers);
          2: per-chunk running max (a thread-local reduction over CHUNK elements)
  PIPE    (LayerNorm) one block reduction per row instead of two: the step that loads row i+1
          reduces (sum of row i+1, centred sum of squares of row i) together, so the load of
          the next row also overlaps this row's work
  SAT     clamp before the cast (the production code; needed by the CPU interpreter) or rely
          on the hardware's saturating convert

    python benchmarks/probe_norm_fwd.py          # on the GPU: time each variant, check bytes
"""
from __future__ import annotations

import triton
import triton.language as tl
from te_triton._common import abs_bits, saturating_cast


@triton.jit
def norm_fwd_variant(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, scale_ptr, amax_ptr, M, N, eps, fmax,
                     BLOCK_N: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, HOIST: tl.constexpr,
                     AMAX: tl.constexpr, CHUNK: tl.constexpr, SAT: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HOIST:
        g0 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if not RMS:
            b0 = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    if AMAX == 1:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.int32)
    elif AMAX == 2:
        acc = tl.zeros([ROWS * BLOCK_N // CHUNK], dtype=tl.int32)
    else:
        acc = tl.zeros([], dtype=tl.int32)
    for first in range(tl.program_id(0) * ROWS, M, tl.num_programs(0) * ROWS):
        rows = first + tl.arange(0, ROWS)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            xc = tl.where(mask, x - mean[:, None], 0.0)
            tl.store(mean_ptr + rows, mean, mask=rmask)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        if HOIST:
            g = g0
        else:
            g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * g[None, :]
        if not RMS:
            if HOIST:
                y = y + b0[None, :]
            else:
                y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        bits = tl.where(mask, abs_bits(y), 0)
        if AMAX == 1:
            acc = tl.maximum(acc, bits)
        elif AMAX == 2:
            acc = tl.maximum(acc, tl.max(tl.reshape(bits, [ROWS * BLOCK_N // CHUNK, CHUNK], can_reorder=True), axis=1))
        else:
            acc = tl.maximum(acc, tl.max(tl.max(bits, axis=1), axis=0))
        if SAT:
            q = saturating_cast(y * scale, fmax, y_ptr.dtype.element_ty)
        else:
            q = (y * scale).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, q, mask=mask)
    if AMAX == 1:
        tl.atomic_max(amax_ptr, tl.max(tl.max(acc, axis=1), axis=0))
    elif AMAX == 2:
        tl.atomic_max(amax_ptr, tl.max(acc, axis=0))
    else:
        tl.atomic_max(amax_ptr, acc)


@triton.jit
def _add2(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def layernorm_fwd_pipelined(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, scale_ptr, amax_ptr, M, N, eps, fmax,
                            BLOCK_N: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, SAT: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    scale = tl.load(scale_ptr)
    acc = tl.zeros([ROWS * BLOCK_N // CHUNK], dtype=tl.int32)
    step = tl.num_programs(0) * ROWS
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = (rows < M)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    for first in range(tl.program_id(0) * ROWS, M, step):
        rows = first + tl.arange(0, ROWS)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        nrows = rows + step
        nmask = (nrows < M)[:, None] & cmask[None, :]
        x_next = tl.load(x_ptr + nrows[:, None] * N + cols[None, :], mask=nmask, other=0.0).to(tl.float32)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        s_next, ss = tl.reduce((x_next, xc * xc), 1, _add2)
        rstd = 1.0 / tl.sqrt(ss / N + eps)
        tl.store(mean_ptr + rows, mean, mask=rmask)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        bb = tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * g[None, :] + bb[None, :]
        bits = tl.where(mask, abs_bits(y), 0)
        acc = tl.maximum(acc, tl.max(tl.reshape(bits, [ROWS * BLOCK_N // CHUNK, CHUNK], can_reorder=True), axis=1))
        if SAT:
            q = saturating_cast(y * scale, fmax, y_ptr.dtype.element_ty)
        else:
            q = (y * scale).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
        x = x_next
        mean = s_next / N
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


PIPELINE_TOO = False  # measured slower (probe-norm-fwd-2026-11-30-session9.log)
PIPELINED = [  # (rows, warps, programs per SM, CHUNK)
    (1, 8, 4, 8), (1, 4, 8, 8), (2, 4, 8, 8), (1, 8, 2, 8), (2, 8, 4, 8), (1, 16, 2, 8), (1, 4, 16, 8), (1, 8, 8, 8),
    (1, 16, 1, 8), (2, 16, 2, 8), (1, 32, 1, 8), (2, 16, 1, 8),
]

VARIANTS = [  # (rows, warps, programs per SM, HOIST, AMAX, CHUNK, SAT); production: rows 4 (2 at N=8192), 8 warps,
    # 4 programs per SM, gamma/beta hoisted, per-step amax reduction (rows x N > 8192) or tile amax
    (4, 8, 4, True, 0, 1, False),
    (4, 8, 4, True, 2, 8, False),
    (2, 8, 4, True, 0, 1, False),
    (2, 8, 4, True, 2, 8, False),
    (2, 4, 8, False, 2, 8, False),
    (2, 4, 8, True, 2, 8, False),
    (4, 8, 4, False, 2, 8, False),
    (4, 4, 8, True, 2, 8, False),
    (2, 4, 8, True, 0, 1, False),
]


def main():
    import torch
    from triton.testing import do_bench

    from te_core.reference.plugin import implementations

    ref = implementations()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    e4m3 = torch.float8_e4m3fn
    for M, N in [(16384, 4096), (16384, 8192)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3 + 1
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        s = torch.full((1,), 16.0, device="cuda")
        for rms in (False, True):
            name = "rmsnorm" if rms else "layernorm"
            want = ref[f"{name}_fwd"](x, w, *(() if rms else (b,)), 1e-5, fp8_scale=s, fp8_dtype=e4m3)
            want_y, want_amax = want[0], want[-1]
            for rows, warps, per_sm, hoist, amax_mode, chunk, sat in VARIANTS:
                y = torch.full((M, N), 0x7F, dtype=torch.uint8, device="cuda").view(e4m3)
                mean = torch.empty(M, device="cuda")
                rstd = torch.empty(M, device="cuda")
                amax = torch.zeros(1, dtype=torch.int32, device="cuda")
                block_n = triton.next_power_of_2(N)
                grid = (min(sms * per_sm, triton.cdiv(M, rows)),)

                def run():
                    amax.zero_()
                    norm_fwd_variant[grid](x, w, b, y, mean, rstd, s, amax, M, N, 1e-5, 448.0, BLOCK_N=block_n,
                                           ROWS=rows, RMS=rms, HOIST=hoist, AMAX=amax_mode, CHUNK=chunk, SAT=sat,
                                           num_warps=warps)

                try:
                    run()
                    off = (y.view(torch.uint8) != want_y.view(torch.uint8)).sum().item()
                    amax_ok = torch.allclose(amax.view(torch.float32), want_amax.float().reshape(1), rtol=1e-6)
                    t = do_bench(run, warmup=5, rep=30)
                    print(f"{name} fwd fp8 {M}x{N} rows{rows} w{warps} x{per_sm}/SM hoist={int(hoist)} "
                          f"amax={amax_mode}/{chunk} sat={int(sat)}: {3 * M * N / t / 1e6:.0f} GB/s "
                          f"({off} bytes off, amax {'ok' if amax_ok else 'WRONG'})", flush=True)
                except Exception as exc:  # a variant that does not compile is a finding, not a stop
                    print(f"{name} rows{rows} w{warps} amax={amax_mode}: FAILED {str(exc)[:160]}", flush=True)
            if rms:
                continue
            for rows, warps, per_sm, chunk in PIPELINED if PIPELINE_TOO else ():
                for sat in (False,):
                    y = torch.full((M, N), 0x7F, dtype=torch.uint8, device="cuda").view(e4m3)
                    mean = torch.empty(M, device="cuda")
                    rstd = torch.empty(M, device="cuda")
                    amax = torch.zeros(1, dtype=torch.int32, device="cuda")
                    grid = (min(sms * per_sm, triton.cdiv(M, rows)),)

                    def run():
                        amax.zero_()
                        layernorm_fwd_pipelined[grid](x, w, b, y, mean, rstd, s, amax, M, N, 1e-5, 448.0,
                                                      BLOCK_N=triton.next_power_of_2(N), ROWS=rows, CHUNK=chunk,
                                                      SAT=sat, num_warps=warps)

                    try:
                        run()
                        off = (y.view(torch.uint8) != want_y.view(torch.uint8)).sum().item()
                        amax_ok = torch.allclose(amax.view(torch.float32), want_amax.float().reshape(1), rtol=1e-6)
                        t = do_bench(run, warmup=5, rep=30)
                        print(f"layernorm PIPELINED fp8 {M}x{N} rows{rows} w{warps} x{per_sm}/SM chunk{chunk}: "
                              f"{3 * M * N / t / 1e6:.0f} GB/s ({off} bytes off, amax {'ok' if amax_ok else 'WRONG'})",
                              flush=True)
                    except Exception as exc:
                        print(f"layernorm PIPELINED rows{rows} w{warps}: FAILED {str(exc)[:160]}", flush=True)


if __name__ == "__main__":
    main()
