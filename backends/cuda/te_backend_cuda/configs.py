"""Triton tuning configs for NVIDIA GPUs, one `Tuning` per device, by kernel family.

`for_device(index)` builds a device's Tuning the first time the device runs a kernel and keeps
it: the table of the device's architecture (TUNED, keyed by compute capability (major, minor))
at the device's SM count. Program caps are multiples of the SM count, so every SM gets the
same share of the work whatever the GPU's size. An architecture without a table of its own
takes DEFAULT, sm_90's choices at its own SM count, until someone tunes it. Importing this
module touches no GPU.

The sm_90 table holds the fastest correct config of each family at the layer's shapes
(16384 rows, 4096 to 16384 columns, bf16), found with `benchmarks/bench_kernels.py --sweep`,
which checks each candidate against the reference as it times it. A new architecture's table
is found the same way and added to TUNED.

hw_saturate: the FP8-output kernels leave saturation to the convert instruction, which
saturates from compute capability 8.9 on (ops.checks sends older GPUs to the reference).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, Mapping, Tuple

import torch
from te_triton import Config

# Descriptor (TMA) kernels only for tensors of at least this many elements (2^26, the layer's
# 16384x4096). Building and encoding the descriptors costs host time on every call, which
# the GPU time they save repays only on large tensors: smaller ones, in steps that are more
# likely host-bound, keep the pointer kernels.
TMA_MIN_NUMEL = 1 << 26

# Tensor-wise FP8 GEMMs of at most this many multiply-adds (M * N * K) that write a new output
# run te_triton's GEMM (Tuning.small_gemm) instead of cuBLASLt through torch._scaled_mm. Up to
# 1024^3 both take the same GPU time on an H200, and a small layer's eager FP8 step, bound by
# host time, runs faster with them on te_triton (benchmarks/bench_host.py's tiny layer); from
# 2048^3 on cuBLASLt's kernels are faster on the GPU. 0 keeps every FP8 GEMM on cuBLASLt.
SMALL_GEMM_MAX_MNK = 1 << 30
# ... and whose K is at most this. te_triton's GEMM gives each output tile one program that walks
# all of K, where cuBLASLt can split a long K across the GPU: a narrow layer's weight gradient over
# many tokens (K = tokens, e.g. 256 x 256 x 16384) would leave most SMs idle. The limit keeps
# the path to the K the GPU measurements above cover (up to 1024).
SMALL_GEMM_MAX_K = 1024


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The te_triton Config of each launch role on one device.

    norm_tma maps (RMSNorm, rows longer than 4096) to the norm forward's descriptor config;
    the *_tma configs apply on compute capability 9.0 and up, for tensors of TMA_MIN_NUMEL
    elements or more (ops.launch.tma_or picks them)."""

    quantize: Config
    cast_transpose: Config
    transpose: Config
    blockwise: Config
    blockwise_1d_transpose: Config
    mxfp8: Config
    norm: Config
    norm_layernorm_long_rows: Config
    norm_high_precision: Config
    norm_bwd: Config
    rmsnorm_bwd_long_rows: Config
    norm_tma: Mapping[Tuple[bool, bool], Config]
    norm_bwd_tma: Config
    norm_bwd_tma_long_rows: Config
    elementwise: Config
    activation_fwd: Config
    activation_fwd_gated: Config
    dbias_cast_transpose: Config
    dbias_cast_transpose_tma: Config
    act_bwd_dbias_cast_transpose_tma: Config
    scaling: Config
    softmax: Config
    rope: Config
    loss: Config
    small_gemm: Config
    add_bias: Config


def _sm90_casts(sms: int) -> dict:
    return dict(
        # programs loop over 8192-element blocks, at most 4 per SM (a cap keeps the amax atomics
        # few; one block per program is slower)
        quantize=Config(block=8192, num_warps=8, max_programs=sms * 4, hw_saturate=True),
        # 64x128 tiles with 4 warps (8 warps on this tile are slower)
        cast_transpose=Config(block_m=64, block_n=128, num_warps=4, hw_saturate=True),
        transpose=Config(block_m=64, block_n=128, num_warps=4),  # the cast-transpose's tiles, untuned
        # 128x128 blocks: 8 warps (4 or 16 are slower). 1x128 blocks + transpose: each 128x128
        # tile taken in 64-row then 64-column slices with 4 warps (8 warps, 32-row slices, the
        # whole tile at once, or its column slices transposed in bf16 are slower). Both leave the
        # saturation to the hardware convert (with a transpose, for bf16 input only:
        # te_triton.cast.transpose_clamps): the block scales keep finite values within the FP8
        # max, and a clamp per element costs bandwidth
        blockwise=Config(block_m=64, num_warps=8, hw_saturate=True),
        blockwise_1d_transpose=Config(block_m=64, num_warps=4, hw_saturate=True),
        # MXFP8 (1x32 E8M0 scales), both layouts from one read of a tile: 32x256 tiles with 4
        # warps (64x128 is about as fast; square tiles, 128 rows or 8 warps are slower)
        mxfp8=Config(block_m=32, block_n=256, num_warps=4, hw_saturate=True),
    )


