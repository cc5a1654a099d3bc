"""te.optimizers: Transformer Engine's FusedAdam and FusedSGD.

FusedAdam steps through the contract's multi-tensor Adam op (ops.multi_tensor_adam), so a
backend with a fused kernel runs it and the reference runs everywhere else; FusedSGD has no
contract op and updates with plain torch tensor operations.
"""
from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD"]
