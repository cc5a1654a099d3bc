"""Recipes: Transformer Engine's defaults, validation with readable errors, checkpoint config."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest

import torch

from te_core.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
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
    runs (a plain tuple or TE's named tuple) and round-trips through a checkpoint config as plain
    values."""
    d = DelayedScaling(override_linear_precision=(False, False, False))
    assert d == DelayedScaling() and d.override_linear_precision.wgrad is False
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


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling])
def test_fields_take_checked_assignments(cls):
    """As Transformer Engine's recipes, te-core's take assignments to their fields; a value the
    constructor would refuse is refused the same way and leaves the recipe as it was."""
    recipe = cls()
    other = Format.E4M3 if recipe.fp8_format is Format.HYBRID else Format.HYBRID
    recipe.fp8_format = other
    assert recipe.fp8_format is other and recipe == dataclasses.replace(cls(), fp8_format=other)
    with pytest.raises(ValueError, match="pure E5M2 training is not supported"):
        recipe.fp8_format = Format.E5M2
    with pytest.raises(TypeError, match="fp8_format must be a te_core.recipe.Format"):
        recipe.fp8_format = "HYBRID"
    assert recipe.fp8_format is other
    with pytest.raises(dataclasses.FrozenInstanceError, match=rf"{cls.__name__} has no field 'fp8_formt'; its fields: .*fp8_format"):
        recipe.fp8_formt = Format.HYBRID
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot be deleted"):
        del recipe.fp8_format
    recipe.fp8_format = other  # (its own value: nothing changes)
    assert recipe == dataclasses.replace(cls(), fp8_format=other)


def test_assignments_keep_the_recipes_rules():
    """What the constructor derives from a field follows an assignment to it; what it refuses, an
    assignment refuses."""
    d = DelayedScaling()
    d.override_linear_precision = (False, False, True)
    assert d.override_linear_precision.wgrad is True and not d.gemm_in_fp8("wgrad")
    with pytest.raises(ValueError, match="delayed scaling supports only backward_override=None"):
        d.backward_override = "high_precision"
    assert d.backward_override is None
    c = Float8CurrentScaling()
    assert not c.fp8_quant_fwd_inp.power_2_scale
    c.use_power_2_scales = True
    assert all(getattr(c, f"fp8_quant_{k}").power_2_scale for k in ("fwd_inp", "fwd_weight", "bwd_grad"))
    c.backward_override = "dequantized"
    assert c.backward_override == "dequantized"
    with pytest.raises(ValueError, match="backward_override must be None, 'high_precision' or 'dequantized'"):
        c.backward_override = "fp32"
    b = Float8BlockScaling()
    with pytest.raises(ValueError, match="w_block_scaling_dim must be 1"):
        b.w_block_scaling_dim = 3
    assert b.w_block_scaling_dim == 2
    with pytest.raises(NotImplementedError, match="enable_2d_quantization=True"):
        MXFP8BlockScaling().enable_2d_quantization = True


def test_in_use_is_an_unchanging_copy_per_change():
    """Modules run with in_use(recipe): one copy per state of the recipe (the same object until
    the recipe changes), equal to it, refusing assignments itself; a deep copy changes apart from
    its original, as TE's tests use one."""
    import copy

    from te_core.recipe import in_use

    r = Float8CurrentScaling()
    first = in_use(r)
    assert first is in_use(r) and first == r and first is not r and in_use(first) is first
    with pytest.raises(dataclasses.FrozenInstanceError, match="te-core's copy of a recipe in use"):
        first.backward_override = "high_precision"
    r.backward_override = "high_precision"
    second = in_use(r)
    assert second is not first and second.backward_override == "high_precision" and first.backward_override is None
    twin = copy.deepcopy(r)
    twin.backward_override = "dequantized"
    assert r.backward_override == "high_precision" and in_use(r) is second
    assert in_use(twin).backward_override == "dequantized"


