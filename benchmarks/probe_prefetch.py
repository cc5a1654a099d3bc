"""Probe: Config.prefetch (a program loads its next row tile before working on the current
one) in the dbias cast-transposes (plain, and fused with the gelu backward) at the
TransformerLayer's gradient shapes, per configuration, with and without. Outputs are checked
against the production configuration's (FP8 bytes equal; dbias within float32 summation order).
The same option in quantize and cast-transpose (session 10, probe-prefetch*-session10.log)
was no faster and was removed.

    python benchmarks/probe_prefetch.py      # on the GPU
"""
from __future__ import annotations

import itertools


def main():
    import torch
    from te_backend_cuda import configs
    from te_triton import Config, activation
    from triton.testing import do_bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    e4m3 = torch.float8_e4m3fn
    scale = torch.full((1,), 8.0, device="cuda")
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
