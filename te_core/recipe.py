"""Quantization recipes: what to quantize to and how scales are chosen (Transformer Engine's names
and defaults).

A recipe is a dataclass validated on construction and on each assignment to a field. It never
runs math itself: for a module's quantizer slots it produces the scaling state and one quantizer
per slot (`make_state`), so modules never ask which recipe is active. Modules run with
`in_use(recipe)`, a copy that never changes, so that changing a recipe between steps is a new
recipe to them.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ._recipe_fields import SCALARS, bools_of, convert_fields, enum_member, instance_of
from ._recipe_objects import (  # noqa: F401 (re-exported: te_core's modules and TE code import them from here)
    FrozenRecipeError,
    _ignores_unknown_arguments,
    config_from_text,
    frozen_copy,
    in_use,
)

__all__ = [
    "Format", "MMParams", "QParams", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
    "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "recipe_from_config", "is_nvfp4_available",
]


class _FormatHelper(NamedTuple):
    """A Format's value, as Transformer Engine's: the largest finite magnitude of its forward
    (activations, weights) and backward (gradients) data type."""

    max_fwd: float
    max_bwd: float


class Format(enum.Enum):
    """Data formats of a recipe: forward (activations, weights) and backward (gradients).
    `Format.HYBRID.value.max_fwd` is the forward type's largest finite value, as in Transformer
    Engine. E2M1 (FP4) is NVFP4BlockScaling's fp4_format only; te-core does not run it."""

    E2M1 = _FormatHelper(max_fwd=6, max_bwd=6)
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)  # E4M3 forward, E5M2 backward: TE's default for training

    @property
    def forward_dtype(self) -> torch.dtype:
        return _dtypes(self)[0]

    @property
    def backward_dtype(self) -> torch.dtype:
        return _dtypes(self)[1]


# (forward, backward) torch dtype of each FP8 format, by member name (E2M1 has none in te-core)
_FORMAT_DTYPES = {
    "E4M3": (torch.float8_e4m3fn, torch.float8_e4m3fn),
    "E5M2": (torch.float8_e5m2, torch.float8_e5m2),
    "HYBRID": (torch.float8_e4m3fn, torch.float8_e5m2),
}


def _dtypes(fmt: Format) -> Tuple[torch.dtype, torch.dtype]:
    if fmt.name not in _FORMAT_DTYPES:
        raise NotImplementedError(f"Format.{fmt.name} has no te-core data type: {NVFP4_UNSUPPORTED}")
    return _FORMAT_DTYPES[fmt.name]


def _check_format(recipe: "Recipe") -> None:
    fmt = recipe.fp8_format
    if fmt is Format.E2M1:
        raise ValueError(f"{type(recipe).__name__}: fp8_format=Format.E2M1 is an FP4 format (NVFP4BlockScaling's "
                         "fp4_format), not an FP8 one; use Format.HYBRID or Format.E4M3")
    if fmt is Format.E5M2:
        raise ValueError(
            f"{type(recipe).__name__}: pure E5M2 training is not supported (E5M2 has too few mantissa bits "
            "for activations and weights); use fp8_format=Format.HYBRID (E4M3 forward, E5M2 gradients)"
        )


def _check_number(owner: str, name: str, value, *, minimum: float, integer: bool = False) -> None:
    """`value` (of its field's type already: _convert) must be finite and >= minimum."""
    if (not integer and not math.isfinite(value)) or value < minimum:
        kind = "an int" if integer else "a number"
        raise ValueError(f"{owner}: {name} must be {kind} >= {minimum:g} and finite, got {value!r}")


