"""Recipe field values as Transformer Engine takes them.

TE declares its recipes, QParams and MMParams as pydantic dataclasses, whose lax mode converts a
value of another type where nothing is lost and refuses the rest: 16.0 or "16" for an int field
is 16 (16.5 and "1e1" are refused), 0/1 and "yes"/"no" for a bool field are False/True (2 and
"maybe" are refused), a dict for an MMParams field is an MMParams. te-core converts the same
values, here and once for every field (by its annotation), before a recipe checks them: a recipe
then holds the field's own type, so that equality, hash, repr and checkpoint configs agree with
those of the recipe given the plain value.
"""
from __future__ import annotations

import dataclasses
import decimal
import math
import numbers
import operator
import os
import re
import sys
import warnings
from typing import Any, Callable, Dict

Converter = Callable[[str, str, Any], Any]

# pydantic's integer strings: ASCII digits, single underscores between them, an optional sign, a
# fraction of zeros only ("16.00"); surrounding whitespace is stripped
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_TRUE_TEXT = ("1", "on", "t", "true", "y", "yes")
_FALSE_TEXT = ("0", "off", "f", "false", "n", "no")


def _text(owner: str, name: str, value, *, bytearrays: bool = False):
    """A str (a str subclass such as a str-valued enum member: its plain text) or bytes (UTF-8) as
    str; None for any other value. pydantic takes a bytearray for a str field only."""
    if isinstance(value, bytes) or (bytearrays and isinstance(value, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{owner}: {name} got bytes that are not UTF-8 text: {value!r}") from None
    return str.__str__(value) if isinstance(value, str) else None


def _is_number(value) -> bool:
    """A real number: Python's, Decimal, or a 0-dimensional numpy/torch scalar (not complex)."""
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        return False
    if isinstance(value, (numbers.Real, decimal.Decimal)):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and getattr(value, "shape", None) == () and not getattr(dtype, "is_complex", False)


def _got(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def to_int(owner: str, name: str, value) -> int:
    if type(value) is int:
        return value
    if isinstance(value, bool):
        return int(value)
    text = _text(owner, name, value)
    if text is not None:
        if not _INT_TEXT.fullmatch(text.strip()):
            raise ValueError(f"{owner}: {name} must be an int, got the string {value!r}, which is not one: give an "
                             "int (16), or a string of decimal digits ('16')")
        return int(text.strip().split(".")[0])
    if _is_number(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
        if not math.isfinite(value):
            raise ValueError(f"{owner}: {name} must be an int, got {_got(value)}: give a finite whole number")
        whole = int(value)
        if bool(whole != value):
            raise ValueError(f"{owner}: {name} must be an int, got {_got(value)}, which has a fractional part; "
                             f"a float is taken only where it is a whole number (16.0 for 16): give an int")
        return whole
    raise TypeError(f"{owner}: {name} must be an int, got {_got(value)}")


def to_bool(owner: str, name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = _text(owner, name, value)
    if text is not None and text.lower() in _TRUE_TEXT + _FALSE_TEXT:
        return text.lower() in _TRUE_TEXT
    if text is None and _is_number(value) and bool(value == 0) | bool(value == 1):
        return bool(value == 1)
    kind = TypeError if text is None and not _is_number(value) else ValueError
    raise kind(f"{owner}: {name} must be True or False, got {_got(value)}: give a bool (0 and 1, and the strings "
               f"{'/'.join(_TRUE_TEXT)} and {'/'.join(_FALSE_TEXT)} in any case, are taken as Transformer Engine "
               "takes them)")


def to_float(owner: str, name: str, value) -> float:
    if type(value) is float:
        return value
    text = _text(owner, name, value)
    if text is not None:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{owner}: {name} must be a number, got the string {value!r}, which is not one: give a "
                             "float (1e-6), or a string of one ('1e-6')") from None
    if isinstance(value, bool) or _is_number(value):
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"{owner}: {name} must be a number a float can hold, got {value!r}") from None
    raise TypeError(f"{owner}: {name} must be a number, got {_got(value)}")


def to_str(owner: str, name: str, value) -> str:
    if type(value) is str:
        return value
    text = _text(owner, name, value, bytearrays=True)
    if text is None:
        raise TypeError(f"{owner}: {name} must be a string, got {_got(value)}")
    return text


def to_optional_str(owner: str, name: str, value):
    return None if value is None else to_str(owner, name, value)


def enum_member(enum_cls) -> Converter:
    """A member of `enum_cls`, or its value (a `Format`'s (max_fwd, max_bwd) tuple), as pydantic
    takes an enum."""
    def convert(owner: str, name: str, value):
        if isinstance(value, enum_cls):
            return value
        if isinstance(value, tuple):
            try:
                return enum_cls(value)
            except (ValueError, TypeError):
                pass
        members = ", ".join(f"{enum_cls.__name__}.{m.name}" for m in enum_cls)
        is_name = isinstance(value, str) and value in enum_cls.__members__
        named = f" (a name: use {enum_cls.__name__}.{value})" if is_name else ""
        raise TypeError(f"{owner}: {name} must be a {enum_cls.__module__}.{enum_cls.__name__}, got {value!r}"
                        f"{named}; one of {members}")
    return convert


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel, for its caller, of the first frame outside te_core (and outside
    the __init__ that dataclasses generate): the user's line that made the recipe."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename == "<string>"):
        frame, level = frame.f_back, level + 1
    return level


def _known_only(owner: str, name: str, cls, given: dict) -> dict:
    """`given` without the keys `cls` does not take, as pydantic leaves them out (with a warning)."""
    known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(cls._fields)
    unknown = [key for key in given if key not in known]
    if unknown:
        warnings.warn(f"{owner}: {name}: {', '.join(map(str, unknown))} {'is' if len(unknown) == 1 else 'are'} not "
                      f"a field of {cls.__name__} and ignored, as Transformer Engine ignores them; its fields: "
                      f"{', '.join(sorted(known))}", stacklevel=_user_stacklevel())
    return {key: item for key, item in given.items() if key in known}


def instance_of(cls) -> Converter:
    """A `cls` (QParams, MMParams), or a dict of its fields, as pydantic takes a dataclass."""
    def convert(owner: str, name: str, value):
        if isinstance(value, dict):
            return cls(**_known_only(owner, name, cls, value))
        if not isinstance(value, cls):
            raise TypeError(f"{owner}: {name} must be a {cls.__module__}.{cls.__name__} (or a dict of its fields), "
                            f"got {value!r}")
        return value
    return convert


def bools_of(tuple_cls) -> Converter:
    """A named tuple of bools (override_linear_precision): a tuple or list of up to its length,
    or a dict of its fields, the ones left out at their defaults, each item taken as to_bool takes
    it, as pydantic takes a NamedTuple."""
    def convert(owner: str, name: str, value):
        fields = tuple_cls._fields
        if isinstance(value, dict):
            given = _known_only(owner, name, tuple_cls, value)
            return tuple_cls(**{key: to_bool(owner, f"{name}.{key}", item) for key, item in given.items()})
        if isinstance(value, (tuple, list)) and len(value) <= len(fields):
            return tuple_cls(*(to_bool(owner, f"{name}.{key}", item) for key, item in zip(fields, value)))
        raise TypeError(f"{owner}: {name} must be {len(fields)} bools ({', '.join(fields)}), got {value!r}")
    return convert


SCALARS: Dict[str, Converter] = {"int": to_int, "bool": to_bool, "float": to_float, "str": to_str,
                                 "Optional[str]": to_optional_str}


def _annotation(field: dataclasses.Field) -> str:
    kind = field.type
    if isinstance(kind, str):
        return kind
    return kind.__name__ if isinstance(kind, type) else str(kind).replace("typing.", "")


def convert_fields(obj, converters: Dict[str, Converter]) -> None:
    """Every field of the dataclass `obj` whose annotation `converters` names, converted in place
    (a frozen dataclass too); other fields (callables) are left as they are."""
    owner = type(obj).__name__
    for field in dataclasses.fields(obj):
        convert = converters.get(_annotation(field))
        if convert is not None:
            value = getattr(obj, field.name)
            new = convert(owner, field.name, value)
            if new is not value:
                object.__setattr__(obj, field.name, new)
