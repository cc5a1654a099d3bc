"""Triton tuning configs for NVIDIA GPUs, by kernel family.

Chosen on an H200 (132 SMs) by `benchmarks/bench_kernels.py --sweep` at 16384x8192 bf16, each
config checked against the reference in the same run (benchmarks/results/kernels-2026-11-30.json).
Program caps are multiples of the SM count; other GPUs use these until measured.
hw_saturate: the FP8-output kernels leave saturation to the convert instruction (fused.py
sends GPUs without it, below compute capability 8.9, to the reference).
"""
from __future__ import annotations

from te_triton import Config

SMS = 132  # H200

QUANTIZE = Config(block=8192, num_warps=8, max_programs=SMS * 4, hw_saturate=True)  # 3749 GB/s (one block per program: 3220)
# a column strip per program, every `groups`-th row tile of it, the next tile loaded before the
# current one is worked on (probe-prefetch-2026-11-30-session10.log, at the layer's gradients):
# dbias + cast-transpose 2621 GB/s at 16384x4096 and 2944 at 16384x12288, gelu bwd + dbias +
# cast-transpose 3180 at 16384x16384; the previous config (32x64, 4 warps, x16/SM, no prefetch)
# 2015 / 2939 / 2871 in the same run
DBIAS_CAST_TRANSPOSE = Config(block_m=32, block_n=64, num_warps=8, max_programs=SMS * 8, hw_saturate=True,
                              prefetch=True)
CAST_TRANSPOSE = Config(block_m=64, block_n=128, num_warps=4, hw_saturate=True)  # 3525 GB/s (64x128 with 8 warps: 2177)
TRANSPOSE = Config(block_m=64, block_n=128, num_warps=4)  # FP8 byte transpose: not measured yet
NORM = Config(num_warps=8, max_programs=SMS * 4, rows=4, hw_saturate=True)  # LayerNorm fwd + FP8 out 16384x4096: 2508 GB/s (1 row: 1754)
# LayerNorm + FP8 out on rows longer than 4096 (16384x8192, probe-norm-fwd-2026-11-30-session9.log):
# 2852 GB/s, against 2115 with NORM (RMSNorm keeps NORM there: 3484 against 3385)
NORM_LAYERNORM_LONG_ROWS = Config(num_warps=4, max_programs=SMS * 8, rows=2, hoist_params=False, amax_chunk=8,
                                  hw_saturate=True)
