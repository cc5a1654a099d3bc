"""Probe: Config.prefetch (a program loads its next block / row tile before working on the
current one) in the kernels that loop: quantize with amax at 16384x8192, and the dbias
cast-transposes (plain, and fused with the gelu backward) at the TransformerLayer's gradient
shapes, per configuration, with and without. Outputs are checked against the production
configuration's (FP8 bytes and amax equal; dbias within float32 summation order).

    python benchmarks/probe_prefetch.py [ct]     # on the GPU (ct: the cast-transpose sweep only)
"""
from __future__ import annotations

import itertools


def cast_transpose(sms):
    """cast_transpose_fp8 at 16384x8192 bf16: one tile per program (production) against programs
    looping over tiles, with and without prefetch."""
    import torch
    from te_backend_cuda import configs
    from te_triton import Config, cast
    from triton.testing import do_bench

    e4m3 = torch.float8_e4m3fn
    scale = torch.full((1,), 8.0, device="cuda")
    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16) * 3
    want = cast.cast_transpose_fp8(x, scale, e4m3, configs.CAST_TRANSPOSE)
    runs = [(64, 128, 4, 0, False)] + [(bm, bn, w, per_sm, pf) for bm, bn, w, per_sm in
                                       [(64, 128, 4, 8), (64, 128, 4, 4), (32, 128, 4, 16), (64, 64, 4, 16),
                                        (128, 128, 8, 2), (64, 128, 8, 4)] for pf in (False, True)]
    for bm, bn, w, per_sm, pf in runs:
        cfg = Config(block_m=bm, block_n=bn, num_warps=w, max_programs=sms * per_sm, hw_saturate=True, prefetch=pf)
        got = cast.cast_transpose_fp8(x, scale, e4m3, cfg)
        ok = all(torch.equal(got[i].view(torch.uint8), want[i].view(torch.uint8)) for i in (0, 1))
        ok = ok and torch.equal(got[2], want[2])
        t = do_bench(lambda: cast.cast_transpose_fp8(x, scale, e4m3, cfg), warmup=5, rep=40)
        print(f"cast_transpose 16384x8192 {bm}x{bn} w{w} x{per_sm}/SM prefetch={int(pf)}: "
              f"{4 * x.numel() / t / 1e6:.0f} GB/s ({'ok' if ok else 'WRONG'})", flush=True)


def main():
    import sys

    import torch
    if sys.argv[1:] == ["ct"]:
        return cast_transpose(torch.cuda.get_device_properties(0).multi_processor_count)
    from te_backend_cuda import configs
    from te_triton import Config, activation, cast
    from triton.testing import do_bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    e4m3 = torch.float8_e4m3fn
    scale = torch.full((1,), 8.0, device="cuda")
    x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16) * 3
    want, want_amax = cast.quantize_fp8(x, scale, e4m3, configs.QUANTIZE)
    blocks = [(8192, 8, 4), (8192, 8, 2), (8192, 8, 8), (4096, 8, 4), (4096, 8, 8), (4096, 4, 8), (2048, 4, 8),
              (16384, 16, 2)]  # block, warps, programs per SM
    for (block, warps, per_sm), prefetch in itertools.product(blocks, (False, True)):
        cfg = Config(block=block, num_warps=warps, max_programs=sms * per_sm, hw_saturate=True, prefetch=prefetch)
        y, amax = cast.quantize_fp8(x, scale, e4m3, cfg)
        ok = torch.equal(y.view(torch.uint8), want.view(torch.uint8)) and torch.equal(amax, want_amax)
        t = do_bench(lambda: cast.quantize_fp8(x, scale, e4m3, cfg), warmup=5, rep=40)
        print(f"quantize 16384x8192 block{block} w{warps} x{per_sm}/SM prefetch={int(prefetch)}: "
              f"{3 * x.numel() / t / 1e6:.0f} GB/s ({'ok' if ok else 'WRONG'})", flush=True)
    tiles = [(32, 64, 4, 16), (32, 64, 4, 8), (64, 64, 4, 8), (32, 128, 4, 8), (64, 64, 8, 8), (32, 64, 8, 8),
             (64, 128, 8, 4), (16, 64, 4, 16)]  # block_m, block_n, warps, programs per SM
    cases = [("dbias_ct", 16384, 4096), ("dbias_ct", 16384, 12288), ("gelu_bwd_dbias_ct", 16384, 16384)]
    for kind, M, N in cases:
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if kind != "dbias_ct" else None
        bytes_per = 4 if x is None else 6

        def call(cfg):
            if x is None:
                return activation.dbias_cast_transpose(dy, scale, e4m3, cfg)
            return activation.activation_bwd_dbias_cast_transpose(dy, x, "gelu", scale, e4m3, cfg)

        want = call(configs.DBIAS_CAST_TRANSPOSE)
        for (bm, bn, warps, per_sm), prefetch in itertools.product(tiles, (False, True)):
            cfg = Config(block_m=bm, block_n=bn, num_warps=warps, max_programs=sms * per_sm, hw_saturate=True,
                         prefetch=prefetch)
            label = f"{kind} {M}x{N} {bm}x{bn} w{warps} x{per_sm}/SM prefetch={int(prefetch)}"
            try:
                got = call(cfg)
                same = torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(
                    got[1].view(torch.uint8), want[1].view(torch.uint8))
                db = (got[2].float() - want[2].float()).abs().max().item() / want[2].float().abs().max().item()
                t = do_bench(lambda: call(cfg), warmup=5, rep=30)
                print(f"{label}: {bytes_per * M * N / t / 1e6:.0f} GB/s (fp8 equal {same}, dbias rel diff {db:.1e})",
                      flush=True)
            except Exception as exc:  # a variant that does not compile is a finding
                print(f"{label}: FAILED {str(exc)[:160]}", flush=True)


if __name__ == "__main__":
    main()
