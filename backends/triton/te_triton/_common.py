"""Pieces every kernel module uses: tuning config, FP8 saturating cast, NaN-aware amax."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

try:  # host-side TMA descriptors: triton 3.4 and later
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton keeps the pointer kernels
    TensorDescriptor = None

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MAX_NUMEL = 2**31 - 1  # kernels index with int32 offsets
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the high-precision dtypes the kernels read
# the contract's high-precision dtypes, which the elementwise, norm, softmax and rope kernels read
# and write back (float64 too: their math is float32 anyway)
HP_DTYPES = FLOAT_DTYPES + (torch.float64,)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Config:
    """Tuning parameters of one launch. Kernels read the fields they need.

    block: elements per program per step (1-D kernels); block_m/block_n: tile shape (2-D kernels);
    num_warps; max_programs: cap on the grid (0 = one program per block/tile/row), programs then
    loop over the work, which keeps the number of amax atomics small; rows: rows a row kernel
    (norms) handles per step, for more loads in flight when rows are short; hoist_params (norm
    forward): gamma/beta stay in registers for the whole program, else they are reloaded each
    step (cache hits) to free registers when rows are long; amax_chunk (norm forward with FP8
    out): 0 keeps a running amax per element (when it fits) or reduces each step's tile, c > 0
    keeps one per c-element chunk (a thread-local reduction, few registers); hw_saturate: the
    target's float32 -> FP8 convert already saturates finite values to the format's max and
    keeps NaN (NVIDIA's cvt.rn.satfinite, which Triton emits from sm_89 on), so the kernels skip
    their clamp. False keeps the clamp, which the CPU interpreter (a plain numpy cast) needs.
    prefetch (the dbias cast-transpose, whose programs loop over row tiles): load the next tile
    before working on the current one.
    tma_stages (norm forward with FP8 out, norm backward, dbias cast-transpose): 0 keeps plain
    pointer loads; s >= 2 loads rows / tiles through TMA descriptors in a loop Triton
    software-pipelines s stages deep (NVIDIA sm_90 and later only: the backend sets it there),
    when the tensors allow it (tma_ready).
    block_k, num_stages (the GEMM): the K step of its loop, and how many steps Triton keeps in
    flight.
    """

    block: int = 4096
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    max_programs: int = 0
    rows: int = 1
    hoist_params: bool = True
    amax_chunk: int = 0
    hw_saturate: bool = False
    prefetch: bool = False
    tma_stages: int = 0
    block_k: int = 64
    num_stages: int = 3


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host. In recent Triton releases triton.cdiv and triton.next_power_of_2
    are constexpr functions, whose calls from Python cost microseconds each: on an eager FP8
    step's launch path, plain integer arithmetic instead."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1), on the host (see cdiv)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def fp8_max(dtype: torch.dtype) -> float:
    if dtype not in FP8_MAX:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return FP8_MAX[dtype]


def answered(check: Callable[[], object]) -> Tuple[bool, str]:
    """(True, "") when check() passes, else (False, its message): a launcher's own argument
    checks, answered instead of raised, for a backend's supports()."""
    try:
        check()
    except (TypeError, ValueError) as exc:
        return False, str(exc)
    return True, ""


def check_2d_input(x: torch.Tensor) -> None:
    """The input of a cast that scales 2-D blocks of itself (block, MXFP8): a contiguous 2-D
    float32/bfloat16/float16 tensor that int32 offsets can index."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if not x.is_contiguous() or x.numel() > MAX_NUMEL:
        raise ValueError("x must be contiguous with fewer than 2^31 elements; call .contiguous() first")


def check_hp_input(x: torch.Tensor, name: str = "x") -> None:
    """x in a dtype these kernels compute on: an integer or FP8 x would be truncated or cast silently."""
    if x.dtype not in HP_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")


def check_device(t: torch.Tensor, x: torch.Tensor, name: str, x_name: str = "x") -> None:
    """t on x's device: the kernel dereferences every pointer on the device it runs on (x's)."""
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}; move it to {x_name}'s device")


def check_scalar(t, device, name: str) -> None:
    """t is a 1-element float32 tensor on `device`: a scale the kernels read or a slot they
    write (amax, scale, scale_inv). They access one float32 there (the amax as an int32 atomic),
    so another dtype or size reads or writes bytes that are not the tensor's."""
    if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dtype != torch.float32:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-element float32 tensor, got {got}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the input is on {device}; move it to the input's device")


def fp8_out_args(x: torch.Tensor, fp8_scale, fp8_dtype) -> bool:
    """Whether a norm or activation writes FP8: fp8_scale and fp8_dtype given together (a scale
    alone would be ignored), the scale one element on x's device."""
    if fp8_dtype is None:
        if fp8_scale is not None:
            raise ValueError("fp8_scale and fp8_dtype go together: pass fp8_dtype for FP8 output, or no fp8_scale")
        return False
    if not isinstance(fp8_scale, torch.Tensor) or fp8_scale.numel() != 1:
        raise ValueError("fp8_dtype needs fp8_scale, a 1-element float32 tensor")
    check_device(fp8_scale, x, "fp8_scale")
    return True