@dataclass(frozen=True)
class QParams:
    """Per-tensor-kind options of the current and block scaling recipes."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    # Transformer Engine's NVFP4 options (its FP8 recipes do not read them): te-core's FP8 recipes
    # refuse True, NVFP4BlockScaling records them
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False

    def __post_init__(self):
        _convert(self)
        # a NaN epsilon makes every scale NaN, an infinite one every scale 0
        _check_number("QParams", "amax_epsilon", self.amax_epsilon, minimum=0.0)
        if self.amax_epsilon > _FLOAT32_MAX:  # (casts take it as a float32, which cannot hold it)
            raise ValueError(f"QParams: amax_epsilon={self.amax_epsilon!r} is above float32's largest value "
                             f"({_FLOAT32_MAX!r}), and scales are float32; give an amax_epsilon <= {_FLOAT32_MAX!r}")


_FP4_QPARAMS = ("random_hadamard_transform", "stochastic_rounding", "fp4_2d_quantization")
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class MMParams:
    """How an FP8 GEMM accumulates (Transformer Engine's MMParams). use_split_accumulator=False
    lets the backend keep the tensor cores' own accumulator for the whole K loop (Hopper's fast
    FP8 accumulation: quicker, less exact as K grows); True promotes partial sums to float32."""

    use_split_accumulator: bool = True

    def __post_init__(self):
        _convert(self)


class _OverrideLinearPrecision(NamedTuple):
    """Transformer Engine's per-GEMM switch to high precision under FP8 (fprop, dgrad, wgrad)."""

    fprop: bool = False
    dgrad: bool = False
    wgrad: bool = False


# Each field's values by its annotation, converted as Transformer Engine's pydantic recipes
# convert them (16.0 -> 16, 0 -> False, a dict -> MMParams), before any recipe checks them
_CONVERTERS = {**SCALARS, "Format": enum_member(Format), "QParams": instance_of(QParams),
               "MMParams": instance_of(MMParams), "_OverrideLinearPrecision": bools_of(_OverrideLinearPrecision)}


def _convert(recipe) -> None:
    convert_fields(recipe, _CONVERTERS)


GEMMS = ("fprop", "dgrad", "wgrad")
# Transformer Engine's choice for recipes without fp8_gemm_* fields (its constants for delayed
# scaling): forward GEMMs fast, gradient GEMMs (summed over every token) split
_DEFAULT_SPLIT = {"fprop": False, "dgrad": True, "wgrad": True}


def default_split_accumulator(gemm: str) -> bool:
    return _DEFAULT_SPLIT[gemm]