def _sm90_norms(sms: int) -> dict:
    return dict(
        # FP8 out: 4 rows per step keep more loads in flight on short rows than one
        norm=Config(num_warps=8, max_programs=sms * 4, rows=4, hw_saturate=True),
        # LayerNorm with FP8 out on rows longer than 4096: 2 rows per step and gamma/beta
        # reloaded each step (cache hits) leave registers for the row; the amax is kept per
        # 8-element chunk. RMSNorm keeps `norm`, which is faster for it there.
        norm_layernorm_long_rows=Config(num_warps=4, max_programs=sms * 8, rows=2, hoist_params=False,
                                        amax_chunk=8, hw_saturate=True),
        # bf16/fp16 out: one row per step (2 rows are slower)
        norm_high_precision=Config(num_warps=8, max_programs=sms * 4),
        # backward: each program loads the next row while reducing the current one. ops.norm
        # raises the warps on long rows so that a thread holds at most 32 elements of a row:
        # beyond that the kernel spills registers
        norm_bwd=Config(num_warps=8, max_programs=sms * 2),
        rmsnorm_bwd_long_rows=Config(num_warps=32, max_programs=sms),
        # descriptor kernels, software-pipelined tma_stages deep; keyed (RMSNorm, long rows)
        norm_tma={
            (False, False): Config(num_warps=4, max_programs=sms * 4, rows=1, hw_saturate=True, tma_stages=3),
            (True, False): Config(num_warps=16, max_programs=sms * 2, rows=2, hw_saturate=True, tma_stages=3),
            (False, True): Config(num_warps=4, max_programs=sms * 2, rows=1, hw_saturate=True, tma_stages=4),
            (True, True): Config(num_warps=16, max_programs=sms, rows=2, hw_saturate=True, tma_stages=4),
        },
        norm_bwd_tma=Config(num_warps=8, max_programs=sms * 2, tma_stages=3),
        # rows longer than 4096: one program per SM
        norm_bwd_tma_long_rows=Config(num_warps=8, max_programs=sms, tma_stages=3),
    )


def _sm90_elementwise(sms: int) -> dict:
    return dict(
        elementwise=Config(block_m=8, block_n=256, num_warps=4),
        # FP8 out: wider tiles and looping programs (at most 8 per SM) keep the amax atomics few
        activation_fwd=Config(block_m=8, block_n=512, num_warps=8, max_programs=sms * 8, hw_saturate=True),
        # gated: 256-wide tiles with 4 warps, faster there than activation_fwd's
        activation_fwd_gated=Config(block_m=8, block_n=256, num_warps=4, max_programs=sms * 8, hw_saturate=True),
        # a column strip per program, every `groups`-th row tile of it, the next tile loaded
        # before the current one is worked on
        dbias_cast_transpose=Config(block_m=32, block_n=64, num_warps=8, max_programs=sms * 8, hw_saturate=True,
                                    prefetch=True),
        dbias_cast_transpose_tma=Config(block_m=64, block_n=64, num_warps=4, max_programs=sms * 4, hw_saturate=True,
                                        tma_stages=3),
        act_bwd_dbias_cast_transpose_tma=Config(block_m=64, block_n=64, num_warps=4, max_programs=sms * 8,
                                                hw_saturate=True, tma_stages=4),
        scaling=Config(block_m=8, block_n=128, num_warps=4),
        softmax=Config(num_warps=4),
        rope=Config(num_warps=4),
        loss=Config(block=4096, num_warps=8),  # untuned
        small_gemm=Config(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3),
        # a GEMM output's bias where cuBLASLt's epilogue takes none: 16x256 tiles, 4 warps (up to
        # 64-row, 1024-wide tiles and 8 warps run within 1% of it on the layer's outputs)
        add_bias=Config(block_m=16, block_n=256, num_warps=4),
    )


def sm90(sms: int) -> Tuning:
    """Hopper (H100, H200): the tuned table."""
    return Tuning(**_sm90_casts(sms), **_sm90_norms(sms), **_sm90_elementwise(sms))


TUNED: Dict[Tuple[int, int], Callable[[int], Tuning]] = {(9, 0): sm90}
DEFAULT: Callable[[int], Tuning] = sm90


def tuning(capability: Tuple[int, int], sms: int) -> Tuning:
    """The Tuning of a GPU of this compute capability with `sms` SMs."""
    if sms < 1:
        raise ValueError(f"a GPU has at least one SM, got sms={sms}")
    return TUNED.get(tuple(capability), DEFAULT)(sms)


@functools.lru_cache(maxsize=None)
def for_device(index: int) -> Tuning:
    """The Tuning of CUDA device `index`, read from its properties once."""
    props = torch.cuda.get_device_properties(index)
    return tuning((props.major, props.minor), props.multi_processor_count)


def for_tensor(x: torch.Tensor) -> Tuning:
    """The Tuning of the CUDA device x is on."""
    return for_device(x.get_device())
