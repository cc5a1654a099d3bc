"""Hook specifications a backend plugin implements (pluggy project "te_core").

A plugin is one backend: a module or object with `@hookimpl`-marked functions, published
under the entry-point group `te_core.backends`. `te_backend_info`, `te_backend_available` and
`te_backend_ops` are required; the others have defaults. The registry calls each plugin's
hooks one plugin at a time, inside a guard: a hook that raises marks the plugin broken.
"""
from __future__ import annotations

import pluggy

PROJECT = "te_core"
ENTRY_POINT_GROUP = "te_core.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED_HOOKS = ("te_backend_info", "te_backend_available", "te_backend_ops")


@hookspec(firstresult=True)
def te_backend_info():
    """Who this backend is. Must not import vendor libraries that may be missing.

    :return: a :class:`te_core.backend.types.BackendInfo`.
    """


@hookspec(firstresult=True)
def te_backend_available():
    """Whether this backend can run on this machine now.

    :return: ``(available, reason)``; the reason says why not (no device, vendor library missing,
        architecture too old) or, when available, what was found. te-core trusts ``True`` only
        after torch confirmed that it can use the backend's device; a backend whose device torch
        cannot use is recorded as broken.
    """


@hookspec(firstresult=True)
def te_backend_capabilities(device):
    """What the backend can do on ``device``. Only called when available.

    :param device: a :class:`torch.device` of the backend's device type.
    :return: a :class:`te_core.backend.types.Capabilities`.
    """


@hookspec(firstresult=True)
def te_backend_ops():
    """The contract ops this backend implements natively. Only called when available.

    :return: a mapping op name -> :class:`te_core.backend.types.OpImpl` (or a plain callable,
        meaning an implementation that supports every call). Names must be contract ops
        (``te_core.ops.CONTRACT``); ops left out run on the reference backend.
    """


@hookspec(firstresult=True)
def te_backend_device_module():
    """The device module (streams, events, RNG, synchronize, memory) for this
    backend's device type. Only called when available. Default: ``torch.get_device_module``.

    :return: a module-like object.
    """
