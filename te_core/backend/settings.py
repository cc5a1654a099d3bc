"""The environment variables that configure backend selection, parsed and validated in one place.

A value that is not understood is an error that names the accepted values: a typo must never
silently change which backend or which mode runs.
"""
from __future__ import annotations

import difflib
import os
from typing import Iterable, List, Optional, Set, Tuple

from .plugin import BackendError

SWITCH_ON = ("1", "true", "yes", "on")
SWITCH_OFF = ("0", "false", "no", "off", "")


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a close match among `choices`, else ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def env_switch(name: str) -> bool:
    """An on/off environment variable; unset is off."""
    raw = os.environ.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    raise BackendError(
        f"{name}={raw!r} is not an on/off value: use {', '.join(SWITCH_ON)} to turn it on, "
        f"or {', '.join(repr(v) for v in SWITCH_OFF)} (or leave it unset) to turn it off"
    )


def plugin_allowlist(installed: Iterable[str], builtin: str) -> Optional[Set[str]]:
    """The entry-point names TE_BACKEND_PLUGINS allows, or None when it is unset (load all).

    Every name must be an installed plugin's entry point (or the built-in backend, which is always
    loaded): a misspelt name would otherwise drop a backend without a word."""
    raw = os.environ.get("TE_BACKEND_PLUGINS")
    if raw is None:
        return None
    installed = sorted(set(installed))
    listing = ", ".join(installed) or "none"
    names = [n.strip() for n in raw.split(",") if n.strip()]
    if not names:
        raise BackendError(
            f"TE_BACKEND_PLUGINS={raw!r} names no plugin. List entry-point names separated by commas "
            f"(installed plugins: {listing}), or unset it to load every installed plugin; "
            f"TE_BACKEND={builtin} runs on the built-in backend alone"
        )
    unknown = [n for n in names if n not in installed and n != builtin]
    if unknown:
        details = ", ".join(f"{n!r}{did_you_mean(n, installed)}" for n in unknown)
        raise BackendError(
            f"TE_BACKEND_PLUGINS={raw!r} names {details}, which is not an installed plugin. "
            f"Installed plugins (entry-point names): {listing}. Fix the name, or unset TE_BACKEND_PLUGINS "
            f"to load every installed plugin"
        )
    return set(names)


def override_entries(spec: str, ops: Iterable[str]) -> List[Tuple[str, str]]:
    """(op, backend name) pairs of TE_BACKEND_OVERRIDES="op=backend;..."; ops must be contract ops."""
    ops = list(ops)
    entries = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        op, sep, backend_name = (s.strip() for s in item.partition("="))
        if not sep or not op or not backend_name:
            raise BackendError(
                f"TE_BACKEND_OVERRIDES entry {item!r} is not of the form op=backend "
                f"(e.g. TE_BACKEND_OVERRIDES=\"gemm_fp8=reference;layernorm_fwd=reference\")"
            )
        if op not in ops:
            raise BackendError(
                f"TE_BACKEND_OVERRIDES entry {item!r} names unknown op {op!r}{did_you_mean(op, ops)}; "
                f"contract ops: {', '.join(ops)}"
            )
        entries.append((op, backend_name))
    return entries
