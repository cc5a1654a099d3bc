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
call differs, a target other than NVIDIA's) takes Triton's own path; launch hooks (a
profiler's) get what Triton gives them. The launch is a function generated per kernel with the
kernel's parameters as its own, so Python binds each call in C, and a call with missing, extra
or doubly given arguments raises Python's TypeError, naming the kernel, before anything runs.
Settings Triton reads when it compiles (TRITON_DEBUG and the like) apply as they were at a
specialization's first launch: change them before the first step, or set
TE_TRITON_FAST_LAUNCH=0, which turns the shortcut off (switched_on).

Where te_triton's C extension was built (te_triton/_fastlaunch.c, optional: any C compiler), a
repeated launch does not reach Python's key at all: the extension builds the same key, looks up
the plan registered after the specialization's first launch (the compiled function, its block
and shared memory, how each parameter is passed) and calls the driver's cuLaunchKernel itself,
as Triton's launcher would with no hooks set (making the GPU's primary context current first
where the thread has none, as autograd's backward thread may not). That is where a host-bound
step spends its time: the key's Python and Triton's launch wrapper cost several times the
driver call. Kernels the plan cannot describe (tensor descriptors, clusters of CTAs, scratch
memory), launches with hooks and callable grids stay in Python; TE_TRITON_C_LAUNCH=0 keeps
every launch there.
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


# each switch's meaning at 1 (its default) and at 0, for the error a value neither names
_SWITCHES = {
    "TE_TRITON_FAST_LAUNCH": ("launches reuse compiled kernels directly", "every launch goes through Triton's own path"),
    "TE_TRITON_C_LAUNCH": ("repeated launches go through te_triton's C extension", "they stay in Python"),
}


def switched_on(value: Optional[str], variable: str = "TE_TRITON_FAST_LAUNCH") -> bool:
    """A switch's value: unset or empty, 1, true, yes, on (any case) turn it on; 0, false, no, off
    turn it off; anything else is an error naming the variable."""
    word = (value or "1").strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    on, off = _SWITCHES[variable]
    raise ValueError(f"{variable}={value!r} is not understood: set it to 1 (the default: {on}) or 0 ({off})")


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

# Triton's CUDA launcher passes a compiled kernel's parameters, constexprs left out, then one null
# pointer per scratch buffer the compiler may ask for: the layout the C launch repeats. Read from
# Triton's source, as _LAUNCH_CALL is, so that a Triton whose launcher differs keeps Python's path.
_SCRATCH_PARAMS = ('params.append("&global_scratch")', 'params.append("&profile_scratch")')
# How a scalar parameter of each Triton type is passed (a byte of te_triton._fastlaunch's plan).
_SCALAR_KINDS = {"i1": "b", "i8": "b", "u1": "B", "u8": "B", "i16": "h", "u16": "H", "i32": "i", "u32": "I",
                 "i64": "q", "u64": "Q", "fp32": "f", "f32": "f", "fp64": "d"}


def _c_launcher():
    """(te_triton._fastlaunch bound to this torch, "") where it was built and Triton launches the
    way it repeats; else (None, why not)."""
    if not switched_on(os.environ.get("TE_TRITON_C_LAUNCH"), "TE_TRITON_C_LAUNCH"):
        return None, "TE_TRITON_C_LAUNCH=0"
    if not ENABLED:
        return None, ("te_triton's launch cache is off (TE_TRITON_FAST_LAUNCH=0, Triton's interpreter, or a "
                      "Triton before 3.3)")
    try:
        from . import _fastlaunch
    except ImportError:
        return None, ("te_triton's C extension was not built (no C compiler when it was installed); reinstall "
                      "te-triton-kernels where gcc or clang is available")
    try:
        from triton.backends.nvidia import driver as nvidia_driver

        source = inspect.getsource(nvidia_driver.make_launcher)
    except (ImportError, OSError, TypeError, AttributeError):
        source = ""
    if not all(s in source for s in _SCRATCH_PARAMS) or "config.gridDimX = gridX * num_ctas" not in source:
        return None, f"Triton {triton.__version__} launches kernels in a way the C extension does not repeat"
    _fastlaunch.bind(_Tensor, float)
    return _fastlaunch, ""


C_LAUNCH, _C_REASON = _c_launcher()
_C_STATE = [None if C_LAUNCH is None else C_LAUNCH.launch]  # what every generated launch reads


def c_launch_status() -> str:
    """One line for `te-core info`: where repeated te_triton launches go, and why not to C."""
    if c_launch_on():
        return "te_triton kernel launches: repeated ones go from C to the driver (te_triton._fastlaunch)"
    why = _C_REASON or "turned off in this process (use_c_launch(False))"
    return f"te_triton kernel launches stay in Python: {why}"


