"""FP8 casts on te_triton's cast, blockwise and MXFP8 kernels: quantize (delayed and current
scaling), cast-transpose, byte transpose, 1x128 / 128x128 block scales, 1x32 E8M0 (MXFP8)
scales, dequantize."""
from __future__ import annotations

import torch
from te_triton import MAX_NUMEL, blockwise, cast, mxfp8

from .. import configs
from ..amax_slots import fresh, fresh_current
from .checks import FLOAT_DTYPES, OK, fp8_cast_ok, fp8_out_device_ok, scale_ok, tensor_ok


def quantize_fp8(x, scale, fp8_dtype, *, amax_out=None):
    return cast.quantize_fp8(x, scale, fp8_dtype, configs.for_tensor(x).quantize, amax_out=fresh(amax_out, x))


def cast_transpose_fp8(x, scale, fp8_dtype, *, amax_out=None):
    return cast.cast_transpose_fp8(x, scale, fp8_dtype, configs.for_tensor(x).cast_transpose,
                                   amax_out=fresh(amax_out, x))


def quantize_fp8_current(x, fp8_dtype, *, with_transpose=False, force_pow2_scales=False, amax_epsilon=0.0):
    t = configs.for_tensor(x)
    amax_out, scale_out, scale_inv_out = fresh_current(x)
    return cast.quantize_fp8_current(x, fp8_dtype, with_transpose=with_transpose, force_pow2_scales=force_pow2_scales,
                                     amax_epsilon=amax_epsilon, cfg=t.quantize, ct_cfg=t.cast_transpose,
                                     amax_out=amax_out, scale_out=scale_out, scale_inv_out=scale_inv_out)


def transpose_fp8(data):
    return cast.transpose_fp8(data, configs.for_tensor(data).transpose)


def dequantize_fp8(data, scale_inv, out_dtype):
    return cast.dequantize_fp8(data, scale_inv, out_dtype, configs.for_tensor(data).quantize)


def quantize_blockwise(x, fp8_dtype, *, block_2d=False, with_transpose=False, force_pow2_scales=True,
                       amax_epsilon=0.0):
    t = configs.for_tensor(x)
    return blockwise.quantize_blockwise(x, fp8_dtype, block_2d=block_2d, with_transpose=with_transpose,
                                        force_pow2_scales=force_pow2_scales, amax_epsilon=amax_epsilon,
                                        cfg=t.blockwise_1d_transpose if with_transpose and not block_2d
                                        else t.blockwise)


def dequantize_blockwise(data, scale_inv, block_2d, out_dtype):
    return blockwise.dequantize_blockwise(data, scale_inv, block_2d, out_dtype, configs.for_tensor(data).blockwise)


def quantize_mxfp8(x, fp8_dtype, *, with_transpose=False):
    return mxfp8.quantize_mxfp8(x, fp8_dtype, with_transpose=with_transpose, cfg=configs.for_tensor(x).mxfp8)


def dequantize_mxfp8(data, scales, out_dtype):
    return mxfp8.dequantize_mxfp8(data, scales, out_dtype, configs.for_tensor(data).mxfp8)


# --- supports -------------------------------------------------------------------------------
def cast_ok(x, scale, *args, amax_out=None, **kwargs):
    return fp8_cast_ok(x, scale, amax_out)


def cast_2d_ok(x, scale, *args, amax_out=None, **kwargs):
    return fp8_cast_ok(x, scale, amax_out, two_d=True)


def self_scaled_2d_ok(x, *args, **kwargs):
    if x.dim() != 2:
        return False, "x is not 2-D"
    return tensor_ok(x)


def blockwise_ok(x, *args, **kwargs):
    """A 2-D x on a GPU whose convert saturates (the block kernels leave it to the hardware)."""
    ok, why = self_scaled_2d_ok(x)
    return fp8_out_device_ok(x) if ok else (ok, why)


def current_ok(x, fp8_dtype, *, with_transpose=False, **_):
    ok, why = self_scaled_2d_ok(x) if with_transpose else tensor_ok(x)
    return fp8_out_device_ok(x) if ok else (ok, why)


def transpose_ok(data):
    if data.dim() != 2 or not data.is_contiguous():
        return False, "data is not a contiguous 2-D tensor"
    if not data.is_cuda:
        return False, "data is not on a CUDA device"
    if data.numel() > MAX_NUMEL:
        return False, "data has more than 2^31 elements"
    return OK


def _fp8_data_ok(data, out_dtype):
    if data.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return False, f"data dtype {data.dtype} is not FP8"
    if out_dtype not in FLOAT_DTYPES:
        return False, f"out_dtype {out_dtype} is not float32/bfloat16/float16"
    if not data.is_contiguous():
        return False, "data is not contiguous"
    if data.numel() > MAX_NUMEL:
        return False, "data has more than 2^31 elements"
    if not data.is_cuda:
        return False, "data is not on a CUDA device"
    return OK


def dequantize_ok(data, scale_inv, out_dtype):
    ok, why = scale_ok(scale_inv, data, "scale_inv")
    return _fp8_data_ok(data, out_dtype) if ok else (ok, why)


def dequantize_blockwise_ok(data, scale_inv, block_2d, out_dtype):
    if data.dim() != 2:
        return False, "data is not 2-D"
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.device != data.device:
        return False, "scale_inv is not a tensor on data's device"
    if scale_inv.dtype != torch.float32:  # (any strides: the kernel reads them)
        return False, "scale_inv is not float32"
    m, k = data.shape
    expected = (-(-m // 128) if block_2d else m, -(-k // 128))
    if tuple(scale_inv.shape) != expected:
        return False, f"scale_inv shape {tuple(scale_inv.shape)} is not {expected} (the reference explains)"
    return _fp8_data_ok(data, out_dtype)


def mxfp8_ok(x, fp8_dtype, *, with_transpose=False):
    # the shape rules (K, and M with the transpose, multiples of 32) are the reference's to name
    if x.dim() != 2:
        return False, "x is not 2-D"
    m, k = x.shape
    if k % mxfp8.MX or (with_transpose and m % mxfp8.MX):
        return False, f"x shape {(m, k)} does not split into 1x32 blocks (the reference explains)"
    ok, why = tensor_ok(x)
    return fp8_out_device_ok(x) if ok else (ok, why)


def dequantize_mxfp8_ok(data, scales, out_dtype):
    if data.dim() != 2:
        return False, "data is not 2-D"
    m, k = data.shape
    if k % mxfp8.MX:
        return False, f"data shape {(m, k)} does not split into 1x32 blocks (the reference explains)"
    if not isinstance(scales, torch.Tensor) or scales.device != data.device:
        return False, "scales is not a tensor on data's device"
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (m, k // mxfp8.MX) or not scales.is_contiguous():
        return False, f"scales is not a contiguous uint8 tensor of shape {(m, k // mxfp8.MX)} (the reference explains)"
    return _fp8_data_ok(data, out_dtype)