# bf16/fp16 output: one row per step (16384x8192: 3209 GB/s against 2725 with 2 rows)
NORM_HIGH_PRECISION = Config(num_warps=8, max_programs=SMS * 4)
# norm backward (probe-norm-bwd-2026-11-30-session10.log, the kernel that loads the next row
# early): 16384x4096 LayerNorm 3390 / RMSNorm 3547 GB/s (16 warps x2/SM: 2408 / 3395), 16384x8192
# LayerNorm 3013. RMSNorm on rows longer than 4096: 3909 at 16384x8192 (NORM_BWD: 3524).
# fused.py raises the warps on longer rows: at 64 elements per thread the kernel spilled (253 GB/s).
NORM_BWD = Config(num_warps=8, max_programs=SMS * 2)
RMSNORM_BWD_LONG_ROWS = Config(num_warps=32, max_programs=SMS)
# Kernels whose rows / tiles arrive through TMA descriptors, software-pipelined tma_stages deep
# (compute capability 9.0 and up; fused.py picks them there for tensors of TMA_MIN_NUMEL
# elements or more).
# Building and encoding the descriptors costs host time on every call: on a slow host of the
# H200 machine a 16384x8192 LayerNorm forward took 39 us more host per call than the pointer
# kernel (132 / 186 against 93 / 147 us in two processes), for about 100 us of GPU time
# (benchmarks/descriptor_host_cost.py, descriptor-host-cost-2026-11-30-session12.txt). The GPU
# time saved is 13 us at 16384x4096 and 30 us at 16384x8192 (LayerNorm forward, below): a gain
# where the GPU is the bottleneck (the layer), a loss where the host is. The threshold keeps
# the descriptors to tensors of the layer's size (2^26 elements, 16384x4096) and up; smaller
# ones, in steps more likely host-bound, keep the pointer kernels.
TMA_MIN_NUMEL = 1 << 26
# GB/s from benchmarks/probe_tma.py at 16384 rows, against the pointer kernels' configs above in
# the same run (probe-tma-2026-11-30-session12-b.log):
NORM_TMA = {  # (RMSNorm, rows longer than 4096) -> norm forward with FP8 out; *: from a wider LayerNorm sweep
    # (probe_tma.py layernorm_fwd_wide, probe-tma-2026-11-30-session12-c.log)
    (False, False): Config(num_warps=4, max_programs=SMS * 4, rows=1, hw_saturate=True, tma_stages=3),  # 3356 / 2773 *
    (True, False): Config(num_warps=16, max_programs=SMS * 2, rows=2, hw_saturate=True, tma_stages=3),  # 3342 / 2363
    (False, True): Config(num_warps=4, max_programs=SMS * 2, rows=1, hw_saturate=True, tma_stages=4),  # 3698 / 2907 *
    (True, True): Config(num_warps=16, max_programs=SMS, rows=2, hw_saturate=True, tma_stages=4),  # 3744 / 3559
}
# norm backward: LayerNorm / RMSNorm 3549 / 3566 at 4096 wide (pointer: 3100 / 3466); on longer
# rows one program per SM, 3801 / 3934 at 8192 wide (probe-tma-2026-11-30-session12.log; pointer
# 2927 / 3848)
NORM_BWD_TMA = Config(num_warps=8, max_programs=SMS * 2, tma_stages=3)
NORM_BWD_TMA_LONG_ROWS = Config(num_warps=8, max_programs=SMS, tma_stages=3)
# dbias + cast-transpose: 3061 at 16384x4096 and 3355 at 16384x12288 (pointer: 1526 / 2947);
# after the gelu backward, 3428 at 16384x16384 (pointer: 3185)
DBIAS_CAST_TRANSPOSE_TMA = Config(block_m=64, block_n=64, num_warps=4, max_programs=SMS * 4, hw_saturate=True,
                                  tma_stages=3)
ACT_BWD_DBIAS_CAST_TRANSPOSE_TMA = Config(block_m=64, block_n=64, num_warps=4, max_programs=SMS * 8,
                                          hw_saturate=True, tma_stages=4)
ELEMENTWISE = Config(block_m=8, block_n=256, num_warps=4)  # gelu bwd: 4179 GB/s
# gelu fwd + FP8 out at 16384x16384: 2434 GB/s (this config's previous one, ELEMENTWISE: 2225)
ACTIVATION_FWD = Config(block_m=8, block_n=512, num_warps=8, max_programs=SMS * 8, hw_saturate=True)
# swiglu fwd + FP8 out, 16384x(2x8192) (probe-gated-2026-11-30-session9.log): 3866 GB/s, against
# 3294 with ACTIVATION_FWD's tiles
ACTIVATION_FWD_GATED = Config(block_m=8, block_n=256, num_warps=4, max_programs=SMS * 8, hw_saturate=True)
SCALING = Config(block_m=8, block_n=128, num_warps=4)
SOFTMAX = Config(num_warps=4)
ROPE = Config(num_warps=4)
# 16384x8192 bf16 (probe-blockwise-2026-11-30.log): 128x128 blocks + transpose 3339 GB/s with 8 warps
# (4: 1976, 16: 1981). 1x128 blocks + transpose, two scale sets per 128x128 tile taken in 64-row
# then 64-column slices (probe-blockwise-slices-2026-11-30-session10.log): 2243 GB/s with 4 warps
# (8: 1809; 32-row slices: 1872; the whole tile at once, before: 1730)
BLOCKWISE = Config(block_m=64, num_warps=8)
BLOCKWISE_1D_TRANSPOSE = Config(block_m=64, num_warps=4)
LOSS = Config(block=4096, num_warps=8)  # not measured yet
