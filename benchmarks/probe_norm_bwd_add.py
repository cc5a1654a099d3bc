"""Probe: the norm backward with a residual gradient added (norm_bwd_add), by where the added
row is loaded, against the plain backward and the backward plus a separate add.

In the layer's first profile with the fused add (session 11) the two norm backwards took 0.47 ms
per step against 0.22 without the add, for 1/3 more bytes. Variants (ADD_AT):
0, te_triton's kernel of the time: the current row's `add` loaded before the reductions;
1, loaded after them, just before the store; 2, loaded for the next row with x and dy.

    python benchmarks/probe_norm_bwd_add.py       # on the GPU
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _variant_kernel(dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, dx_ptr, dw_part_ptr, db_part_ptr, add_ptr, M, N,
                    BLOCK_N: tl.constexpr, RMS: tl.constexpr, ADD_AT: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_next = tl.load(x_ptr + pid * N + cols, mask=cmask, other=0.0)
    dy_next = tl.load(dy_ptr + pid * N + cols, mask=cmask, other=0.0)
    if ADD_AT == 2:
        a_next = tl.load(add_ptr + pid * N + cols, mask=cmask, other=0.0)
    for row in range(pid, M, step):
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        if ADD_AT == 2:
            extra = a_next.to(tl.float32)
        following = row + step
        fmask = cmask & (cols * 0 + following < M)
        x_next = tl.load(x_ptr + following * N + cols, mask=fmask, other=0.0)
        dy_next = tl.load(dy_ptr + following * N + cols, mask=fmask, other=0.0)
        if ADD_AT == 2:
            a_next = tl.load(add_ptr + following * N + cols, mask=fmask, other=0.0)
        if ADD_AT == 0:
            extra = tl.load(add_ptr + row * N + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        if RMS:
            xhat = x * rstd
            wdy = dy * g
            c1 = tl.sum(xhat * wdy, axis=0) / N
            dx = (wdy - xhat * c1) * rstd
        else:
            xhat = tl.where(cmask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
            wdy = dy * g
            s1, s2 = tl.reduce((xhat * wdy, wdy), 0, _add_pair)
            dx = (wdy - (xhat * (s1 / N) + s2 / N)) * rstd
            db += dy
        dw += dy * xhat
        if ADD_AT == 1:
            extra = tl.load(add_ptr + row * N + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * N + cols, (dx + extra).to(dx_ptr.dtype.element_ty), mask=cmask)
    tl.store(dw_part_ptr + pid * N + cols, dw, mask=cmask)
    if not RMS:
        tl.store(db_part_ptr + pid * N + cols, db, mask=cmask)


@triton.jit
def _add_pair(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


def main():
    import torch
    from _norm_bwd import norm_bwd_cases
    from te_triton import norm
    from triton.testing import do_bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, M, N, rms, x, dy, w, mean, rstd, cfg in norm_bwd_cases():
        add = torch.randn_like(dy)
        want = norm.norm_bwd_add(dy, x, mean, rstd, w, add, rms=rms, cfg=cfg)
        gb = lambda t, tensors: tensors * 2 * M * N / t / 1e6  # noqa: E731  bf16 rows read + written
        t = do_bench(lambda: norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=cfg), warmup=5, rep=40)
        print(f"{name} {M}x{N} plain bwd: {t * 1e3:.0f} us ({gb(t, 3):.0f} GB/s)", flush=True)
        t = do_bench(lambda: norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=cfg)[0].add_(add), warmup=5, rep=40)
        print(f"{name} {M}x{N} bwd then add_: {t * 1e3:.0f} us", flush=True)
        t = do_bench(lambda: norm.norm_bwd_add(dy, x, mean, rstd, w, add, rms=rms, cfg=cfg), warmup=5, rep=40)
        print(f"{name} {M}x{N} te_triton norm_bwd_add: {t * 1e3:.0f} us ({gb(t, 4):.0f} GB/s)", flush=True)
        for at in (0, 1, 2):
            for warps, per_sm in [(cfg.num_warps, cfg.max_programs // sms), (16, 1), (16, 2), (4, 4)]:
                programs = min(M, sms * per_sm)
                dx = torch.empty_like(x)
                dw = torch.empty((programs, N), device="cuda", dtype=torch.float32)
                db = torch.empty_like(dw)

                def run():
                    _variant_kernel[(programs,)](dy, x, rstd if rms else mean, rstd, w, dx, dw, db, add, M, N,
                                                 BLOCK_N=triton.next_power_of_2(N), RMS=rms, ADD_AT=at,
                                                 num_warps=warps)

                run()
                same = torch.equal(dx, want[0])
                t = do_bench(run, warmup=5, rep=40)
                print(f"{name} {M}x{N} ADD_AT={at} w{warps} x{per_sm}/SM: {t * 1e3:.0f} us ({gb(t, 4):.0f} GB/s)"
                      f" dx equal {same}", flush=True)


if __name__ == "__main__":
    main()