class Recipe:
    """Base of every recipe. Subclasses are dataclasses whose fields are set through
    _assignable (checked assignments) and read by modules through in_use."""

    # Its fields as text, renewed with every change (_recipe_objects.remember_config); None for
    # a recipe made inside a torch.compile trace, whose fields are constants there
    _te_config = None

    def split_accumulator(self, gemm: str) -> bool:
        """Whether this recipe's `gemm` ("fprop", "dgrad" or "wgrad") accumulates in float32: its
        fp8_gemm_<gemm> field where it has one, else Transformer Engine's fixed choice."""
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {', '.join(GEMMS)}, got {gemm!r}")
        params = getattr(self, f"fp8_gemm_{gemm}", None)
        return default_split_accumulator(gemm) if params is None else params.use_split_accumulator

    def gemm_in_fp8(self, gemm: str) -> bool:
        """Whether this recipe runs `gemm` ("fprop", "dgrad" or "wgrad") of an FP8 layer in FP8:
        every GEMM does, except where DelayedScaling's override_linear_precision keeps the wgrad
        in high precision."""
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {', '.join(GEMMS)}, got {gemm!r}")
        return True

    # Whether its forward casts write state that outlives the step (DelayedScaling's amax
    # histories): a recompute must then replay the forward's scales, not re-run its casts.
    keeps_state = False
    # How many assignments to its fields the recipe has taken (_assign; a class default, so that
    # a module's check per step is one attribute read, which torch.compile guards on)
    _te_version = 0

    def make_state(self, slots: Sequence, device: torch.device):
        """The scaling state and quantizers of a module's `slots` (te_core.quantization.QuantizerSlot).
        Default: no per-module state, each slot's quantizer from quantizer_for (DelayedScaling
        overrides it with amax histories and scales)."""
        from .quantization.state import StatelessState

        return StatelessState(self, slots)

    def quantizer_for(self, role):
        """A quantizer for a tensor of `role` that needs no per-module state (stateless recipes)."""
        raise NotImplementedError

    def fp8_dtype(self, role) -> torch.dtype:
        return self.fp8_format.forward_dtype if role.direction == "forward" else self.fp8_format.backward_dtype

    def to_config(self) -> Dict[str, Any]:
        """Plain values only (checkpoint-safe); callables are recorded by name."""
        config: Dict[str, Any] = {"recipe": recipe_name(self)}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Format):
                value = value.name
            elif isinstance(value, QParams):
                value = {"power_2_scale": value.power_2_scale, "amax_epsilon": float(value.amax_epsilon)}
            elif isinstance(value, MMParams):
                value = {"use_split_accumulator": value.use_split_accumulator}
            elif isinstance(value, _OverrideLinearPrecision):
                value = value._asdict()
            elif callable(value):
                value = f"<callable {getattr(value, '__qualname__', type(value).__name__)}>"
            config[f.name] = value
        return config

    def compatible_key(self) -> tuple:
        """What must agree for saved scaling state to be reused (checked on checkpoint load); an
        amax_history_len does not need to (the history is fitted to the recipe's)."""
        return (recipe_name(self), self.fp8_format.name)

    # Transformer Engine's type queries, for user code ported from TE (te_core itself never calls
    # them): class methods as in TE, so `recipe.mxfp8()` and `MXFP8BlockScaling.mxfp8()` both work.
    @classmethod
    def delayed(cls) -> bool:
        return issubclass(cls, DelayedScaling)

    @classmethod
    def float8_current_scaling(cls) -> bool:
        return issubclass(cls, Float8CurrentScaling)

    @classmethod
    def float8_block_scaling(cls) -> bool:
        return issubclass(cls, Float8BlockScaling)

    @classmethod
    def mxfp8(cls) -> bool:
        return issubclass(cls, MXFP8BlockScaling)

    @classmethod
    def float8_per_tensor_scaling(cls) -> bool:
        return issubclass(cls, (DelayedScaling, Float8CurrentScaling))

    @classmethod
    def nvfp4(cls) -> bool:
        return issubclass(cls, NVFP4BlockScaling)

    @classmethod
    def custom(cls) -> bool:
        """Whether this is a CustomRecipe (user-supplied quantizer factories)."""
        return issubclass(cls, CustomRecipe)


AmaxAlgo = Union[str, Callable[[torch.Tensor], torch.Tensor]]


def _env_flag(name: str) -> Callable[[], bool]:
    """A field default read from Transformer Engine's environment variable `name` ("1": True), as
    TE's recipes read it (te-core reads it when the recipe is built, TE when it is imported)."""
    return lambda: os.getenv(name, "0") == "1"


def _env_str(name: str, default: Optional[str]) -> Callable[[], Optional[str]]:
    return lambda: os.getenv(name, default)


_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")


def _check_backward_override(recipe) -> None:
    """Transformer Engine's backward_override (default from NVTE_BACKWARD_OVERRIDE): None runs the
    backward GEMMs in FP8 as the recipe says; "high_precision" runs them in high precision on the
    layer's original operands (its input and weight as given); "dequantized" runs them in high
    precision on the forward's FP8 operands, dequantized. Either way the forward is the recipe's
    and no output gradient is quantized (no column-wise copies are made in the forward)."""
    owner, value = type(recipe).__name__, recipe.backward_override
    if value not in _BACKWARD_OVERRIDES:
        raise ValueError(f"{owner}: backward_override must be None, 'high_precision' or 'dequantized' (as in "
                         f"Transformer Engine; NVTE_BACKWARD_OVERRIDE sets its default), got {value!r}")


def recipe_name(recipe: "Recipe") -> str:
    """The te-core recipe a recipe is, by name: a subclass (Megatron-LM's TEDelayedScaling) is its
    te-core base, so that checkpoints name a recipe te-core can rebuild."""
    for cls in type(recipe).__mro__:
        if RECIPES.get(cls.__name__) is cls:
            return cls.__name__
    return type(recipe).__name__


