"""Transformer Engine's registration of operation fusions (register_forward_fusion,
register_backward_fusion, register_forward_backward_fusion), refused: a fusion function replaces a
run of basic operations with a fused one whose fuser_forward / fuser_backward te-core never calls,
since it runs every operation as it is (their results are the unfused operations' results)."""
from __future__ import annotations


def _refuse(name: str) -> None:
    raise NotImplementedError(f"ops.{name}: te-core fuses no operations (each runs as it is, through te-core's "
                              "modules and ops), so a fusion function would never be applied; drop the call, or "
                              "write the fused computation as a torch.nn.Module and put it in the ops.Sequential")


def register_forward_fusion(op_fusion_func, prepend: bool = False) -> None:
    """Refused: te-core fuses no operations."""
    _refuse("register_forward_fusion")


def register_backward_fusion(op_fusion_func, prepend: bool = False) -> None:
    """Refused: te-core fuses no operations."""
    _refuse("register_backward_fusion")


def register_forward_backward_fusion(op_fusion_func, prepend: bool = False) -> None:
    """Refused: te-core fuses no operations."""
    _refuse("register_forward_backward_fusion")
