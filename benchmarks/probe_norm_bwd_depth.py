"""Probe: is the norm backward latency-bound? Variants of te_triton's kernel with more loads in
flight, against it (production config and a sweep), LayerNorm and RMSNorm, 4096 and 8192 wide.

In session 11's probe_norm_bwd_add.py the LayerNorm backward at 16384x8192 with a fourth tensor
read (16 warps, 1 program per SM) took 285 us, about what the plain kernel takes for three:
more bytes in flight cost nothing, so the plain kernel waits on latency. Variants:
- DEPTH2: each step loads the row two ahead (te_triton's kernel loads the next one);
- PAIR: each step takes two rows as one (2, N) tile, reducing both in one round of barriers,
  and loads the next pair before reducing.

    python benchmarks/probe_norm_bwd_depth.py       # on the GPU
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add_pair(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _row_grads(x, dy, g, mean, rstd, N, RMS: tl.constexpr, AXIS: tl.constexpr):
    """dx and xhat for rows x / dy (1-D, or 2-D with the rows along axis 0 and AXIS=1)."""
    if RMS:
        xhat = x * rstd
        wdy = dy * g
        c1 = tl.sum(xhat * wdy, axis=AXIS) / N
        if AXIS == 1:
            c1 = c1[:, None]
        return (wdy - xhat * c1) * rstd, xhat
    xhat = (x - mean) * rstd
    wdy = dy * g
    s1, s2 = tl.reduce((xhat * wdy, wdy), AXIS, _add_pair)
    if AXIS == 1:
        s1 = s1[:, None]
        s2 = s2[:, None]
    return (wdy - (xhat * (s1 / N) + s2 / N)) * rstd, xhat


@triton.jit
def _depth2_kernel(dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, dx_ptr, dw_part_ptr, db_part_ptr, M, N,
                   BLOCK_N: tl.constexpr, RMS: tl.constexpr):
    """Rows as te_triton's kernel (N a power of two here: no column masks)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    g = tl.load(w_ptr + cols).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    ok1 = cols * 0 + pid + step < M
    x1 = tl.load(x_ptr + pid * N + cols)
    dy1 = tl.load(dy_ptr + pid * N + cols)
    x2 = tl.load(x_ptr + (pid + step) * N + cols, mask=ok1, other=0.0)
    dy2 = tl.load(dy_ptr + (pid + step) * N + cols, mask=ok1, other=0.0)
    for row in range(pid, M, step):
        x = x1.to(tl.float32)
        dy = dy1.to(tl.float32)
        x1, dy1 = x2, dy2
        ahead = row + 2 * step
        amask = cols * 0 + ahead < M
        x2 = tl.load(x_ptr + ahead * N + cols, mask=amask, other=0.0)
        dy2 = tl.load(dy_ptr + ahead * N + cols, mask=amask, other=0.0)
        rstd = tl.load(rstd_ptr + row)
        mean = 0.0 if RMS else tl.load(mean_ptr + row)
        dx, xhat = _row_grads(x, dy, g, mean, rstd, N, RMS, 0)
        dw += dy * xhat
        if not RMS:
            db += dy
        tl.store(dx_ptr + row * N + cols, dx.to(dx_ptr.dtype.element_ty))
    tl.store(dw_part_ptr + pid * N + cols, dw)
    if not RMS:
        tl.store(db_part_ptr + pid * N + cols, db)


@triton.jit
def _pair_load(x_ptr, dy_ptr, rows, cols, M, N):
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    off = rows[:, None] * N + cols[None, :]
    return tl.load(x_ptr + off, mask=mask, other=0.0), tl.load(dy_ptr + off, mask=mask, other=0.0)


@triton.jit
def _pair_kernel(dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, dx_ptr, dw_part_ptr, db_part_ptr, M, N,
                 BLOCK_N: tl.constexpr, RMS: tl.constexpr):
    """Rows pid + k * programs as te_triton's kernel, two of them (k, k + 1) per step."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    pair = tl.arange(0, 2) * step
    g = tl.load(w_ptr + cols).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_next, dy_next = _pair_load(x_ptr, dy_ptr, pid + pair, cols, M, N)
    for first in range(pid, M, 2 * step):
        rows = first + pair
        rmask = rows < M
        x = x_next.to(tl.float32)
        dy = dy_next.to(tl.float32)
        x_next, dy_next = _pair_load(x_ptr, dy_ptr, rows + 2 * step, cols, M, N)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)[:, None]
        if RMS:
            mean = 0.0
        else:
            mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)[:, None]
        dx, xhat = _row_grads(x, dy, g[None, :], mean, rstd, N, RMS, 1)
        dw += tl.sum(dy * xhat, axis=0)
        if not RMS:
            db += tl.sum(dy, axis=0)
        off = rows[:, None] * N + cols[None, :]
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=rmask[:, None] & (cols[None, :] < N))
    tl.store(dw_part_ptr + pid * N + cols, dw)
    if not RMS:
        tl.store(db_part_ptr + pid * N + cols, db)


def main():
    import torch
    from _norm_bwd import norm_bwd_cases
    from te_triton import Config, norm
    from triton.testing import do_bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, M, N, rms, x, dy, w, mean, rstd, chosen in norm_bwd_cases():
        want = norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=chosen)
        gbs = lambda t: 6 * M * N / t / 1e6  # noqa: E731  x and dy read, dx written (bf16)
        t = do_bench(lambda: norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=chosen), warmup=5, rep=40)
        print(f"{name} {M}x{N} te_triton w{chosen.num_warps} x{chosen.max_programs // sms}/SM: "
              f"{gbs(t):.0f} GB/s", flush=True)
        for warps, per_sm in [(8, 2), (16, 1), (16, 2), (32, 1)]:
            cfg = Config(num_warps=warps, max_programs=sms * per_sm)
            t = do_bench(lambda: norm.norm_bwd(dy, x, mean, rstd, w, rms=rms, cfg=cfg), warmup=5, rep=40)
            print(f"{name} {M}x{N} te_triton w{warps} x{per_sm}/SM: {gbs(t):.0f} GB/s", flush=True)
            for label, kernel in (("DEPTH2", _depth2_kernel), ("PAIR", _pair_kernel)):
                programs = min(M, sms * per_sm)
                dx = torch.empty_like(x)
                dwp = torch.empty((programs, N), device="cuda", dtype=torch.float32)
                dbp = torch.empty_like(dwp)

                def run():
                    kernel[(programs,)](dy, x, rstd if rms else mean, rstd, w, dx, dwp, dbp, M, N, BLOCK_N=N,
                                        RMS=rms, num_warps=warps)

                try:
                    run()
                    err = (dx.float() - want[0].float()).abs().max().item()
                    dw_err = (dwp.sum(0).to(w.dtype).float() - want[1].float()).abs().max().item()
                    t = do_bench(run, warmup=5, rep=40)
                    print(f"{name} {M}x{N} {label} w{warps} x{per_sm}/SM: {gbs(t):.0f} GB/s "
                          f"(max |dx - te_triton| {err:.3g}, |dw - te_triton| {dw_err:.3g})", flush=True)
                except Exception as exc:  # a variant that does not compile is a result too
                    print(f"{name} {M}x{N} {label} w{warps}: failed {type(exc).__name__}: {str(exc)[:120]}")


if __name__ == "__main__":
    main()
