"""FP8 GEMMs through torch._scaled_mm (cuBLASLt): a @ b.T with per-mode scale layouts.

torch._scaled_mm wants the second operand column-major, so b (N, K) row-major is passed as
b.t(). Its scales multiply back (they are our scale_inv). Scale layouts it expects (torch
2.8+, cuBLAS 12.9+, sm_90): 1x128 scales "outer-dim-major" ((M, K/128) with stride (1, M));
128x128 scales of b as a (K/128, N/128) view whose memory is K-major.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from te_core.backend.types import BLOCK_1x128_1x128, BLOCK_1x128_128x128, MXFP8, ROWWISE, TENSORWISE, as_dtype
from te_triton import gemm as triton_gemm

from . import configs

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _small(a, b, scaling, out, bias) -> bool:
    """Whether te_triton's GEMM takes this call instead of cuBLASLt (configs.SMALL_GEMM_MAX_MNK and
    SMALL_GEMM_MAX_K; the limit first, so that with the path off every FP8 GEMM pays one comparison)."""
    limit = configs.SMALL_GEMM_MAX_MNK
    if limit <= 0 or scaling != TENSORWISE or out is not None:
        return False
    k = a.shape[1]
    return (k <= configs.SMALL_GEMM_MAX_K and a.shape[0] * b.shape[0] * k <= limit
            and (bias is None or bias.is_contiguous()))


def _aligned_scalar(scale):
    """A one-element float32 scale at a 16-byte aligned address: cuBLASLt can answer
    CUBLAS_STATUS_NOT_SUPPORTED for a scale sliced out of a module's scale vector at an
    unaligned offset. Its shape stays as given: torch._scaled_mm takes any one-element float32
    tensor as a tensor-wise scale, and a reshape would be one more torch call per GEMM."""
    if scale.dtype != torch.float32:
        scale = scale.float()
    return scale.clone() if scale.data_ptr() % 16 else scale


def _scale_args(a, b, a_si, b_si, scaling: str):
    M, N = a.shape[0], b.shape[0]
    if scaling == TENSORWISE:
        if a_si.numel() != 1 or b_si.numel() != 1:  # else torch._scaled_mm could read them as row-wise
            raise ValueError(f"tensor-wise scaling takes one-element scale_inv tensors, got shapes "
                             f"{tuple(a_si.shape)} and {tuple(b_si.shape)}")
        if a_si.dtype == b_si.dtype == torch.float32 and not (a_si.data_ptr() % 16 or b_si.data_ptr() % 16):
            return a_si, b_si  # _aligned_scalar's answer for both, without its calls (every FP8 GEMM)
        return _aligned_scalar(a_si), _aligned_scalar(b_si)
    if scaling == ROWWISE:
        return a_si.reshape(M, 1).float().contiguous(), b_si.reshape(1, N).float().contiguous()
    if scaling not in (BLOCK_1x128_128x128, BLOCK_1x128_1x128):
        raise ValueError(f"scaling {scaling!r} is not run by torch._scaled_mm here")
    sa = a_si if _outer_major(a_si) else a_si.float().t().contiguous().t()
    if scaling == BLOCK_1x128_128x128:
        return sa, b_si.float().contiguous().t()
    return sa, (b_si.t() if _outer_major(b_si) else b_si.float().t().contiguous())


def _outer_major(scales) -> bool:
    """Whether a (rows, K/128) float32 grid of 1x128 scales is laid out column by column, as
    cuBLASLt reads it: then it goes to torch._scaled_mm as it is, where a row-major grid costs a
    transposing copy per GEMM. quantize_blockwise lays them out so (te_core.ops)."""
    if scales.dtype != torch.float32:
        return False
    row_step, col_step = scales.stride()
    return row_step == 1 and (col_step == scales.shape[0] or scales.shape[1] == 1)


def block_scale_shapes(a, b, scaling: str):
    """The (a, b) scale_inv shapes a block-scaled GEMM of a (M, K) and b (N, K) reads: 1x128
    runs of a's rows; of b's rows too, or b's 128x128 tiles."""
    (M, K), N = a.shape, b.shape[0]
    kb = -(-K // 128)
    return (M, kb), ((-(-N // 128), kb) if scaling == BLOCK_1x128_128x128 else (N, kb))


def _add_bias(result, bias):
    """The bias for outputs not given to cuBLASLt's epilogue (_epilogue_bias: float32 output, a
    bias of another dtype, row-wise scales). A bf16/fp16 output of the bias's dtype takes it
    through te_triton's add_bias_: the same bytes as torch's add_, whose row-broadcast add runs
    its strided elementwise kernel at well under half the bandwidth (on an H200, 1.4-1.5 TB/s
    against 3.6-3.9 TB/s on a layer's GEMM outputs)."""
    if bias.dtype == result.dtype:
        if result.is_cuda and triton_gemm.add_bias_reason(result, bias) is None:
            return triton_gemm.add_bias_(result, bias, configs.for_tensor(result).add_bias)
        return result.add_(bias)
    return as_dtype(result.float() + bias.float(), result.dtype)


# The scalings whose GEMMs take the bias in cuBLASLt's epilogue: tensor-wise, and both block
# layouts (checked on the GPU against the float32 reference over shapes on and off the 128
# tiles). Row-wise scales keep the separate add: their epilogue bias is untested.
EPILOGUE_BIAS_SCALINGS = (TENSORWISE, BLOCK_1x128_128x128, BLOCK_1x128_1x128)


def _epilogue_bias(bias, out_dtype, scaling) -> bool:
    """cuBLASLt adds a bias of the output's dtype (bf16/fp16) in the GEMM's epilogue, in float32
    before the output is rounded: that saves a separate add, which reads and writes the whole
    output once more, and rounds the output once instead of twice."""
    return (bias is not None and bias.dtype == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
            and scaling in EPILOGUE_BIAS_SCALINGS)


def gemm_fp8(a, b, a_scale_inv, b_scale_inv, *, out_dtype, scaling=TENSORWISE, bias=None, out=None,
             accumulate=False, fast_accumulation=False):
    """te_core.ops.gemm_fp8 on cuBLASLt. fast_accumulation applies to tensor-wise and row-wise
    scales (block scales always accumulate in float32 here, as Transformer Engine's block
    recipe does). Fast accumulation shortens the FP8 GEMMs; the recipe decides whether to ask
    for it (Transformer Engine asks for it in the forward GEMMs). Small tensor-wise GEMMs can
    run te_triton's kernel instead (configs.SMALL_GEMM_MAX_MNK)."""
    if _small(a, b, scaling, out, bias):
        return triton_gemm.gemm_fp8(a, b, a_scale_inv, b_scale_inv, out_dtype=out_dtype, bias=bias,
                                    fast_accumulation=fast_accumulation, cfg=configs.for_tensor(a).small_gemm)
    sa, sb = _scale_args(a, b, a_scale_inv, b_scale_inv, scaling)
    kwargs = dict(out_dtype=out_dtype, use_fast_accum=bool(fast_accumulation) and scaling in (TENSORWISE, ROWWISE))
    if _epilogue_bias(bias, out_dtype, scaling):
        kwargs["bias"], bias = bias, None
    direct = out is not None and not accumulate and out.dtype == out_dtype and out.is_contiguous() and bias is None
    if direct:
        result = torch._scaled_mm(a, b.t(), sa, sb, out=out, **kwargs)
    else:
        result = torch._scaled_mm(a, b.t(), sa, sb, **kwargs)
    if bias is not None:
        result = _add_bias(result, bias)
    if out is None or direct:
        return out if direct else result
    if accumulate:
        return out.add_(result)
    return out.copy_(result)


def supports_gemm_fp8(a, b, a_scale_inv, b_scale_inv, *, out_dtype, scaling=TENSORWISE, bias=None, out=None,
                      accumulate=False, fast_accumulation=False) -> Tuple[bool, str]:
    if not (a.is_cuda and b.is_cuda):
        return False, "operands are not on a CUDA device"
    why = fp8_gemm_decline_reason(a, b, out_dtype, scaling)
    return (why is None), (why or "")


def fp8_gemm_decline_reason(a, b, out_dtype, scaling) -> Optional[str]:
    """Why cuBLASLt (through torch._scaled_mm) cannot take this call, or None."""
    why = fp8_gemm_layout_reason(a, b, out_dtype, scaling)
    if why is None and (a.data_ptr() % 16 or b.data_ptr() % 16):
        return "operands must be 16-byte aligned"
    return why


def fp8_gemm_layout_reason(a, b, out_dtype, scaling) -> Optional[str]:
    """fp8_gemm_decline_reason's rules that shapes, dtypes and strides decide: what a torch.compile
    trace can check (it has no addresses; the compiler allocates 16-byte aligned buffers)."""
    if a.dim() != 2 or b.dim() != 2:
        return "operands must be 2-D"
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        return f"operands must be FP8, got {a.dtype} and {b.dtype}"
    if a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2:
        return "cuBLASLt has no E5M2 x E5M2 GEMM"
    (M, K), N = a.shape, b.shape[0]
    if M % 16 or N % 16 or K % 16:
        return f"cuBLASLt FP8 needs M, N, K multiples of 16, got M={M} N={N} K={K}"
    if not (a.is_contiguous() and b.is_contiguous()):
        return "operands must be contiguous row-major"
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"out_dtype {out_dtype} is not produced by cuBLASLt FP8 GEMMs here"
    if scaling == MXFP8:
        return "mxfp8 GEMM needs swizzled E8M0 scales; not implemented in te-backend-cuda yet"
    if scaling in (BLOCK_1x128_128x128, BLOCK_1x128_1x128):
        if K % 128:
            return f"block-scaled cuBLASLt GEMMs need K a multiple of 128, got {K}"
        if scaling == BLOCK_1x128_128x128 and (K // 128) % 4:
            return f"128x128 block scales need K/128 a multiple of 4 (cuBLASLt pads them), got K={K}"
    return None


def _expand(scale, rows, cols, mode, is_b):
    if mode == TENSORWISE:
        return scale.reshape(()).float()
    if mode == ROWWISE:
        return scale.reshape(rows, 1).float()
    s = scale.float()
    if mode == BLOCK_1x128_128x128 and is_b:
        s = s.repeat_interleave(128, 0)[:rows]
    return s.repeat_interleave(128, 1)[:, :cols]


def emulate(a, b, a_scale_inv, b_scale_inv, scaling: str) -> torch.Tensor:
    """float32 dequant(a) @ dequant(b).T: the math gemm_fp8 must match (the capability probes
    compare against it)."""
    (M, K), N = a.shape, b.shape[0]
    da = a.float() * _expand(a_scale_inv, M, K, scaling, False)
    db = b.float() * _expand(b_scale_inv, N, K, scaling, True)
    return da @ db.t()


def _mm_out_dtype(a, b_t, out_dtype: torch.dtype) -> torch.Tensor:
    if out_dtype == a.dtype:
        return torch.mm(a, b_t)
    if out_dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        try:  # torch >= 2.8: fp32 output straight from the bf16/fp16 GEMM
            return torch.mm(a, b_t, out_dtype=torch.float32)
        except (TypeError, NotImplementedError, RuntimeError):  # older torch, or a device without it
            pass
    return as_dtype(torch.mm(a.float(), b_t.float()), out_dtype)


def gemm(a, b, *, bias: Optional[torch.Tensor] = None, out=None, accumulate=False, out_dtype=None):
    """te_core.ops.gemm on cuBLAS."""
    out_dtype = out_dtype or (out.dtype if out is not None else a.dtype)
    if out is not None and accumulate and out.dtype == a.dtype and bias is None:
        return out.addmm_(a, b.t())
    if bias is not None and out_dtype == a.dtype and bias.dtype == a.dtype and not accumulate:
        result = torch.addmm(bias, a, b.t())
    else:
        result = _mm_out_dtype(a, b.t(), out_dtype)
        if bias is not None:
            result = as_dtype(result.float() + bias.float(), out_dtype)
    if out is None:
        return result
    return out.add_(result) if accumulate else out.copy_(result)


def supports_gemm(a, b, *, bias=None, out=None, accumulate=False, out_dtype=None) -> Tuple[bool, str]:
    if not (a.is_cuda and b.is_cuda):
        return False, "operands are not on a CUDA device"
    if a.dim() != 2 or b.dim() != 2 or a.dtype != b.dtype:
        return False, "cuBLAS path takes 2-D operands of one dtype"
    if a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False, f"dtype {a.dtype} is not a cuBLAS GEMM type here"
    return True, ""
