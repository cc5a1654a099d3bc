"""Transformer Engine's DType: the integer tags TE code passes for data types
(`tex.DType.kFloat8E4M3`), with their torch dtypes.

The values are those of TE's C++ enum (transformer_engine.h), so a tag stored as an int (in a
checkpoint, or compared with `int(...)`) means the same type in both. te-core computes with torch
dtypes; `to_torch_dtype` is where a DType given by a user becomes one.
"""
from __future__ import annotations

import enum
from typing import Union

import torch

__all__ = ["DType", "to_torch_dtype", "fp8_torch_dtype", "FP8_DTYPES"]


class DType(enum.IntEnum):
    """A data type as Transformer Engine tags it. Members and values are TE's; kFloat4E2M1
    exists so that TE code naming it imports, but te-core has no FP4 type to map it to."""

    kByte = 0
    kInt32 = 2
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat4E2M1 = 10

    def __reduce_ex__(self, protocol):
        # by value, whatever the Python release (some 3.11 releases pickle an enum member as
        # getattr(cls, name), a global torch.load(weights_only=True) refuses)
        return type(self), (int(self),)

    @classmethod
    def cast(cls, value: Union["DType", int, torch.dtype]) -> "DType":
        """`value` as a DType: a member, its integer value, or a torch dtype that has one."""
        if isinstance(value, cls):
            return value
        if isinstance(value, torch.dtype):
            if value not in _FROM_TORCH:
                raise ValueError(f"{value} has no Transformer Engine DType; the torch dtypes that have one: "
                                 f"{', '.join(str(d) for d in _FROM_TORCH)}")
            return _FROM_TORCH[value]
        if isinstance(value, bool) or not isinstance(value, int):  # (a bool is no type tag)
            raise TypeError(f"expected a DType, its integer value or a torch.dtype, got {value!r} "
                            f"({type(value).__name__})")
        try:
            return cls(int(value))
        except ValueError:
            raise ValueError(f"{value!r} is not a DType value; the values: "
                             f"{', '.join(f'{m.name}={m.value}' for m in cls)}") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        if self not in _TO_TORCH:
            raise NotImplementedError(f"DType.{self.name} has no torch dtype in te-core: FP4 (NVFP4) is not "
                                      "supported by te-core yet")
        return _TO_TORCH[self]


# The pairs TE's own table holds (FP4 has no torch dtype there either)
_TO_TORCH = {
    DType.kByte: torch.uint8, DType.kInt32: torch.int32, DType.kFloat32: torch.float32,
    DType.kFloat16: torch.float16, DType.kBFloat16: torch.bfloat16,
    DType.kFloat8E4M3: torch.float8_e4m3fn, DType.kFloat8E5M2: torch.float8_e5m2,
}
_FROM_TORCH = {dtype: member for member, dtype in _TO_TORCH.items()}

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_torch_dtype(value: Union[DType, torch.dtype]) -> torch.dtype:
    """A torch dtype given as itself or as a DType (an int is refused: a bare 7 is more likely
    a mistake than a type)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, DType):
        return value.torch_dtype
    raise TypeError(f"expected a torch.dtype or a te_core.DType, got {value!r} ({type(value).__name__})")


def fp8_torch_dtype(value: Union[DType, torch.dtype], *, owner: str, name: str = "fp8_dtype") -> torch.dtype:
    """The FP8 torch dtype `value` names (DType.kFloat8E4M3 / kFloat8E5M2 or the torch dtype),
    else an error saying which argument of `owner` was wrong and what it accepts."""
    accepted = ("DType.kFloat8E4M3, DType.kFloat8E5M2, torch.float8_e4m3fn or torch.float8_e5m2")
    if not isinstance(value, (torch.dtype, DType)):
        raise TypeError(f"{owner}: {name} must be one of {accepted}; got {value!r} ({type(value).__name__})")
    if value is DType.kFloat4E2M1:
        raise NotImplementedError(f"{owner}: {name}=DType.kFloat4E2M1: FP4 (NVFP4) is not supported by te-core "
                                  f"yet; use {accepted}")
    dtype = to_torch_dtype(value)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{owner}: {name}={value!r} is not an FP8 type; use {accepted}")
    return dtype
