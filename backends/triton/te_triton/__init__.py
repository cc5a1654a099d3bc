"""Triton kernels shared by te-core backends (any vendor whose Triton compiles them).

One module per op family. Every launcher takes its tuning parameters (block sizes, warps,
program caps) from the caller as a `Config`, so each backend picks configs for its hardware.
Launchers take and return torch tensors on the kernel's device and follow the te_core op
contract (te_core/ops) for the op of the same name.
"""
from ._common import Config

__all__ = ["Config"]