def test_recipe_subclass_keeps_its_own_attributes():
    """A subclass (Megatron-LM's TEDelayedScaling) may set attributes of its own; its fields take
    checked assignments as the base's do, and its copy in use keeps its class and attributes."""
    from te_core.recipe import in_use

    class Sub(DelayedScaling):
        def __init__(self, config=None, **kwargs):
            super().__init__(**kwargs)
            self.config = config

    sub = Sub("cfg", margin=2)
    assert sub.config == "cfg" and sub.margin == 2
    sub.margin = 3
    sub.config = "other"
    with pytest.raises(ValueError, match="margin must be an int, got 0.5"):
        sub.margin = 0.5
    used = in_use(sub)
    assert type(used) is Sub and used.margin == 3 and used.config == "other"


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling])
def test_pure_e5m2_training_rejected(cls):
    with pytest.raises(ValueError, match="pure E5M2 training is not supported.*HYBRID"):
        cls(fp8_format=Format.E5M2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(amax_compute_algo="mean"), "amax_compute_algo must be 'max', 'most_recent' or a callable"),
    (dict(amax_history_len=0), "amax_history_len must be an int >= 1"),
    (dict(margin=-113), "margin=-113 is too small"),
    (dict(fp8_format="HYBRID"), "fp8_format must be a te_core.recipe.Format"),
    (dict(fp8_dpa=True), "fp8_dpa / fp8_mha"),
    (dict(override_linear_precision=(True, False, False)), r"override_linear_precision=\(True, False, False\) is not "
                                                           r"supported: only the wgrad override is"),
    (dict(override_linear_precision=(0, 0, 2)), "override_linear_precision.wgrad must be True or False, got 2"),
    (dict(override_linear_precision=(False,) * 4), "override_linear_precision must be 3 bools"),
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
    (lambda: DelayedScaling(margin=NAN), ValueError, r"margin must be an int, got nan \(float\): give a finite whole"),
    (lambda: DelayedScaling(margin=INF), ValueError, r"margin must be an int, got inf \(float\): give a finite whole"),
    (lambda: DelayedScaling(margin="1.5"), ValueError, r"margin must be an int, got the string '1.5'"),
    (lambda: DelayedScaling(margin=None), TypeError, r"margin must be an int, got None \(NoneType\)"),
    (lambda: DelayedScaling(amax_history_len=-3), ValueError, r"amax_history_len must be an int >= 1"),
    (lambda: DelayedScaling(amax_history_len=16.5), ValueError, r"amax_history_len must be an int, got 16.5 \(float\), "
                                                                r"which has a fractional part"),
    (lambda: DelayedScaling(amax_history_len=False), ValueError, r"amax_history_len must be an int >= 1 and finite"),
    (lambda: DelayedScaling(reduce_amax="nope"), ValueError, r"reduce_amax must be True or False, got 'nope'"),
    (lambda: DelayedScaling(fp8_dpa=2), ValueError, r"fp8_dpa must be True or False, got 2"),
    (lambda: DelayedScaling(scaling_factor_compute_algo="max"), TypeError, r"scaling_factor_compute_algo must be"),
    (lambda: QParams(amax_epsilon=NAN), ValueError, r"amax_epsilon must be a number >= 0 and finite, got nan"),
    (lambda: QParams(amax_epsilon=INF), ValueError, r"amax_epsilon must be a number >= 0 and finite, got inf"),
    (lambda: QParams(amax_epsilon=None), TypeError, r"amax_epsilon must be a number"),
    (lambda: QParams(power_2_scale=None), TypeError, r"power_2_scale must be True or False"),
    (lambda: Float8CurrentScaling(fp8_quant_fwd_inp=1e-6), TypeError, r"fp8_quant_fwd_inp must be a te_core.recipe.QParams"),
    (lambda: Float8CurrentScaling(fp8_mha=[]), TypeError, r"fp8_mha must be True or False"),
    (lambda: Float8BlockScaling(w_block_scaling_dim=2.5), ValueError, r"w_block_scaling_dim must be an int"),
    (lambda: Float8BlockScaling(fp8_quant_bwd_grad=None), TypeError, r"fp8_quant_bwd_grad must be a te_core.recipe.QParams"),
    (lambda: MXFP8BlockScaling(margin=2), ValueError, r"margin=2 is not used"),
    (lambda: MXFP8BlockScaling(margin=NAN), ValueError, r"margin must be an int, got nan"),
])
def test_malformed_configuration_is_rejected_clearly(make, error, message):
    """Every recipe field with a value of the wrong type, out of range or non-finite, or given to
    a recipe that would not use it: a clear error naming the field and the value."""
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("fmt, smallest", [(Format.HYBRID, -112), (Format.E4M3, -119)])
def test_margin_outside_float32s_normal_range_is_refused_with_the_bound(gen, fmt, smallest):
    """fp8_max * 2**-margin below float32's smallest normal number (the forward format's maximum)
    would make every scale underflow (inf scale_inv, NaN outputs), above float32's largest value
    (the backward format's) every scale inf: refused, saying the bound. Margins are ints, as in
    Transformer Engine, negative ones included."""
    tiny, huge = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max
    too_large = [135 + int(torch.randint(0, 1000, (), generator=gen)), 135]
    for margin in too_large:
        assert fmt.value.max_fwd * 2.0 ** -margin < tiny
        message = (rf"margin={margin} is too large: fp8_max \* 2\*\*-margin \(with Format.{fmt.name}'s forward "
                   r"maximum 448\) falls below float32's smallest normal number \(2\*\*-126\).*The largest margin "
                   r"allowed is 134 \(126 \+ log2\(448\), rounded down\)")
        with pytest.raises(ValueError, match=message):
            DelayedScaling(margin=margin, fp8_format=fmt)
    for margin in (smallest - 1, smallest - 1 - int(torch.randint(0, 1000, (), generator=gen))):
        assert fmt.value.max_bwd * 2.0 ** -margin > huge
        with pytest.raises(ValueError, match=rf"margin={margin} is too small: .*backward maximum "
                                             rf"{fmt.value.max_bwd}\) exceeds float32's largest value.*The smallest "
                                             rf"margin allowed is {smallest}"):
            DelayedScaling(margin=margin, fp8_format=fmt)
    inside = int(torch.randint(smallest, 135, (), generator=gen))
    for margin in (inside, 134, smallest):
        d = DelayedScaling(margin=margin, fp8_format=fmt)
        assert d.margin == margin and tiny <= fmt.value.max_fwd * 2.0 ** -margin
        assert fmt.value.max_bwd * 2.0 ** -margin <= huge
    with pytest.raises(ValueError, match="The largest margin allowed is 134"):
        d.margin = too_large[0]
    assert d.margin == smallest


