"""transformer_engine.pytorch.module.base.TransformerEngineBaseModule (te_core.modules._te_base):
te-core's modules are instances of it, and the members ported code (Megatron-LM's FSDP and
CUDA-graph code) reads on it answer from te-core's state or refuse clearly."""
from __future__ import annotations

import pytest
import torch

import te_core as te
from te_core.recipe import DelayedScaling, Float8CurrentScaling, Format, MXFP8BlockScaling


def _te_modules():
    return [te.Linear(16, 16), te.LayerNormLinear(16, 16), te.LayerNormMLP(16, 32), te.GroupedLinear(2, 16, 16),
            te.DotProductAttention(2, 8)]


def test_te_cores_modules_are_instances(stand_in):
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    for module in _te_modules():
        assert isinstance(module, TransformerEngineBaseModule), type(module).__name__
        assert callable(module.set_tensor_parallel_group)
    # as in Transformer Engine: norms and containers are not (their GEMM submodules are)
    assert not isinstance(te.LayerNorm(16), TransformerEngineBaseModule)
    layer = te.TransformerLayer(16, 32, 2)
    assert not isinstance(layer, TransformerEngineBaseModule)
    assert {type(m).__name__ for m in layer.modules() if isinstance(m, TransformerEngineBaseModule)} == {
        "LayerNormLinear", "Linear", "LayerNormMLP", "DotProductAttention"}

    class MegatronStyle(te.Linear):  # Megatron-LM's TELinear subclasses TE's module classes
        pass

    assert isinstance(MegatronStyle(16, 16), TransformerEngineBaseModule)


def test_fp8_meta_follows_the_modules_state():
    linear = te.Linear(16, 16)
    assert set(linear.fp8_meta) == {"recipe", "fp8_checkpoint", "fp8_group"}
    assert isinstance(linear.fp8_meta["recipe"], DelayedScaling) and linear.fp8_meta["fp8_checkpoint"] is False
    current = Float8CurrentScaling()
    with te.autocast(recipe=current):
        assert linear.fp8_meta["recipe"] is current  # before its first forward: the active autocast's
    delayed = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4)
    with te.autocast(recipe=delayed):
        linear(torch.randn(8, 16)).sum().backward()
    assert linear.fp8_meta["recipe"] == delayed and linear.fp8_meta["fp8_checkpoint"] is True
    assert linear.fp8_meta["fp8_group"] is None
    with te.autocast(recipe=current), pytest.warns(UserWarning, match="Recipe type changed"):
        linear(torch.randn(8, 16))  # a recipe without state: nothing to checkpoint
    assert linear.fp8_meta["recipe"] == current and linear.fp8_meta["fp8_checkpoint"] is False


def test_fp8_meta_refuses_writes_and_unknown_keys():
    linear = te.Linear(16, 16)
    with pytest.raises(TypeError, match="Linear.fp8_meta is a read-only view in te-core.*te.autocast.*'recipe'"):
        linear.fp8_meta["recipe"] = DelayedScaling()
    with pytest.raises(KeyError, match="has no 'scaling_fwd' in te-core.*quantization_state"):
        linear.fp8_meta["scaling_fwd"]


def test_fp8_primary_weights_for_megatron_fsdp():
    """Megatron-FSDP's meta-device init: param_init_meta[name].fp8_meta_index marks the FP8
    primary weights of a module with primary_weights_in_fp8, and fp8_meta['recipe'].mxfp8() says
    whether they keep column-wise data."""
    plain = te.LayerNormMLP(32, 64)
    assert plain.primary_weights_in_fp8 is False
    assert all(meta.fp8_meta_index is None for meta in plain.param_init_meta.values())
    recipe = MXFP8BlockScaling()
    with te.quantized_model_init(enabled=True, recipe=recipe):
        mlp, linear = te.LayerNormMLP(32, 64), te.Linear(32, 32)
    assert mlp.primary_weights_in_fp8 is True and mlp.fp8_meta["recipe"].mxfp8()
    marked = {name for name, p in mlp.named_parameters(recurse=False)
              if mlp.param_init_meta[name].fp8_meta_index is not None}
    assert marked == {"fc1_weight", "fc2_weight"}
    assert all(isinstance(getattr(mlp, name), te.QuantizedTensor) for name in marked)
    # the weight's quantizer among the forward ones (input, weight, ...), an int as in TE
    assert linear.param_init_meta["weight"].fp8_meta_index == 1
    assert linear.param_init_meta["bias"].fp8_meta_index is None


def test_init_fp8_metadata_has_nothing_to_prepare():
    grouped = te.GroupedLinear(3, 16, 16)
    grouped.init_fp8_metadata(num_gemms=3)  # Megatron-LM's TEGroupedLinear calls it before each load
    te.Linear(16, 16).init_fp8_metadata()
    with pytest.raises(ValueError, match="num_gemms=2, but the module runs 3 GEMM"):
        grouped.init_fp8_metadata(num_gemms=2)
