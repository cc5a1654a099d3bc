"""te.optimizers: Transformer Engine's FusedAdam and FusedSGD.

FusedAdam steps through the contract's multi-tensor Adam op (ops.multi_tensor_adam), so a
backend with a fused kernel runs it and the reference runs everywhere else; FusedSGD has no
contract op and updates with plain torch tensor operations. The multi-tensor helpers
(multi_tensor_applier and its ops) are Transformer Engine's, for training frameworks.
"""
from .fused_adam import FusedAdam
from .fused_sgd import FusedSGD
from .multi_tensor import multi_tensor_applier, multi_tensor_l2norm, multi_tensor_scale, multi_tensor_scale_tensor

__all__ = ["FusedAdam", "FusedSGD", "multi_tensor_applier", "multi_tensor_l2norm", "multi_tensor_scale",
           "multi_tensor_scale_tensor"]