def test_amax_epsilon_above_float32_max_is_refused_naming_the_field(gen):
    """Finite in Python but beyond float32 (the casts' type): refused when the QParams is made,
    not at the first cast; float32's largest value itself casts."""
    f32_max = torch.finfo(torch.float32).max
    for epsilon in (f32_max * (1 + float(torch.rand((), generator=gen))), 1e39):
        message = (rf"QParams: amax_epsilon={re.escape(repr(epsilon))} is above float32's largest value "
                   r"\(3.4028234663852886e\+38\).*give an amax_epsilon <= ")
        with pytest.raises(ValueError, match=message):
            QParams(amax_epsilon=epsilon)
    from te_core.quantization.roles import gemm_slots

    x = torch.randn(4, 128, generator=gen) * 3
    for cls in (Float8CurrentScaling, Float8BlockScaling):
        recipe = cls(fp8_quant_fwd_inp=QParams(amax_epsilon=f32_max))
        scale_inv = recipe.quantizer_for(gemm_slots()[0].role).quantize(x).rowwise().scale_inv
        assert torch.isfinite(scale_inv).all() and (scale_inv > 1e35).all()


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
    with pytest.raises(ValueError, match="use_split_accumulator must be True or False"):
        MMParams(use_split_accumulator="maybe")
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


def test_te_type_queries_are_class_methods_with_nvfp4_and_custom():
    """Transformer Engine's queries are class methods (TE code asks the class: `recipe.mxfp8()`
    and `type(recipe).mxfp8()` alike); nvfp4() and custom() exist too."""
    assert DelayedScaling.delayed() and MXFP8BlockScaling.mxfp8() and not Recipe.delayed()
    assert NVFP4BlockScaling.nvfp4() and NVFP4BlockScaling().nvfp4() and not NVFP4BlockScaling.mxfp8()
    assert not any(cls.nvfp4() for cls in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
                                           MXFP8BlockScaling))
    assert not any(cls.custom() for cls in (Recipe, DelayedScaling, MXFP8BlockScaling, NVFP4BlockScaling))


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

    with pytest.warns(UserWarning, match="params_dtype, device are not arguments of the recipe, in te-core or in "
                                         "Transformer Engine, and are ignored"):
        rec = TEDelayedScaling(8)
    assert rec.amax_history_len == 8 and rec.fp8_format is Format.E4M3
    config = rec.to_config()
    assert config["recipe"] == "DelayedScaling"
    assert recipe_from_config(config) == DelayedScaling(fp8_format=Format.E4M3, amax_history_len=8)
    assert rec.compatible_key() == DelayedScaling(fp8_format=Format.E4M3, amax_history_len=8).compatible_key()


