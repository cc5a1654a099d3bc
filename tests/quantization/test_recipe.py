"""Recipes: Transformer Engine's defaults, validation with readable errors, checkpoint config."""
from __future__ import annotations

import dataclasses

import pytest

from te_core.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    QParams,
    recipe_from_config,
)


def test_defaults_match_transformer_engine():
    d = DelayedScaling()
    assert (d.margin, d.fp8_format, d.amax_history_len, d.amax_compute_algo) == (0, Format.HYBRID, 1024, "max")
    assert d.scaling_factor_compute_algo is None and d.reduce_amax is True and not d.fp8_dpa and not d.fp8_mha
    assert Float8CurrentScaling().fp8_format is Format.HYBRID
    b = Float8BlockScaling()
    assert b.fp8_format is Format.E4M3 and (b.x_block_scaling_dim, b.w_block_scaling_dim) == (1, 2)
    assert b.fp8_quant_fwd_inp.power_2_scale and b.fp8_quant_bwd_grad.power_2_scale
    assert MXFP8BlockScaling().fp8_format is Format.E4M3


def test_override_linear_precision_as_transformer_engine_passes_it():
    """Hugging Face Accelerate passes TE's field whenever a user sets it: the all-False triple
    runs (a plain tuple or TE's named tuple), keeps TE's positional place, and round-trips
    through a checkpoint config as plain values."""
    d = DelayedScaling(override_linear_precision=(False, False, False))
    assert d == DelayedScaling() and d.override_linear_precision.wgrad is False
    assert DelayedScaling(0, Format.HYBRID, 16, "max", (False, False, False)).amax_history_len == 16
    config = d.to_config()
    assert config["override_linear_precision"] == {"fprop": False, "dgrad": False, "wgrad": False}
    assert recipe_from_config(config) == d


def test_wgrad_override_as_transformer_engine():
    """(False, False, True) runs the weight-gradient GEMM in high precision, the other GEMMs in FP8;
    it round-trips through a checkpoint config. Other recipes run every GEMM in FP8."""
    d = DelayedScaling(override_linear_precision=(False, False, True))
    assert [d.gemm_in_fp8(g) for g in ("fprop", "dgrad", "wgrad")] == [True, True, False]
    assert recipe_from_config(d.to_config()) == d
    assert all(r.gemm_in_fp8(g) for r in (DelayedScaling(), Float8CurrentScaling(), MXFP8BlockScaling())
               for g in ("fprop", "dgrad", "wgrad"))
    with pytest.raises(ValueError, match="gemm must be one of fprop, dgrad, wgrad, got 'bprop'"):
        d.gemm_in_fp8("bprop")


def test_recipes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DelayedScaling().margin = 1


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling])
def test_pure_e5m2_training_rejected(cls):
    with pytest.raises(ValueError, match="pure E5M2 training is not supported.*HYBRID"):
        cls(fp8_format=Format.E5M2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(amax_compute_algo="mean"), "amax_compute_algo must be 'max', 'most_recent' or a callable"),
    (dict(amax_history_len=0), "amax_history_len must be an int >= 1"),
    (dict(margin=-1), "margin must be a number >= 0"),
    (dict(fp8_format="HYBRID"), "fp8_format must be a te_core.recipe.Format"),
    (dict(fp8_dpa=True), "fp8_dpa / fp8_mha"),
    (dict(override_linear_precision=(True, False, False)), r"override_linear_precision=\(True, False, False\) is not "
                                                           r"supported: only the wgrad override is"),
    (dict(override_linear_precision=(0, 0, 0)), "must be three bools"),
    (dict(override_linear_precision=(False, False)), "must be three bools"),
])
def test_delayed_scaling_validation(kwargs, message):
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        DelayedScaling(**kwargs)


def test_block_scaling_validation():
    with pytest.raises(ValueError, match="x_block_scaling_dim=2 is not supported"):
        Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="w_block_scaling_dim must be 1"):
        Float8BlockScaling(w_block_scaling_dim=3)
    with pytest.raises(ValueError, match="amax_epsilon must be a number >= 0"):
        QParams(amax_epsilon=-1.0)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make, error, message", [
    (lambda: DelayedScaling(margin=NAN), ValueError, r"margin must be a number >= 0 and finite, got nan"),
    (lambda: DelayedScaling(margin=INF), ValueError, r"margin must be a number >= 0 and finite, got inf"),
    (lambda: DelayedScaling(margin="1"), TypeError, r"margin must be a number >= 0, got '1' \(str\)"),
    (lambda: DelayedScaling(margin=True), TypeError, r"margin must be a number"),
    (lambda: DelayedScaling(amax_history_len=-3), ValueError, r"amax_history_len must be an int >= 1"),
    (lambda: DelayedScaling(amax_history_len=16.0), TypeError, r"amax_history_len must be an int >= 1, got 16.0"),
    (lambda: DelayedScaling(amax_history_len=True), TypeError, r"amax_history_len must be an int"),
    (lambda: DelayedScaling(reduce_amax="no"), TypeError, r"reduce_amax must be True or False, got 'no'"),
    (lambda: DelayedScaling(fp8_dpa=0), TypeError, r"fp8_dpa must be True or False"),
    (lambda: DelayedScaling(scaling_factor_compute_algo="max"), TypeError, r"scaling_factor_compute_algo must be"),
    (lambda: QParams(amax_epsilon=NAN), ValueError, r"amax_epsilon must be a number >= 0 and finite, got nan"),
    (lambda: QParams(amax_epsilon=INF), ValueError, r"amax_epsilon must be a number >= 0 and finite, got inf"),
    (lambda: QParams(amax_epsilon=None), TypeError, r"amax_epsilon must be a number"),
    (lambda: QParams(power_2_scale="yes"), TypeError, r"power_2_scale must be True or False"),
    (lambda: Float8CurrentScaling(fp8_quant_fwd_inp=1e-6), TypeError, r"fp8_quant_fwd_inp must be a te_core.recipe.QParams"),
    (lambda: Float8CurrentScaling(fp8_mha="false"), TypeError, r"fp8_mha must be True or False"),
    (lambda: Float8BlockScaling(w_block_scaling_dim=2.0), TypeError, r"w_block_scaling_dim must be an int"),
    (lambda: Float8BlockScaling(fp8_quant_bwd_grad=None), TypeError, r"fp8_quant_bwd_grad must be a te_core.recipe.QParams"),
    (lambda: MXFP8BlockScaling(margin=2), ValueError, r"margin=2 is not used"),
    (lambda: MXFP8BlockScaling(margin=NAN), ValueError, r"margin must be a number >= 0 and finite"),
])
def test_malformed_configuration_is_rejected_clearly(make, error, message):
    """Every recipe field with a value of the wrong type, out of range or non-finite, or given to
    a recipe that would not use it: a clear error naming the field and the value."""
    with pytest.raises(error, match=message):
        make()


