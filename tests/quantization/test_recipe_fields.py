"""Recipe field values as Transformer Engine's pydantic recipes take them (te_core._recipe_fields):
a value TE converts (16.0 -> 16, 0 -> False, "yes" -> True, a dict -> MMParams) gives the
field's own type and value, so the recipe equals, hashes, prints and saves as the one given the
plain value; a value TE refuses raises, naming the field. The cases were checked against TE's
recipe module under pydantic 2."""
from __future__ import annotations

import dataclasses
import decimal
import enum
import fractions
import re

import numpy as np
import pytest
import torch

import te_core as te
import te_core.modules as tm
from te_core.custom_recipe import CustomRecipe
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
)

CLASSES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling,
           CustomRecipe, QParams, MMParams)


class _Mode(str, enum.Enum):
    DEQUANTIZED = "dequantized"


def _int_spellings(value: int) -> list:
    spellings = [float(value), str(value), f" {value}\t", f"{value}.00", str(value).encode(), np.int64(value),
                 np.float32(value), decimal.Decimal(value), fractions.Fraction(value), torch.tensor(value),
                 torch.tensor(float(value))]
    return spellings + ([bool(value)] if value in (0, 1) else [])


_TEXT = {True: ["true", "YES", "On", "t", "y", "1", b"true"], False: ["false", "No", "OFF", "f", "n", "0", b"false"]}


def _bool_spellings(value: bool) -> list:
    return [int(value), float(value), np.bool_(value), np.int8(value), decimal.Decimal(int(value)),
            torch.tensor(value)] + _TEXT[value]


def _float_spellings(value: float) -> list:
    spellings = [str(value), f" {value} ", str(value).encode(), np.float32(value), decimal.Decimal(str(value)),
                 torch.tensor(value, dtype=torch.float64)]
    return spellings + ([int(value)] if value == int(value) else []) + ([bool(value)] if value in (0, 1) else [])


def _str_spellings(value: str) -> list:
    return [value.encode(), bytearray(value.encode()), np.str_(value)]


_KINDS = {"int": _int_spellings, "bool": _bool_spellings, "float": _float_spellings, "str": _str_spellings}

# (field, a value te-core runs) per class: each field's default where the class runs it, else a
# supported value; every field of every class is here (test_every_field_has_cases checks)
_SPECIAL = {
    "backward_override": ("dequantized", [b"dequantized", bytearray(b"dequantized"), _Mode.DEQUANTIZED]),
    "fp8_format": None,  # (its Format's value tuple, below)
    "override_linear_precision": ((False, False, True), [[0, 0, 1], (0.0, "no", "yes"), {"wgrad": 1}]),
    "margin": None,  # (DelayedScaling's: negative and converted values, below; MXFP8's as an int)
}
_CALLABLES = {"amax_compute_algo", "scaling_factor_compute_algo", "qfactory"}


def _factory(role):
    return te.Float8CurrentScalingQuantizer(te.DType.kFloat8E4M3)


def _make(cls, **kwargs):
    return cls(qfactory=_factory, **kwargs) if cls is CustomRecipe else cls(**kwargs)


def _accepted_cases():
    """(cls, field, given, expected) for every convertible field of every class."""
    for cls in CLASSES:
        default = _make(cls)
        for f in dataclasses.fields(cls):
            if f.name in _CALLABLES:
                continue
            value = getattr(default, f.name)
            if f.name == "backward_override" and cls is not DelayedScaling:
                value, spellings = _SPECIAL["backward_override"]
            elif f.name == "backward_override":
                continue  # (DelayedScaling takes None only)
            elif f.name == "override_linear_precision":
                value, spellings = _SPECIAL[f.name]
            elif isinstance(value, Format):
                spellings = [tuple(value.value), (float(value.value.max_fwd), float(value.value.max_bwd))]
            elif isinstance(value, (MMParams, QParams)):
                value = type(value)()
                spellings = [{k.name: getattr(value, k.name) for k in dataclasses.fields(value)}, {}]
            elif f.name == "margin" and cls is DelayedScaling:
                value, spellings = -1, [-1.0, "-1", " -1 ", b"-1", np.int64(-1), decimal.Decimal("-1.0")]
            else:
                spellings = _KINDS[type(value).__name__](value)
            for given in spellings:
                yield pytest.param(cls, f.name, given, value, id=f"{cls.__name__}.{f.name}={given!r:.40}")


@pytest.mark.parametrize("cls, name, given, expected", list(_accepted_cases()))
def test_a_value_transformer_engine_converts_gives_the_fields_own_type(cls, name, given, expected):
    """Constructed with `given`, or assigned it, the recipe holds what it holds made with
    `expected` (its type too) and is that recipe: equal, same hash, repr and checkpoint config."""
    want = _make(cls, **{name: expected})
    expected = getattr(want, name)  # (a plain triple becomes the named one)
    made = [_make(cls, **{name: given})]
    if issubclass(cls, Recipe):  # (QParams and MMParams are frozen: no assignments)
        made.append(_make(cls))
        setattr(made[-1], name, given)
    for recipe in made:
        got = getattr(recipe, name)
        assert got == expected and type(got) is type(expected), (got, type(got))
        assert recipe == want and hash(recipe) == hash(want) and repr(recipe) == repr(want)
        if hasattr(want, "to_config"):
            assert recipe.to_config() == want.to_config()