# ---------------------------------------------------------------- Transformer Engine's other fields

def test_format_values_carry_te_max_fwd_and_max_bwd():
    """TE code reads the FP8 maxima from the format (`Format.HYBRID.value.max_fwd`); te-core's own
    dtype lookups keep working."""
    assert (Format.HYBRID.value.max_fwd, Format.HYBRID.value.max_bwd) == (448, 57344)
    assert (Format.E4M3.value.max_fwd, Format.E4M3.value.max_bwd) == (448, 448)
    assert (Format.E5M2.value.max_fwd, Format.E5M2.value.max_bwd) == (57344, 57344)
    assert (Format.E2M1.value.max_fwd, Format.E2M1.value.max_bwd) == (6, 6)
    assert Format.HYBRID.value == (448, 57344)  # TE's value: a (max_fwd, max_bwd) named tuple
    for fmt in (Format.E4M3, Format.E5M2, Format.HYBRID):
        assert fmt.value.max_fwd == torch.finfo(fmt.forward_dtype).max
        assert fmt.value.max_bwd == torch.finfo(fmt.backward_dtype).max
    assert (Format.HYBRID.forward_dtype, Format.HYBRID.backward_dtype) == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert len(Format) == 4  # no member is an alias of another
    with pytest.raises(ValueError, match="fp8_format=Format.E2M1 is an FP4 format"):
        Float8CurrentScaling(fp8_format=Format.E2M1)
    with pytest.raises(NotImplementedError, match="Format.E2M1 has no te-core data type: NVFP4"):
        Format.E2M1.forward_dtype


ALL_FP8_RECIPES = [DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling]


def _te_fields():
    """TE's recipe fields (its recipe module, transformer_engine/common/recipe/__init__.py),
    that te-core must define rather than drop as unknown arguments."""
    common = {"fp8_format", "fp8_dpa", "fp8_mha", "backward_override"}
    gemms = {"fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"}
    return {
        DelayedScaling: common | {"margin", "amax_history_len", "amax_compute_algo", "scaling_factor_compute_algo",
                                  "reduce_amax"},
        Float8CurrentScaling: common | gemms | {"use_power_2_scales"},
        MXFP8BlockScaling: common | {"margin", "enable_2d_quantization"},
        Float8BlockScaling: common | gemms | {"use_f32_scales", "x_block_scaling_dim", "w_block_scaling_dim",
                                              "grad_block_scaling_dim"},
        NVFP4BlockScaling: {"disable_rht", "disable_stochastic_rounding", "disable_2d_quantization",
                            "row_scaled_activation", "nvfp4_4over6", "nvfp4_4over6_e4m3_use_256",
                            "nvfp4_4over6_err_mode", "fp4_format", "fp8_format", "fp8_dpa", "fp8_mha",
                            "backward_override"},
        QParams: {"power_2_scale", "amax_epsilon", "random_hadamard_transform", "stochastic_rounding",
                  "fp4_2d_quantization"},
        MMParams: {"use_split_accumulator"},
    }


def test_every_te_recipe_field_is_a_field():
    for cls, names in _te_fields().items():
        missing = names - {f.name for f in dataclasses.fields(cls)}
        assert not missing, f"{cls.__name__} lacks Transformer Engine's {sorted(missing)}"


