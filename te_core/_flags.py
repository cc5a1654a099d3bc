"""The rule every boolean flag of te-core's public API follows, kept below both the modules and
te_core.quantization (te.autocast) so that each can import it.

A flag read by its truthiness turns `bias="no"` into a bias and `autocast(enabled="no")` into
FP8, without a word; so only values that can only mean True or False pass: bool, numpy's bool,
and the ints 0 and 1 (users write `bias=0`). Strings, None, other numbers are refused.
"""
from __future__ import annotations

from typing import Optional


def _is_numpy_bool(value) -> bool:
    kind = type(value)  # (by name: te_core imports numpy nowhere else)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


def _as_bool(value) -> Optional[bool]:
    """`value` as a Python bool, or None where it is not a flag."""
    if isinstance(value, bool):
        return value
    if _is_numpy_bool(value) or (type(value) is int and value in (0, 1)):
        return bool(value)
    return None


def flag(value, name: str, where: str) -> bool:
    """`value` as a Python bool, or a TypeError naming `where`'s argument `name` and the value."""
    result = _as_bool(value)
    if result is None:
        raise TypeError(f"{where}: {name} must be True or False, got {value!r} ({type(value).__name__}); pass a bool "
                        "(a string or other number is not read by its truthiness)")
    return result


def optional_flag(value, name: str, where: str) -> Optional[bool]:
    """flag() for an argument documented as Optional[bool]: None stays None."""
    result = None if value is None else _as_bool(value)
    if result is None and value is not None:
        raise TypeError(f"{where}: {name} must be True, False or None, got {value!r} ({type(value).__name__})")
    return result