def test_the_audited_values():
    """margin=-1, amax_history_len=16.0 and reduce_amax=0, which Transformer Engine takes."""
    d = DelayedScaling(margin=-1, amax_history_len=16.0, reduce_amax=0)
    assert (d.margin, d.amax_history_len, d.reduce_amax) == (-1, 16, False)
    assert type(d.amax_history_len) is int and d.reduce_amax is False
    assert d == DelayedScaling(margin=-1, amax_history_len=16, reduce_amax=False)


def test_a_negative_margin_doubles_the_scales(gen):
    """scale = fp8_max * 2**-margin / amax with margin -1 (given as "-1"): the first step's
    scale and the update's, against float64, and the same outputs as margin=-1 given as an int."""
    e4m3_max = 448.0
    x1, x2 = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen) * 10
    outputs = []
    for margin in ("-1", -1):
        torch.manual_seed(0)
        layer = tm.Linear(32, 16)
        rec = DelayedScaling(margin=margin, amax_history_len=4)
        with te.autocast(recipe=rec):
            y1 = layer(x1)
            first = layer.quantization_state()["forward"]["input"]["scale"].clone()
        with te.autocast(recipe=rec):
            y2 = layer(x2)
        updated = layer.quantization_state()["forward"]["input"]["scale"]
        for scale, x in ((first, x1), (updated, x2)):
            want = e4m3_max * 2.0 / x.double().abs().max()
            torch.testing.assert_close(scale.double(), want.reshape(1), rtol=1.3e-6, atol=0)
        outputs.append((y1, y2))
    for a, b in zip(*outputs):
        assert torch.equal(a, b)


_REFUSED = {
    # Transformer Engine's pydantic refusals, per kind of field
    "int": [16.5, "16.5", "1e1", "16.", "0x10", "", float("inf"), float("nan"), None, [1], 1 + 0j,
            bytearray(b"1"), decimal.Decimal("1.5"), np.float64(2.5)],
    "bool": [2, -1, 0.5, float("nan"), "maybe", " true", "2", "", None, [], bytearray(b"1"), np.int64(2)],
    "float": [None, "abc", "", [0.1], 10 ** 400],
    "str": [1, 1.5, None, ["all"]],
    "Optional[str]": [1, 1.5, ["dequantized"]],
    "Format": ["E4M3", "HYBRID", 1, None, [448, 448], (1, 2)],
    "MMParams": [True, None, (True,), {"use_split_accumulator": 2}],
    "QParams": [1e-6, None, (False,), {"amax_epsilon": "abc"}],
    "_OverrideLinearPrecision": [(0, 0, 2), (False,) * 4, "abc", {"wgrad": "maybe"}],
}


def _refused_cases():
    """(cls, field, given, the name the error must say: the field's, or a dict's own key)."""
    for cls in CLASSES:
        for f in dataclasses.fields(cls):
            if f.name in _CALLABLES:
                continue
            for given in _REFUSED[f.type]:
                named = next(iter(given)) if isinstance(given, dict) else f.name
                yield pytest.param(cls, f.name, given, named, id=f"{cls.__name__}.{f.name}={given!r:.40}")
    for cls, name, given in ((DelayedScaling, "amax_compute_algo", "MAX"),
                             (DelayedScaling, "amax_compute_algo", b"max"), (DelayedScaling, "amax_compute_algo", None),
                             (DelayedScaling, "scaling_factor_compute_algo", 1), (CustomRecipe, "qfactory", "f")):
        yield pytest.param(cls, name, given, name, id=f"{cls.__name__}.{name}={given!r:.40}")


@pytest.mark.parametrize("cls, name, given, named", list(_refused_cases()))
def test_a_value_transformer_engine_refuses_raises_naming_the_field(cls, name, given, named):
    """Refused as constructor argument and as assignment, the error naming the field (or the
    field of its MMParams / QParams / triple); a refused assignment leaves the recipe as it was."""
    with pytest.raises((TypeError, ValueError), match=re.escape(named)):
        _make(cls, **{name: given})
    if issubclass(cls, Recipe):  # (QParams and MMParams are frozen: no assignments)
        recipe = _make(cls)
        before = repr(recipe)
        with pytest.raises((TypeError, ValueError), match=re.escape(named)):
            setattr(recipe, name, given)
        assert repr(recipe) == before


def test_every_field_has_cases():
    """A field added to a recipe gets its conversions checked here (its annotation has refusals
    listed, or it is a callable field)."""
    for cls in CLASSES:
        for f in dataclasses.fields(cls):
            assert f.name in _CALLABLES or f.type in _REFUSED, (cls.__name__, f.name, f.type)


def test_a_dict_with_unknown_keys_warns_and_ignores_them():
    """Transformer Engine ignores a dict's keys that are not the dataclass's fields; te-core warns
    naming them, at the caller's line."""
    with pytest.warns(UserWarning, match=r"Float8CurrentScaling: fp8_gemm_fprop: bogus is not a field of MMParams "
                                         r"and ignored.*its fields: use_split_accumulator") as record:
        recipe = Float8CurrentScaling(fp8_gemm_fprop={"use_split_accumulator": 1, "bogus": 2})
    assert recipe.fp8_gemm_fprop == MMParams(use_split_accumulator=True)
    assert record[0].filename == __file__