def column_blocks(parts) -> list:
    """parts as a list, after checking that they are 2-D column blocks of one gradient."""
    parts = list(parts) if isinstance(parts, (list, tuple)) else parts
    if not isinstance(parts, list) or not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        raise TypeError("parts must be a non-empty list or tuple of 2-D tensors")
    for i, p in enumerate(parts):
        if p.dim() != 2 or p.shape[0] != parts[0].shape[0] or p.dtype != parts[0].dtype or p.device != parts[0].device:
            raise ValueError(f"parts[{i}] ({p.dtype}, shape {tuple(p.shape)}, {p.device}) is not a column block "
                             f"matching parts[0] ({parts[0].dtype}, {parts[0].shape[0]} rows, {parts[0].device})")
    return parts


def grid_size(work_items: int, cfg: Config) -> int:
    if cfg.max_programs > 0:
        return max(1, min(work_items, cfg.max_programs))
    return max(1, work_items)


def new_amax_buffer(device, amax_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The float32 the kernels max |x| into (see max_into): `amax_out` itself when given (a
    1-element float32 slot holding a non-negative amax or NaN, e.g. an amax history row: no
    buffer to zero, no separate max afterwards), else a fresh 0-dim zero."""
    if amax_out is not None:
        check_scalar(amax_out, device, "amax_out")
        return amax_out
    return torch.zeros((), dtype=torch.float32, device=device)


def amax_from_buffer(buf: torch.Tensor, amax_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return amax_out if amax_out is not None else buf


def amax_out_ok(amax_out, x: torch.Tensor) -> Tuple[bool, str]:
    """Whether the kernels can max into `amax_out` (else the caller's supports() declines)."""
    if amax_out is None:
        return True, ""
    if not isinstance(amax_out, torch.Tensor) or amax_out.dtype != torch.float32 or amax_out.numel() != 1:
        return False, "amax_out is not a 1-element float32 tensor"
    if amax_out.device != x.device:
        return False, "amax_out is not on x's device"
    return True, ""


@triton.jit
def saturating_cast(v, fmax, out_dtype: tl.constexpr, CLAMP: tl.constexpr = True):
    """v (float32) clamped to [-fmax, fmax] then cast round-to-nearest-even; NaN stays NaN.
    CLAMP=False (Config.hw_saturate) leaves the saturation to the hardware convert."""
    if CLAMP:
        c = tl.minimum(tl.maximum(v, -fmax), fmax)
        c = tl.where(v != v, v, c)
        return c.to(out_dtype)
    return v.to(out_dtype)


FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def as_float32(v):
    """A float argument as float32: Triton's launcher passes a Python float as one, while the
    launches torch.compile writes for a kernel (torch.library.wrap_triton) pass it as float64,
    whose arithmetic would promote the cast's (and which div_rn refuses). The same value either
    way: the float64 holds the float the eager launch rounds to float32."""
    return tl.cast(v, tl.float32)


@triton.jit
def scale_from_amax(amax, fmax, eps, POW2: tl.constexpr):
    """Current scaling's scale of an amax (a scalar, or a block of them), as
    te_core.ops.quantize_fp8_current defines it: fmax / max(amax, eps) rounded once; an infinite
    quotient becomes float32's max; 1 where amax is NaN or inf or the divisor 0; with POW2,
    rounded down to a power of two."""
    amax_eff = tl.maximum(amax, eps)
    scale = tl.math.div_rn(tl.zeros_like(amax_eff) + fmax, amax_eff)
    scale = tl.where(scale == float("inf"), FLT_MAX, scale)
    bad = (amax != amax) | (amax == float("inf")) | (amax_eff == 0.0)
    scale = tl.where(bad, 1.0, scale)
    if POW2:  # keep the exponent, drop the mantissa
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def max_into(amax_ptr, bits):
    """Max `bits` (abs_bits of |x|) into the float32 at amax_ptr, as an int32 atomic max: the bits
    of non-negative floats order like the floats (NaN above inf), so it is a float max that keeps
    NaN. The pointer is reinterpreted here, so callers pass float32 buffers without a view."""
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32), bitcast=True), bits)


@triton.jit
def abs_bits(v):
    """|v| as int32 bits; max over these is max |v| with NaN winning."""
    return tl.abs(v).to(tl.int32, bitcast=True)


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether each tensor can be read or written through a TMA descriptor as the 2-D array it
    is: triton provides descriptors, the tensor is 2-D and contiguous, its base 16-byte
    aligned and its rows a multiple of 16 bytes long."""
    if TensorDescriptor is None:
        return False
    return all(t.dim() == 2 and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[1] * t.element_size() % 16 == 0
               for t in tensors)


def descriptor(t: torch.Tensor, block: Sequence[int]):
    """A TMA descriptor of 2-D `t` that loads and stores (block[0], block[1]) boxes; boxes
    reaching past the tensor read zeros and store only what lies inside."""
    return TensorDescriptor.from_tensor(t, list(block))


def launched(kernel, grid, *args, **kwargs) -> bool:
    """Launch; False when the kernel does not fit the GPU's shared memory (a descriptor kernel
    with too many stages of too large tiles), which Triton reports before running anything."""
    try:
        kernel[grid](*args, **kwargs)
    except OutOfResources:
        return False
    return True
