"""Probe: LayerNorm / RMSNorm backward (te_triton.norm) per warp count and programs per SM.

Session 10 compared the kernel of the time against a variant that loads the next row's x and
dy before reducing the current one (probe-norm-bwd-2026-11-30-session10.log); the variant
won by 10-30% and became the kernel, so this probe now sweeps its configurations, checked
against the backend's own choice (dx bit for bit where the reduction order is the same).

    python benchmarks/probe_norm_bwd.py       # on the GPU
"""
from __future__ import annotations


def main():
    import torch
    from _norm_bwd import norm_bwd_cases
    from te_triton import Config, norm
    from triton.testing import do_bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, M, N, rms, x, dy, w, mean, rstd, chosen in norm_bwd_cases():
        want = norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=chosen)
        for warps, per_sm in [(8, 2), (16, 2), (8, 4), (16, 1), (32, 1), (4, 8)]:
            cfg = Config(num_warps=warps, max_programs=sms * per_sm)
            got = norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=cfg)
            same = torch.equal(got[0], want[0])
            t = do_bench(lambda: norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=cfg), warmup=5, rep=30)
            mark = " (the backend's choice)" if (warps, sms * per_sm) == (chosen.num_warps, chosen.max_programs) else ""
            # x and dy read, dx written (bf16), as bench_kernels counts
            print(f"{name} bwd w{warps} x{per_sm}/SM {M}x{N}: {6 * M * N / t / 1e6:.0f} GB/s "
                  f"(dx equal to the backend's {same}){mark}", flush=True)


if __name__ == "__main__":
    main()
