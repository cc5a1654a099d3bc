"""Probe: LayerNorm / RMSNorm backward, production kernel (te_triton.norm) against a variant
that loads the next row's x and dy before reducing the current row, so that a program's
loads overlap its own block reduction (the production loop issues them only after the
current row's store). Checked against the production kernel's dx (dweight in the sums' order).

    python benchmarks/probe_norm_bwd.py       # on the GPU
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add_pair(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def norm_bwd_prefetch(dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, dx_ptr, dw_part_ptr, db_part_ptr, M, N,
                      BLOCK_N: tl.constexpr, RMS: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    x = tl.load(x_ptr + pid * N + cols, mask=cmask, other=0.0)  # the grid has at most M programs
    dy = tl.load(dy_ptr + pid * N + cols, mask=cmask, other=0.0)
    for row in range(pid, M, step):
        nxt = row + step
        nmask = cmask & (cols * 0 + nxt < M)
        x_next = tl.load(x_ptr + nxt * N + cols, mask=nmask, other=0.0)
        dy_next = tl.load(dy_ptr + nxt * N + cols, mask=nmask, other=0.0)
        xf = x.to(tl.float32)
        dyf = dy.to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if RMS:
            xhat = xf * rstd
        else:
            xhat = tl.where(cmask, (xf - tl.load(mean_ptr + row)) * rstd, 0.0)
        wdy = dyf * g
        if RMS:
            c1 = tl.sum(xhat * wdy, axis=0) / N
            dx = (wdy - xhat * c1) * rstd
        else:
            s1, s2 = tl.reduce((xhat * wdy, wdy), 0, _add_pair)
            dx = (wdy - (xhat * (s1 / N) + s2 / N)) * rstd
            db += dyf
        dw += dyf * xhat
        tl.store(dx_ptr + row * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=cmask)
        x = x_next
        dy = dy_next
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cmask)
    if not RMS:
        tl.store(db_part_ptr + pid * N + cols, db, mask=cmask)


def main():
    import torch
    from te_triton import Config, norm
    from triton.testing import do_bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M, N in [(16384, 4096), (16384, 8192)]:
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 3 + 1
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        for rms in (False, True):
            name = "rmsnorm" if rms else "layernorm"
            _, mean, rstd, _ = norm.norm_fwd(x, w, None if rms else b, 1e-5, rms=rms)
            want = norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=Config(num_warps=16, max_programs=sms * 2))
            gbs = lambda t: 3 * M * N * 2 / t / 1e6  # noqa: E731  x, dy read, dx written (bf16)
            for warps, per_sm in [(16, 2), (8, 4), (16, 1), (8, 2), (4, 8), (32, 1)]:
                cfg = Config(num_warps=warps, max_programs=sms * per_sm)
                t = do_bench(lambda: norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=cfg), warmup=5, rep=30)
                print(f"{name} bwd production w{warps} x{per_sm}/SM {M}x{N}: {gbs(t):.0f} GB/s", flush=True)
                programs = min(sms * per_sm, M)
                dx = torch.empty_like(x)
                dw_part = torch.zeros((programs, N), dtype=torch.float32, device="cuda")
                db_part = torch.zeros((programs, N), dtype=torch.float32, device="cuda")

                def run():
                    norm_bwd_prefetch[(programs,)](dy, x, rstd if mean is None else mean, rstd, w, dx, dw_part,
                                                   db_part, M, N, BLOCK_N=triton.next_power_of_2(N), RMS=rms,
                                                   num_warps=warps)
                    return dx, dw_part.sum(0)

                try:
                    got_dx, got_dw = run()
                    same = torch.equal(got_dx, want[0])
                    dw_off = (got_dw.to(w.dtype).float() - want[1].float()).abs().max().item()
                    t = do_bench(run, warmup=5, rep=30)
                    print(f"{name} bwd PREFETCH w{warps} x{per_sm}/SM {M}x{N}: {gbs(t):.0f} GB/s "
                          f"(dx equal {same}, dw max diff {dw_off:.3g})", flush=True)
                except Exception as exc:  # a variant that does not compile is a finding
                    print(f"{name} bwd PREFETCH w{warps} x{per_sm}/SM {M}x{N}: FAILED {str(exc)[:160]}", flush=True)


if __name__ == "__main__":
    main()
