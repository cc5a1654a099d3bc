"""te_core.install_as_transformer_engine(): code written for Transformer Engine imports te-core,
and gets TE's return types; a real Transformer Engine is never shadowed by accident."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import te_core
from te_core.compat.transformer_engine import uninstall_transformer_engine


def test_te_imports_resolve_to_te_core(stand_in):
    import transformer_engine
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context, mark_not_offload
    from transformer_engine.pytorch.distributed import checkpoint
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, check_fp8_support, check_mxfp8_support

    assert te is stand_in and transformer_engine.pytorch is te and transformer_engine.common.recipe is te_recipe
    assert te.Linear is te_core.Linear and te.TransformerLayer is te_core.TransformerLayer
    assert te_recipe.DelayedScaling is te_core.recipe.DelayedScaling and checkpoint is te_core.checkpoint
    assert get_cpu_offload_context is te.get_cpu_offload_context is te_core.get_cpu_offload_context
    assert mark_not_offload is te_core.mark_not_offload
    assert transformer_engine.__version__.startswith("2.")
    assert importlib.util.find_spec("transformer_engine.pytorch") is not None
    ok, reason = check_fp8_support()
    assert ok is True and reason == ""
    native, why = check_mxfp8_support()
    assert isinstance(native, bool) and isinstance(why, str)
    assert FP8GlobalStateManager.is_fp8_available() == (True, "")
    assert te.is_fp8_available() is True  # a bool, so `if te.is_fp8_available():` means what it says
    assert importlib.import_module("transformer_engine.pytorch.quantization").check_fp8_support() == (True, "")


def test_distribution_metadata_follows_the_stand_in(stand_in):
    """Integrations look up the distribution before importing (Accelerate reads its metadata)."""
    import importlib.metadata

    assert importlib.metadata.version("transformer-engine") == stand_in.__version__
    assert importlib.metadata.metadata("transformer_engine")["Name"] == "transformer-engine"
    uninstall_transformer_engine()
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("transformer-engine")


def test_global_state_queries_follow_autocast(stand_in):
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    te = stand_in
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=8)
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert isinstance(FP8GlobalStateManager.get_fp8_recipe(), DelayedScaling)
    group = object()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group):
            assert FP8GlobalStateManager.is_fp8_enabled() and not FP8GlobalStateManager.is_fp8_calibration()
            assert FP8GlobalStateManager.get_fp8_recipe() is recipe
            assert FP8GlobalStateManager.get_fp8_group() is group
    with te.autocast(enabled=False, calibrating=True):
        assert FP8GlobalStateManager.is_fp8_calibration() and not FP8GlobalStateManager.is_fp8_enabled()
    with te.quantized_model_init(recipe=recipe):
        assert FP8GlobalStateManager.with_fp8_parameters()


def _te_convert(model, te):
    """What an integration such as Hugging Face Accelerate's convert_model does: swap
    nn.Linear / nn.LayerNorm for TE's, copying the weights."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                            params_dtype=child.weight.dtype)
            new.weight.copy_(child.weight)
            new.bias.copy_(child.bias)
            setattr(model, name, new)
        elif isinstance(child, nn.LayerNorm):
            new = te.LayerNorm(child.normalized_shape[0], eps=child.eps, params_dtype=child.weight.dtype)
            new.weight.copy_(child.weight)
            new.bias.copy_(child.bias)
            setattr(model, name, new)
        else:
            _te_convert(child, te)


def test_an_integration_converts_and_autowraps_a_model(stand_in):
    """The flow of Accelerate's convert_model + apply_fp8_autowrap, written against the
    transformer_engine names, runs on te-core: high precision matches the original model,
    FP8 training steps stay within E4M3's tolerance of it."""
    import transformer_engine.common.recipe as te_recipe
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32))
    model = nn.Sequential(*(m for m in (nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32))))
    model.load_state_dict(original.state_dict())
    with torch.no_grad():
        _te_convert(model, te)
    assert isinstance(model[0], te.Linear) and isinstance(model[2], te.LayerNorm)
    recipe = te_recipe.DelayedScaling(fp8_format=getattr(te_recipe.Format, "HYBRID"), amax_history_len=16,
                                      amax_compute_algo="max")
    plain_forward = model.forward

    def forward(*args):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with te.fp8_autocast(enabled=model.training, fp8_recipe=recipe):
                return plain_forward(*args)

    model.forward = forward
    x = torch.randn(32, 32)
    torch.testing.assert_close(model.eval()(x), original(x), rtol=1.3e-6, atol=1e-5)
    model.train()
    for _ in range(2):  # delayed scaling calibrates on the first step
        y = model(x)
        y.sum().backward()
    want = original(x)
    scale = want.abs().max()
    torch.testing.assert_close(y / scale, want / scale, rtol=0.125, atol=0.0675)


