"""What the Transformer Engine stand-in holds beyond transformer_engine.* itself: the
`transformer_engine_torch` extension module (TE's compiled bindings, imported as `tex`), of which
te-core backs DType, thd_get_partitioned_indices (te_thd), rmsnorm_fwd and dequantize
(te_norm_cast), device_supports_multicast (te_userbuffers: False), and TE's `constants` tables of DType.

te-core's kernels sit behind its op contract (te_core.ops), not behind TE's binding functions, so
any other `tex.<name>` is refused with the stand-in's explanation rather than imitated.
"""
from __future__ import annotations

from ..dtype import _FROM_TORCH, _TO_TORCH, DType

EXTENSION = "transformer_engine_torch"

EXTENSION_HINT = (f"{EXTENSION} is Transformer Engine's compiled extension; te-core's stand-in for it holds only "
                  "DType (te_core.DType), thd_get_partitioned_indices, rmsnorm_fwd, dequantize and "
                  "device_supports_multicast. te-core's "
                  "kernels are its op contract (te_core.ops), and TE's quantizer classes are "
                  "transformer_engine.pytorch.Float8Quantizer, Float8CurrentScalingQuantizer, Float8BlockQuantizer and "
                  "MXFP8Quantizer")


def constants() -> dict:
    """transformer_engine.pytorch.constants' DType tables (TE_DType: torch dtype -> DType)."""
    return {"DType": DType, "TE_DType": dict(_FROM_TORCH), "TE_DType_To_Torch": dict(_TO_TORCH)}


def tensor_quantizers() -> dict:
    """TE's quantizer classes by the tensor submodule that defines them in TE."""
    from ..quantization import te_quantizers as q
    from ..quantization.hybrid import HybridQuantizer
    from ..quantization.identity import IdentityQuantizer

    return {"float8_tensor": {"Float8Quantizer": q.Float8Quantizer,
                              "Float8CurrentScalingQuantizer": q.Float8CurrentScalingQuantizer},
            "mxfp8_tensor": {"MXFP8Quantizer": q.MXFP8Quantizer},
            "float8_blockwise_tensor": {"Float8BlockQuantizer": q.Float8BlockQuantizer},
            "identity_tensor": {"IdentityQuantizer": IdentityQuantizer},
            "hybrid_tensor": {"HybridQuantizer": HybridQuantizer}}