def test_checkpoint_config_with_unknown_format_names_it():
    config = DelayedScaling().to_config()
    config["fp8_format"] = "E3M4"
    with pytest.raises(ValueError, match=r"unknown fp8_format 'E3M4'.*known: E4M3, E5M2, HYBRID"):
        recipe_from_config(config)


def test_gemm_accumulation_follows_transformer_engine():
    """MMParams: current scaling's fp8_gemm_* fields default to TE's (forward fast, gradients
    split); delayed and MXFP8 recipes have none and take TE's fixed choice; block scaling
    accumulates in float32 and refuses otherwise."""
    assert [Float8CurrentScaling().split_accumulator(g) for g in ("fprop", "dgrad", "wgrad")] == [False, True, True]
    assert [DelayedScaling().split_accumulator(g) for g in ("fprop", "dgrad", "wgrad")] == [False, True, True]
    assert Float8CurrentScaling(fp8_gemm_fprop=MMParams()).split_accumulator("fprop") is True
    assert all(Float8BlockScaling().split_accumulator(g) for g in ("fprop", "dgrad", "wgrad"))
    with pytest.raises(ValueError, match="block-scaled GEMMs accumulate in float32"):
        Float8BlockScaling(fp8_gemm_dgrad=MMParams(use_split_accumulator=False))
    with pytest.raises(TypeError, match="must be a bool"):
        MMParams(use_split_accumulator="yes")
    with pytest.raises(TypeError, match="fp8_gemm_wgrad must be a te_core.recipe.MMParams"):
        Float8CurrentScaling(fp8_gemm_wgrad=True)
    with pytest.raises(ValueError, match="gemm must be one of"):
        DelayedScaling().split_accumulator("forward")


@pytest.mark.parametrize("recipe", [
    DelayedScaling(margin=1, amax_history_len=16, amax_compute_algo="most_recent"),
    Float8CurrentScaling(fp8_quant_fwd_weight=QParams(power_2_scale=True, amax_epsilon=1e-6)),
    Float8CurrentScaling(fp8_gemm_fprop=MMParams(use_split_accumulator=True)),
    Float8BlockScaling(w_block_scaling_dim=1),
    MXFP8BlockScaling(),
])
def test_config_roundtrip(recipe):
    config = recipe.to_config()
    assert all(isinstance(v, (str, int, float, bool, dict, type(None))) for v in config.values())
    assert recipe_from_config(config) == recipe


def test_config_with_callable_keeps_the_state_fields():
    recipe = DelayedScaling(amax_compute_algo=lambda h: h.max(0).values, amax_history_len=8)
    config = recipe.to_config()
    assert config["amax_compute_algo"].startswith("<callable")
    restored = recipe_from_config(config)
    assert restored.amax_history_len == 8 and restored.compatible_key() == recipe.compatible_key()
    with pytest.raises(ValueError, match="unknown recipe 'Bogus'"):
        recipe_from_config({"recipe": "Bogus"})


def test_te_type_queries():
    assert DelayedScaling().delayed() and not DelayedScaling().mxfp8()
    assert MXFP8BlockScaling().mxfp8() and Float8BlockScaling().float8_block_scaling()
    assert Float8CurrentScaling().float8_current_scaling() and Float8CurrentScaling().float8_per_tensor_scaling()


def test_unknown_recipe_arguments_are_ignored_with_a_warning_and_subclasses_save_as_their_base():
    """Megatron-LM's TEDelayedScaling subclasses DelayedScaling and passes its module arguments
    (params_dtype, device) too, which Transformer Engine's recipes ignore: te-core leaves them out
    with a warning naming them, and a checkpoint names the te-core recipe it is, so it loads."""
    import torch

    from te_core.recipe import DelayedScaling, Format, recipe_from_config

    class TEDelayedScaling(DelayedScaling):
        def __init__(self, history: int):
            super().__init__(fp8_format=Format.E4M3, amax_history_len=history, params_dtype=torch.bfloat16,
                             device="cpu")

    with pytest.warns(UserWarning, match="params_dtype, device are not an argument of the recipe"):
        rec = TEDelayedScaling(8)
    assert rec.amax_history_len == 8 and rec.fp8_format is Format.E4M3
    config = rec.to_config()
    assert config["recipe"] == "DelayedScaling"
    assert recipe_from_config(config) == DelayedScaling(fp8_format=Format.E4M3, amax_history_len=8)
    assert rec.compatible_key() == DelayedScaling(fp8_format=Format.E4M3, amax_history_len=8).compatible_key()
