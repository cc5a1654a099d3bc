"""The stand-in's `transformer_engine_torch` (DType and thd_get_partitioned_indices), TE's quantizer
classes and CustomRecipe under Transformer Engine's import paths, and a TE test ported unchanged."""
from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

import te_core
from te_core.compat.transformer_engine import uninstall_transformer_engine


def test_tex_holds_dtype(stand_in):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.constants import TE_DType, TE_DType_To_Torch

    assert tex.DType is stand_in.DType is te_core.DType
    assert tex.DType.kFloat8E4M3 == stand_in.DType.kFloat8E4M3 and int(tex.DType.kFloat8E5M2) == 8
    assert TE_DType[torch.float8_e4m3fn] is tex.DType.kFloat8E4M3 and TE_DType_To_Torch[tex.DType.kBFloat16] is \
        torch.bfloat16
    assert set(TE_DType) == {torch.uint8, torch.int32, torch.float32, torch.float16, torch.bfloat16,
                             torch.float8_e4m3fn, torch.float8_e5m2}


def test_a_tex_name_te_core_lacks_says_so(stand_in):
    import transformer_engine_torch as tex

    hint = "transformer_engine_torch is Transformer Engine's compiled extension; te-core's stand-in for it holds only DType"
    with pytest.raises(AttributeError, match=f"has no attribute 'quantize': te-core stands in .*{hint}"):
        tex.quantize
    assert not hasattr(tex, "FP8FwdTensors")
    with pytest.raises(ImportError, match=f"cannot import name 'FP8FwdTensors' from 'transformer_engine_torch': .*{hint}"):
        from transformer_engine_torch import FP8FwdTensors  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="No module named 'transformer_engine_torch.ops': te-core"):
        importlib.import_module("transformer_engine_torch.ops")
    assert importlib.util.find_spec("transformer_engine_torch.ops") is None  # probes still answer None


def test_tex_leaves_with_the_stand_in(stand_in):
    uninstall_transformer_engine()
    assert "transformer_engine_torch" not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="^No module named 'transformer_engine_torch'$"):
        importlib.import_module("transformer_engine_torch")


def test_quantizers_and_custom_recipe_import_from_te_paths(stand_in):
    from transformer_engine.common.recipe import CustomRecipe
    from transformer_engine.pytorch import Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer
    from transformer_engine.pytorch.quantization import QuantizerRole
    from transformer_engine.pytorch.quantized_tensor import Quantizer
    from transformer_engine.pytorch.tensor import Float8Quantizer
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer as block
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer as current
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer as mxfp8

    assert (Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer, Float8Quantizer) == (
        te_core.Float8BlockQuantizer, te_core.Float8CurrentScalingQuantizer, te_core.MXFP8Quantizer,
        te_core.Float8Quantizer)
    assert (block, current, mxfp8) == (Float8BlockQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer)
    assert CustomRecipe is te_core.recipe.CustomRecipe and QuantizerRole is te_core.QuantizerRole
    assert issubclass(Float8CurrentScalingQuantizer, Quantizer) and issubclass(Float8Quantizer, Quantizer)


def test_transformer_engines_custom_recipe_test_runs_unchanged(stand_in):
    """TE's test_custom_recipe_matches_current_scaling, with the device and sizes of this machine:
    a factory of tex.DType current-scaling quantizers equals Float8CurrentScaling bit for bit."""
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.common import recipe
    from transformer_engine.pytorch import Float8CurrentScalingQuantizer, Linear, autocast

    torch.manual_seed(123)
    model_ref = Linear(64, 64, params_dtype=torch.bfloat16, device="cpu")
    model_custom = Linear(64, 64, params_dtype=torch.bfloat16, device="cpu")
    model_custom.load_state_dict(model_ref.state_dict())
    base = torch.randn(32, 64, dtype=torch.bfloat16)
    inp_ref, inp_custom = base.clone().requires_grad_(), base.clone().requires_grad_()

    with autocast(enabled=True, recipe=recipe.Float8CurrentScaling()):
        out_ref = model_ref(inp_ref)
    out_ref.float().sum().backward()

    def quantizer_factory(role):
        if role in ("linear_input", "linear_weight", "linear_output"):
            return Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device="cpu")
        if role in ("linear_grad_output", "linear_grad_input"):
            return Float8CurrentScalingQuantizer(tex.DType.kFloat8E5M2, device="cpu")
        return Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, device="cpu")

    custom_recipe = recipe.CustomRecipe(qfactory=quantizer_factory)
    assert custom_recipe.custom() and te.fp8.FP8GlobalStateManager.get_fp8_recipe() is not custom_recipe
    with autocast(enabled=True, recipe=custom_recipe):
        assert te.fp8.FP8GlobalStateManager.get_fp8_recipe() is custom_recipe
        out_custom = model_custom(inp_custom)
    out_custom.float().sum().backward()

    torch.testing.assert_close(out_ref, out_custom, rtol=0, atol=0)
    torch.testing.assert_close(inp_ref.grad, inp_custom.grad, rtol=0, atol=0)
    for ref, custom in zip(model_ref.parameters(), model_custom.parameters()):
        torch.testing.assert_close(ref.grad, custom.grad, rtol=0, atol=0)
