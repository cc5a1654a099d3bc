"""The life of a recipe object: the arguments its constructor takes and ignores, the checked
assignments to its fields (te_core.recipe's classes take them as Transformer Engine's do), the
unchanging copy modules run with (in_use), and the registry through which code that torch.compile
runs untraced finds a recipe made outside the trace (its fields as text: remember_config)."""
from __future__ import annotations

import ast
import copy
import functools
import warnings
import weakref
from dataclasses import FrozenInstanceError, fields

import torch

# A recipe's fields as text (repr of its to_config()), kept in its __dict__ and renewed whenever
# a field changes: torch.compile reads it as a constant while tracing, where the fields of a
# recipe made outside the trace may be symbolic values (dynamic shapes, or a field dynamo saw
# change), which code run untraced cannot be handed; equal recipes have equal text, so a new but
# equal recipe object reuses the graph.
_CONFIG = "_te_config"


# The text is (config, {field: key}) for the fields holding a callable (amax_compute_algo,
# scaling_factor_compute_algo), which to_config() records by name only: the key finds the
# callable itself again (callable_for), so that the state made untraced runs the recipe's own.
_CALLABLES = weakref.WeakValueDictionary()
_UNWEAKABLE: dict = {}  # (callables without weak references: builtins)


def remember_config(recipe, untraced: bool = False) -> None:
    """`untraced`: called from code torch.compile runs while tracing rather than traces (a
    recipe's fields are plain values there), where is_compiling() answers True as well."""
    if torch.compiler.is_compiling() and not untraced:  # (a recipe made inside a trace has constant fields)
        return
    config = recipe.to_config()
    keys = {}
    for name, value in config.items():
        if isinstance(value, str) and value.startswith("<callable"):
            function = getattr(recipe, name)
            keys[name] = id(function)
            try:
                _CALLABLES[id(function)] = function
            except TypeError:
                _UNWEAKABLE[id(function)] = function
    text = repr((config, keys))
    try:  # values without a literal form (a numpy scalar) keep the text out: tracing reads the fields
        ast.literal_eval(text)
    except (ValueError, SyntaxError):
        text = None
    recipe.__dict__[_CONFIG] = text


def config_from_text(text: str) -> tuple:
    """(the to_config() dict, {field: callable key}) remember_config wrote (plain values only: no
    code runs)."""
    return ast.literal_eval(text)


def callable_for(key: int):
    """The callable a recipe's text names by `key`, or None where it no longer exists."""
    function = _CALLABLES.get(key)
    return _UNWEAKABLE.get(key) if function is None else function


def _ignores_unknown_arguments(cls):
    """Keyword arguments that are not the recipe's fields are left out with a warning naming them,
    as Transformer Engine's recipes (pydantic dataclasses) ignore arguments they do not define:
    Megatron-LM's recipe subclasses pass their module arguments (params_dtype, device) to the
    recipe too. Every field Transformer Engine's recipe defines is a field here (so never
    ignored): it works, or its unsupported values raise. Being every recipe class's decorator, it
    also gives the class its checked field assignments (_assignable)."""
    init, known = cls.__init__, {f.name for f in fields(cls)}

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        unknown = [name for name in kwargs if name not in known]
        if unknown:
            one = len(unknown) == 1
            verb = "is not an argument" if one else "are not arguments"
            warnings.warn(f"{cls.__name__}: {', '.join(unknown)} {verb} "
                          f"of the recipe, in te-core or in Transformer Engine, and {'is' if one else 'are'} ignored "
                          f"(Transformer Engine's recipes ignore arguments they do not define); its arguments: "
                          f"{', '.join(sorted(known))}", stacklevel=2)
            kwargs = {name: value for name, value in kwargs.items() if name in known}
        init(self, *args, **kwargs)
        remember_config(self)

    cls.__init__ = __init__
    _assignable(cls)
    return cls


def _same(current, value) -> bool:
    try:
        return current is value or (type(current) is type(value) and bool(current == value))
    except Exception:  # noqa: BLE001 - a value that cannot be compared is a change
        return False