def test_a_real_transformer_engine_is_not_shadowed(monkeypatch):
    uninstall_transformer_engine()
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    with pytest.raises(RuntimeError, match="a real transformer_engine package is installed or imported"):
        te_core.install_as_transformer_engine()
    te = te_core.install_as_transformer_engine(replace=True)
    assert sys.modules["transformer_engine.pytorch"] is te
    uninstall_transformer_engine()
    assert "transformer_engine.pytorch" not in sys.modules


def test_a_name_te_core_does_not_provide_is_a_clear_attribute_error(stand_in):
    import transformer_engine.pytorch as te
    import transformer_engine.pytorch.fp8 as te_fp8

    for module, name in ((te, "initialize_ub"), (te_fp8, "no_such_query")):
        with pytest.raises(AttributeError, match=f"has no attribute '{name}': te-core stands in for Transformer "
                                                 f"Engine here and does not provide '{module.__name__}.{name}'"):
            getattr(module, name)
        assert not hasattr(module, name)  # integrations probe with hasattr
    with pytest.raises(AttributeError, match=r"\(userbuffers \(communication overlap\) are not supported"):
        te.initialize_ub
    with pytest.raises(ImportError, match="userbuffers"):
        from transformer_engine.pytorch import initialize_ub  # noqa: F401
    assert not hasattr(te, "__wrapped__") and te.Linear is te_core.Linear


def test_the_submodules_megatron_imports_resolve(stand_in):
    """The submodules Megatron-LM's Transformer Engine integration imports at load time or on its
    default training path resolve to te-core's objects; TE's fusible-op API (`ops`) is not
    te-core's op contract: only the Mixtral tutorial's subset of it is provided, not its fuser's modules."""
    import torch

    from transformer_engine.pytorch.attention import DotProductAttention
    from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy
    from transformer_engine.pytorch.distributed import CudaRNGStatesTracker, activation_recompute_forward
    from transformer_engine.pytorch.module.base import get_dummy_wgrad
    from transformer_engine.pytorch.permutation import moe_permute, moe_unpermute
    from transformer_engine.pytorch.router import fused_topk_with_score_function
    from transformer_engine.pytorch.tensor import QuantizedTensor
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Tensor

    from te_core.modules.checkpoint import activation_recompute_forward as own

    assert DotProductAttention is te_core.DotProductAttention and apply_rotary_pos_emb is te_core.apply_rotary_pos_emb
    assert parallel_cross_entropy is te_core.parallel_cross_entropy and moe_permute is te_core.moe_permute
    assert moe_unpermute is te_core.moe_unpermute and CudaRNGStatesTracker is te_core.CudaRNGStatesTracker
    assert activation_recompute_forward is own
    assert QuantizedTensor is te_core.QuantizedTensor and Float8Tensor is te_core.Float8Tensor
    assert MXFP8Tensor is te_core.MXFP8Tensor
    dummy = get_dummy_wgrad([3, 5], torch.float32, zero=True)
    assert dummy.shape == (3, 5) and not dummy.any() and get_dummy_wgrad([3, 5], torch.float32).shape == (3, 5)
    from te_core import router

    assert fused_topk_with_score_function is router.fused_topk_with_score_function
    import transformer_engine.pytorch as te

    assert te.ops is not te_core.ops and not hasattr(te.ops, "is_op_fuser_grouped_tensor_path_supported")
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("transformer_engine.pytorch.ops.fuser")
    uninstall_transformer_engine()
    assert not any(name.startswith("transformer_engine") for name in sys.modules)


# ---------------------------------------------------------------- NVFP4 names, missing submodules