def c_launch_on() -> bool:
    """Whether repeated launches go through the C extension now."""
    return _C_STATE[0] is not None


def use_c_launch(on: bool) -> bool:
    """Turn the C launch on or off for every kernel from the next launch on (on: only where it
    is available, C_LAUNCH); returns whether it was on. For comparing the two in one process
    (specializations first launched while it is off are registered all the same);
    TE_TRITON_C_LAUNCH=0 keeps it off from the start."""
    previous = _C_STATE[0] is not None
    _C_STATE[0] = C_LAUNCH.launch if on and C_LAUNCH is not None else None
    return previous


def make_plan(compiled, args: tuple):
    """The C launch's plan for `compiled` (a kernel Triton compiled for the call `args`, every
    parameter in order), or None where the C launch cannot repeat Triton's: several CTAs per
    program, a cooperative or programmatic-dependent launch, scratch memory, a parameter type it
    does not pass (a tensor descriptor, a half-precision scalar), a pointer given as other than a
    tensor."""
    metadata = compiled.metadata
    if (getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_cooperative_grid", False)
            or getattr(metadata, "launch_pdl", False) or getattr(metadata, "global_scratch_size", 0)
            or getattr(metadata, "profile_scratch_size", 0)):
        return None
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    function = getattr(compiled, "function", None)
    if not isinstance(signature, dict) or len(signature) != len(args) or not isinstance(function, int):
        return None
    kinds = []
    for kind, arg in zip(signature.values(), args):
        if kind == "constexpr":
            kinds.append("-")
        elif isinstance(kind, str) and kind.startswith("*") and isinstance(arg, _Tensor):
            kinds.append("p")
        elif kind in _SCALAR_KINDS:
            kinds.append(_SCALAR_KINDS[kind])
        else:
            return None
    return C_LAUNCH.make_plan(function, metadata.num_warps, metadata.shared, "".join(kinds).encode(),
                              len(_SCRATCH_PARAMS))


def register_plan(plans: dict, mask: bytes, device, options: tuple, args: tuple, compiled) -> None:
    """After Triton's own first launch of a specialization: its plan under the C launch's key for
    the call, so that the next call with that key launches from C."""
    key = C_LAUNCH.key(mask, device, options, args)
    if key is None:
        return
    plan = make_plan(compiled, args)
    if plan is not None:
        try:
            plans[key] = (plan, compiled)
        except TypeError:  # an unhashable constexpr: never cached (as on Python's path)
            pass


class _NoRule(Exception):
    """An argument of a type the key has no rule for: the launch takes Triton's own path."""


def _spec(value):
    """The key's entry for a non-constexpr argument that is neither a plain tensor nor an int
    (those two are spelled out in the generated launch)."""
    if value is None or value.__class__ is bool:
        return value
    if isinstance(value, _Tensor):  # a subclass (a Parameter)
        return value.dtype, value.data_ptr() % 16 == 0
    if value.__class__ is float:
        return float
    raise _NoRule


