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
])
def test_delayed_scaling_validation(kwargs, message):
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=message):
        DelayedScaling(**kwargs)


def test_block_scaling_validation():
    with pytest.raises(ValueError, match="x_block_scaling_dim=2 is not supported"):
        Float8BlockScaling(x_block_scaling_dim=2)
    with pytest.raises(ValueError, match="w_block_scaling_dim must be 1"):
        Float8BlockScaling(w_block_scaling_dim=3)
    with pytest.raises(ValueError, match="amax_epsilon must be a float >= 0"):
        QParams(amax_epsilon=-1.0)


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
