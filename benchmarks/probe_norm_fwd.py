"""Probe: LayerNorm / RMSNorm forward with FP8 out + amax, per configuration of the production
kernel (te_triton.norm).

Before session 9 the FP8 forward ran 1.9 TB/s at 16384x8192 against 3.2 TB/s with bf16 out.
Compiled for sm_90 its FP8 variant needed 150-255 registers per thread (one program per SM),
so few loads were in flight. The production kernel's options, swept here:

  rows, num_warps, programs per SM
  hoist_params  gamma/beta held in registers for the whole program, or reloaded each step
  amax_chunk    0: per-element running amax when it fits, else a block reduction per step;
                c > 0: a running max per c-element chunk (a thread-local reduction)
  hw_saturate   the hardware convert saturates (no clamp)

Variants measured against these configs and not adopted, with their logs: session 9's
pipelined LayerNorm (one block reduction per row, merged across rows), session 10's
one-reduction statistics (per-chunk, merged pairwise) and next-row prefetch
(probe-norm-fwd-*-2026-11-30-session{9,10}.log).

    python benchmarks/probe_norm_fwd.py          # on the GPU: time each variant, check bytes
"""
from __future__ import annotations

# (rows, warps, programs per SM, hoist_params, amax_chunk); all with hw_saturate. Production at
# session 9's end: (4, 8, 4, True, 0) at 4096 wide, LayerNorm wider than 4096 (2, 4, 8, False, 8)
CONFIGS = [(4, 8, 4, True, 0), (4, 8, 4, True, 8), (2, 8, 4, True, 0), (2, 8, 4, True, 8), (2, 4, 8, False, 8),
           (2, 4, 8, True, 8), (4, 8, 4, False, 8), (4, 4, 8, True, 8), (2, 4, 8, True, 0)]


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

    # 16383 rows: the same work without full tiles (rows 2 or 4 per step), so the kernel keeps
    # its per-element masks; 16384 rows take the unmasked path (EVEN)
    for M, N in [(16384, 4096), (16383, 4096), (16384, 8192), (16383, 8192)]:
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


if __name__ == "__main__":
    main()
