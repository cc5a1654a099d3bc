"""The Transformer Engine import paths of the names added for ported code resolve to te-core's
objects under the stand-in: utils' device queries, export's ONNX switch, distributed's
prepare_te_modules_for_fsdp, and FP8GlobalStateManager.reset."""
from __future__ import annotations

import pytest

import te_core


def test_the_new_names_resolve(stand_in):
    from transformer_engine.pytorch import get_cudnn_version, get_device_compute_capability, onnx_export
    from transformer_engine.pytorch.distributed import prepare_te_modules_for_fsdp
    from transformer_engine.pytorch.export import is_in_onnx_export_mode
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager as via_quantization
    from transformer_engine.pytorch.utils import is_bf16_available

    from te_core.distributed import fsdp1

    assert get_cudnn_version is te_core.get_cudnn_version and onnx_export is te_core.onnx_export
    assert get_device_compute_capability is te_core.get_device_compute_capability
    assert prepare_te_modules_for_fsdp is fsdp1.prepare_te_modules_for_fsdp and is_bf16_available is te_core.is_bf16_available
    assert is_in_onnx_export_mode() is False and FP8GlobalStateManager is via_quantization
    FP8GlobalStateManager.reset()  # outside any context: nothing to do, no error
    with stand_in.autocast(enabled=False, calibrating=True):
        with pytest.raises(RuntimeError, match="inside te.autocast"):
            FP8GlobalStateManager.reset()


def test_a_utils_name_te_core_lacks_says_so(stand_in):
    with pytest.raises(ImportError, match="cannot import name 'clear_tensor_data' from "
                                          "'transformer_engine.pytorch.utils': te-core stands in for "
                                          "Transformer Engine"):
        from transformer_engine.pytorch.utils import clear_tensor_data  # noqa: F401


def test_identity_and_hybrid_quantizers_resolve(stand_in):
    from transformer_engine.pytorch import HybridQuantizedTensor, HybridQuantizer, IdentityQuantizer
    from transformer_engine.pytorch.tensor.hybrid_tensor import HybridQuantizer as hybrid
    from transformer_engine.pytorch.tensor.identity_tensor import IdentityQuantizer as identity, IdentityTensor

    assert (IdentityQuantizer, identity, IdentityTensor) == (te_core.IdentityQuantizer,) * 2 + (te_core.IdentityTensor,)
    assert (HybridQuantizer, hybrid, HybridQuantizedTensor) == (te_core.HybridQuantizer,) * 2 + (
        te_core.HybridQuantizedTensor,)