@pytest.mark.parametrize("cls", ALL_FP8_RECIPES + [NVFP4BlockScaling])
def test_te_fields_are_taken_not_dropped_with_a_warning(cls):
    """backward_override=None (TE's default) is a real argument: no 'ignored' warning."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = cls(backward_override=None)
    assert recipe.backward_override is None and recipe == cls()


def test_te_defaults_of_the_new_fields(monkeypatch):
    for name in ("NVTE_BACKWARD_OVERRIDE", "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES",
                 "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"):
        monkeypatch.delenv(name, raising=False)
    assert all(cls().backward_override is None for cls in ALL_FP8_RECIPES)
    assert Float8CurrentScaling().use_power_2_scales is False
    assert Float8BlockScaling().use_f32_scales is False
    assert MXFP8BlockScaling().enable_2d_quantization is False
    q = QParams()
    assert not (q.random_hadamard_transform or q.stochastic_rounding or q.fp4_2d_quantization)


@pytest.mark.parametrize("cls", [Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling])
@pytest.mark.parametrize("value", ["high_precision", "dequantized"])
def test_backward_override_te_modes_are_taken(cls, value):
    """(What they do: tests/modules/test_backward_override.py.)"""
    assert cls(backward_override=value).backward_override == value


def test_backward_override_validation_as_transformer_engine(monkeypatch):
    with pytest.raises(ValueError, match="delayed scaling supports only backward_override=None"):
        DelayedScaling(backward_override="high_precision")
    for cls in ALL_FP8_RECIPES + [NVFP4BlockScaling]:
        with pytest.raises(ValueError, match="backward_override must be None, 'high_precision' or 'dequantized'"):
            cls(backward_override="fp32")
    # TE's environment default: the recipes that take it read it; DelayedScaling (which supports
    # only None in TE) and so te-core's default recipe keep building
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "dequantized")
    assert Float8CurrentScaling().backward_override == "dequantized"
    assert DelayedScaling().backward_override is None
    assert NVFP4BlockScaling().backward_override == "dequantized"


def test_current_scaling_use_power_2_scales_rounds_every_scale_to_a_power_of_2(monkeypatch):
    """TE's current-scaling quantizers read use_power_2_scales (not the QParams): True gives every
    tensor kind power-of-2 scales, amax_epsilon kept; the quantizers te-core builds follow."""
    from te_core.quantization.roles import gemm_slots

    monkeypatch.delenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", raising=False)
    recipe = Float8CurrentScaling(use_power_2_scales=True, fp8_quant_fwd_inp=QParams(amax_epsilon=1e-6))
    assert all(getattr(recipe, n).power_2_scale for n in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight",
                                                           "fp8_quant_bwd_grad"))
    assert recipe.fp8_quant_fwd_inp.amax_epsilon == 1e-6
    state = recipe.make_state(gemm_slots(), torch.device("cpu"))
    quantizers = [state.quantizer(slot.name) for slot in gemm_slots()]
    assert quantizers and all(q.power_2_scale for q in quantizers)
    x = torch.tensor([[3.0, -1.5, 0.25, 2.0]])  # amax 3: scale 448 / 3, rounded down to 128
    role = gemm_slots()[0].role
    assert recipe.quantizer_for(role).quantize(x).rowwise().scale_inv.item() == 1 / 128
    assert Float8CurrentScaling().quantizer_for(role).quantize(x).rowwise().scale_inv.item() == pytest.approx(3 / 448)
    assert not Float8CurrentScaling().fp8_quant_fwd_inp.power_2_scale
    assert recipe_from_config(recipe.to_config()) == recipe
    monkeypatch.setenv("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "1")  # TE's environment default
    assert Float8CurrentScaling().use_power_2_scales and Float8CurrentScaling().fp8_quant_fwd_weight.power_2_scale


def test_block_scaling_use_f32_scales_turns_power_of_2_scales_off(monkeypatch):
    """TE's recipe defaults take power_2_scale = not use_f32_scales: True gives each block the
    float32 scale fp8_max / amax (not rounded down to a power of 2)."""
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    default, f32 = Float8BlockScaling(), Float8BlockScaling(use_f32_scales=True)
    assert default.fp8_quant_fwd_inp.power_2_scale and not default.use_f32_scales
    assert not any(getattr(f32, n).power_2_scale for n in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight",
                                                           "fp8_quant_bwd_grad"))
    from te_core.quantization.roles import gemm_slots

    role = gemm_slots()[0].role
    x = torch.full((1, 128), 3.0)
    x[0, 0] = 5.0  # block amax 5: scale 448 / 5 = 89.6, rounded down to a power of 2: 64
    assert f32.quantizer_for(role).quantize(x).rowwise().scale_inv.item() == pytest.approx(5 / 448)
    assert default.quantizer_for(role).quantize(x).rowwise().scale_inv.item() == 1 / 64
    assert recipe_from_config(f32.to_config()) == f32
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")  # TE's environment default
    assert Float8BlockScaling().use_f32_scales and not Float8BlockScaling().fp8_quant_bwd_grad.power_2_scale


_FLAG_ENV = {"use_power_2_scales": "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES",
             "use_f32_scales": "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"}


@pytest.mark.parametrize("cls, flag", [(Float8CurrentScaling, "use_power_2_scales"),
                                       (Float8BlockScaling, "use_f32_scales")])
@pytest.mark.parametrize("qparams_given", [False, True], ids=["default-qparams", "qparams-given"])
@pytest.mark.parametrize("from_env", [False, True], ids=["flag-passed", "flag-from-env"])
def test_power_2_flag_assigned_or_replaced_is_the_recipe_built_with_it(monkeypatch, gen, cls, flag, qparams_given,
                                                                        from_env):
    """The fp8_quant_* QParams follow the flag and the QParams given, never an earlier value of the
    flag: assigning it (either way, also over its environment default) or dataclasses.replace
    with it changed gives the recipe built with the new value, QParams and quantizers alike."""
    from te_core.quantization.roles import gemm_slots

    names = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")
    epsilons = (torch.rand(3, generator=gen) * 1e-3).tolist()
    given = {n: QParams(power_2_scale=bool(i % 2), amax_epsilon=e) for i, (n, e) in enumerate(zip(names, epsilons))}
    kwargs = given if qparams_given else {}
    x = torch.randn(4, 128, generator=gen) * (1 + 9 * torch.rand(4, 1, generator=gen))
    role = gemm_slots()[0].role

    def made(value):
        if from_env:
            monkeypatch.setenv(_FLAG_ENV[flag], "1" if value else "0")
            return cls(**kwargs)
        return cls(**{flag: value}, **kwargs)

    for start in (True, False):
        for end in (True, False):
            want = cls(**{flag: end}, **kwargs)
            assigned = made(start)
            setattr(assigned, flag, end)
            replaced = dataclasses.replace(made(start), **{flag: end})
            for recipe in (assigned, replaced):
                assert recipe == want, (start, end)
                assert [getattr(recipe, n) for n in names] == [getattr(want, n) for n in names]
                got = recipe.quantizer_for(role).quantize(x).rowwise().scale_inv
                assert torch.equal(got, want.quantizer_for(role).quantize(x).rowwise().scale_inv)
            setattr(assigned, flag, start)  # and back again
            assert assigned == cls(**{flag: start}, **kwargs)
    forcing = flag == "use_power_2_scales"  # the value of the flag that forces power_2_scale, and to what
    r = cls(**{flag: True}, **kwargs)
    assert all(getattr(r, n).power_2_scale is forcing for n in names)
    r.fp8_quant_fwd_inp = QParams(power_2_scale=not forcing, amax_epsilon=epsilons[0])  # assigned under the flag
    assert r.fp8_quant_fwd_inp == QParams(power_2_scale=forcing, amax_epsilon=epsilons[0])
    setattr(r, flag, False)
    assert r.fp8_quant_fwd_inp == QParams(power_2_scale=not forcing, amax_epsilon=epsilons[0])


def test_mxfp8_2d_quantization_is_refused_naming_field_and_value():
    assert MXFP8BlockScaling(enable_2d_quantization=False) == MXFP8BlockScaling()
    with pytest.raises(NotImplementedError, match=r"enable_2d_quantization=True \(one E8M0 scale per 32x32 weight "
                                                  r"tile\) is not supported by te-core yet"):
        MXFP8BlockScaling(enable_2d_quantization=True)
    with pytest.raises(ValueError, match="enable_2d_quantization must be True or False"):
        MXFP8BlockScaling(enable_2d_quantization="maybe")


@pytest.mark.parametrize("option", ["random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization"])
def test_nvfp4_qparams_options_are_refused_by_fp8_recipes(option):
    params = QParams(**{option: True})  # constructible: NVFP4BlockScaling's own options
    with pytest.raises(NotImplementedError, match=f"fp8_quant_bwd_grad.{option}=True is not supported: it is an "
                                                  "NVFP4 option"):
        Float8CurrentScaling(fp8_quant_bwd_grad=params)
    with pytest.raises(NotImplementedError, match=f"{option}=True"):
        Float8BlockScaling(fp8_quant_fwd_inp=params)
    with pytest.raises(ValueError, match=f"QParams: {option} must be True or False"):
        QParams(**{option: 2})


def test_unknown_names_still_warn_and_name_te_fields_in_the_list():
    with pytest.warns(UserWarning, match=r"MXFP8BlockScaling: device is not an argument of the recipe, in te-core "
                                         r"or in Transformer Engine, and is ignored \(Transformer Engine's recipes "
                                         r"ignore arguments they do not define\); its arguments: backward_override, "
                                         r"enable_2d_quantization, fp8_dpa"):
        MXFP8BlockScaling(device="cpu")


# ---------------------------------------------------------------- NVFP4 (importable, refused on use)

def test_nvfp4_recipe_has_te_fields_defaults_and_checks(monkeypatch):
    for name in ("NVTE_NVFP4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION",
                 "NVTE_NVFP4_ROW_SCALED_ACTIVATION", "NVTE_NVFP4_4OVER6", "NVTE_NVFP4_4OVER6_E4M3_USE_256",
                 "NVTE_NVFP4_4OVER6_ERR_MODE", "NVTE_BACKWARD_OVERRIDE"):
        monkeypatch.delenv(name, raising=False)
    r = NVFP4BlockScaling()
    assert (r.fp4_format, r.fp8_format) == (Format.E2M1, Format.E4M3)
    assert not (r.disable_rht or r.disable_stochastic_rounding or r.disable_2d_quantization or r.row_scaled_activation)
    assert (r.nvfp4_4over6, r.nvfp4_4over6_e4m3_use_256, r.nvfp4_4over6_err_mode) == ("none", "all", "MAE")
    assert not (r.fp8_dpa or r.fp8_mha) and r.backward_override is None
    # TE's derived per-tensor options: RHT on inputs and gradients, 2D weights, stochastic rounding for gradients
    assert r.fp4_quant_fwd_inp == QParams(random_hadamard_transform=True)
    assert r.fp4_quant_fwd_weight == QParams(fp4_2d_quantization=True)
    assert r.fp4_quant_bwd_grad == QParams(random_hadamard_transform=True, stochastic_rounding=True)
    assert NVFP4BlockScaling(disable_rht=True).fp4_quant_bwd_grad == QParams(stochastic_rounding=True)
    monkeypatch.setenv("NVTE_NVFP4_4OVER6_ERR_MODE", "mse")
    assert NVFP4BlockScaling().nvfp4_4over6_err_mode == "MSE"
    for kwargs, message in [(dict(fp4_format=Format.E4M3), "fp4_format must be Format.E2M1"),
                            (dict(fp8_format=Format.HYBRID), "fp8_format .* must be Format.E4M3"),
                            (dict(nvfp4_4over6="some"), "nvfp4_4over6 must be one of 'none', 'weights'"),
                            (dict(nvfp4_4over6_err_mode="L1"), "nvfp4_4over6_err_mode must be one of 'MAE', 'MSE'")]:
        with pytest.raises(ValueError, match=message):
            NVFP4BlockScaling(**kwargs)


def test_nvfp4_recipe_is_refused_where_te_core_builds_quantizers():
    from te_core.quantization.roles import gemm_slots

    r = NVFP4BlockScaling()
    for use in (lambda: r.make_state(gemm_slots(), torch.device("cpu")), lambda: r.quantizer_for(gemm_slots()[0].role)):
        with pytest.raises(NotImplementedError, match=r"NVFP4 \(FP4 E2M1 block scaling\) is not supported by te-core "
                                                      "yet; te-core runs the recipes DelayedScaling, "
                                                      "Float8CurrentScaling, Float8BlockScaling and MXFP8BlockScaling"):
            use()


def test_positional_fields_follow_transformer_engines_order():
    """TE 2.x's dataclass fields, in order, for positional calls; te-core's own fields (TE 1.x's
    override_linear_precision, the fp8_quant_* QParams) come after them."""
    algo = lambda amaxes, scale, fp8_max, recipe: scale  # noqa: E731
    d = DelayedScaling(1, Format.E4M3, 16, "most_recent", algo, False, False, False)
    assert (d.margin, d.fp8_format, d.amax_history_len, d.amax_compute_algo) == (1, Format.E4M3, 16, "most_recent")
    assert d.scaling_factor_compute_algo is algo and d.reduce_amax is False
    c = Float8CurrentScaling(True, Format.E4M3)
    assert c.use_power_2_scales and c.fp8_format is Format.E4M3 and c.fp8_quant_fwd_inp.power_2_scale
    b = Float8BlockScaling(True, Format.E4M3, 1, 1)
    assert b.use_f32_scales and b.w_block_scaling_dim == 1 and not b.fp8_quant_fwd_weight.power_2_scale
    m = MXFP8BlockScaling(0, Format.E4M3)
    assert m.margin == 0 and m.fp8_format is Format.E4M3
