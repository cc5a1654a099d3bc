"""Kernel launches with Triton's per-call argument binding done once per specialization.

`kernel[grid](*args, **kwargs)` makes Triton bind the arguments to the signature, work out the
specialization (dtypes, 16-byte alignment of pointers, integers divisible by 16 or equal to 1),
build a cache key from it and the launch options, read its knobs and check the kernel's globals:
tens of microseconds of host time per launch, paid by every cast of an eager FP8 step. A kernel
decorated with `@launcher` (under `@triton.jit`) is launched the same way, but remembers the
compiled kernel under a key of what Triton specializes on, and on a hit calls the compiled
kernel's launcher directly, as Triton itself does after its lookup.

The key is at least as fine as Triton's (constexpr values exactly, every other argument by the
properties Triton specializes on, the launch options exactly, the current device), so a hit
always names the kernel Triton would have picked. Anything the key does not understand (an
argument of another type, a kernel with pre-run hooks, the interpreter, a Triton whose launch
call differs, a target other than NVIDIA's, a malformed call) takes Triton's own path; launch
hooks (a profiler's) get what Triton gives them. Settings Triton reads when it compiles
(TRITON_DEBUG and the like) apply as they were at a specialization's first launch: change them
before the first step, or set TE_TRITON_FAST_LAUNCH=0, which turns the shortcut off
(switched_on).
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import triton

try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - triton before 3.4 keeps its hooks elsewhere
    _knobs = None

_I32_MIN, _I32_END = -(2**31), 2**31
_Tensor = torch.Tensor
_LAUNCH_CALL = "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,"


def switched_on(value: Optional[str]) -> bool:
    """TE_TRITON_FAST_LAUNCH's value: unset or empty, 1, true, yes, on (any case) turn the
    cache on; 0, false, no, off turn it off; anything else is an error naming the variable."""
    word = (value or "1").strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"TE_TRITON_FAST_LAUNCH={value!r} is not understood: set it to 1 (the default: launches "
                     "reuse compiled kernels directly) or 0 (every launch goes through Triton's own path)")


def _supported() -> bool:
    """Whether this Triton launches a compiled kernel the way the shortcut repeats: its JIT
    passes every bound argument to `kernel.run` after the grid, stream, function, metadata and
    hooks (triton 3.3 and later). Read from Triton's own source, so a change there turns the
    shortcut off instead of launching with the wrong arguments."""
    if not switched_on(os.environ.get("TE_TRITON_FAST_LAUNCH")) or _knobs is None:
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    try:
        from triton.runtime.jit import JITFunction

        src = inspect.getsource(JITFunction.run)
    except (ImportError, OSError, TypeError):  # pragma: no cover - source not installed
        return False
    return _LAUNCH_CALL in src and "*bound_args.values()" in src


ENABLED = _supported()


class Launcher:
    """A @triton.jit kernel whose `[grid](...)` launches through the specialization cache."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        self._ok = ENABLED and params is not None
        if self._ok:
            self._names = [p.name for p in params]
            self._constexpr = [p.is_constexpr for p in params]
            self._defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
            self._params = frozenset(self._names)
            # the names the first i positional arguments bind, per i: a keyword naming one of them too is an error
            self._bound_by_position = [frozenset(self._names[:i]) for i in range(len(self._names) + 1)]
        self._compiled: Dict[Tuple, Any] = {}

    def __getattr__(self, name):  # everything else is the kernel's (warmup, fn, cache, ...)
        return getattr(self.kernel, name)

    def __getitem__(self, grid) -> Callable[..., Any]:
        return functools.partial(self.launch, grid)  # (a C-level callable: no Python frame of its own)

    def _key(self, device: int, values: list, kwargs: dict) -> Optional[Tuple]:
        """(device, specialization, launch options), or None for an argument it has no rule for.
        One loop without calls but data_ptr(): this runs on every launch."""
        spec = []
        append = spec.append
        for value, constexpr in zip(values, self._constexpr):
            cls = value.__class__
            if constexpr or value is None or cls is bool:
                append(value)
            elif cls is _Tensor or isinstance(value, _Tensor):
                append((value.dtype, value.data_ptr() % 16 == 0))
            elif cls is int:
                append((value == 1, value % 16 == 0, _I32_MIN <= value < _I32_END, value >= 2**63))
            elif cls is float:
                append(float)
            else:
                return None
        params = self._params
        options = tuple([item for item in kwargs.items() if item[0] not in params]) if kwargs else ()
        return device, tuple(spec), options

    def launch(self, grid, *args, **kwargs):
        if not self._ok or self.kernel.pre_run_hooks:
            return self.kernel[grid](*args, **kwargs)
        current_device, current_stream, specializes_as_cuda = _DRIVER[0] if _DRIVER else _driver()
        if not specializes_as_cuda:
            return self.kernel[grid](*args, **kwargs)
        device = current_device()
        if len(args) > len(self._names) or not self._bound_by_position[len(args)].isdisjoint(kwargs):
            return self.kernel[grid](*args, **kwargs)  # too many or doubly given arguments: Triton's error
        values = list(args)
        try:
            for name in self._names[len(args):]:
                values.append(kwargs[name] if name in kwargs else self._defaults[name])
        except KeyError:  # a required argument is missing: Triton's path names it
            return self.kernel[grid](*args, **kwargs)
        key = self._key(device, values, kwargs)
        try:
            compiled = self._compiled.get(key) if key is not None else None
        except TypeError:  # an unhashable constexpr value
            compiled = key = None
        if compiled is None:  # Triton binds, compiles or finds the kernel, and launches it
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and hasattr(compiled, "packed_metadata"):
                self._compiled[key] = compiled
            return compiled
        stream = current_stream(device)
        if callable(grid):
            grid = grid(dict(zip(self._names, values)))
        n = len(grid)
        hooks = _knobs.runtime
        enter, exit_hook = hooks.launch_enter_hook, hooks.launch_exit_hook
        if enter is not None or exit_hook is not None:  # (a chain object in recent Triton: see _active)
            enter, exit_hook = _active(enter), _active(exit_hook)
        # the metadata is only for the hooks: without any, neither it nor empty hook calls
        metadata = None if enter is None and exit_hook is None else compiled.launch_metadata(grid, stream, *values)
        compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                     compiled.packed_metadata, metadata, enter, exit_hook, *values)
        return compiled