def test_nvfp4_names_import_as_in_transformer_engine(stand_in):
    """TE code imports NVFP4BlockScaling unconditionally (TE's FSDP example does) and asks
    is_nvfp4_available: both work, the recipe builds with TE's defaults."""
    from transformer_engine.common.recipe import Format, NVFP4BlockScaling, Recipe
    from transformer_engine.pytorch import is_nvfp4_available
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager, check_nvfp4_support
    from transformer_engine.pytorch.quantization import NVFP4BlockScaling as via_quantization

    from te_core.recipe import NVFP4BlockScaling as own

    assert NVFP4BlockScaling is own is via_quantization
    recipe = NVFP4BlockScaling()
    assert recipe.nvfp4() and Recipe.nvfp4() is False and recipe.fp4_format is Format.E2M1
    assert is_nvfp4_available() is False and stand_in.is_nvfp4_available(return_reason=True)[0] is False
    assert check_nvfp4_support() == FP8GlobalStateManager.is_nvfp4_available() == is_nvfp4_available(True)


NVFP4_REFUSAL = (r"NVFP4 \(FP4 E2M1 block scaling\) is not supported by te-core yet; te-core runs the recipes "
                 "DelayedScaling, Float8CurrentScaling, Float8BlockScaling and MXFP8BlockScaling")


def test_nvfp4_recipe_is_refused_on_use(stand_in):
    """Using it (a module forward under autocast, quantized_model_init) raises NotImplementedError
    that says so; with FP8 off, the recipe is never used and the forward runs."""
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import NVFP4BlockScaling

    layer, x = te.Linear(32, 32), torch.randn(4, 32)
    with pytest.raises(NotImplementedError, match=NVFP4_REFUSAL):
        with te.autocast(recipe=NVFP4BlockScaling()):
            layer(x)
    with pytest.raises(NotImplementedError, match=NVFP4_REFUSAL):
        with te.autocast(recipe=NVFP4BlockScaling()):  # on entry, before any forward
            pass
    with pytest.raises(NotImplementedError, match=NVFP4_REFUSAL):
        with te.quantized_model_init(recipe=NVFP4BlockScaling()):
            te.LayerNormMLP(32, 64)
    with pytest.raises(NotImplementedError, match=NVFP4_REFUSAL):
        te_core.convert_model(nn.Sequential(nn.Linear(32, 32)), recipe=NVFP4BlockScaling())
    with te.autocast(enabled=False, recipe=NVFP4BlockScaling()):
        assert layer(x).shape == (4, 32)


PROVIDES = "It provides Transformer Engine's public API: the top-level names of transformer_engine.pytorch"


@pytest.mark.parametrize("name, hint", [
    ("transformer_engine.pytorch.jit", "Transformer Engine's kernels and bindings"),
    ("transformer_engine.pytorch.tensor.nvfp4_tensor", "NVFP4 is not supported by te-core yet"),
    ("transformer_engine.pytorch.ops.fused", "not its fused operations nor its fuser"),
    ("transformer_engine.pytorch.module.no_such_file", None),
])
def test_a_missing_submodule_says_what_te_core_provides(stand_in, name, hint):
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module(name)
    message = str(info.value)
    assert message.startswith(f"No module named '{name}': te-core stands in for Transformer Engine here and does not "
                              f"provide '{name}'")
    assert info.value.name == name and PROVIDES in message
    assert "attention.rope" in message and "quantized_tensor" in message and "transformer_engine.common.recipe" in message
    assert hint is None or hint in message
    with pytest.raises(ModuleNotFoundError, match=f"No module named '{name}': te-core"):
        exec(f"import {name}")


def test_from_import_of_a_missing_name_keeps_the_explanation(stand_in):
    """`from transformer_engine.pytorch import X` for an X te-core lacks used to end in Python's
    '(unknown location)'; it now says what is missing and the nearest te-core counterpart."""
    with pytest.raises(ImportError, match="cannot import name 'missing_name' from 'transformer_engine.pytorch': "
                                          "te-core stands in for Transformer Engine here") as info:
        from transformer_engine.pytorch import missing_name  # noqa: F401
    assert PROVIDES in str(info.value) and "unknown location" not in str(info.value)
    with pytest.raises(ImportError, match=r"'transformer_engine.pytorch.Float8TensorStorage' \(te-core's quantized "
                                          "tensors are transformer_engine.pytorch.QuantizedTensor"):
        from transformer_engine.pytorch import Linear, Float8TensorStorage  # noqa: F401
    with pytest.raises(ImportError, match="NVFP4 is not supported by te-core yet"):
        from transformer_engine.pytorch import NVFP4Quantizer  # noqa: F401
    with pytest.raises(ImportError, match="cannot import name 'nope' from 'transformer_engine.pytorch.fp8': te-core"):
        from transformer_engine.pytorch.fp8 import nope  # noqa: F401