class FrozenRecipeError(FrozenInstanceError):
    """An assignment te-core refuses: to the copy of a recipe that modules run with (in_use), or
    to an attribute that is not one of the recipe's fields."""


# Keys in a recipe's __dict__ (never dataclass fields): how many assignments it has taken
# (Recipe._te_version), the copy in_use() made of it and at which count, the mark of such a copy.
_VERSION, _IN_USE, _COPY = "_te_version", "_te_in_use", "_te_copy"


def _assignable(cls) -> None:
    """Assignments to a recipe's fields, as Transformer Engine's recipes take them (its tests and
    tutorials set `recipe.backward_override = ...` on a copy): the value is checked as the
    constructor checks it (an invalid one raises and leaves the recipe as it was), the recipe's
    derived values follow, and the next te.autocast (or quantized_model_init,
    make_graphed_callables) runs with it. Eager modules never see the object itself: they run
    with in_use(recipe), a copy made once per change, so a change cannot alter a state in the
    middle of a step (traced, see in_use). Attributes that are not fields are refused on
    te-core's own recipe classes (a misspelt field would otherwise be set and never read); a
    subclass's own attributes (Megatron-LM's) are its business."""
    names = {f.name for f in fields(cls)}

    def __setattr__(self, name, value):
        if self.__dict__.get(_COPY):
            raise FrozenRecipeError(
                f"{type(self).__name__}.{name}: this is te-core's copy of a recipe in use, which does not change; "
                f"assign to the recipe you passed to te.autocast (or make a new one)")
        if name in names:
            if not _same(getattr(self, name), value):  # (TE code re-assigns fields their own values)
                _assign(self, name, value)
            return
        if type(self) is cls and name not in self.__dict__:
            raise FrozenRecipeError(f"{cls.__name__} has no field {name!r}; its fields: {', '.join(sorted(names))}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        if name in names or type(self) is cls:
            raise FrozenRecipeError(f"{type(self).__name__}.{name} cannot be deleted (a recipe's fields always "
                                    "have a value); assign the value you want instead")
        object.__delattr__(self, name)

    cls.__setattr__, cls.__delattr__ = __setattr__, __delattr__


def _assign(recipe, name: str, value) -> None:
    """recipe.name = value, checked by the recipe's own __post_init__ on a copy first."""
    candidate = copy.copy(recipe)
    object.__setattr__(candidate, name, value)
    post_init = getattr(candidate, "__post_init__", None)
    if post_init is not None:
        post_init()
    for key, new in candidate.__dict__.items():
        if key not in (_VERSION, _IN_USE, _COPY, _CONFIG):
            object.__setattr__(recipe, key, new)
    object.__setattr__(recipe, _VERSION, recipe._te_version + 1)
    remember_config(recipe)


def in_use(recipe: "Recipe") -> "Recipe":
    """The recipe modules run with for `recipe`: a copy of its present fields that never changes
    (assignments to it are refused), made at the first use after each change to `recipe` and
    kept. Module states are bound to it, so a change to `recipe` reaches them at the next
    te.autocast as a new recipe object of the same kind would: states carry over, cached FP8
    weights are cast again. Traced by torch.compile, the recipe itself: a trace can neither copy
    it nor read this bookkeeping without guarding on it (an eager step's copy would then
    recompile the graph). A state bound to the recipe itself notices an assignment by its
    _te_version (QuantizedModule.new_quantization_step), which dynamo guards on."""
    if torch.compiler.is_compiling():
        return recipe
    return frozen_copy(recipe)


def frozen_copy(recipe: "Recipe") -> "Recipe":
    """in_use's copy, also while tracing (code torch.compile runs untraced binds states to it)."""
    state = recipe.__dict__
    if state.get(_COPY):
        return recipe
    version = recipe._te_version
    made = state.get(_IN_USE)
    if made is not None and made[0] == version:
        return made[1]
    frozen = copy.copy(recipe)
    frozen.__dict__.pop(_IN_USE, None)
    frozen.__dict__[_COPY] = True
    state[_IN_USE] = (version, frozen)
    return frozen