# The launch, generated per kernel with the kernel's own parameters as its parameters, so that
# Python binds the call in C and the key is one tuple expression (no per-argument loop, list or
# call on the hot path). Each non-constexpr argument enters the key by what Triton specializes
# on: a tensor's dtype and 16-byte alignment; an int's equality to 1, divisibility by 16 and
# width; a float's type; None and bools as they are. A constexpr enters by its value.
_TEMPLATE = """
def {name}(_te_grid, _te_device_of, _te_stream_of, {signature}, **_te_options):
    _te_device = _te_device_of()
    _te_opts = tuple(_te_options.items()) if _te_options else ()
    _te_c_launch = _te_c[0]
    if _te_c_launch is not None and _te_grid.__class__ is tuple:  # the registered plan, launched in C
        _te_hooks = _te_knobs.runtime
        if _te_active(_te_hooks.launch_enter_hook) is None and _te_active(_te_hooks.launch_exit_hook) is None:
            _te_done = _te_c_launch(_te_plans, _te_mask, _te_device, _te_opts, _te_grid, _te_stream_of(_te_device),
                                    ({values},))
            if _te_done is not None:
                return _te_done
    try:
        _te_key = (_te_device, {key}, _te_opts)
        _te_compiled = _te_cache.get(_te_key)
    except (_te_NoRule, TypeError):  # an argument without a rule, an unhashable constexpr: never cached
        return _te_kernel[_te_grid]({values}, **_te_options)
    if _te_compiled is None:  # Triton binds, compiles or finds the kernel, and launches it
        _te_compiled = _te_kernel[_te_grid]({values}, **_te_options)
        if hasattr(_te_compiled, "packed_metadata"):
            _te_cache[_te_key] = _te_compiled
            if _te_register is not None:  # (also while use_c_launch(False): on again, the C launch has it)
                _te_register(_te_plans, _te_mask, _te_device, _te_opts, ({values},), _te_compiled)
        return _te_compiled
    _te_stream = _te_stream_of(_te_device)
    if _te_grid.__class__ is not tuple and callable(_te_grid):
        _te_grid = _te_grid({{{named}}})
    _te_n = len(_te_grid)
    _te_hooks = _te_knobs.runtime
    _te_enter, _te_exit = _te_hooks.launch_enter_hook, _te_hooks.launch_exit_hook
    if _te_enter is not None or _te_exit is not None:  # (a chain object in recent Triton: see _active)
        _te_enter, _te_exit = _te_active(_te_enter), _te_active(_te_exit)
    # the metadata is only for the hooks: without any, neither it nor empty hook calls
    _te_metadata = (None if _te_enter is None and _te_exit is None
                    else _te_compiled.launch_metadata(_te_grid, _te_stream, {values}))
    _te_compiled.run(_te_grid[0], _te_grid[1] if _te_n > 1 else 1, _te_grid[2] if _te_n > 2 else 1, _te_stream,
                     _te_compiled.function, _te_compiled.packed_metadata, _te_metadata, _te_enter, _te_exit,
                     {values})
    return _te_compiled
"""


def _key_entry(name: str, constexpr: bool) -> str:
    if constexpr:
        return name
    return (f"(({name}.dtype, {name}.data_ptr() % 16 == 0) if {name}.__class__ is _te_Tensor else "
            f"({name} == 1, {name} % 16 == 0, {_I32_MIN} <= {name} < {_I32_END}, {name} >= {2**63}) "
            f"if {name}.__class__ is int else _te_spec({name}))")


def _generate(kernel, names, constexpr, defaults, cache):
    """The kernel's launch function (see _TEMPLATE), or None where its parameter names would
    clash with the generated code's own."""
    if any(name.startswith("_te_") for name in names):
        return None
    env = {"_te_kernel": kernel, "_te_cache": cache, "_te_NoRule": _NoRule, "_te_spec": _spec,
           "_te_Tensor": _Tensor, "_te_knobs": _knobs, "_te_active": _active,
           "_te_c": _C_STATE, "_te_register": None if C_LAUNCH is None else register_plan,
           "_te_plans": {}, "_te_mask": b"".join(b"c" if c else b"." for c in constexpr)}
    signature = []
    for name in names:
        if name in defaults:
            env["_te_default_" + name] = defaults[name]
            signature.append(f"{name}=_te_default_{name}")
        else:
            signature.append(name)
    # named after the kernel: Python's error for a malformed call names the function
    name = getattr(kernel, "__name__", "")
    name = name if name.isidentifier() and name not in names and not name.startswith("_te_") else "launch"
    source = _TEMPLATE.format(name=name, signature=", ".join(signature),
                              key=", ".join(_key_entry(n, c) for n, c in zip(names, constexpr)),
                              values=", ".join(names), named=", ".join(f"{n!r}: {n}" for n in names))
    exec(compile(source, f"<te_triton launch of {name}>", "exec"), env)
    return env[name]


class Launcher:
    """A @triton.jit kernel whose `[grid](...)` launches through the specialization cache."""

    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        self._compiled: Dict[Tuple, Any] = {}
        self._fast = None
        if ENABLED and params is not None:
            names = [p.name for p in params]
            defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
            self._fast = _generate(kernel, names, [p.is_constexpr for p in params], defaults, self._compiled)
        self._ok = self._fast is not None

    def __getattr__(self, name):  # everything else is the kernel's (warmup, fn, cache, ...)
        return getattr(self.kernel, name)

    def __getitem__(self, grid) -> Callable[..., Any]:
        # Python binds the call to the generated launch's parameters: a call with too many,
        # doubly given or missing arguments raises its TypeError before anything launches.
        if not self._ok or self.kernel.pre_run_hooks:
            return self.kernel[grid]
        current_device, current_stream, specializes_as_cuda = _DRIVER[0] if _DRIVER else _driver()
        if not specializes_as_cuda:
            return self.kernel[grid]
        return functools.partial(self._fast, grid, current_device, current_stream)  # (C-level: no frame of its own)


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