def test_probes_for_missing_submodules_still_answer_none(stand_in):
    """importlib.util.find_spec is how integrations probe: it keeps answering None (no error)."""
    assert importlib.util.find_spec("transformer_engine.pytorch.jit") is None
    assert importlib.util.find_spec("transformer_engine.pytorch.module.linear") is not None


def test_te_submodules_with_a_te_core_counterpart_are_aliases(stand_in):
    from transformer_engine.pytorch.float8_tensor import Float8Tensor
    from transformer_engine.pytorch.module.grouped_linear import GroupedLinear
    from transformer_engine.pytorch.module.layernorm_mlp import LayerNormMLP
    from transformer_engine.pytorch.module.linear import Linear
    from transformer_engine.pytorch.module.rmsnorm import RMSNorm
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor, Quantizer
    from transformer_engine.pytorch.transformer import TransformerLayer

    from te_core.quantization import Quantizer as own_quantizer

    assert (Linear, LayerNormMLP, GroupedLinear, RMSNorm) == (te_core.Linear, te_core.LayerNormMLP,
                                                              te_core.GroupedLinear, te_core.RMSNorm)
    assert TransformerLayer is te_core.TransformerLayer and Float8Tensor is te_core.Float8Tensor
    assert QuantizedTensor is te_core.QuantizedTensor and Quantizer is own_quantizer
    from transformer_engine.pytorch.quantized_tensor import prepare_for_saving, restore_from_func_ctx, restore_from_saved

    from te_core.quantization import te_storage as protocol

    assert (prepare_for_saving, restore_from_saved, restore_from_func_ctx) == (
        protocol.prepare_for_saving, protocol.restore_from_saved, protocol.restore_from_func_ctx)
    with pytest.raises(ImportError, match="'transformer_engine.pytorch.quantized_tensor.Float8TensorStorage'"):
        from transformer_engine.pytorch.quantized_tensor import Float8TensorStorage  # noqa: F401


def test_fusible_operations_import_from_transformer_engines_files(stand_in):
    """TE's own tests import an operation from the file that defines it (`ops.basic.l2normalization`,
    test_qk_norm.py); each such path is the class `transformer_engine.pytorch.ops` has, and
    `ops.basic` holds every basic operation, as TE's does."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.ops.basic import ScaledSReLU as via_basic
    from transformer_engine.pytorch.ops.basic.activation import GELU, ScaledSReLU
    from transformer_engine.pytorch.ops.basic.basic_linear import BasicLinear
    from transformer_engine.pytorch.ops.basic.l2normalization import L2Normalization
    from transformer_engine.pytorch.ops.basic.swiglu import ScaledClampedQGeGLU
    from transformer_engine.pytorch.ops.linear import Linear
    from transformer_engine.pytorch.ops.op import BasicOperation, FusedOperation, FusibleOperation
    from transformer_engine.pytorch.ops.sequential import Sequential

    from te_core.compat.te_ops_files import OPS_BASIC_FILES, OPS_FILES

    assert (L2Normalization, BasicLinear, GELU, ScaledSReLU, ScaledClampedQGeGLU) == (
        te.ops.L2Normalization, te.ops.BasicLinear, te.ops.GELU, te.ops.ScaledSReLU, te.ops.ScaledClampedQGeGLU)
    assert (Linear, Sequential, BasicOperation, FusedOperation, FusibleOperation) == (
        te.ops.Linear, te.ops.Sequential, te.ops.BasicOperation, te.ops.FusedOperation, te.ops.FusibleOperation)
    assert via_basic is ScaledSReLU and te.ops.basic.L2Normalization is L2Normalization
    for package, files in (("ops", OPS_FILES), ("ops.basic", OPS_BASIC_FILES)):
        for sub, classes in files.items():
            module = importlib.import_module(f"transformer_engine.pytorch.{package}.{sub}")
            assert all(getattr(module, cls) is getattr(te.ops, cls) for cls in classes), (package, sub)
    # TE's qk-norm use of the imported class: x / sqrt(sum(x^2) + eps) over the last dimension
    x = torch.randn(4, 2, 3, 16, dtype=torch.float64).float()
    y = Sequential(L2Normalization(eps=1e-6))(x)
    x64 = x.double()
    torch.testing.assert_close(y.double(), x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) + 1e-6),
                               rtol=1.3e-6, atol=1e-5)
    # a file TE has but not te-core (a fused operation) still says so
    with pytest.raises(ModuleNotFoundError, match="not its fused operations nor its fuser"):
        importlib.import_module("transformer_engine.pytorch.ops.fused.forward_linear_bias_add")


def test_transformer_engines_quantizer_factories_import_and_run(stand_in):
    """TE's custom_recipes.quantizer_factories (its tests' import): te-core's factories, and a
    CustomRecipe of one runs as the built-in recipe, bit for bit, as TE's test_factory_matches_*."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe
    from transformer_engine.pytorch.custom_recipes import quantizer_factories
    from transformer_engine.pytorch.custom_recipes.quantizer_factories import (
        current_scaling_factory, delayed_scaling_factory, float8_block_scaling_factory, high_precision_factory,
        mxfp8_factory, nvfp4_factory)

    from te_core.quantization import factories

    assert (current_scaling_factory, delayed_scaling_factory, float8_block_scaling_factory, high_precision_factory,
            mxfp8_factory, nvfp4_factory) == (
        factories.current_scaling_factory, factories.delayed_scaling_factory, factories.float8_block_scaling_factory,
        factories.high_precision_factory, factories.mxfp8_factory, factories.nvfp4_factory)
    assert quantizer_factories.mxfp8_factory is factories.mxfp8_factory
    a = te.Linear(128, 128, params_dtype=torch.bfloat16, bias=False)
    b = te.Linear(128, 128, params_dtype=torch.bfloat16, bias=False)
    b.load_state_dict(a.state_dict())
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    results = []
    for layer, used in ((a, recipe.Float8CurrentScaling()), (b, recipe.CustomRecipe(qfactory=current_scaling_factory))):
        inp = x.clone().requires_grad_()
        with te.autocast(recipe=used):
            out = layer(inp)
        out.float().sum().backward()
        results.append((out, inp.grad, layer.weight.grad))
    assert all(torch.equal(p, q) for p, q in zip(*results))
    with pytest.raises(ModuleNotFoundError, match="te-core provides quantizer_factories .* and quantizer_factory_zoo"):
        importlib.import_module("transformer_engine.pytorch.custom_recipes.reference_nvfp4")


