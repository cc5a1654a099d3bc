"""te.optimizers: Transformer Engine's FusedAdam and FusedSGD.

FusedAdam steps through the contract's multi-tensor Adam op (ops.multi_tensor_adam), so a
backend with a fused kernel runs it and the reference runs everywhere else; FusedSGD has no
contract op and updates with plain torch tensor operations. The multi-tensor helpers
(multi_tensor_applier, MultiTensorApply and their ops) are Transformer Engine's, for training
frameworks; its kernel-only names (multi_tensor_adam, multi_tensor_sgd, ...) are not provided:
FusedAdam and FusedSGD are the optimizers they serve.
"""
from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD
from .multi_tensor import (MultiTensorApply, multi_tensor_applier, multi_tensor_l2norm, multi_tensor_scale,
                           multi_tensor_scale_tensor, multi_tensor_unscale_l2norm)

__all__ = ["FusedAdam", "FusedSGD", "MultiTensorApply", "multi_tensor_applier", "multi_tensor_l2norm",
           "multi_tensor_scale", "multi_tensor_scale_tensor", "multi_tensor_unscale_l2norm"]