@_ignores_unknown_arguments
@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scales from the amax history of earlier steps.

    scale = fp8_max * 2^-margin / amax, amax = max over the last `amax_history_len` steps
    ("max"), the latest step ("most_recent"), or `amax_compute_algo(history) -> amax` (per
    column of the (L, n) history). `scaling_factor_compute_algo(amax, scale, fp8_max, recipe)`
    replaces the scale formula. With `reduce_amax`, amaxes are all-reduced (MAX) over the
    autocast's amax_reduction_group before each update. `override_linear_precision=(False,
    False, True)` runs each layer's weight-gradient GEMM in high precision (Transformer Engine's
    wgrad override).
    """

    keeps_state = True

    # (fields in Transformer Engine's order, for positional arguments; te-core's own after them)
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxAlgo = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    # Transformer Engine allows None only for delayed scaling (and so never reads
    # NVTE_BACKWARD_OVERRIDE here: te-core's default recipe builds with it set)
    backward_override: Optional[str] = None
    # TE 1.x's field (Megatron-LM and Accelerate still pass it); TE 2.x dropped it
    override_linear_precision: _OverrideLinearPrecision = _OverrideLinearPrecision()

    def __post_init__(self):
        _convert(self)
        _check_format(self)
        _check_override(self)
        if self.backward_override is not None:
            if self.backward_override in _BACKWARD_OVERRIDES:
                raise ValueError(f"DelayedScaling: backward_override={self.backward_override!r}: delayed scaling "
                                 "supports only backward_override=None, as in Transformer Engine")
            _check_backward_override(self)
        _check_margin(self)
        _check_number("DelayedScaling", "amax_history_len", self.amax_history_len, minimum=1, integer=True)
        algo = self.amax_compute_algo
        if not callable(algo) and algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling: amax_compute_algo must be 'max', 'most_recent' or a callable "
                f"(history -> amax), got {algo!r}"
            )
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise TypeError("DelayedScaling: scaling_factor_compute_algo must be None or a callable "
                            "(amax, scale, fp8_max, recipe) -> scale")
        if self.fp8_dpa or self.fp8_mha:
            raise NotImplementedError("DelayedScaling: fp8_dpa / fp8_mha (FP8 attention) are not supported "
                                      "by te-core yet; leave them False (attention runs in high precision)")

    def gemm_in_fp8(self, gemm: str) -> bool:
        return super().gemm_in_fp8(gemm) and not getattr(self.override_linear_precision, gemm)

    def make_state(self, slots, device):
        from .quantization.state import DelayedScalingState

        return DelayedScalingState(self, slots, device)


def _check_margin(recipe) -> None:
    """fp8_max * 2^-margin (the update's numerator, as in Transformer Engine) must be a normal
    float32: below its smallest normal number no scale is normal (a subnormal or 0 one has an inf
    reciprocal); above its largest every scale is inf, clamped to float32's largest whatever the
    amax. A negative margin (TE takes any int) doubles the scales per unit instead of halving them."""
    fmt = recipe.fp8_format  # (E4M3 or HYBRID: its forward maximum is the smaller, its backward one the larger)
    low_max, high_max = fmt.value.max_fwd, fmt.value.max_bwd
    largest = math.floor(126 + math.log2(low_max))  # low_max * 2^-largest >= 2^-126
    smallest = math.ceil(math.log2(high_max) - math.log2(_FLOAT32_MAX))  # high_max * 2^-smallest <= float32 max
    # (compared, not computed: 2.0 ** -margin fails for a huge int margin)
    if recipe.margin > largest:
        raise ValueError(
            f"DelayedScaling: margin={recipe.margin!r} is too large: fp8_max * 2**-margin (with Format.{fmt.name}'s "
            f"forward maximum {low_max}) falls below float32's smallest normal number (2**-126), so every scale would "
            f"underflow. The largest margin allowed is {largest} (126 + log2({low_max}), rounded down); each unit "
            "of margin halves every scale")
    if recipe.margin < smallest:
        raise ValueError(
            f"DelayedScaling: margin={recipe.margin!r} is too small: fp8_max * 2**-margin (with Format.{fmt.name}'s "
            f"backward maximum {high_max}) exceeds float32's largest value, so every scale would be inf. The smallest "
            f"margin allowed is {smallest}; each unit of negative margin doubles every scale")


_SUPPORTED_OVERRIDES = ((False, False, False), (False, False, True))


def _check_override(recipe) -> None:
    """override_linear_precision, Transformer Engine's (fprop, dgrad, wgrad) triple of bools, by
    TE's rule: all-False, or (False, False, True), the weight-gradient GEMM in high precision
    (it reads the layer input and the output gradient in their high-precision dtype; the forward
    and dgrad GEMMs stay FP8)."""
    value = recipe.override_linear_precision
    if tuple(value) not in _SUPPORTED_OVERRIDES:
        raise NotImplementedError(
            f"DelayedScaling: override_linear_precision={tuple(value)} is not supported: only the wgrad override "
            "is, as in Transformer Engine. Use (False, False, True) to run the weight-gradient GEMM in high "
            "precision, or (False, False, False) to run every GEMM of an FP8 layer in FP8")


_FP8_QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


def _check_qparams(recipe) -> None:
    for name in _FP8_QPARAMS:
        value = getattr(recipe, name)
        for option in _FP4_QPARAMS:
            if getattr(value, option):
                raise NotImplementedError(
                    f"{type(recipe).__name__}: {name}.{option}=True is not supported: it is an NVFP4 option "
                    "(Transformer Engine's FP8 recipes do not read it) and te-core's FP8 casts round to nearest "
                    f"without transforms; leave {option} False")


# The attribute (outside its fields) of a QParams that a recipe's flag rewrote: the QParams given.
_GIVEN = "_te_given"


def _apply_power_2_flag(recipe, forced: Optional[bool]) -> None:
    """Every fp8_quant_* QParams of `recipe` made from the one given: power_2_scale=`forced`
    (amax_epsilon kept), or as given where `forced` is None. A rewritten QParams carries the one
    given (outside its fields: equality and repr ignore it), so assigning the flag back, or
    dataclasses.replace (which passes the fields as they read), gives what construction gives."""
    for name in _FP8_QPARAMS:
        value = getattr(recipe, name)
        given = value.__dict__.get(_GIVEN, value)
        effective = given
        if forced is not None and given.power_2_scale is not forced:
            effective = dataclasses.replace(given, power_2_scale=forced)
            object.__setattr__(effective, _GIVEN, given)
        if effective is not value:
            object.__setattr__(recipe, name, effective)


def _check_block_recipe_flags(recipe) -> None:
    if recipe.fp8_dpa or recipe.fp8_mha:
        raise NotImplementedError(f"{type(recipe).__name__}: fp8_dpa / fp8_mha (FP8 attention) are not "
                                  "supported by te-core yet; leave them False")


# Object defaults come from functions: a recipe made inside a torch.compile'd function then
# builds them in the trace (dynamo can wrap neither a shared default instance nor a class given
# as the default factory, as it reaches them without a source).
def _qparams() -> QParams:
    return QParams()


def _mm_params() -> MMParams:
    return MMParams()


def _fast_mm_params() -> MMParams:
    return MMParams(use_split_accumulator=False)


@_ignores_unknown_arguments
@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor scales from each tensor's own amax, computed in the same op as the cast."""

    # (fields in Transformer Engine's order, for positional arguments; te-core's own after them)
    # Transformer Engine's switch for power-of-2 scales (default from
    # NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1): True rounds every tensor's scale down to a power
    # of 2, whatever the fp8_quant_* QParams say (TE's current-scaling quantizers read this flag only)
    use_power_2_scales: bool = field(default_factory=_env_flag("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES"))
    fp8_format: Format = Format.HYBRID
    fp8_gemm_fprop: MMParams = field(default_factory=_fast_mm_params)
    fp8_gemm_dgrad: MMParams = field(default_factory=_mm_params)
    fp8_gemm_wgrad: MMParams = field(default_factory=_mm_params)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_str("NVTE_BACKWARD_OVERRIDE", None))
    fp8_quant_fwd_inp: QParams = field(default_factory=_qparams)
    fp8_quant_fwd_weight: QParams = field(default_factory=_qparams)
    fp8_quant_bwd_grad: QParams = field(default_factory=_qparams)

    def __post_init__(self):
        _convert(self)
        _check_format(self)
        _check_block_recipe_flags(self)
        _check_qparams(self)
        _check_backward_override(self)
        _apply_power_2_flag(self, True if self.use_power_2_scales else None)

    def quantizer_for(self, role):
        from .quantization.quantizers import Float8CurrentScalingQuantizer

        params = _qparams_for(self, role)
        return Float8CurrentScalingQuantizer(role, self.fp8_dtype(role), params.power_2_scale, params.amax_epsilon)


def _qparams_for(recipe, role) -> QParams:
    return {"input": recipe.fp8_quant_fwd_inp, "weight": recipe.fp8_quant_fwd_weight,
            "grad_output": recipe.fp8_quant_bwd_grad}[role.value]


def _pow2_qparams() -> QParams:
    return QParams(power_2_scale=True)


@_ignores_unknown_arguments
@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """One scale per block: 1x128 runs for activations and gradients, 128x128 tiles for weights
    (w_block_scaling_dim=2; 1 gives 1x128 runs), power-of-2 scales by default (DeepSeek-V3 style)."""

    # (fields in Transformer Engine's order, for positional arguments; te-core's own after them)
    # Transformer Engine's switch off power-of-2 scales (default from
    # NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1): True gives every block the exact float32 scale
    # fp8_max / amax (every fp8_quant_* QParams' power_2_scale becomes False)
    use_f32_scales: bool = field(default_factory=_env_flag("NVTE_FP8_BLOCK_SCALING_FP32_SCALES"))
    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = field(default_factory=_mm_params)
    fp8_gemm_dgrad: MMParams = field(default_factory=_mm_params)
    fp8_gemm_wgrad: MMParams = field(default_factory=_mm_params)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_str("NVTE_BACKWARD_OVERRIDE", None))
    fp8_quant_fwd_inp: QParams = field(default_factory=_pow2_qparams)
    fp8_quant_fwd_weight: QParams = field(default_factory=_pow2_qparams)
    fp8_quant_bwd_grad: QParams = field(default_factory=_pow2_qparams)

    def __post_init__(self):
        _convert(self)
        _check_format(self)
        _check_block_recipe_flags(self)
        _check_qparams(self)
        _check_backward_override(self)
        _apply_power_2_flag(self, False if self.use_f32_scales else None)
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            _check_number("Float8BlockScaling", name, getattr(self, name), minimum=1, integer=True)
        for gemm in GEMMS:
            if not self.split_accumulator(gemm):
                raise ValueError(f"Float8BlockScaling: block-scaled GEMMs accumulate in float32; leave "
                                 f"fp8_gemm_{gemm} at MMParams(use_split_accumulator=True)")
        for name in ("x_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) != 1:
                raise ValueError(f"Float8BlockScaling: {name}={getattr(self, name)!r} is not supported; activations "
                                 "and gradients use 1x128 blocks (1)")
        if self.w_block_scaling_dim not in (1, 2):
            raise ValueError(f"Float8BlockScaling: w_block_scaling_dim must be 1 (1x128) or 2 (128x128), "
                             f"got {self.w_block_scaling_dim!r}")

    def quantizer_for(self, role):
        from .quantization.quantizers import Float8BlockQuantizer

        params = _qparams_for(self, role)
        block_2d = role.value == "weight" and self.w_block_scaling_dim == 2
        return Float8BlockQuantizer(role, self.fp8_dtype(role), block_2d, params.power_2_scale, params.amax_epsilon)


@_ignores_unknown_arguments
@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """OCP MXFP8: a power-of-two E8M0 scale per 32 consecutive elements (emulated GEMM where the
    backend lacks it: the capability check declines and the reference backend runs, with a warning)."""

    margin: int = 0  # (fields in Transformer Engine's order, for positional arguments)
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_str("NVTE_BACKWARD_OVERRIDE", None))
    enable_2d_quantization: bool = False

    def __post_init__(self):
        _convert(self)
        _check_format(self)
        _check_block_recipe_flags(self)
        _check_backward_override(self)
        if self.enable_2d_quantization:
            raise NotImplementedError(
                "MXFP8BlockScaling: enable_2d_quantization=True (one E8M0 scale per 32x32 weight tile) is not "
                "supported by te-core yet: every tensor, weights included, gets one scale per 32 consecutive "
                "elements (enable_2d_quantization=False, the default)")
        if self.margin != 0:  # Transformer Engine accepts it and ignores it: te-core says so instead
            raise ValueError(
                f"MXFP8BlockScaling: margin={self.margin!r} is not used: each 32-element block's E8M0 scale is "
                "the power of two that fits the block's amax; leave margin at 0"
            )

    def quantizer_for(self, role):
        from .quantization.quantizers import MXFP8Quantizer

        return MXFP8Quantizer(role, self.fp8_dtype(role))


# Why te-core refuses NVFP4: raised by every use of NVFP4BlockScaling, is_nvfp4_available's reason
NVFP4_UNSUPPORTED = ("NVFP4 (FP4 E2M1 block scaling) is not supported by te-core yet; te-core runs the recipes "
                     "DelayedScaling, Float8CurrentScaling, Float8BlockScaling and MXFP8BlockScaling: pass one of "
                     "them as the recipe instead (MXFP8BlockScaling() is the nearest: FP8 with one scale per 32 "
                     "values), or run without quantization (te.autocast(enabled=False))")

_NVFP4_4OVER6_SCOPES = ("none", "weights", "activations", "all")
_NVFP4_4OVER6_ERR_MODES = ("MAE", "MSE")


@_ignores_unknown_arguments
@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """Transformer Engine's NVFP4 recipe (E2M1 values, an E4M3 scale per 16 elements and a float32
    scale per tensor), with its fields, defaults (read from the same NVTE_NVFP4_* environment
    variables) and checks, so that code importing it runs. te-core does not implement NVFP4:
    building the recipe works, using it (a module forward under te.autocast, quantized_model_init,
    te.convert_model) raises NotImplementedError; te.is_nvfp4_available() is False."""

    disable_rht: bool = field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_RHT"))
    disable_stochastic_rounding: bool = field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"))
    disable_2d_quantization: bool = field(default_factory=_env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION"))
    row_scaled_activation: bool = field(default_factory=_env_flag("NVTE_NVFP4_ROW_SCALED_ACTIVATION"))
    nvfp4_4over6: str = field(default_factory=_env_str("NVTE_NVFP4_4OVER6", "none"))
    nvfp4_4over6_e4m3_use_256: str = field(default_factory=_env_str("NVTE_NVFP4_4OVER6_E4M3_USE_256", "all"))
    nvfp4_4over6_err_mode: str = field(
        default_factory=lambda: os.getenv("NVTE_NVFP4_4OVER6_ERR_MODE", "MAE").upper())
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = field(default_factory=_env_str("NVTE_BACKWARD_OVERRIDE", None))

    def __post_init__(self):
        _convert(self)
        owner = "NVFP4BlockScaling"
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"{owner}: fp4_format must be Format.E2M1, got {self.fp4_format!r}")
        if self.fp8_format is not Format.E4M3:
            raise ValueError(f"{owner}: fp8_format (the block scales' format) must be Format.E4M3, "
                             f"got {self.fp8_format!r}")
        if self.backward_override not in _BACKWARD_OVERRIDES:
            raise ValueError(f"{owner}: backward_override must be None, 'high_precision' or 'dequantized', "
                             f"got {self.backward_override!r}")
        for name, allowed in (("nvfp4_4over6", _NVFP4_4OVER6_SCOPES),
                              ("nvfp4_4over6_e4m3_use_256", _NVFP4_4OVER6_SCOPES),
                              ("nvfp4_4over6_err_mode", _NVFP4_4OVER6_ERR_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{owner}: {name} must be one of {', '.join(map(repr, allowed))}, "
                                 f"got {getattr(self, name)!r}")
        # Transformer Engine's per-tensor-kind options, derived from the switches above
        object.__setattr__(self, "fp4_quant_fwd_inp", QParams(random_hadamard_transform=not self.disable_rht))
        object.__setattr__(self, "fp4_quant_fwd_weight",
                           QParams(fp4_2d_quantization=not self.disable_2d_quantization))
        object.__setattr__(self, "fp4_quant_bwd_grad", QParams(
            random_hadamard_transform=not self.disable_rht,
            stochastic_rounding=not self.disable_stochastic_rounding))

    # The one place te-core turns a recipe into quantizers (modules, quantized_model_init and
    # convert_model all build their state here): NVFP4 stops at it.
    def make_state(self, slots, device):
        raise NotImplementedError(f"NVFP4BlockScaling: {NVFP4_UNSUPPORTED}")

    def quantizer_for(self, role):
        raise NotImplementedError(f"NVFP4BlockScaling: {NVFP4_UNSUPPORTED}")

    def fp8_dtype(self, role) -> torch.dtype:
        raise NotImplementedError(f"NVFP4BlockScaling: {NVFP4_UNSUPPORTED}")

    def split_accumulator(self, gemm: str) -> bool:
        raise NotImplementedError(f"NVFP4BlockScaling: {NVFP4_UNSUPPORTED}")


def is_nvfp4_available(return_reason: bool = False) -> Union[bool, Tuple[bool, str]]:
    """Whether te-core runs the NVFP4 recipe: False on every backend (te-core does not implement
    NVFP4). A bool, or (False, reason) with return_reason=True, as Transformer Engine's."""
    return (False, NVFP4_UNSUPPORTED) if return_reason else False


RECIPES = {cls.__name__: cls for cls in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)}


def recipe_from_config(config: Dict[str, Any], callables: Optional[Dict[str, Callable]] = None) -> Recipe:
    """Inverse of Recipe.to_config. A callable recorded by name comes back as the default ("max"
    / None): the checkpoint keeps the state, the caller's autocast recipe supplies the callable.
    `callables` ({field: callable}) are the recipe's own, for code that torch.compile runs
    untraced (modules/_base._prepare), which rebuilds a live recipe from its text: they go to the
    constructor, and a qfactory among them admits a CustomRecipe, which no config alone rebuilds
    (no checkpoint holds one: a CustomRecipe's state has nothing to save)."""
    config, callables = dict(config), dict(callables or {})
    name = config.pop("recipe", None)
    known = {**RECIPES, "CustomRecipe": CustomRecipe} if "qfactory" in callables else RECIPES
    if name not in known:
        raise ValueError(f"unknown recipe {name!r} in checkpoint; known: {', '.join(RECIPES)}")
    cls = known[name]
    kwargs = {f.name: callables[f.name] for f in fields(cls) if f.name in callables}
    for f in fields(cls):
        if f.name not in config or f.name in kwargs:
            continue
        value = config[f.name]
        if f.name == "fp8_format":
            if value not in _FORMAT_DTYPES:  # (the FP8 formats: E2M1 is no recipe's fp8_format)
                raise ValueError(f"unknown fp8_format {value!r} in the {name} checkpoint config; "
                                 f"known: {', '.join(_FORMAT_DTYPES)}")
            value = Format[value]
        elif f.name == "override_linear_precision":
            value = _OverrideLinearPrecision(**value)
        elif isinstance(value, dict):
            value = (MMParams if f.name.startswith("fp8_gemm_") else QParams)(**value)
        elif isinstance(value, str) and value.startswith("<callable"):
            continue
        kwargs[f.name] = value
    return cls(**kwargs)


# Its own module (it builds on the helpers above); a name of this one, as in Transformer Engine
from .custom_recipe import CustomRecipe  # noqa: E402