def _active(hook):
    """A launch hook, or None where there is none to call: in recent Triton releases the knob is a
    chain of hooks that is never None itself, and the compiled launcher calls whatever it is given."""
    calls = getattr(hook, "calls", None)
    return None if hook is None or (calls is not None and not calls) else hook


_DRIVER = []


def _driver():
    """(current device, current stream of a device, whether the key covers the target): Triton's
    active driver's own functions, bound at the first launch (not at import: a machine without a
    GPU imports this module too). The key follows what Triton specializes on for NVIDIA targets;
    other targets specialize on more (AMD on whether a pointer's range fits 32 bits), so their
    launches keep Triton's own path."""
    if not _DRIVER:
        active = triton.runtime.driver.active
        try:
            backend = active.get_current_target().backend
        except Exception:  # pragma: no cover - a driver without targets: stay on Triton's path
            backend = None
        current_device = active.get_current_device
        if current_device is torch.cuda.current_device and hasattr(torch._C, "_cuda_getDevice"):
            # torch.cuda.current_device() is Python around the runtime's call (a lazy-init check,
            # done by now: a launch initializes CUDA first); the call alone costs no frame
            current_device()
            current_device = torch._C._cuda_getDevice
        _DRIVER.append((current_device, active.get_current_stream, backend == "cuda"))
    return _DRIVER[0]


def launcher(kernel) -> Launcher:
    """Decorator (under @triton.jit): launch `kernel[grid](...)` through the specialization cache."""
    return Launcher(kernel)