def test_transformer_engines_quantizer_factory_zoo_imports_te_cores(stand_in):
    """TE's custom_recipes.quantizer_factory_zoo (imported by its test_hybrid_quantization.py and
    test_identity_quantizer.py): every name TE's module defines, te-core's functions."""
    from transformer_engine.pytorch.custom_recipes import quantizer_factory_zoo
    from transformer_engine.pytorch.custom_recipes.quantizer_factory_zoo import (  # noqa: F401
        high_precision_fwd_mxfp8_bwd_factory, mxfp8_fwd_high_precision_bwd_factory, mxfp8_fwd_nvfp4_bwd_factory,
        nvfp4_1d_weight_factory, nvfp4_linear_fp8_dpa_factory, nvfp4_row_scaled_fwd_high_precision_bwd_factory,
        nvfp4_row_scaled_fwd_mxfp8_bwd_factory)

    from te_core.quantization import factory_zoo

    assert all(getattr(quantizer_factory_zoo, name) is getattr(factory_zoo, name) for name in factory_zoo.__all__)
    assert len(factory_zoo.__all__) == 7


def test_the_not_provided_finder_leaves_with_the_stand_in(stand_in):
    from te_core.compat.transformer_engine import _FINDER

    assert sys.meta_path.count(_FINDER) == 1
    te_core.install_as_transformer_engine()  # again: harmless, one finder
    assert sys.meta_path.count(_FINDER) == 1
    uninstall_transformer_engine()
    assert _FINDER not in sys.meta_path
    with pytest.raises(ModuleNotFoundError, match="^No module named 'transformer_engine'$"):
        importlib.import_module("transformer_engine.pytorch.utils")


def test_top_level_quantized_tensor_names_match_their_submodules(stand_in):
    """TE exports Quantizer and Float8BlockwiseQTensor at the top of transformer_engine.pytorch as
    well as in its tensor submodules; both paths give te-core's classes."""
    import transformer_engine.pytorch as te_pt
    from transformer_engine.pytorch.quantized_tensor import Quantizer
    from transformer_engine.pytorch.tensor import Float8BlockwiseQTensor

    from te_core import quantization

    assert te_pt.Quantizer is Quantizer is quantization.Quantizer
    assert te_pt.Float8BlockwiseQTensor is Float8BlockwiseQTensor is quantization.Float8BlockwiseTensor
